"""The metadata registry: owner-scoped entries, refused collisions, no leaks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shoal.discovery import EndpointId, ModelKey
from shoal.worker.metadata import CollisionError, MetadataKey, MetadataRegistry

EP = EndpointId("ns", "backend", "generate")
BASE = ModelKey(EP, 0xA1)
ADAPTER = ModelKey(EP, 0xA1, "my-lora")
OTHER_INSTANCE = ModelKey(EP, 0xB2)


def files(suffix: str | None, *names: str) -> list[tuple[MetadataKey, bytes]]:
    return [(MetadataKey.of(EP, "model", suffix, n), f"{suffix}/{n}".encode()) for n in names]


def test_registering_a_key_held_by_another_owner_raises_and_changes_nothing() -> None:
    registry = MetadataRegistry()
    registry.register(BASE, files(None, "config.json"))
    before = {k: (registry.lookup(k), registry.owner_of(k)) for k, _ in files(None, "config.json")}

    with pytest.raises(CollisionError) as info:
        registry.register(OTHER_INSTANCE, files(None, "tokenizer.json", "config.json"))

    assert str(BASE) in str(info.value) and str(OTHER_INSTANCE) in str(info.value)
    assert len(registry) == 1
    assert registry.lookup(MetadataKey.of(EP, "model", None, "tokenizer.json")) is None
    assert {k: (registry.lookup(k), registry.owner_of(k)) for k in before} == before


def test_same_owner_registering_again_updates_the_bytes() -> None:
    registry = MetadataRegistry()
    key = MetadataKey.of(EP, "model", None, "config.json")
    registry.register(BASE, [(key, b"old")])
    registry.register(BASE, [(key, b"new")])
    assert registry.lookup(key) == b"new"
    assert len(registry) == 1


def test_unregister_for_owner_removes_exactly_that_owners_entries_and_is_idempotent() -> None:
    registry = MetadataRegistry()
    registry.register(BASE, files(None, "config.json", "tokenizer_config.json"))
    registry.register(ADAPTER, files("my-lora", "config.json", "adapter_config.json"))

    assert registry.unregister_for_owner(ADAPTER) == 2
    assert registry.unregister_for_owner(ADAPTER) == 0
    assert len(registry) == 2
    assert all(registry.owner_of(k) == BASE for k, _ in files(None, "config.json"))


def test_reassign_hands_entries_to_the_new_instance_id() -> None:
    registry = MetadataRegistry()
    registry.register(BASE, files(None, "config.json"))
    renamed = ModelKey(EP, 0xC3)
    assert registry.reassign(BASE, renamed) == 1
    assert registry.files_of(BASE) == []
    assert registry.unregister_for_owner(renamed) == 1


def test_a_thousand_register_unregister_cycles_leave_the_registry_at_its_starting_size() -> None:
    registry = MetadataRegistry()
    registry.register(BASE, files(None, "config.json"))
    start = len(registry)
    for i in range(1000):
        owner = ModelKey(EP, 0xA1, f"lora-{i % 7}")
        registry.register(owner, files(f"lora-{i % 7}", "config.json", "adapter_config.json"))
        registry.unregister_for_owner(owner)
    assert len(registry) == start


def test_metadata_url_path_quotes_every_segment() -> None:
    key = MetadataKey.of(EP, "model", None, "chat template.jinja")
    assert key.path == "/v1/metadata/ns/backend/generate/model/_/chat%20template.jinja"


def test_replace_swaps_an_owners_files_all_or_nothing() -> None:
    registry = MetadataRegistry()
    registry.register(BASE, files(None, "config.json", "old.json"))
    registry.register(OTHER_INSTANCE, files(None, "taken.json"))

    with pytest.raises(CollisionError):
        registry.replace(BASE, files(None, "config.json", "taken.json"))
    assert sorted(k.filename for k, _ in registry.files_of(BASE)) == ["config.json", "old.json"]

    registry.replace(BASE, files(None, "config.json", "new.json"))
    assert sorted(k.filename for k, _ in registry.files_of(BASE)) == ["config.json", "new.json"]


class _CountingEntries(dict[MetadataKey, tuple[bytes, ModelKey]]):
    """The registry's entries, counting every entry a scan over them visits."""

    visited = 0

    def _count(self, it: Iterator[Any]) -> Iterator[Any]:
        for item in it:
            self.visited += 1
            yield item

    def __iter__(self) -> Iterator[MetadataKey]:
        return self._count(super().__iter__())

    def items(self) -> Any:
        return self._count(iter(super().items()))

    def keys(self) -> Any:
        return self._count(iter(super().keys()))

    def values(self) -> Any:
        return self._count(iter(super().values()))


def test_per_owner_calls_visit_only_that_owners_entries_not_every_models() -> None:
    """What was wrong: `unregister_for_owner`, `reassign`, `files_of` and `replace` scanned
    every entry of every model, so detaching or re-registering N models cost N² (2,000
    adapters: 6 s to reassign them all). What holds now: an index by owner; a pass over N
    owners visits no entry beyond the ones it touches, and the index stays exact."""
    registry = MetadataRegistry()
    owners = [ModelKey(EP, 1, f"lora-{i}") for i in range(300)]
    for owner in owners:
        registry.register(owner, files(owner.suffix, "config.json", "tokenizer.json"))
    entries = _CountingEntries(registry._entries)
    registry._entries = entries

    moved = [ModelKey(EP, 2, o.suffix) for o in owners]
    assert sum(registry.reassign(old, new) for old, new in zip(owners, moved, strict=True)) == 600
    assert all(len(registry.files_of(owner)) == 2 for owner in moved)
    assert all(registry.files_of(owner) == [] for owner in owners)
    for owner in moved:
        registry.replace(owner, files(owner.suffix, "config.json"))
    assert len(registry) == 300
    assert registry.owner_of(MetadataKey.of(EP, "model", "lora-7", "config.json")) == moved[7]
    assert sum(registry.unregister_for_owner(owner) for owner in moved) == 300
    assert len(registry) == 0
    assert entries.visited == 0
