"""Real `shoal worker --engine openai` processes in front of a fake OpenAI-compatible upstream,
on a SQLite store (`store_url`, `store`: tests/worker/conftest.py), checked through discovery,
the status server and the openai client."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest

from shoal.catalog.backends import READY_LINE
from shoal.discovery import Discovery, ModelInstance, Query
from shoal.store import Store, open_store
from shoal.worker.engines.openai_sidecar import OpenAISidecarEngine
from shoal.worker.runtime import CLEANUP_BUDGET, Runtime
from tests.etcd_server import EtcdServer
from tests.helpers import wait_for
from tests.processes import Process, Processes, shoal
from tests.worker.engines.fake_upstream import MODEL, FakeUpstream
from tests.worker.test_worker_drain import SLACK

UPSTREAM_KEY = "sk-upstream-only"


async def sidecar_worker(
    processes: Processes, store_url: str, upstream: FakeUpstream, *args: str, model: str = MODEL
) -> Process:
    return await processes.worker(
        store_url, "--upstream", upstream.server.url, *args, model=model, engine="openai"
    )


async def models_of(store: Store, worker: Process) -> list[ModelInstance]:
    models = await Discovery(store).list(Query(namespace="default"))
    return [m for m in models if m.instance_id == worker.instance_id]


@pytest.mark.parametrize("how", ["flag", "env"])
async def test_a_sidecar_with_the_upstream_api_key_announces_and_serves_a_keyed_upstream(
    how: str,
    fake: FakeUpstream,
    processes: Processes,
    store_url: str,
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake.api_key = UPSTREAM_KEY
    args: tuple[str, ...] = ()
    if how == "flag":
        args = ("--upstream-api-key", UPSTREAM_KEY)
    else:
        monkeypatch.setenv("SHOAL_UPSTREAM_API_KEY", UPSTREAM_KEY)
    worker = await sidecar_worker(processes, store_url, fake, *args)

    assert [m.card.display_name for m in await models_of(store, worker)] == [MODEL, "sql-lora"]
    fake.authorizations.clear()
    async with openai.AsyncOpenAI(
        base_url=worker.url + "/v1", api_key="the-client-s-own-key", max_retries=0
    ) as client:
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    assert chat.choices[0].message.content == "Hello"
    assert fake.authorizations == [f"Bearer {UPSTREAM_KEY}"]


async def test_a_sidecar_whose_upstream_lacks_the_model_announces_nothing_and_says_why(
    fake: FakeUpstream, processes: Processes, store_url: str, store: Store
) -> None:
    fake.model_ids = ["other-model"]
    worker = await sidecar_worker(processes, store_url, fake, model="wanted")

    assert await models_of(store, worker) == []
    async with aiohttp.ClientSession() as http, http.get(worker.status_url + "/health") as resp:
        assert resp.status == 503
        reasons = " ".join((await resp.json())["reasons"])
    assert "does not list 'wanted'" in reasons and "other-model" in reasons


async def test_sidecar_replicas_behind_different_upstreams_announce_one_identity(
    fake: FakeUpstream, processes: Processes, store_url: str, store: Store
) -> None:
    other = FakeUpstream()
    await other.server.start()
    try:
        first = await sidecar_worker(processes, store_url, fake)
        second = await sidecar_worker(processes, store_url, other)
        cards = [m.card for w in (first, second) for m in await models_of(store, w)]
    finally:
        await other.server.stop()
    assert [c.display_name for c in cards] == [MODEL, "sql-lora", MODEL, "sql-lora"]
    assert cards[0].mdcsum == cards[2].mdcsum, "one model, one identity, whatever its upstream"
    assert cards[1].mdcsum == cards[3].mdcsum


async def test_a_sidecar_with_credentials_in_its_upstream_url_exits_at_start_in_one_line(
    processes: Processes, store_url: str
) -> None:
    proc = await shoal(
        "worker", "--engine", "openai", "--model", MODEL, "--store", store_url,
        "--upstream", "http://admin:s3cret-PW@127.0.0.1:1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shoal worker:"), lines
    assert "--upstream-api-key" in lines[0]
    assert b"s3cret-PW" not in out + err


async def test_a_sidecar_without_model_keeps_its_model_when_the_upstream_reorders_its_list(
    fake: FakeUpstream, store_url: str
) -> None:
    fake.model_ids = ["model-a", "model-b"]
    engine = OpenAISidecarEngine(fake.server.url, health_interval=0.0)
    async with Runtime(store_url) as runtime:
        endpoint = runtime.endpoint("default.backend.generate")
        await endpoint.serve(engine)
        assert endpoint.models[None].card.display_name == "model-a"
        fake.model_ids = ["model-b", "model-a"]  # Ollama lists the newest first
        await endpoint.sync_models()
        assert endpoint.models[None].card.display_name == "model-a"
        fake.model_ids = ["model-b"]  # gone: the other one is announced instead
        await endpoint.sync_models()
        assert endpoint.models[None].card.display_name == "model-b"


async def test_deleting_an_adapter_the_sidecar_cannot_unload_answers_501_and_withdraws_nothing(
    fake: FakeUpstream, processes: Processes, store_url: str, store: Store
) -> None:
    worker = await sidecar_worker(processes, store_url, fake)
    before = await models_of(store, worker)
    assert [m.card.display_name for m in before] == [MODEL, "sql-lora"]
    async with (
        aiohttp.ClientSession() as http,
        http.delete(worker.status_url + "/v1/loras/sql-lora") as response,
    ):
        assert response.status == 501, await response.text()
        assert "sql-lora" in (await response.json())["error"]["message"]
    assert [(m.key, m.card) for m in await models_of(store, worker)] == [
        (m.key, m.card) for m in before
    ]


async def test_one_adapter_with_a_bad_card_is_refused_alone_and_the_others_are_announced(
    fake: FakeUpstream, processes: Processes, store_url: str, store: Store
) -> None:
    """What was wrong: one adapter the upstream listed with a card the worker cannot build
    (an id over the card's 512 characters) made the sync raise: the sidecar worker did not
    start, and the adapters listed after it were never announced. What holds now: that
    adapter alone is refused (logged, counted, named in `/health`), the others announced."""
    bad = "x" * 600
    fake.adapter_ids = [bad, "sql-lora", "good-lora"]
    worker = await sidecar_worker(processes, store_url, fake)

    names = [m.card.display_name for m in await models_of(store, worker)]
    assert sorted(names) == sorted([MODEL, "sql-lora", "good-lora"])
    async with aiohttp.ClientSession() as http, http.get(worker.status_url + "/health") as resp:
        assert resp.status == 200
        (endpoint,) = (await resp.json())["endpoints"]
    assert endpoint["models_refused"] == 1
    (refused,) = endpoint["refused"]
    assert refused["name"].startswith("'xxx") and "600 characters" in refused["name"]
    assert "512" in refused["reason"] and bad not in refused["reason"]


async def test_health_and_the_ready_line_name_the_first_models_by_name_and_count_the_rest(
    fake: FakeUpstream, processes: Processes, store_url: str, store: Store
) -> None:
    """What was wrong: `/health` (the readiness probe) and the ready line named every model,
    so a sidecar in front of 20,000 adapters answered each probe with 1.8 MB of JSON built
    on the event loop. What holds now: both name the base model, then the first adapters by
    name, up to `MODELS_SHOWN`, and count all of them."""
    from shoal.worker import health

    adapters = [f"lora-{i:03d}" for i in reversed(range(30))]  # listed out of name order
    fake.adapter_ids = adapters
    worker = await sidecar_worker(processes, store_url, fake)
    assert len(await models_of(store, worker)) == 31  # every one announced

    shown = [MODEL, *sorted(adapters)[: health.MODELS_SHOWN - 1]]
    assert worker.ready["model"] == ",".join(shown) + f" (+{31 - len(shown)} more)"
    async with aiohttp.ClientSession() as http, http.get(worker.status_url + "/health") as resp:
        assert resp.status == 200
        (endpoint,) = (await resp.json())["endpoints"]
    assert endpoint["models_announced"] == 31
    assert [m["name"] for m in endpoint["models"]] == shown
    assert [m["suffix"] for m in endpoint["models"]][:2] == [None, "lora-000"]


async def test_a_slow_but_answering_upstream_keeps_the_worker_healthy_and_its_health_prompt(
    fake: FakeUpstream, processes: Processes, store_url: str
) -> None:
    """An upstream answering each probe in 1.6 s (within the sidecar's 5 s per GET) is slow,
    not stuck: the worker's `/health` stays 200 and answers at once (a Kubernetes readiness
    probe gives it 1 s), instead of reporting its models loop silent or waiting on the probe."""
    worker = await sidecar_worker(processes, store_url, fake)
    fake.probe_delay = 1.6
    answers: list[tuple[int, float, list[str]]] = []
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        deadline = loop.time() + 9.0  # (two probes' worth of silence past the loop's 3 s)
        while loop.time() < deadline:
            started = loop.time()
            async with http.get(worker.status_url + "/health") as response:
                body = await response.json()
                answers.append((response.status, loop.time() - started, body["reasons"]))
            await asyncio.sleep(0.25)
    unhealthy = [(status, reasons) for status, _, reasons in answers if status != 200]
    assert not unhealthy, unhealthy
    slowest = max(took for _, took, _ in answers)
    assert slowest < 1.0, f"/health took {slowest:.2f}s"


async def test_a_model_name_with_a_newline_cannot_split_or_forge_the_ready_line(
    fake: FakeUpstream, processes: Processes, store_url: str, store: Store
) -> None:
    """The ready line names the first models, as the upstream names them: a newline in an
    adapter's name split the line, and what followed it was a ready line of the upstream's
    making (`shoal worker ready: ... instance=...`), which `shoal up` and the catalog's
    local backend read. What holds now: one line, every value's control characters escaped."""
    forged = "shoal worker ready: model=x url=http://evil:1 instance=deadbeef"
    fake.adapter_ids = ["sql-lora", f"evil\n{forged}"]
    worker = await sidecar_worker(processes, store_url, fake)
    assert {"model", "url", "status", "instance"} <= worker.ready.keys(), worker.ready
    (model,) = [m for m in await models_of(store, worker) if m.card.lora is None]
    assert worker.ready["url"] == model.url and "evil:1" not in worker.ready["url"]
    ready_lines = [line for line in worker.stdout if READY_LINE.match(line.strip())]
    assert len(ready_lines) == 1 and "\\n" in ready_lines[0]
    match = READY_LINE.match(ready_lines[0].strip())
    assert match is not None and int(match["instance"], 16) == model.instance_id


async def test_health_is_never_200_before_the_models_of_an_upstream_come_up_are_announced(
    fake: FakeUpstream, processes: Processes, store_url: str, store: Store
) -> None:
    """A sidecar started while its upstream loads (503) answers /health 503; once the upstream
    is up, /health's own probe saw it healthy and answered 200 while the models loop had not
    announced its models yet (up to a second: a rolling update took the worker as ready
    with nothing a frontend could route to), and 200 for good if the upstream listed none.
    What holds now: 200 only with a model announced, in the store."""
    fake.health_status = 503
    worker = await sidecar_worker(processes, store_url, fake)
    answers: list[tuple[int, int, bool]] = []
    fake.health_status = 200
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        deadline = loop.time() + 10.0
        while loop.time() < deadline:
            async with http.get(worker.status_url + "/health") as response:
                body = await response.json()
            announced = sum(e["models_announced"] for e in body["endpoints"])
            if response.status == 200:
                stored = bool(await models_of(store, worker))
                answers.append((response.status, announced, stored))
                break
            await asyncio.sleep(0.01)
    assert answers, "never healthy"
    assert answers[0][1:] == (1 + len(fake.adapter_ids), True), answers


BIG_LISTING = 20_000
"""Adapters the upstream of the drain tests below lists, besides its base model."""


async def big_sidecars(
    count: int, url: str, fake: FakeUpstream, processes: Processes, store: Store, *args: str
) -> list[Process]:
    """`count` sidecar workers on `url` in front of `fake` listing 1 + `BIG_LISTING` models,
    each with every one of them announced."""
    fake.adapter_ids = [f"lora-{i:05d}" for i in range(BIG_LISTING)]
    workers = []
    for _ in range(count):
        worker = await processes.worker(
            url, "--upstream", fake.server.url, "--lease-ttl", "60", *args,
            model=MODEL, engine="openai", timeout=120,
        )  # fmt: skip
        workers.append(worker)

        async def announced(worker: Process = worker) -> bool:
            return len(await models_of(store, worker)) == 1 + BIG_LISTING

        await wait_for(announced, timeout=120, interval=0.5, message="every model announced")
    return workers


@contextlib.asynccontextmanager
async def store_of(backend: str, tmp_path: Path) -> AsyncIterator[tuple[str, Store]]:
    """A store URL of `backend` of the test's own (a SQLite file, an etcd), and a client."""
    with contextlib.ExitStack() as stack:
        if backend == "etcd":
            url = stack.enter_context(EtcdServer()).url
        else:
            url = f"sqlite:///{tmp_path / 'store.db'}"
        store = await open_store(url)
        try:
            yield url, store
        finally:
            await store.close()


BACKENDS = ["sqlite", pytest.param("etcd", marks=pytest.mark.etcd)]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_sidecars_in_front_of_20_001_models_stopped_at_once_leave_no_key_when_they_exit(
    backend: str, fake: FakeUpstream, processes: Processes, tmp_path: Path
) -> None:
    """What was wrong: a sidecar in front of an upstream listing 20,001 models, on SIGTERM,
    tainted its 20,001 cards `draining` out of its 2 s cleanup budget (1.5 s of it, a
    SQLite file writing ~15,000 keys/s) and left its lease revoke (0.4 s for 20,002 keys) the
    0.5 s reserved: a store any busier (two such workers stopped at once, as a host shutting
    down stops them; a loaded machine) cut the revoke and the worker exited with every key
    in the store until its lease expired (20,002 ghosts, up to the TTL). What holds now: a
    drain with nothing to wait for taints nothing, the revoke has first claim on the budget,
    and both workers exit within their drain timeout plus the budget, no key of theirs left."""
    drain_timeout = 1.0
    async with store_of(backend, tmp_path) as (url, store):
        workers = await big_sidecars(
            2, url, fake, processes, store, "--drain-timeout", str(drain_timeout)
        )
        signalled = time.monotonic()
        for worker in workers:
            worker.signal(signal.SIGTERM)
        codes = [await w.wait(drain_timeout + CLEANUP_BUDGET + 30) for w in workers]
        exited = time.monotonic() - signalled
        left = (await store.get_prefix("shoal/v1/")).items
    logs = "\n".join(w.stderr()[-2000:] for w in workers)
    assert codes == [0, 0], logs
    assert left == [], f"{len(left)} keys left (first {left[0].key}):\n{logs}"
    assert exited < drain_timeout + CLEANUP_BUDGET + SLACK, f"exit after {exited:.1f}s:\n{logs}"
    assert "cleanup budget" not in logs, logs


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_sidecar_in_front_of_20_001_models_taints_while_it_waits_and_leaves_no_key(
    backend: str, fake: FakeUpstream, processes: Processes, tmp_path: Path
) -> None:
    """A drain with a request in flight taints the cards `draining` while it waits for it
    (frontends stop picking the worker), cuts it at the drain timeout, and then revokes:
    the taint, however long 20,001 cards take, is the wait's, never the revoke's budget.
    (6 s to wait: the taint and a listing of 20,001 cards seeing it took over 2 s on a loaded
    machine, and once the wait is cut the keys are revoked, taint and all.)"""
    drain_timeout = 6.0
    async with store_of(backend, tmp_path) as (url, store):
        (worker,) = await big_sidecars(
            1, url, fake, processes, store, "--drain-timeout", str(drain_timeout)
        )
        discovery = Discovery(store)

        async def base_tainted() -> bool:
            models = await discovery.list(Query(namespace="default"))
            return any(m.card.lora is None and "draining" in m.card.taints for m in models)

        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(worker.url + "/v1/chat/completions", json=body) as resp:
                fake.gate.release()  # one chunk; the rest of the stream waits
                await resp.content.readuntil(b"\n\n")
                signalled = time.monotonic()
                worker.signal(signal.SIGTERM)
                await wait_for(base_tainted, timeout=drain_timeout, message="tainted while waiting")
                code = await worker.wait(drain_timeout + CLEANUP_BUDGET + 30)
                exited = time.monotonic() - signalled
        left = (await store.get_prefix("shoal/v1/")).items
    log = worker.stderr()
    assert code == 0, log
    assert left == [], f"{len(left)} keys left (first {left[0].key}):\n{log[-3000:]}"
    assert exited < drain_timeout + CLEANUP_BUDGET + SLACK, f"exit after {exited:.1f}s:\n{log}"
    assert "cleanup budget" not in log, log
