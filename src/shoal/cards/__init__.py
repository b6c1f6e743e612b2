"""Layer 2: model cards, what a worker serves. Pure data, no I/O."""

from shoal.cards.card import (
    CardError,
    Lora,
    MetadataFile,
    ModelCard,
    ModelType,
    WorkerRole,
    file_checksum,
    slugify,
)

__all__ = [
    "CardError",
    "Lora",
    "MetadataFile",
    "ModelCard",
    "ModelType",
    "WorkerRole",
    "file_checksum",
    "slugify",
]
