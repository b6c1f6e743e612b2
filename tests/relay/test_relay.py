"""`shoal kv-relay` with real parts: mocker workers publishing KV events, a real `nats-server -js`,
relay processes. What the stream holds is compared with what the workers published (read
straight from their ZMQ sockets)."""

from __future__ import annotations

import asyncio
import re
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats
import openai
import pytest
import zmq.asyncio
from nats.js import api

from shoal.discovery import Discovery, Query
from shoal.kv import KVEventBatch, decode_batch, encode_batch
from shoal.kv import stream as layout
from shoal.kv.subscription import KvStats, KvSubscription
from shoal.store import open_store
from shoal.worker.engines.mocker.text import VOCAB
from tests.helpers import wait_for
from tests.nats_server import NatsServer
from tests.processes import Process, Processes

MODEL = "relay-llm"
BS = 4
WORKER_FLAGS = (
    "--lease-ttl", "2", "--ttft-ms", "1", "--itl-ms", "1",
    "--block-size", str(BS), "--kv-blocks", "64", "--kv-events-port", "0",
)  # fmt: skip


def prompt(seed: int) -> str:
    return " ".join(VOCAB[(seed * 7 + i * i) % 20] for i in range(40))


async def send(worker: Process, text: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0)
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=1,
    )


async def status(relay: Process) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{relay.ready['status']}/v1/membership/status") as resp,
    ):
        body: dict[str, Any] = await resp.json()
        return body


async def stream_records(url: str) -> list[tuple[str, dict[str, str], bytes]]:
    """Every record the stream holds, in order: (subject, headers, payload)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(layout.DEFAULT_STREAM)
        total = info.state.messages
        sub = await js.subscribe(
            f"{layout.SUBJECT_PREFIX}.>",
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL,
        )
        records = []
        for _ in range(total):
            msg = await sub.next_msg(timeout=5)
            records.append((msg.subject, dict(msg.headers or {}), msg.data))
        await sub.unsubscribe()
        return records
    finally:
        await nc.close()


@pytest.fixture
async def fleet(
    processes: Processes, tmp_path: Path
) -> AsyncIterator[tuple[str, str, list[Process]]]:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    namespace = f"relay-{uuid.uuid4().hex[:8]}"
    workers = [
        await processes.worker(store_url, "--namespace", namespace, *WORKER_FLAGS, model=MODEL)
        for _ in range(2)
    ]
    yield store_url, namespace, workers


async def direct_batches(store_url: str, namespace: str) -> dict[int, dict[int, KVEventBatch]]:
    """Each worker's batches as its own replay socket gives them (seq -> batch)."""
    store = await open_store(store_url)
    ctx = zmq.asyncio.Context()
    found: dict[int, dict[int, KVEventBatch]] = {}
    subs = []
    try:
        for model in await Discovery(store).list(Query(namespace=namespace)):
            kv = model.instance.kv_events
            assert kv is not None
            got = found.setdefault(model.instance_id, {})
            sub = KvSubscription(
                ctx, model.instance_id, kv, lambda s, b, got=got: got.__setitem__(s, b),
                lambda: None, KvStats(),
            )  # fmt: skip
            sub.start()
            subs.append(sub)
        await wait_for(lambda: all(found.values()), message="every worker's history replayed")
        return found
    finally:
        for sub in subs:
            await sub.stop()
        ctx.destroy(linger=0)
        await store.close()


async def test_two_relays_put_each_batch_in_the_stream_once(
    processes: Processes,
    fleet: tuple[str, str, list[Process]],
    nats_server: NatsServer,
) -> None:
    store_url, namespace, workers = fleet
    for i, worker in enumerate(workers):
        await send(worker, prompt(i))
    relay_args = (
        "kv-relay", "--store", store_url, "--namespace", namespace,
        "--nats", nats_server.url, "--status-port", "0",
    )  # fmt: skip
    relays = [await processes.start(*relay_args, ready="kv-relay") for _ in range(2)]
    for i, worker in enumerate(workers):
        await send(worker, prompt(i + 10))
    direct = await direct_batches(store_url, namespace)
    last = {inst: max(batches) for inst, batches in direct.items()}

    async def relayed_all() -> bool:
        for relay in relays:
            members = {int(m["instance_id"], 16): m for m in (await status(relay))["members"]}
            if {i: m["last_seq"] for i, m in members.items()} != last:
                return False
            if any(m["pending"] for m in members.values()):
                return False
        return True

    await wait_for(relayed_all, timeout=20, message="both relays published every batch")
    records = await stream_records(nats_server.url)
    seen: dict[int, list[int]] = {}
    joined: dict[int, int] = {}
    for subject, headers, payload in records:
        parsed = layout.parse_subject(subject)
        assert parsed is not None and parsed[0] == namespace
        instance = parsed[1]
        kind = headers[layout.KIND]
        if kind == layout.JOINED:
            joined[instance] = joined.get(instance, 0) + 1
            info = msgspec.json.decode(payload, type=layout.Joined)
            assert (info.model, info.block_size, info.namespace) == (MODEL, BS, namespace)
        elif kind == layout.BATCH:
            seq = int(headers[layout.SEQ])
            seen.setdefault(instance, []).append(seq)
            assert encode_batch(decode_batch(payload)) == encode_batch(direct[instance][seq])
        else:
            raise AssertionError(f"unexpected {kind} record")
    assert joined == {i: 1 for i in direct}
    # Every batch once, in the worker's order: two relays, no duplicate kept.
    assert seen == {i: sorted(direct[i]) for i in direct}
    assert sorted(direct[next(iter(direct))]) == list(range(last[next(iter(direct))] + 1))
    text = ""
    async with aiohttp.ClientSession() as session:
        for relay in relays:
            async with session.get(f"{relay.ready['status']}/metrics") as resp:
                text += await resp.text()
    duplicates = re.findall(r"^shoal_relay_duplicates_total (\S+)$", text, re.M)
    assert len(duplicates) == 2 and sum(float(d) for d in duplicates) > 0, text


def check_complete(
    records: list[tuple[str, dict[str, str], bytes]], direct: dict[int, dict[int, KVEventBatch]]
) -> dict[int, list[str]]:
    """Every worker batch in the stream exactly once, in order; the control records by instance."""
    seen: dict[int, list[int]] = {}
    controls: dict[int, list[str]] = {}
    for subject, headers, _ in records:
        parsed = layout.parse_subject(subject)
        assert parsed is not None
        if headers[layout.KIND] == layout.BATCH:
            seen.setdefault(parsed[1], []).append(int(headers[layout.SEQ]))
        else:
            controls.setdefault(parsed[1], []).append(headers[layout.KIND])
    assert seen == {i: sorted(direct[i]) for i in direct}
    return controls


async def test_a_relay_killed_under_load_leaves_the_other_keeping_the_stream_complete(
    processes: Processes,
    fleet: tuple[str, str, list[Process]],
    nats_server: NatsServer,
) -> None:
    store_url, namespace, workers = fleet
    relay_args = (
        "kv-relay", "--store", store_url, "--namespace", namespace,
        "--nats", nats_server.url, "--status-port", "0",
    )  # fmt: skip
    survivor, victim = [await processes.start(*relay_args, ready="kv-relay") for _ in range(2)]
    for n in range(12):
        if n == 4:
            victim.signal(signal.SIGKILL)
        await asyncio.gather(*(send(w, prompt(n * 3 + i)) for i, w in enumerate(workers)))
    direct = await direct_batches(store_url, namespace)
    last = {inst: max(batches) for inst, batches in direct.items()}

    async def relayed_all() -> bool:
        members = (await status(survivor))["members"]
        return {int(m["instance_id"], 16): m["last_seq"] for m in members} == last and not any(
            m["pending"] for m in members
        )

    await wait_for(relayed_all, timeout=20, message="the survivor published every batch")
    controls = check_complete(await stream_records(nats_server.url), direct)
    assert controls == {i: ["joined"] for i in direct}  # nothing resnapshotted


async def test_a_worker_that_leaves_is_unsubscribed_and_left_is_published_once(
    processes: Processes,
    fleet: tuple[str, str, list[Process]],
    nats_server: NatsServer,
) -> None:
    store_url, namespace, (a, b) = fleet
    relay = await processes.start(
        "kv-relay", "--store", store_url, "--namespace", namespace,
        "--nats", nats_server.url, "--status-port", "0", ready="kv-relay",
    )  # fmt: skip
    await send(a, prompt(1))

    async def members() -> set[int]:
        return {int(m["instance_id"], 16) for m in (await status(relay))["members"]}

    await wait_for(lambda: _eq(members(), {a.instance_id, b.instance_id}), message="followed")
    async with aiohttp.ClientSession() as session:
        for probe in ("/live", "/health"):
            async with session.get(f"{relay.ready['status']}{probe}") as resp:
                assert resp.status == 200, await resp.text()
    b.signal(signal.SIGTERM)
    assert await b.wait() == 0
    await wait_for(lambda: _eq(members(), {a.instance_id}), timeout=15, message="b unfollowed")

    async def left_records() -> list[str]:
        records = await stream_records(nats_server.url)
        return [
            h[layout.KIND]
            for s, h, _ in records
            if layout.parse_subject(s) == (namespace, b.instance_id) and h[layout.KIND] == "left"
        ]

    await wait_for(left_records, message="left published")
    assert await left_records() == ["left"]
    relay.signal(signal.SIGTERM)
    assert await relay.wait(10) == 0


async def _eq(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


def write_atomically(path: Path, content: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(content)
    tmp.rename(path)


async def test_the_relay_follows_its_sources_file_and_connects_again_on_a_new_connection_revision(
    processes: Processes,
    fleet: tuple[str, str, list[Process]],
    nats_server: NatsServer,
    tmp_path: Path,
) -> None:
    store_url, namespace, (a, _) = fleet
    sources = tmp_path / "sources.json"
    listing = '{{"version": 1, "revision": "{r}", "connection_revision": "{c}", "sources": [{s}]}}'
    write_atomically(sources, listing.format(r="r1", c="c1", s=f'{{"namespace": "{namespace}"}}'))
    relay = await processes.start(
        "kv-relay", "--store", store_url, "--namespace-sources", str(sources),
        "--nats", nats_server.url, "--status-port", "0", ready="kv-relay",
    )  # fmt: skip

    async def shows(
        revision: str, connection: str, members: int, connections: int, error: bool = False
    ) -> bool:
        body = await status(relay)
        return (
            body["applied_revision"] == revision
            and body["connection_revision"] == connection
            and len(body["members"]) == members
            and body["nats"]["connections"] == connections
            and body["nats"]["state"] == "connected"
            and (body["last_error"] is not None) == error
        )

    await wait_for(lambda: shows("r1", "c1", 2, 1), message="r1 in force, both followed")
    write_atomically(sources, listing.format(r="r2", c="c1", s=""))
    await wait_for(lambda: shows("r2", "c1", 0, 1), message="r2 in force: nobody followed")
    write_atomically(sources, '{"version": 1, "sources": [')  # invalid: r2 stays in force
    await wait_for(lambda: shows("r2", "c1", 0, 1, error=True), message="the error shown")
    write_atomically(sources, listing.format(r="r3", c="c2", s=f'{{"namespace": "{namespace}"}}'))
    await wait_for(lambda: shows("r3", "c2", 2, 2), message="r3 in force, connected again")
    records = await stream_records(nats_server.url)
    kinds = [
        h[layout.KIND]
        for s, h, _ in records
        if layout.parse_subject(s) == (namespace, a.instance_id)
    ]
    assert kinds[:1] == ["joined"] and kinds.count("left") == 1
