"""`KvTracker` follows the instances the registry routes to, and only those."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from shoal.cards import MetadataFile, ModelCard
from shoal.discovery import EndpointId, InstanceInfo, ModelInstance, ModelKey
from shoal.frontend.kv import prompt as prompt_module
from shoal.frontend.kv import tracker as tracker_module
from shoal.frontend.kv.prompt import CONFIG_FILE, TOKENIZER_FILE
from shoal.frontend.kv.tracker import KvTracker
from shoal.frontend.registry.metadata import MetadataCache
from shoal.frontend.registry.registry import Registry, WorkerSet
from shoal.kv import KvEndpoint, token_block_hashes
from shoal.worker.engines.mocker.text import VOCAB
from shoal.worker.engines.mocker.tokenizer import CHAT_TEMPLATE, TOKENIZER
from tests.helpers import wait_for
from tests.kv import vllm_fixtures as vllm
from tests.kv.fake_vllm import FakeVllmPublisher

TOKENS = list(range(32))
CARD = ModelCard.build(
    display_name="m", slug="m", source="test/m", model_types=["chat"], context_length=4096
)


def instance(namespace: str, instance_id: int, publisher: FakeVllmPublisher) -> ModelInstance:
    endpoint = EndpointId(namespace, "backend", "generate")
    info = InstanceInfo(
        namespace, "backend", "generate", instance_id, f"http://127.0.0.1:{9000 + instance_id}",
        f"http://127.0.0.1:{9100 + instance_id}",
        kv_events=KvEndpoint(publisher=publisher.endpoint, replay=publisher.replay_endpoint),
    )  # fmt: skip
    return ModelInstance(ModelKey(endpoint, instance_id), CARD, info)


async def test_instances_outside_the_membership_view_are_purged_and_unfollowed() -> None:
    publishers = [FakeVllmPublisher(), FakeVllmPublisher()]
    registry, tracker = Registry(), KvTracker()
    registry.observers.append(tracker)
    try:
        sets = [
            registry.join(instance(ns, i + 1, p))
            for i, (ns, p) in enumerate(zip(("a", "b"), publishers, strict=True))
        ]
        stored = vllm.batch(vllm.stored([1], None, TOKENS[:16], 16))
        for p in publishers:
            await p.send(0, stored)
        hashes = token_block_hashes(TOKENS, 16)

        def held(i: int) -> dict[int, int]:
            return tracker.sets[sets[i].id].index.overlaps(hashes)

        await wait_for(lambda: held(0) == {1: 1} and held(1) == {2: 1}, message="both indexed")
        tracker.retain(lambda endpoint: endpoint.namespace == "a")
        assert held(1) == {} and held(0) == {1: 1}
        await publishers[1].send(1, msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]]]))
        await publishers[1].send(2, stored)  # b's stream is no longer read: nothing comes back
        await publishers[0].send(1, vllm.batch(vllm.removed([1])))
        await wait_for(lambda: held(0) == {}, message="a still followed")
        assert held(1) == {}
    finally:
        await tracker.close()
        registry.close()
        for p in publishers:
            await p.close()


def _card(slug: str, files: dict[str, MetadataFile]) -> ModelCard:
    return ModelCard.build(
        display_name=slug, slug=slug, source=f"test/{slug}", model_types=["chat"],
        context_length=4096, metadata_files=files,
    )  # fmt: skip


def _counted_tracker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: bytes, *, on_disk: bool = True
) -> tuple[dict[str, MetadataFile], list[Path], Registry, KvTracker]:
    """A tracker over a metadata cache holding the tokenizer file `text` (or not yet, unless
    `on_disk`), the files a card names for it, and the list of the paths it loaded."""
    cache = MetadataCache(tmp_path / "cache")
    checksum = "sha256:" + hashlib.sha256(text).hexdigest()
    cache.directory.mkdir(parents=True, exist_ok=True)
    if on_disk:
        cache.path(checksum).write_bytes(text)
    files = {
        TOKENIZER_FILE: MetadataFile(url="http://127.0.0.1:1/t", checksum=checksum, size=len(text))
    }
    loads: list[Path] = []
    real = tracker_module.read_files

    def counting(path: Path, config: Path | None) -> tuple[Any, Any]:
        loads.append(path)
        return real(path, config)

    monkeypatch.setattr(tracker_module, "read_files", counting)
    registry, tracker = Registry(), KvTracker(cache)
    registry.observers.append(tracker)
    return files, loads, registry, tracker


async def test_sets_with_the_same_tokenizer_files_load_and_share_one_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Models (or namespaces) whose cards name the same tokenizer files load it once: each
    load holds the GIL ~100 ms and keeps its own Rust tables and prompt cache. The shared
    tokenizer stays usable while any set uses it and is closed with the last one."""
    text = TOKENIZER.to_str().encode()
    files, loads, registry, tracker = _counted_tracker(tmp_path, monkeypatch, text)
    models = []
    try:
        for i in range(5):
            endpoint = EndpointId(f"ns{i % 2}", "backend", "generate")
            url = f"http://127.0.0.1:{9000 + i}"
            info = InstanceInfo(f"ns{i % 2}", "backend", "generate", i + 1, url, url)
            model = ModelInstance(ModelKey(endpoint, i + 1), _card(f"m{i}", files), info)
            models.append((model, registry.join(model)))
        states = [tracker.sets[ws.id] for _, ws in models]
        await wait_for(lambda: all(s.tokenizer is not None for s in states), message="loaded")
        assert len(loads) == 1, f"{len(loads)} loads of one tokenizer file"
        prompts = [s.tokenizer for s in states]
        assert all(p is not None for p in prompts)
        shared = prompts[0].tokenizer  # type: ignore[union-attr]
        assert all(p.tokenizer is shared for p in prompts)  # type: ignore[union-attr]
        # Each set keeps its own template state: one set's template disabled (a chat that
        # made it overrun) leaves the others rendering.
        assert len({id(p) for p in prompts}) == len(prompts)
        prompts[0].disabled = "overran"  # type: ignore[union-attr]
        assert all(not p.disabled for p in prompts[1:])  # type: ignore[union-attr]
        last = prompts[4]
        assert last is not None
        started, release = threading.Event(), threading.Event()
        busy = last.submit(lambda: (started.set(), release.wait(10)))
        assert started.wait(10)  # (its thread runs)
        for model, _ in models[:4]:
            registry.leave(model.key)
        assert last._queue is not None and tracker._tokenizers  # still in use
        registry.leave(models[4][0].key)
        assert last._queue is None and not tracker._tokenizers  # let go with its last set
        release.set()
        busy.result(timeout=10)
        again = registry.join(models[0][0])  # a set that comes back loads it anew
        await wait_for(lambda: tracker.sets[again.id].tokenizer is not None, message="reloaded")
        assert len(loads) == 2
    finally:
        await tracker.close()
        registry.close()


async def test_a_failed_shared_load_is_made_anew_by_the_next_set_that_joins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that failed (its file not on disk yet: evicted, or the disk refused it) is not
    the answer for every later set naming the same files: the next set to join loads it
    anew, and the sets that joined before get the tokenizer too. Shared as it was, a failed
    load left every later set of those files routed by prefix while any earlier one lived."""
    text = TOKENIZER.to_str().encode()
    files, loads, registry, tracker = _counted_tracker(tmp_path, monkeypatch, text, on_disk=False)

    def joined(i: int) -> WorkerSet:
        endpoint = EndpointId(f"ns{i}", "backend", "generate")
        url = f"http://127.0.0.1:{9000 + i}"
        info = InstanceInfo(f"ns{i}", "backend", "generate", i + 1, url, url)
        return registry.join(ModelInstance(ModelKey(endpoint, i + 1), _card(f"m{i}", files), info))

    try:
        first = tracker.sets[joined(0).id]
        await wait_for(lambda: "could not be loaded" in first.no_tokenizer, message="failed")
        checksum = files[TOKENIZER_FILE].checksum
        MetadataCache(tmp_path / "cache").path(checksum).write_bytes(text)  # (on disk now)
        second = tracker.sets[joined(1).id]
        await wait_for(lambda: second.tokenizer is not None, message="the second set's load")
        await wait_for(
            lambda: (
                first.tokenizer is not None
                and second.tokenizer is not None
                and first.tokenizer.tokenizer is second.tokenizer.tokenizer
            ),
            message="shared with the first",
        )
        assert len(loads) == 2
    finally:
        await tracker.close()
        registry.close()


async def test_a_tokenizer_file_refused_for_its_content_is_parsed_once_for_every_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file on disk that `tokenizers` refuses (a format this version cannot read, a
    worker's hostile file) is refused for good: its checksum names its content, so a set
    that joins later would parse the same bytes to the same error. Loaded anew for each
    set as a file missing from the disk is, a base model's adapters joining one by one
    parsed it once each, every parse holding the GIL (the event loop) as long as a good
    file's does: 85-114 ms for a real model's, up to seconds at the 64 MiB file bound."""
    refused = json.loads(TOKENIZER.to_str())
    refused["model"]["type"] = "NoSuchModel"  # (a format of a newer `tokenizers`, say)
    text = json.dumps(refused).encode()
    files, loads, registry, tracker = _counted_tracker(tmp_path, monkeypatch, text)
    endpoint = EndpointId("ns", "backend", "generate")
    url = "http://127.0.0.1:9000"
    info = InstanceInfo("ns", "backend", "generate", 1, url, url)
    try:
        states = []
        for i in range(20):  # (adapters of one base, joining one after another)
            key = ModelKey(endpoint, 1, f"lora-{i}" if i else None)
            ws = registry.join(ModelInstance(key, _card(f"m{i}", files), info))
            state = tracker.sets[ws.id]
            states.append(state)
            await wait_for(lambda s=state: "could not be loaded" in s.no_tokenizer)  # type: ignore[misc]
        assert len(loads) == 1, f"{len(loads)} parses of one refused file"
        assert all(s.tokenizer is None for s in states)
    finally:
        await tracker.close()
        registry.close()


async def test_sets_sharing_a_tokenizer_share_its_segment_cache_and_its_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The segment cache of tokenized chats is a function of the tokenizer alone: sets that
    share the tokenizer share it, within one bound (`CHAIN_CACHE_BYTES`, 64 MiB per
    tokenizer), and the probe that makes it (`splits_cleanly`: the whole vocabulary read,
    80-200 ms of the GIL for a 65,000-token one) runs once per tokenizer, not once per set.
    Each set still has its own template: disabling one leaves the others rendering."""
    capacity = 1 << 20
    monkeypatch.setattr(prompt_module, "CHAIN_CACHE_BYTES", capacity)
    probes: list[int] = []
    real_probe = prompt_module.splits_cleanly

    def counting(tokenizer: Any, special_ids: dict[str, int]) -> bool:
        probes.append(1)
        return real_probe(tokenizer, special_ids)

    monkeypatch.setattr(prompt_module, "splits_cleanly", counting)
    cache = MetadataCache(tmp_path / "cache")
    cache.directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, text in (
        (TOKENIZER_FILE, TOKENIZER.to_str().encode()),
        (CONFIG_FILE, json.dumps({"chat_template": CHAT_TEMPLATE}).encode()),
    ):
        checksum = "sha256:" + hashlib.sha256(text).hexdigest()
        cache.path(checksum).write_bytes(text)
        files[name] = MetadataFile(url="http://127.0.0.1:1/t", checksum=checksum, size=len(text))
    registry, tracker = Registry(), KvTracker(cache)
    registry.observers.append(tracker)
    endpoint = EndpointId("ns", "backend", "generate")
    url = "http://127.0.0.1:9000"
    info = InstanceInfo("ns", "backend", "generate", 1, url, url)
    try:
        states = []
        for i in range(6):  # (a base and its adapters)
            key = ModelKey(endpoint, 1, f"lora-{i}" if i else None)
            states.append(
                tracker.sets[registry.join(ModelInstance(key, _card(f"m{i}", files), info)).id]
            )
        await wait_for(lambda: all(s.tokenizer is not None for s in states), message="loaded")
        prompts = [s.tokenizer for s in states if s.tokenizer is not None]
        for n, prompt in enumerate(prompts):
            for turn in range(8):  # distinct ~80 KB chats to each set
                text = f"{n} {turn} " + " ".join(
                    VOCAB[(n * 7 + turn + j) % 40] for j in range(16_000)
                )
                assert prompt.chat([{"role": "user", "content": text}]) is not None
        chains = {id(p.chain): p.chain for p in prompts if p.chain is not None}
        held = sum(c.bytes for c in chains.values())
        assert held <= capacity, f"{held} bytes in {len(chains)} caches of one tokenizer"
        assert len(probes) == 1, f"{len(probes)} probes of one tokenizer"
        prompts[0].disabled = "overran"
        assert not prompts[0].renders and all(p.renders for p in prompts[1:])
    finally:
        await tracker.close()
        registry.close()
