"""The bounded `/health` and `/ui` dashboard at their edges: stopping while a read is in
flight, reads that fail, an instance with two upstreams, totals, a registry changing between
a read's slices, and clients asking back to back."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from typing import Any

import aiohttp
import msgspec
import pytest

from shoal.cards import ModelCard, WorkerRole
from shoal.discovery import InstanceInfo, ModelInstance, ModelKey
from shoal.frontend import Frontend
from shoal.frontend.dashboard import snapshot
from shoal.frontend.registry.registrations import Registration, State
from tests.frontend.conftest import StartFrontend
from tests.frontend.test_fleet_reports import FIRST_ID, card, get_json, join
from tests.helpers import wait_for


def instance(iid: int, model: ModelCard, url: str = "http://127.0.0.1:9/v1") -> ModelInstance:
    info = InstanceInfo("fleet", "backend", "generate", iid, url, "")
    return ModelInstance(ModelKey(info.endpoint_id, iid), model, info)


def key_of(iid: int) -> ModelKey:
    return ModelKey(InstanceInfo("fleet", "backend", "generate", iid, "", "").endpoint_id, iid)


class Gate:
    """Replaces `reader.read` with one that waits for `open` (a read still in flight)."""

    def __init__(self, frontend: Frontend, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = asyncio.Event()
        self.started = asyncio.Event()
        self.calls = 0
        reader = frontend.dashboard.reader
        real = reader.read

        async def gated() -> snapshot.Sections:
            self.calls += 1
            self.started.set()
            await self.open.wait()
            return await real()

        monkeypatch.setattr(reader, "read", gated)


async def read_head(reader: asyncio.StreamReader, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(65536), timeout)
    except (TimeoutError, ConnectionError):
        return b""


# -- shutdown --------------------------------------------------------------------------------


async def test_stop_while_a_snapshot_is_read_answers_it_and_does_not_wait_for_the_drain(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    frontend = await start_frontend(reconcile_interval=3600, drain_timeout=3.0)
    join(frontend, FIRST_ID, card("m"))
    gate = Gate(frontend, monkeypatch)
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    writer.write(b"GET /ui/api/snapshot HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(gate.started.wait(), 5)
    started = time.monotonic()
    await frontend.stop()  # Dashboard.close cancels the shared read the snapshot awaits
    took = time.monotonic() - started
    answer = await read_head(reader, 1.0)
    writer.close()
    # Either the client is answered (200 or 503) at once, or at least the drain is not held.
    assert answer.startswith(b"HTTP/1.1 "), f"no answer at all; stop took {took:.2f} s"
    assert took < 2.0, f"stop waited {took:.2f} s (drain_timeout 3 s) for an orphaned snapshot"


async def test_close_leaves_no_dashboard_task_pending(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pages open at once while the first read is in flight: each page's read is the
    dashboard's to stop."""
    frontend = await start_frontend(reconcile_interval=3600)
    join(frontend, FIRST_ID, card("m"))
    gate = Gate(frontend, monkeypatch)
    conns = []
    for _ in range(2):
        conns.append(await asyncio.open_connection("127.0.0.1", frontend.port))
        conns[-1][1].write(b"GET /ui/api/events HTTP/1.1\r\nhost: x\r\n\r\n")
        await conns[-1][1].drain()
    await asyncio.wait_for(gate.started.wait(), 5)
    await wait_for(lambda: len(frontend.dashboard.streams) == 2, 5, message="two pages open")
    await frontend.dashboard.close()
    assert all(task.done() for task in frontend.dashboard._tasks)
    pending = [
        t for t in asyncio.all_tasks()
        if t is not asyncio.current_task() and not t.done()
        and ("tick" in repr(t) or "read" in repr(t) or "_answer" in repr(t))
    ]  # fmt: skip
    for _, w in conns:
        w.close()
    assert not pending, pending


# -- the errors column -----------------------------------------------------------------------


async def test_an_instance_with_two_upstreams_counts_one_failure_once(
    start_frontend: StartFrontend,
) -> None:
    """One instance id, two cards, two URLs (the instance moved: the old card keeps the old
    `Upstream`). One failure must count once however many reads see it."""
    frontend = await start_frontend(reconcile_interval=3600)
    frontend.registry.join(instance(FIRST_ID, card("a"), "http://127.0.0.1:9/v1"))
    adapter = instance(FIRST_ID, card("b"), "http://127.0.0.1:10/v1")
    info = adapter.instance
    frontend.registry.join(  # an adapter card (key suffix) of the same instance
        ModelInstance(ModelKey(info.endpoint_id, FIRST_ID, "lora-b"), adapter.card, info)
    )
    members = [m for model in frontend.registry.models.values() for ws in model.sets.values()
               for m in ws.members.values()]  # fmt: skip
    assert len({id(m.upstream) for m in members}) == 2
    members[-1].upstream.inhibit(60)  # one failure, of the card read last
    reader = frontend.dashboard.reader
    errors = []
    for _ in range(5):
        sections = await reader.read()
        (row,) = sections["instances"].values()
        errors.append(msgspec.json.decode(row)["errors"])
    assert errors == [1] * 5, errors


async def test_errors_of_a_failed_instance_are_kept_while_it_stays_and_dropped_when_it_leaves(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(reconcile_interval=3600)
    for i in range(3):
        join(frontend, FIRST_ID + i, card("m"))
    member = frontend.registry.member(key_of(FIRST_ID + 1))
    assert member is not None
    reader = frontend.dashboard.reader
    member.upstream.inhibit(60)
    await reader.read()
    member.upstream.inhibit(61)  # a second failure
    sections = await reader.read()
    rows = {
        msgspec.json.decode(r)["instance_id"]: msgspec.json.decode(r)
        for r in sections["instances"].values()
    }
    assert rows[f"{FIRST_ID + 1:x}"]["errors"] == 2
    assert rows[f"{FIRST_ID + 1:x}"]["state"] == "inhibited"
    frontend.registry.leave(key_of(FIRST_ID + 1))
    await reader.read()
    assert not reader._failures


# -- totals ----------------------------------------------------------------------------------


def stage_card(name: str, role: WorkerRole, context: int = 4096) -> ModelCard:
    return ModelCard.build(
        display_name=name, slug=name, source=f"test://{name}", model_types=["chat"],
        context_length=context, role=role,
    )  # fmt: skip


async def test_health_counts_an_instance_with_an_adapter_on_another_url_once(
    start_frontend: StartFrontend,
) -> None:
    """`instances` counts instance ids: one worker whose adapter card names another URL is
    one instance with two upstreams, not two instances."""
    frontend = await start_frontend(reconcile_interval=3600)
    frontend.registry.join(instance(FIRST_ID, card("a"), "http://127.0.0.1:9/v1"))
    adapter = instance(FIRST_ID, card("b"), "http://127.0.0.1:10/v1")
    info = adapter.instance
    frontend.registry.join(
        ModelInstance(ModelKey(info.endpoint_id, FIRST_ID, "lora-b"), adapter.card, info)
    )
    frontend.registry.join(instance(FIRST_ID + 1, card("a"), "http://127.0.0.1:11/v1"))
    status, body, _ = await get_json(f"{frontend.url}/health")
    assert status == 200, body
    assert body["models"]["a"]["instances"] == 2
    assert body["models"]["b"]["instances"] == 1
    assert body["instances"] == 2, body["instances"]


async def test_a_serving_model_with_a_lone_stage_set_is_not_counted_as_not_serving(
    start_frontend: StartFrontend,
) -> None:
    """Serving (aggregated instances routable) but `incomplete` (a prefill set of a new
    checksum waits for its decode set, e.g. a rolling upgrade)."""
    frontend = await start_frontend(reconcile_interval=3600)
    join(frontend, FIRST_ID, card("m"))
    frontend.registry.join(instance(FIRST_ID + 1, stage_card("m", WorkerRole.PREFILL, 8192)))
    model = frontend.registry.models["m"]
    assert model.serving and model.incomplete
    _, health, _ = await get_json(f"{frontend.url}/health")
    _, snap, _ = await get_json(f"{frontend.url}/ui/api/snapshot")
    assert health["models"]["m"]["serving"]
    assert (health["models_not_serving"], snap["totals"]["models_not_serving"]) == (0, 0)


async def test_by_state_counts_an_instance_once_whatever_its_cards_and_registrations(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "SLICE", 3)
    frontend = await start_frontend(reconcile_interval=3600)
    # A: two models, one card draining -> draining
    join(frontend, FIRST_ID, card("m1"))
    join(frontend, FIRST_ID, card("m2"), taints=("draining",))
    # B: joined and a pending adapter registration -> ready (joined), incomplete=[pending]
    join(frontend, FIRST_ID + 1, card("m1"))
    # C: a pending and a refused registration, never joined -> refused
    # D: only pending -> pending
    regs = [
        Registration(instance(FIRST_ID + 1, card("m3")), 1, State.PENDING),
        Registration(instance(FIRST_ID + 2, card("m3")), 1, State.PENDING),
        Registration(instance(FIRST_ID + 2, card("m4")), 1, State.REFUSED, error="x"),
        Registration(instance(FIRST_ID + 3, card("m3")), 1, State.PENDING),
    ]
    assert frontend.watcher is not None
    monkeypatch.setattr(frontend.watcher, "incomplete", lambda: list(regs))
    sections = await frontend.dashboard.reader.read()
    rows = {
        msgspec.json.decode(r)["instance_id"]: msgspec.json.decode(r)
        for r in sections["instances"].values()
    }
    totals = msgspec.json.decode(sections["totals"][""])
    states = {iid: row["state"] for iid, row in rows.items()}
    assert states == {
        f"{FIRST_ID:x}": "draining",
        f"{FIRST_ID + 1:x}": "ready",
        f"{FIRST_ID + 2:x}": "refused",
        f"{FIRST_ID + 3:x}": "pending",
    }
    assert rows[f"{FIRST_ID + 1:x}"]["incomplete"] == ["pending"]
    expected = dict.fromkeys(snapshot.STATES, 0)
    for state in states.values():
        expected[state] += 1
    assert totals["by_state"] == expected and totals["instances"] == 4
    assert totals["incomplete"] == 4


# -- a registry that changes during a sliced read --------------------------------------------


async def test_a_registry_changing_between_slices_never_breaks_a_read(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot, "SLICE", 7)
    monkeypatch.setattr(snapshot, "MAX_ROWS", 30)
    frontend = await start_frontend(reconcile_interval=3600)
    models = [card(f"m-{i}") for i in range(12)]
    for i in range(300):
        join(frontend, FIRST_ID + i, models[i % 12])
    rng = random.Random(5)
    stop = False

    async def churn() -> None:
        n = 300
        while not stop:
            op = rng.random()
            registry = frontend.registry
            if op < 0.35:
                join(frontend, FIRST_ID + n, models[rng.randrange(12)])
                n += 1
            elif op < 0.7 and len(registry):
                keys = list(registry._members)
                registry.leave(rng.choice(keys))
            else:
                keys = list(registry._members)
                if keys:
                    registry.set_taints(rng.choice(keys), rng.choice([(), ("draining",), ("x",)]))
            member = registry.member(rng.choice(list(registry._members))) if len(registry) else None
            if member is not None and rng.random() < 0.3:
                member.upstream.inhibit(30)
            await asyncio.sleep(0)

    task = asyncio.create_task(churn())
    try:
        for _ in range(40):
            sections = await frontend.dashboard.reader.read()
            totals = msgspec.json.decode(sections["totals"][""])
            rows = [msgspec.json.decode(r) for r in sections["instances"].values()]
            assert len(rows) <= 30 and len(sections["models"]) <= 30
            assert totals["instances"] == sum(totals["by_state"].values())
            shown: dict[str, int] = {}
            for row in rows:
                shown[row["state"]] = shown.get(row["state"], 0) + 1
            assert all(shown[s] <= totals["by_state"][s] for s in shown)
            # the most severe first: a shown row's state is never less severe than a hidden one
            if totals["instances"] > len(rows):
                worst_hidden = max(
                    (snapshot.STATES.index(s) for s, n in totals["by_state"].items() if n > shown.get(s, 0)),
                )  # fmt: skip
                assert all(snapshot.STATES.index(r["state"]) <= worst_hidden for r in rows)
    finally:
        stop = True
        await task


# -- HTTP ------------------------------------------------------------------------------------


async def test_head_of_the_snapshot_has_the_length_of_the_get_and_no_body(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(reconcile_interval=3600)
    join(frontend, FIRST_ID, card("m"))
    async with aiohttp.ClientSession() as session:
        head = await session.head(f"{frontend.url}/ui/api/snapshot")
        body = await head.read()
        assert head.status == 200 and body == b""
        assert int(head.headers["content-length"]) > 100
        # keep-alive after a HEAD answered later: the next request on the connection works
        again = await session.get(f"{frontend.url}/ui/api/snapshot")
        assert again.status == 200 and (await again.json())["totals"]["instances"] == 1


async def events(
    reader: asyncio.StreamReader, count: int, timeout: float = 5.0
) -> list[tuple[str, Any]]:
    got: list[tuple[str, Any]] = []
    buf = b""
    deadline = time.monotonic() + timeout
    while len(got) < count:
        chunk = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            lines = dict(line.split(b": ", 1) for line in block.split(b"\n") if b": " in line)
            if b"event" in lines:
                got.append((lines[b"event"].decode(), msgspec.json.decode(lines[b"data"])))
    return got


async def test_a_page_opened_while_a_tick_reads_gets_one_snapshot_then_the_same_changes(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    frontend = await start_frontend(reconcile_interval=3600)
    join(frontend, FIRST_ID, card("m"))
    gate = Gate(frontend, monkeypatch)
    a_r, a_w = await asyncio.open_connection("127.0.0.1", frontend.port)
    a_w.write(b"GET /ui/api/events HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(gate.started.wait(), 5)
    b_r, b_w = await asyncio.open_connection("127.0.0.1", frontend.port)
    b_w.write(b"GET /ui/api/events HTTP/1.1\r\nhost: x\r\n\r\n")
    await wait_for(lambda: len(frontend.dashboard.streams) == 2, 5, message="two pages open")
    join(frontend, FIRST_ID + 1, card("m"))
    gate.open.set()
    first_a = await events(a_r, 1)
    first_b = await events(b_r, 1)
    assert [e for e, _ in first_a] == ["snapshot"] and [e for e, _ in first_b] == ["snapshot"]
    join(frontend, FIRST_ID + 2, card("m"))
    change_a = [e for e in await events(a_r, 1) if e[0] == "change"]
    change_b = [e for e in await events(b_r, 1) if e[0] == "change"]
    a_w.close()
    b_w.close()
    assert change_a and change_b
    assert change_a[0][1]["set"]["totals"]["instances"] == 3
    assert change_b[0][1]["set"]["totals"]["instances"] == 3


async def test_a_read_that_fails_answers_every_sharer_500_and_leaves_no_unretrieved_error(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    frontend = await start_frontend(reconcile_interval=3600)
    dashboard = frontend.dashboard
    asked, reads = [0], [0]  # the dashboard's reads asked for, the fleet's read
    ask = dashboard.read

    async def counted() -> snapshot.Sections:
        asked[0] += 1
        return await ask()

    def shared() -> bool:
        """Whoever is meant to share the read asked: the three snapshots, then both pages."""
        return asked[0] >= 3 and (reads[0] == 1 or len(dashboard.streams) == 2)

    async def broken() -> snapshot.Sections:
        reads[0] += 1
        await wait_for(shared, 5, message="every sharer asked")  # (in flight until then)
        raise RuntimeError("boom")

    monkeypatch.setattr(dashboard, "read", counted)
    monkeypatch.setattr(dashboard.reader, "read", broken)
    loop = asyncio.get_running_loop()
    unretrieved: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    try:
        results = await asyncio.gather(
            *(get_json(f"{frontend.url}/ui/api/snapshot") for _ in range(3)), return_exceptions=True
        )
        statuses = [r[0] if isinstance(r, tuple) else r for r in results]
        assert statuses == [500, 500, 500]
        assert reads == [1]  # (one read, shared)
        # two pages with no previous read: each starts a tick, the first's is forgotten
        conns = []
        for _ in range(2):
            conns.append(await asyncio.open_connection("127.0.0.1", frontend.port))
            conns[-1][1].write(b"GET /ui/api/events HTTP/1.1\r\nhost: x\r\n\r\n")
            await conns[-1][1].drain()
        await wait_for(lambda: len(frontend.dashboard.streams) == 2, 5, message="two pages open")
        await wait_for(lambda: not frontend.dashboard._tasks, 5, message="their reads ended")
        for _, w in conns:
            w.close()
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(old)
    # (only the read's own failure: the collection may also find an earlier test's leftovers)
    ours = [ctx for ctx in unretrieved if "boom" in repr(ctx.get("exception"))]
    msgs = [f"{ctx.get('message')}: {ctx.get('future')!r:.200}" for ctx in ours]
    assert not msgs, msgs
    assert "a new page's first read failed" in caplog.text


async def test_stop_while_a_real_sliced_read_is_in_flight_same_as_gated(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same without a stand-in: a real read of 5,000 instances in slices of 20."""
    monkeypatch.setattr(snapshot, "SLICE", 20)
    frontend = await start_frontend(reconcile_interval=3600, drain_timeout=3.0)
    for i in range(5000):
        join(frontend, FIRST_ID + i, card("m"))
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    started_reading = asyncio.Event()
    real = frontend.dashboard.reader.read

    async def noted() -> snapshot.Sections:
        started_reading.set()
        return await real()

    monkeypatch.setattr(frontend.dashboard.reader, "read", noted)
    writer.write(b"GET /ui/api/snapshot HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(started_reading.wait(), 5)
    assert frontend.dashboard._reading is not None and not frontend.dashboard._reading.done()
    started = time.monotonic()
    await frontend.stop()
    took = time.monotonic() - started
    answer = await read_head(reader, 1.0)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 "), f"no answer at all; stop took {took:.2f} s"
    assert took < 2.0, took


async def test_snapshot_requests_back_to_back_are_held_to_the_busy_share(
    start_frontend: StartFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients asking `/ui/api/snapshot` back to back (open to anyone when no API key is
    set) do not keep a read of the whole fleet running: after a read, the next starts
    `BUSY_SHARE` times its time later at the earliest."""
    from shoal.frontend.dashboard import dashboard as dashboard_module

    frontend = await start_frontend(reconcile_interval=3600)
    models = [card(f"m-{i}") for i in range(50)]
    for i in range(20_000):
        join(frontend, FIRST_ID + i, models[i % 50])
    reader = frontend.dashboard.reader
    real = reader.read
    busy: list[float] = []

    async def timed() -> snapshot.Sections:
        result = await real()
        busy.append(reader.busy)
        return result

    monkeypatch.setattr(reader, "read", timed)
    status, first, _ = await get_json(f"{frontend.url}/ui/api/snapshot")  # (not counted)
    assert status == 200 and first["totals"]["instances"] == 20_000
    busy.clear()

    async def client() -> int:
        answered = 0
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < end:
                async with session.get(f"{frontend.url}/ui/api/snapshot") as response:
                    assert response.status == 200
                    await response.read()
                    answered += 1
        return answered

    start = time.monotonic()
    end = start + 2.0
    answered = sum(await asyncio.gather(*(client() for _ in range(3))))
    elapsed = time.monotonic() - start
    assert answered > 3 * len(busy), (answered, busy)  # most answers were the last read
    # each read is followed by BUSY_SHARE times its time without one (the last may run over)
    allowed = elapsed / dashboard_module.BUSY_SHARE + max(busy, default=0.0)
    assert sum(busy) <= allowed, f"reads took {sum(busy):.2f} s of {elapsed:.2f} s: {busy}"
