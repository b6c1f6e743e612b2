"""Metadata downloads shared by checksum: many cards of one model fetch each file once, a
failed shared download falls back to each card's own URL, and a card going away does not
cancel the download the others wait on."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from shoal.cards import MetadataFile, ModelCard
from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelKey
from shoal.frontend import Frontend
from shoal.frontend.registry import cache_io
from shoal.frontend.registry import metadata as metadata_module
from shoal.frontend.registry.cache_io import RESOLVE_SLICE, Writer
from shoal.frontend.registry.metadata import MetadataCache, MetadataError
from shoal.frontend.registry.registrations import State
from shoal.frontend.registry.watcher import ModelWatcher
from shoal.store import Lease, Store
from tests.frontend.conftest import StartFrontend
from tests.frontend.support import serving
from tests.helpers import LoopTurns, Server, wait_for

MODEL = "shared-llm"
FILES = {
    "config.json": b'{"model": "shared-llm"}',
    "tokenizer.json": b'{"vocab": {"a": 0, "b": 1}}',
    "chat_template.jinja": b"{{ messages }}",
}
FILES_BY_CHECKSUM = {f"sha256:{hashlib.sha256(data).hexdigest()}": data for data in FILES.values()}


class MetadataHost:
    """One HTTP server hosting the metadata files of many fake workers at `/{worker}/{file}`.

    `requests` counts requests by file and `by_worker` by worker. Requests wait while
    `release` is clear (`held` says how many are waiting). A worker in `failing` answers
    500; one in `dropping` closes the connection without answering.
    """

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.active: Counter[str] = Counter()  # requests being answered now, by file
        self.most_active: Counter[str] = Counter()  # the most at once, by file
        self.by_worker: Counter[str] = Counter()
        self.release = asyncio.Event()
        self.release.set()
        self.held = 0
        self.failing: set[str] = set()
        self.dropping: set[str] = set()
        app = web.Application()
        app.router.add_get("/{worker}/{name}", self._file)
        self.server = Server(app, port=0)

    async def _file(self, request: web.Request) -> web.StreamResponse:
        worker, name = request.match_info["worker"], request.match_info["name"]
        self.requests[name] += 1
        self.by_worker[worker] += 1
        self.active[name] += 1
        self.most_active[name] = max(self.most_active[name], self.active[name])
        self.held += 1
        try:
            await self.release.wait()
        finally:
            self.held -= 1
            self.active[name] -= 1
        if worker in self.dropping:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if worker in self.failing:
            return web.Response(status=500, text="injected failure")
        return web.Response(body=FILES[name])

    def card(self, worker: str, declared_size: int | None = None) -> ModelCard:
        """The card of `worker`: the same files (checksums) as every other, at its own URLs."""
        return ModelCard.build(
            display_name=MODEL,
            slug=MODEL,
            source=f"test/{MODEL}",
            model_types=["chat"],
            context_length=4096,
            metadata_files={
                name: {
                    "url": f"{self.server.url}/{worker}/{name}",
                    "checksum": "sha256:" + hashlib.sha256(data).hexdigest(),
                    "size": declared_size or len(data),
                }
                for name, data in FILES.items()
            },
        )


class Cards:
    """Registers cards of `MODEL` in discovery, one instance (and lease) each."""

    def __init__(self, store: Store, host: MetadataHost) -> None:
        self.store = store
        self.host = host
        self.discovery = Discovery(store)
        self.keys: dict[str, ModelKey] = {}
        self.leases: list[Lease] = []

    async def register(self, worker: str, declared_size: int | None = None) -> ModelKey:
        lease = await self.store.grant(30)
        self.leases.append(lease)
        endpoint = EndpointId("default", "backend", "generate")
        key = ModelKey(endpoint, lease.id)
        url = f"{self.host.server.url}/{worker}"
        info = InstanceInfo("default", "backend", "generate", lease.id, f"{url}/v1", url)
        await self.discovery.register_instance(info, lease=lease.id)
        await self.discovery.register_model(
            key, self.host.card(worker, declared_size), lease=lease.id
        )
        self.keys[worker] = key
        return key

    async def unregister(self, worker: str) -> None:
        await self.discovery.unregister_model(self.keys[worker])


@pytest.fixture
async def host() -> AsyncIterator[MetadataHost]:
    host = MetadataHost()
    await host.server.start()
    yield host
    host.release.set()
    await host.server.stop()


@pytest.fixture
async def cards(store: Store, host: MetadataHost) -> AsyncIterator[Cards]:
    cards = Cards(store, host)
    yield cards
    for lease in cards.leases:
        with contextlib.suppress(Exception):
            await lease.revoke()


def watcher_of(frontend: Frontend) -> ModelWatcher:
    assert frontend.watcher is not None
    return frontend.watcher


def fetching(watcher: ModelWatcher, keys: list[ModelKey]) -> bool:
    """Every key is registered and has its metadata fetch in flight."""
    registrations = [watcher.registrations.get(key) for key in keys]
    return all(r is not None and r.task is not None for r in registrations)


async def test_ten_cards_of_one_model_download_each_file_once_and_all_join(
    host: MetadataHost, cards: Cards, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    watcher = watcher_of(frontend)
    host.release.clear()  # every download stays in flight until all ten cards wait on it
    keys = [await cards.register(f"w{i}") for i in range(10)]
    await wait_for(lambda: fetching(watcher, keys), message="ten fetches in flight")
    await wait_for(lambda: host.held >= len(FILES), message="the shared downloads arrived")
    host.release.set()
    await wait_for(lambda: serving(frontend, MODEL, instances=10))
    assert host.requests == Counter(dict.fromkeys(FILES, 1))  # each file once, not ten times
    assert all(key in frontend.registry for key in keys)
    assert watcher.incomplete() == []


@pytest.mark.parametrize("failure", ["status-500", "connection-dropped"])
async def test_failed_shared_download_falls_back_to_each_waiting_cards_own_url(
    failure: str, host: MetadataHost, cards: Cards, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    watcher = watcher_of(frontend)
    (host.failing if failure == "status-500" else host.dropping).add("w0")
    host.release.clear()
    broken = await cards.register("w0")
    # w0's downloads are the shared ones: in flight before the other cards arrive.
    await wait_for(lambda: host.by_worker["w0"] == len(FILES), message="w0 downloads started")
    others = [await cards.register(f"w{i}") for i in range(1, 4)]
    await wait_for(lambda: fetching(watcher, [broken, *others]), message="all cards waiting")
    host.release.set()
    await wait_for(lambda: serving(frontend, MODEL, instances=3))
    assert all(key in frontend.registry for key in others)
    # One waiting card took over with its own URL; the others waited on that download.
    assert sum(host.by_worker[f"w{i}"] for i in range(1, 4)) == len(FILES)
    # The card whose URL failed stays out, pending with the error, until a retry.
    registration = watcher.registrations[broken]
    await wait_for(lambda: registration.task is None)
    assert broken not in frontend.registry
    assert registration.state is State.PENDING
    assert registration.error is not None and "w0" in registration.error
    assert [r.model.key for r in watcher.incomplete()] == [broken]
    asked = host.by_worker["w0"]  # aiohttp may retry a dropped request once
    # The retry (reconciliation) joins it from the files the others fetched: w0 not asked again.
    assert await watcher.reconcile() == {"retry": 1}
    assert broken in frontend.registry
    assert host.by_worker["w0"] == asked
    assert watcher.incomplete() == []


@pytest.mark.parametrize("removed", ["card-that-started-the-download", "card-waiting-on-it"])
async def test_card_removed_mid_download_does_not_cancel_the_download_for_the_others(
    removed: str, host: MetadataHost, cards: Cards, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    watcher = watcher_of(frontend)
    host.release.clear()
    first = await cards.register("w0")
    await wait_for(lambda: host.by_worker["w0"] == len(FILES), message="w0 downloads started")
    rest = [await cards.register(f"w{i}") for i in range(1, 4)]
    await wait_for(lambda: fetching(watcher, [first, *rest]), message="all cards waiting")
    assert watcher.fetching == 4 and not watcher.no_fetches.is_set()
    gone = "w0" if removed == "card-that-started-the-download" else "w1"
    gone_key = cards.keys[gone]
    fetch = watcher.registrations[gone_key].task
    assert fetch is not None
    # The four cards wait on one fetch (not a task each), whoever started the downloads.
    assert {watcher.registrations[key].task for key in (first, *rest)} == {fetch}
    await cards.unregister(gone)  # its Removed event ends its wait, not the others' fetch
    await wait_for(lambda: gone_key not in watcher.registrations and watcher.fetching == 3)
    assert not fetch.done()
    assert host.held == len(FILES)  # the shared downloads are still waiting on the server
    host.release.set()
    staying = [key for key in (first, *rest) if key != gone_key]
    await wait_for(lambda: serving(frontend, MODEL, instances=3))
    assert all(key in frontend.registry for key in staying)
    assert gone_key not in frontend.registry
    assert host.requests == Counter(dict.fromkeys(FILES, 1))  # not restarted by anyone
    assert watcher.incomplete() == []
    # Every fetch is counted out, the cancelled one too (what the heap trim waits for).
    assert watcher.fetching == 0 and watcher.no_fetches.is_set()


async def test_a_fetch_nobody_waits_for_any_more_is_cancelled_and_counted_out(
    host: MetadataHost, cards: Cards, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    watcher = watcher_of(frontend)
    host.release.clear()
    keys = [await cards.register(f"w{i}") for i in range(2)]
    await wait_for(lambda: fetching(watcher, keys), message="both cards waiting")
    fetch = watcher.registrations[keys[0]].task
    assert fetch is not None and watcher.fetching == 2
    for name in ("w0", "w1"):
        await cards.unregister(name)
    await wait_for(lambda: fetch.done(), message="the fetch ended")
    assert fetch.cancelled()
    assert watcher.fetching == 0 and watcher.no_fetches.is_set()
    assert not watcher.registrations and MODEL not in frontend.registry.models
    host.release.set()


async def test_files_another_frontend_put_in_a_shared_cache_directory_are_used_not_fetched(
    host: MetadataHost, cards: Cards, start_frontend: StartFrontend, tmp_path: Path
) -> None:
    shared = tmp_path / "shared-cache"
    frontend = await start_frontend(reconcile_interval=60, cache_dir=shared)
    cache = watcher_of(frontend).cache
    # Written after this frontend indexed the directory, as another frontend would.
    shared.mkdir(exist_ok=True)
    for data in FILES.values():
        cache.path("sha256:" + hashlib.sha256(data).hexdigest()).write_bytes(data)
    key = await cards.register("w0")
    await wait_for(lambda: serving(frontend, MODEL, instances=1))
    assert key in frontend.registry
    assert host.requests == Counter()  # found on disk: nothing downloaded
    assert cache.downloads == 0


async def test_fetches_started_together_look_on_disk_in_one_thread_hop_not_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Looking for a file another frontend put in the shared directory is a `stat`: a cold
    start's thousands of fetches begin in the same turns of the loop, and a `stat` each on
    the loop held it 30-60 ms at a time (the cache writer creating files in the same
    directory). They look in one batch, in a thread; what they find is used, not fetched."""
    cache = MetadataCache(tmp_path / "shared")
    (tmp_path / "shared").mkdir()
    cards = []
    for i in range(200):  # 200 models' files, put there after the cache indexed the directory
        data = f'{{"model": {i}}}'.encode()
        checksum = "sha256:" + hashlib.sha256(data).hexdigest()
        cache.path(checksum).write_bytes(data)
        files = {"config.json": {"url": "http://127.0.0.1:9/x", "checksum": checksum}}
        files["config.json"]["size"] = len(data)  # type: ignore[assignment]
        cards.append(
            ModelCard.build(
                display_name=f"m{i}",
                slug=f"m{i}",
                source="test",
                model_types=["chat"],
                context_length=4096,
                metadata_files=files,
            )
        )
    stats_on_loop = 0
    loop_thread = threading.get_ident()
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        nonlocal stats_on_loop
        if threading.get_ident() == loop_thread and "shared" in str(path):
            stats_on_loop += 1
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    hops = 0
    real_sizes = cache._sizes_on_disk

    def sizes_on_disk(checksums: list[str]) -> dict[str, int]:
        nonlocal hops
        hops += 1
        return real_sizes(checksums)

    monkeypatch.setattr(cache, "_sizes_on_disk", sizes_on_disk)
    try:
        await asyncio.gather(*(cache.fetch(card) for card in cards))
        assert stats_on_loop == 0
        assert hops == 1
        assert cache.downloads == 0  # every file found on disk (its URL answers nothing)
        assert all(not cache.missing(card) for card in cards)
    finally:
        await cache.close()


async def test_failed_shared_download_is_taken_over_by_one_waiter_not_forty(
    host: MetadataHost, cards: Cards, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    watcher = watcher_of(frontend)
    host.failing.add("w0")
    host.release.clear()
    broken = await cards.register("w0")
    await wait_for(lambda: host.by_worker["w0"] == len(FILES), message="w0 downloads started")
    others = [await cards.register(f"w{i}") for i in range(1, 41)]
    await wait_for(lambda: fetching(watcher, [broken, *others]), message="all cards waiting")
    host.release.set()
    await wait_for(lambda: serving(frontend, MODEL, instances=40), timeout=20)
    # Each file: the failed shared download, then exactly one takeover; never two at once.
    assert host.requests == Counter(dict.fromkeys(FILES, 2))
    assert host.most_active == Counter(dict.fromkeys(FILES, 1))


async def test_file_over_the_size_cap_is_refused_without_downloading(
    host: MetadataHost, cards: Cards, start_frontend: StartFrontend
) -> None:
    frontend = await start_frontend(reconcile_interval=60, metadata_max_file_bytes=1 << 20)
    watcher = watcher_of(frontend)
    key = await cards.register("w0", declared_size=100 << 20)
    await wait_for(lambda: (r := watcher.registrations.get(key)) is not None and r.error)
    error = watcher.registrations[key].error
    assert error is not None and "limit" in error and str(1 << 20) in error
    assert key not in frontend.registry
    assert host.requests == Counter()


async def test_a_download_that_times_out_says_so_and_names_the_timeout(
    host: MetadataHost, cards: Cards, start_frontend: StartFrontend
) -> None:
    host.release.clear()  # the host never answers
    frontend = await start_frontend(reconcile_interval=60, metadata_timeout=0.3)
    watcher = watcher_of(frontend)
    key = await cards.register("w0")
    await wait_for(lambda: (r := watcher.registrations.get(key)) is not None and r.error)
    error = watcher.registrations[key].error
    assert error is not None and error.endswith("failed: timed out after 0.3s"), error


async def test_unwritable_cache_still_joins_reports_trouble_and_downloads_once(
    host: MetadataHost, cards: Cards, start_frontend: StartFrontend, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    frontend = await start_frontend(reconcile_interval=60, cache_dir=blocker / "metadata")
    key = await cards.register("w0")
    await wait_for(lambda: serving(frontend, MODEL, instances=1))
    assert key in frontend.registry
    await watcher_of(frontend).cache.flush()
    status, health = frontend.health()
    assert status == 200
    problem = health["metadata_cache"]["problem"]
    assert problem is not None and "cannot write" in problem
    assert health["metadata_cache"]["uncached_files"] == len(FILES)
    metrics = frontend.metrics.render().decode()
    assert "shoal_frontend_metadata_cache_errors_total 3.0" in metrics
    # Verified files are remembered: reconciliation does not download them again.
    await frontend.watcher.reconcile() if frontend.watcher else None
    assert host.requests == Counter(dict.fromkeys(FILES, 1))


class FullDiskCache(MetadataCache):
    """A cache whose temporary files sit on a full disk: every write fails with ENOSPC
    (the kernel's `/dev/full`), as on a real full disk, after the temporary file exists."""

    def _create_tmp(self, checksum: str) -> tuple[str, int | None]:
        tmp, fd = super()._create_tmp(checksum)
        assert fd is not None
        os.close(fd)
        return tmp, os.open("/dev/full", os.O_WRONLY)


async def test_full_disk_leaves_no_temporary_files_and_the_card_joins(
    host: MetadataHost, cards: Cards, start_frontend: StartFrontend, tmp_path: Path
) -> None:
    frontend = await start_frontend(reconcile_interval=60)
    watcher = watcher_of(frontend)
    directory = tmp_path / "full"
    watcher.cache = FullDiskCache(directory)
    key = await cards.register("w0")
    await wait_for(lambda: serving(frontend, MODEL, instances=1))
    assert key in frontend.registry
    await watcher.cache.flush()
    assert list(directory.iterdir()) == []  # every temporary file removed
    assert watcher.cache.problem is not None and "No space left" in watcher.cache.problem
    await watcher.cache.close()


async def test_cache_is_bounded_least_recently_used_file_leaves_first(
    host: MetadataHost, tmp_path: Path
) -> None:
    sizes = {name: len(data) for name, data in FILES.items()}
    names = list(FILES)  # config.json, tokenizer.json, chat_template.jinja
    # Room for the two largest files, not for all three.
    cache = MetadataCache(tmp_path / "lru", max_bytes=sum(sorted(sizes.values())[1:]))
    card = host.card("w0")
    files = card.metadata_files
    try:
        await cache._fetch_one(names[0], files[names[0]])
        await cache._fetch_one(names[1], files[names[1]])
        await cache.flush()  # (on disk: verified files are written after their fetch)
        assert cache.has(files[names[0]])  # names[0] is now the most recently used
        await cache._fetch_one(names[2], files[names[2]])
        await cache.flush()
        on_disk = {p.name for p in (tmp_path / "lru").iterdir()}
        assert cache.path(files[names[1]].checksum).name not in on_disk  # evicted
        assert cache.path(files[names[0]].checksum).name in on_disk
        assert cache.path(files[names[2]].checksum).name in on_disk
        assert cache.status()["bytes"] <= cache.max_bytes
        assert cache.evictions == 1
    finally:
        await cache.close()


def test_stale_temporary_files_of_dead_processes_are_removed_at_start(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    directory.mkdir()
    stale = directory / ".sha256-ab.123.1.tmp"
    fresh = directory / ".sha256-cd.456.2.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    MetadataCache(directory)
    assert not stale.exists()
    assert fresh.exists()  # may belong to a live frontend sharing the directory


async def test_a_card_arriving_as_a_shared_download_fails_takes_over_without_spinning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A card whose file is being downloaded with another worker's URL, arriving in the loop
    turn in which that download failed (before its done-callback ran), waited on the failed
    download again and again without ever yielding: the frontend's loop spun for good."""
    cache = MetadataCache(tmp_path / "cache")
    checksum = "sha256:" + "0" * 64
    downloads: list[str] = []

    async def failing_download(name: str, file: MetadataFile) -> None:
        downloads.append(file.url)
        raise MetadataError(f"{file.url} failed")

    monkeypatch.setattr(cache, "_download", failing_download)

    def card(url: str) -> ModelCard:
        return ModelCard.build(
            display_name="m", slug="m", source="s", model_types=["chat"], context_length=8,
            metadata_files={"config.json": {"url": url, "checksum": checksum, "size": 1}},
        )  # fmt: skip

    late: list[asyncio.Task[None]] = []

    async def arrive_late() -> None:  # runs in the turn after the first download started
        late.append(asyncio.create_task(cache.fetch(card("http://b/config.json"))))

    def spinning(signum: int, frame: object) -> None:
        raise TimeoutError("the fetch spun without yielding to the event loop")

    previous = signal.signal(signal.SIGALRM, spinning)
    signal.setitimer(signal.ITIMER_REAL, 5)
    try:
        first = asyncio.create_task(cache.fetch(card("http://a/config.json")))
        await asyncio.create_task(arrive_late())
        results = await asyncio.gather(first, *late, return_exceptions=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert [type(r) for r in results] == [MetadataError, MetadataError], results
    assert downloads == ["http://a/config.json", "http://b/config.json"]


async def test_thousands_of_writes_answered_at_once_wake_their_fetches_in_slices() -> None:
    """The cache's writer thread answers every file of a wake-up in one call back to the
    loop: at a cold start thousands at once, each waking a fetch that goes on with its
    card. Those wake-ups are spread over turns of the loop, a slice at a time, never all
    in one turn (counted: `RESOLVE_SLICE` fetches of each batch at most go on in one turn)."""
    fetches = 4000
    gate = threading.Event()

    def write(checksum: str, data: bytes) -> bool:
        return gate.wait(30)

    writer = Writer(write)
    asked = 0
    woken = LoopTurns()

    async def fetch(i: int) -> None:
        nonlocal asked
        asked += 1
        assert await writer.write(f"sha256:{i:064x}", b"{}")
        woken.note()
        hashlib.sha256(b"x" * 20_000).digest()  # what a fetch does next, in short

    tasks = [asyncio.create_task(fetch(i)) for i in range(fetches)]
    await wait_for(lambda: asked == fetches, message="every file queued")
    gate.set()  # (the first file's wake-up held the thread: the others come in one batch)
    try:
        await asyncio.gather(*tasks)
    finally:
        await woken.stop()
    assert writer.batches <= 3
    assert woken.on_loop == fetches
    most = woken.most_per_turn  # (the first file's batch of one may wake beside a slice)
    assert most <= RESOLVE_SLICE * writer.batches, f"{most} fetches in one turn"


class SlowDiskCache(MetadataCache):
    """A cache whose disk takes every write only once `disk` is set."""

    def __init__(self, directory: Path, **kwargs: Any) -> None:
        super().__init__(directory, **kwargs)
        self.disk = threading.Event()

    def _write_whole(self, checksum: str, data: bytes) -> bool:
        assert self.disk.wait(30), "the test never let the disk take the write"
        return super()._write_whole(checksum, data)


async def test_a_card_joins_while_its_verified_files_wait_for_a_slow_disk(
    host: MetadataHost, cards: Cards, start_frontend: StartFrontend, tmp_path: Path
) -> None:
    """A file is usable once verified: its card joins while the disk is still behind (a
    cold start's 20,000 file creations, one after the other, held every join), and the
    files reach the disk after."""
    frontend = await start_frontend(reconcile_interval=60)
    watcher = watcher_of(frontend)
    directory = tmp_path / "slow"
    cache = watcher.cache = SlowDiskCache(directory)
    try:
        key = await cards.register("w0")
        await wait_for(lambda: serving(frontend, MODEL, instances=1))
        assert key in frontend.registry
        _, health = frontend.health()
        assert health["metadata_cache"]["unwritten_files"] == len(FILES)
        assert not directory.exists() or not any(
            p.name.startswith("sha256-") for p in directory.iterdir()
        )
        cache.disk.set()
        await wait_for(lambda: cache.status()["files"] == len(FILES), message="written")
        for file in host.card("w0").metadata_files.values():
            assert cache.path(file.checksum).read_bytes() == FILES_BY_CHECKSUM[file.checksum]
        assert cache.status()["unwritten_files"] == 0
    finally:
        cache.disk.set()
        await cache.close()


async def test_a_disk_that_hangs_holds_at_most_the_bound_of_files_in_memory(
    host: MetadataHost,
    cards: Cards,
    start_frontend: StartFrontend,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over `MAX_PENDING_BYTES` of verified files held for a disk that does not take them,
    a download waits for its own write: the card joins when the disk answers, and memory
    stays bounded."""
    monkeypatch.setattr(metadata_module, "MAX_PENDING_BYTES", 1)
    frontend = await start_frontend(reconcile_interval=60)
    watcher = watcher_of(frontend)
    cache = watcher.cache = SlowDiskCache(tmp_path / "hung")
    try:
        key = await cards.register("w0")
        await wait_for(lambda: host.requests == Counter(dict.fromkeys(FILES, 1)))
        await wait_for(lambda: cache._writer._queue != [] or cache._writer._draining)
        assert not serving(frontend, MODEL, instances=1)
        assert cache.status()["unwritten_files"] == 0  # none held: each waits for its write
        cache.disk.set()
        await wait_for(lambda: serving(frontend, MODEL, instances=1))
        assert key in frontend.registry
        assert cache.status()["files"] == len(FILES)
    finally:
        cache.disk.set()
        await cache.close()


@pytest.mark.parametrize("size", [0, 1, 2046, 2047, 2048, 4095, 20_000, 1 << 20])
def test_a_small_file_is_hashed_in_pieces_hashlib_hashes_without_letting_go_of_the_gil(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the event loop, hashlib would let go of the GIL for 2,048 bytes or more, and the
    loop then waited for a busy thread (the store's, the cache writer's) to give it back:
    the digest is the same, from pieces that never let it go."""
    data = os.urandom(size)
    pieces: list[int] = []
    real = hashlib.sha256

    class Recording:
        def __init__(self) -> None:
            self.digest = real()

        def update(self, piece: memoryview) -> None:
            pieces.append(len(piece))
            self.digest.update(piece)

        def hexdigest(self) -> str:
            return self.digest.hexdigest()

    monkeypatch.setattr(cache_io.hashlib, "sha256", Recording)
    assert cache_io.sha256_holding_the_gil(data) == real(data).hexdigest()
    assert sum(pieces) == size
    assert all(n < cache_io.GIL_FREE_HASH_BYTES for n in pieces)
