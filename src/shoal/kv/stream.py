"""The layout of relayed KV events in NATS JetStream: what `shoal kv-relay` writes and what a
frontend with `--kv-events nats://...` reads. Pure data, a public contract like the discovery
keys.

- Stream `shoal-kv` (the default name), subjects `shoal.kv.{namespace}.{instance_id:x}`.
- Every message carries the header `Shoal-Kind`: `batch` (payload: the worker's msgpack
  `KVEventBatch`, as it published it), `joined` (payload: JSON `{"block_size", "model",
  "namespace", "component", "endpoint", "role", "mdcsum"}`), `resnapshot` (drop what you
  hold for this instance: the batches before `Shoal-Seq` are lost) or `left`.
- `Shoal-Seq` is the worker's own sequence number of a batch (of the batch that follows, on
  a `resnapshot`); `Shoal-Ts` is the worker's timestamp of that batch. Together they name a
  batch, whichever relay saw it, whenever it started following the worker: a publisher that
  restarts numbers from 0 again, later. A reader's next batch is numbered one more than its
  last one and not older; a batch numbered at or below the last one and not newer is one it
  has; anything else is a loss (a gap, a new run of the numbering).
- `Nats-Msg-Id` is `{namespace}:{instance:x}:{seq}:{ts in us:x}` for a batch (`batch_id`),
  `{namespace}:{instance:x}:resnapshot:{seq}:{ts in us:x}` for a resnapshot, so the stream
  keeps one copy of what two relays both publish (within its duplicate window);
  `{namespace}:{instance:x}:left:{seq}:{ts in us:x}` for a `left` after batch `seq` (two
  relays that saw the same last batch agree), `{namespace}:{instance:x}:{kind}:{run}` for a
  `joined`, and a `left` after no batch, `run` naming that run of the instance (`r` and the
  card's store revision in hex, the same for every relay; else a relay's own token)
  (`control_id`): an instance back under the same id (a restarted worker), or the same id
  in another namespace, is never refused as a duplicate of another run.
"""

from __future__ import annotations

import math
import re

import msgspec

DEFAULT_STREAM = "shoal-kv"
SUBJECT_PREFIX = "shoal.kv"

KIND = "Shoal-Kind"
SEQ = "Shoal-Seq"
TS = "Shoal-Ts"
MSG_ID = "Nats-Msg-Id"
EXPECTED_STREAM = "Nats-Expected-Stream"  # the stream refuses a record another one would take

BATCH = "batch"
JOINED = "joined"
RESNAPSHOT = "resnapshot"
LEFT = "left"
KINDS = frozenset({BATCH, JOINED, RESNAPSHOT, LEFT})

_TOKEN = re.compile(r"[^.*>\s]+")


class Joined(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What a `joined` record says of an instance: the worker set its blocks belong to."""

    block_size: int
    model: str
    namespace: str
    component: str
    endpoint: str
    role: str
    mdcsum: str


def subject(namespace: str, instance_id: int) -> str:
    """The subject of one instance's records; ValueError for a namespace NATS cannot carry
    as one subject token (a dot, a wildcard, whitespace)."""
    if not _TOKEN.fullmatch(namespace):
        raise ValueError(f"namespace {namespace!r} cannot be a NATS subject token")
    return f"{SUBJECT_PREFIX}.{namespace}.{instance_id:x}"


def parse_subject(text: str) -> tuple[str, int] | None:
    """(namespace, instance id) of a record's subject; None for any other subject."""
    parts = text.split(".")
    if len(parts) != 4 or f"{parts[0]}.{parts[1]}" != SUBJECT_PREFIX:
        return None
    try:
        return parts[2], int(parts[3], 16)
    except ValueError:
        return None


def batch_id(namespace: str, instance_id: int, seq: int, ts: float) -> str:
    """The de-duplication id of a batch: the same from every relay that publishes it."""
    return f"{namespace}:{instance_id:x}:{seq}:{_micros(ts):x}"


def resnapshot_id(namespace: str, instance_id: int, seq: int, ts: float) -> str:
    """The id of a resnapshot before batch `seq` (timestamped `ts`)."""
    return f"{namespace}:{instance_id:x}:{RESNAPSHOT}:{seq}:{_micros(ts):x}"


def control_id(namespace: str, instance_id: int, kind: str, run: str, seq: int, ts: float) -> str:
    """The id of a `joined` or `left` record of one run of an instance (`run`: the relay's
    own name for it); a `left` after batch `seq` (not -1) is named by it instead, as every
    relay that saw that batch last names it."""
    if kind == LEFT and seq >= 0:
        return f"{namespace}:{instance_id:x}:{LEFT}:{seq}:{_micros(ts):x}"
    return f"{namespace}:{instance_id:x}:{kind}:{run}"


def _micros(ts: float) -> int:
    return int(ts * 1_000_000) if math.isfinite(ts) else 0
