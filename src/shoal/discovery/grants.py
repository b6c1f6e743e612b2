"""API keys as frontends see them: a key's hash, allow-list and limits, kept in the store.

The models controller (`shoal.catalog`) publishes one `Grant` per live secret of each catalog
`Key` at `shoal/v1/keys/{workspace}/{hash_prefix}`; every frontend with `--auth keys` follows
that prefix like the routes and checks a request's bearer in memory, never calling the catalog.
The secret itself is never stored anywhere: a grant holds `hash_secret(secret, pepper)`, the
SHA-256 of the secret and the server pepper that the catalog and the frontends share
(`--key-pepper`, `SHOAL_KEY_PEPPER`; empty by default).

Grants are desired state, written without a lease and removed when their key or secret goes
away. Unknown fields are ignored (a newer controller's grant stays readable by an older
frontend); known fields are validated strictly, and a grant whose key does not match its own
hash is refused, so a value copied to another key never grants anything.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec

from shoal.bounds import TooDeep, check_json_depth
from shoal.discovery.keys import ROOT
from shoal.discovery.routes import _quote
from shoal.store import MAX_KEY_BYTES

KEYS = ROOT + "keys/"
SECRET_PREFIX = "sk-shoal-"
HASH_PREFIX_CHARS = 32  # of the 64 hex digits: the store key; the value holds the whole hash

Limit = Annotated[int, msgspec.Meta(ge=1, le=10**12)]
Hash = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1, max_length=400)]
MAX_MODELS = 1000  # a key's allow-list at most (the catalog's bound): scanned per request
Models = Annotated[tuple[NonEmpty, ...], msgspec.Meta(max_length=MAX_MODELS)]


class GrantError(ValueError):
    """A grant key or value that is not valid; the message names what is wrong."""


class Grant(msgspec.Struct, frozen=True):
    """What one secret of key `name` in `workspace` may do.

    `models` empty: every model the key reaches (the fleet's, and its own workspace's virtual
    models: never another workspace's); else only those named. `rpm`, `tpm` (tokens per
    minute) and `max_parallel` null: no limit. `expires_at` (Unix seconds, null: never) is the earlier of
    the key's expiry and this secret's own end after a rotation. `disabled` refuses it at once.
    """

    workspace: NonEmpty
    name: NonEmpty
    hash: Hash
    models: Models = ()
    rpm: Limit | None = None
    tpm: Limit | None = None
    max_parallel: Limit | None = None
    expires_at: float | None = None
    disabled: bool = False

    @property
    def key(self) -> str:
        return grant_key(self.workspace, self.hash)

    def to_json(self) -> bytes:
        return _encoder.encode(self)


_encoder = msgspec.json.Encoder(order="deterministic")
_decoder = msgspec.json.Decoder(Grant)


def hash_secret(secret: str | bytes, pepper: str = "") -> str:
    """The hex SHA-256 of the secret followed by the pepper: what the catalog keeps and the
    store holds, and what a frontend computes from a bearer to look it up."""
    raw = secret.encode() if isinstance(secret, str) else secret
    return hashlib.sha256(raw + pepper.encode()).hexdigest()


def grants_prefix(workspace: str) -> str:
    return f"{KEYS}{_quote(workspace)}/"


def grant_key(workspace: str, hash_: str) -> str:
    return grants_prefix(workspace) + hash_[:HASH_PREFIX_CHARS]


def decode_grant(key: str, value: bytes) -> Grant:
    """The grant stored at `key`; `GrantError` naming the problem if it does not fit."""
    if len(key) > MAX_KEY_BYTES:  # (another writer's: etcd takes keys of 1.5 MiB)
        raise GrantError(f"key grant key of {len(key):,} characters, over the store's bound")
    if not key.startswith(KEYS) or key.count("/") != KEYS.count("/") + 1:
        raise GrantError(f"malformed key grant {key!r}: expected {KEYS}WORKSPACE/HASH_PREFIX")
    try:
        check_json_depth(value)  # before the decoder: its recursion limit is the caller's
        grant = _decoder.decode(value)
    except (msgspec.ValidationError, msgspec.DecodeError, TooDeep) as exc:
        raise GrantError(f"invalid key grant at {key}: {exc}") from None
    if grant.key != key:  # a value copied to another key grants nothing
        raise GrantError(f"key grant at {key} is for {grant.workspace}/{grant.hash[:12]}...")
    return grant
