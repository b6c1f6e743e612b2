"""Store values parsed into what discovery's readers hold: endpoint instances and model
cards read from the store, checked (size, depth, key against value), and kept small.

A malformed value is counted (`MALFORMED`) and reported with its reason
(`report_malformed`); the cards of one model share what they repeat (`compact_card`); what
a reader holds per store key is an immutable record (`HeldCard`, `HeldInstance`) that the
readers of one query share, kept out of the garbage collector's way (`gc=False`): it holds
no reference cycles, and a collector pass over a hundred thousand of them holds the loop.
"""

from __future__ import annotations

import logging
import sys
from typing import TypeVar

import msgspec
from prometheus_client import Counter

from shoal.bounds import check_json_depth
from shoal.cards import MetadataFile, ModelCard
from shoal.discovery.keys import ModelKey, parse_instance_key, quoted
from shoal.discovery.records import InstanceInfo
from shoal.store import MAX_VALUE_BYTES

log = logging.getLogger(__name__)
T = TypeVar("T")

MALFORMED = Counter(
    "shoal_discovery_malformed_values_total",
    "Values in the discovery store that could not be parsed and were skipped.",
    ["kind"],
)

MAX_SHARED_MODELS = 16384
"""Models whose cards share what they repeat (`compact_card`). Past that, the cards of
further models are held whole: as correct, only larger."""

Skipped = dict[str, str]
"""Store keys whose value is not used, with the reason: malformed, or a change ignored."""

_instance_decoder = msgspec.json.Decoder(InstanceInfo)


def report_malformed(kind: str, kv_key: str, error: Exception, skipped: Skipped | None) -> None:
    """Count and log a value that cannot be used (`kind`: "model" or "instance"), and list
    it in `skipped` if given."""
    MALFORMED.labels(kind).inc()
    shown = quoted(kv_key, 200)  # (another writer's key may be a megabyte)
    if kind == "model":
        log.error("skipping malformed model card at %s: %s", shown, error)
        reason = str(error)
    else:
        log.error("skipping malformed endpoint instance at %s: %s", shown, error)
        reason = f"invalid endpoint instance: {error}"
    if skipped is not None:
        skipped[kv_key] = reason


def check_size(value: bytes) -> None:
    """ValueError for a value over the stores' bound (`MAX_VALUE_BYTES`): another writer's
    (a store takes no larger one), left unread: it would be parsed on the event loop."""
    if len(value) > MAX_VALUE_BYTES:
        raise ValueError(f"{len(value)} bytes, over the {MAX_VALUE_BYTES}-byte bound of values")


def parse_instance(kv_key: str, value: bytes) -> InstanceInfo:
    """The endpoint instance stored at `kv_key`; ValueError if key or value does not fit
    (`TooDeep` if it nests deeper than `shoal.bounds.MAX_DEPTH`). It holds the name strings
    of its key's `EndpointId` (one copy for the fleet), and its URL twice when its status
    URL is the same."""
    endpoint, instance_id = parse_instance_key(kv_key)
    check_size(value)
    check_json_depth(value)
    try:
        info = _instance_decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise ValueError(str(exc)) from None
    if (info.namespace, info.component, info.endpoint, info.instance_id) != (
        endpoint.namespace,
        endpoint.component,
        endpoint.endpoint,
        instance_id,
    ):
        raise ValueError("value does not match its key")
    return msgspec.structs.replace(
        info,
        namespace=endpoint.namespace,
        component=endpoint.component,
        endpoint=endpoint.endpoint,
        status_url=info.url if info.status_url == info.url else info.status_url,
    )


_models: dict[str, tuple[ModelCard, str]] = {}
"""A card of each model (by name) and its `mdcsum`, whose parts later cards share."""


def compact_card(card: ModelCard) -> tuple[ModelCard, str]:
    """`card`, holding what it repeats of the first card read of its model (its names, file
    names, checksums and sizes, kinds, numbers, an equal runtime config) as that card's
    objects, and its `mdcsum`, computed only when its identity differs from that card's.
    Ten thousand instances of a model then each hold little more than their file URLs."""
    first = _models.get(card.display_name)
    if first is None:
        card = msgspec.structs.replace(
            card,
            display_name=sys.intern(card.display_name),
            slug=sys.intern(card.slug),
            source=sys.intern(card.source),
            metadata_files={
                sys.intern(name): MetadataFile(file.url, sys.intern(file.checksum), file.size)
                for name, file in card.metadata_files.items()
            },
        )
        mdcsum = sys.intern(card.mdcsum)
        if len(_models) >= MAX_SHARED_MODELS:
            del _models[next(iter(_models))]  # the oldest: its model's later cards are held whole
        _models[card.display_name] = (card, mdcsum)
        return card, mdcsum
    model, mdcsum = first
    theirs = model.metadata_files
    same = len(card.metadata_files) == len(theirs)  # an identity equal to `model`'s
    files: dict[str, MetadataFile] = {}
    for name, file in card.metadata_files.items():
        other = theirs.get(name)
        if other is not None and other.checksum == file.checksum:
            size = other.size if other.size == file.size else file.size
            files[sys.intern(name)] = MetadataFile(file.url, other.checksum, size)
        else:
            same = False
            files[sys.intern(name)] = MetadataFile(file.url, sys.intern(file.checksum), file.size)
    same = (
        same
        and card.source == model.source
        and card.context_length == model.context_length
        and card.kv_block_size == model.kv_block_size
        and card.role == model.role
        and card.lora == model.lora
    )
    compact = ModelCard(
        display_name=model.display_name,
        slug=_either(card.slug, model.slug),
        source=_either(card.source, model.source),
        model_types=_either(card.model_types, model.model_types),
        context_length=_either(card.context_length, model.context_length),
        kv_block_size=_either(card.kv_block_size, model.kv_block_size),
        role=card.role,
        runtime_config=_either(card.runtime_config, model.runtime_config),
        metadata_files=files,
        lora=_either(card.lora, model.lora),
        created=_either(card.created, model.created),
    )
    return compact, mdcsum if same else sys.intern(compact.mdcsum)


def _either(value: T, shared: T) -> T:
    """`shared` when it equals `value` (a card never changes what it holds: sharing is safe)."""
    return shared if value == shared else value


class HeldInstance(msgspec.Struct, frozen=True, gc=False):
    """An endpoint instance as read at `kv_key`, with the revisions of that store value.
    Immutable: the readers of one query that read the same value share it."""

    kv_key: str
    info: InstanceInfo
    create_revision: int
    mod_revision: int


class HeldCard(msgspec.Struct, frozen=True, gc=False):
    """A registered card (at `key.key`) and its `mdcsum`, with the revisions of the store
    value it was read from. Immutable: the readers of one query share it."""

    key: ModelKey
    card: ModelCard
    mdcsum: str
    create_revision: int
    mod_revision: int


def held_revisions(create_revision: int, mod_revision: int) -> tuple[int, int]:
    """One number object when a value was never changed since its key was created."""
    return (mod_revision if create_revision == mod_revision else create_revision), mod_revision
