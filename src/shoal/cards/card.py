"""`ModelCard`: what a worker serves, and `mdcsum`, the checksum of its identity.

Two workers serve the same model exactly when their cards have the same `mdcsum`: the same
name, weights source, metadata files (by checksum), context length, KV block size, role and
LoRA. Runtime config (which holds the `taints`) is not identity: it may change while a card
is registered.
"""

from __future__ import annotations

import enum
import hashlib
import re
from pathlib import Path
from typing import Annotated, Any

import msgspec

from shoal.bounds import TooDeep, check_json_depth

_SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_CHECKSUM_RE = re.compile(r"^sha256:[0-9a-f]{64}$")

MAX_METADATA_FILES = 64
"""Metadata files a card may list (a model directory has ~10 besides its weights): each is
a download for every frontend, and a card of thousands (1 MB holds 6,300) cost a frontend's
loop 31-56 ms to join. A card over it is skipped as malformed."""
MAX_ENTRIES = 64
"""Keys of `runtime_config`, taints, and request kinds a card may list."""

Positive = Annotated[int, msgspec.Meta(gt=0)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Slug = Annotated[str, msgspec.Meta(pattern=_SLUG_RE.pattern)]
Checksum = Annotated[str, msgspec.Meta(pattern=_CHECKSUM_RE.pattern)]


class CardError(ValueError):
    """A card that fails validation; the message names the field."""


class ModelType(enum.StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"


class WorkerRole(enum.StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class MetadataFile(msgspec.Struct, frozen=True, gc=False):
    """A non-weight file of the model (config, tokenizer, chat template), hosted by the worker.
    (It holds strings and a number only: the collector need not track the many a fleet has.)"""

    url: NonEmpty
    checksum: Checksum
    size: Annotated[int, msgspec.Meta(ge=0)]


class Lora(msgspec.Struct, frozen=True, gc=False):
    """A LoRA adapter card names its base model and the adapter."""

    base_model: NonEmpty
    adapter: NonEmpty


class ModelCard(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a worker serves. Immutable; `with_taints` returns a copy. It holds decoded JSON
    values only, which cannot refer back to it: the collector need not track the hundred
    thousand cards a frontend may hold (`gc=False`).

    Reading a card (`from_json`) ignores fields this version does not know, at every level,
    so a newer worker's card stays readable by an older frontend; the fields it knows are
    validated strictly, and `mdcsum` covers only those. `build` (cards made in code) refuses
    unknown fields: there they are typos.
    """

    display_name: NonEmpty
    slug: Slug
    source: NonEmpty
    model_types: Annotated[list[ModelType], msgspec.Meta(min_length=1, max_length=MAX_ENTRIES)]
    context_length: Positive
    kv_block_size: Positive = 16
    role: WorkerRole = WorkerRole.AGGREGATED
    runtime_config: Annotated[dict[str, Any], msgspec.Meta(max_length=MAX_ENTRIES)] = msgspec.field(
        default_factory=dict
    )
    metadata_files: Annotated[
        dict[str, MetadataFile], msgspec.Meta(max_length=MAX_METADATA_FILES)
    ] = msgspec.field(default_factory=dict)
    lora: Lora | None = None
    # Unix time the worker registered the model (0: not said). Not identity: frontends show
    # the earliest of a model's cards as its `created`, the same on each of them.
    created: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        taints = self.runtime_config.get("taints", [])
        if not isinstance(taints, list) or not all(isinstance(t, str) and t for t in taints):
            raise CardError("runtime_config.taints: must be a list of non-empty strings")
        if len(taints) > MAX_ENTRIES:
            raise CardError(f"runtime_config.taints: more than {MAX_ENTRIES} taints")
        for name in self.metadata_files:
            if not name or "/" in name or name in (".", "..") or "\x00" in name:
                raise CardError(f"metadata_files: invalid file name {name!r}")

    @property
    def taints(self) -> tuple[str, ...]:
        """The taints, sorted and without duplicates, however the writer stored them: two
        cards that differ only in taint order or repeats have equal `taints`."""
        taints = self.runtime_config.get("taints", ())
        return tuple(sorted(set(taints))) if taints else ()

    def with_taints(self, taints: list[str] | tuple[str, ...]) -> ModelCard:
        return msgspec.structs.replace(
            self, runtime_config={**self.runtime_config, "taints": sorted(set(taints))}
        )

    @property
    def mdcsum(self) -> str:
        """A stable hash of the identity fields; runtime config and taints are excluded.
        Computed on every call (a cache would cost every card a dict): what holds many cards
        keeps it beside them (`shoal.discovery.ModelInstance.mdcsum`)."""
        return self._identity_sum(with_role=True)

    @property
    def pairsum(self) -> str:
        """The identity's hash without the role: a `prefill` and a `decode` worker set of the
        same model (same weights, files, context, block size) have equal `pairsum`, so they
        pair up to serve it in two stages. Computed on every call, as `mdcsum`."""
        return self._identity_sum(with_role=False)

    def _identity_sum(self, *, with_role: bool) -> str:
        identity: dict[str, Any] = {
            "name": self.display_name,
            "source": self.source,
            "files": {n: f.checksum for n, f in sorted(self.metadata_files.items())},
            "context_length": self.context_length,
            "kv_block_size": self.kv_block_size,
            "lora": None if self.lora is None else [self.lora.base_model, self.lora.adapter],
        }
        if with_role:
            identity["role"] = str(self.role)
        return hashlib.sha256(msgspec.json.encode(identity, order="sorted")).hexdigest()[:16]

    def same_except_taints(self, other: ModelCard) -> bool:
        strip = {k: v for k, v in self.runtime_config.items() if k != "taints"}
        other_strip = {k: v for k, v in other.runtime_config.items() if k != "taints"}
        return msgspec.structs.replace(self, runtime_config=strip) == msgspec.structs.replace(
            other, runtime_config=other_strip
        )

    def to_json(self) -> bytes:
        return _encoder.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> ModelCard:
        """The card `data` holds; `CardError` naming the problem if it is not one (nested
        deeper than `shoal.bounds.MAX_DEPTH` included)."""
        try:
            check_json_depth(data)
            return _decoder.decode(data)
        except TooDeep as exc:
            raise CardError(f"invalid model card JSON: {exc}") from None
        except msgspec.ValidationError as exc:
            raise CardError(f"invalid model card: {exc}") from None
        except msgspec.DecodeError as exc:
            raise CardError(f"invalid model card JSON: {exc}") from None

    @classmethod
    def build(cls, **fields: Any) -> ModelCard:
        """Construct with the same strict validation as `from_json` (errors name the field),
        refusing fields this version does not know."""
        unknown = sorted(fields.keys() - set(cls.__struct_fields__))
        if unknown:
            raise CardError(f"invalid model card: unknown field(s) {', '.join(unknown)}")
        try:
            return msgspec.convert(fields, cls)
        except msgspec.ValidationError as exc:
            raise CardError(f"invalid model card: {exc}") from None


_encoder = msgspec.json.Encoder(order="deterministic")
_decoder = msgspec.json.Decoder(ModelCard)


def slugify(name: str) -> str:
    """A URL- and key-safe slug for a model name: `Qwen/Qwen3-0.6B` -> `qwen--qwen3-0.6b`."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", name.lower().replace("/", "--")).strip("-._")
    return slug[:128] or "model"


def file_checksum(path: Path) -> tuple[str, int]:
    """`sha256:<hex>` and size of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return f"sha256:{digest.hexdigest()}", size
