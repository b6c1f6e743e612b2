"""`KvRelay` in this process against a real `nats-server -js`, its members fed by hand (no
worker): what it does when the stream is deleted under it, and when a member comes back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import nats
import pytest
from nats.js.errors import NotFoundError

from shoal.frontend.kv import stream as kv_stream
from shoal.frontend.kv.stream import KvStreamReader
from shoal.kv import AllBlocksCleared, KvEndpoint, KVEventBatch
from shoal.kv import stream as layout
from shoal.membership import MembershipStatus
from shoal.relay.member import Member
from shoal.relay.relay import KvRelay, RelayConfig
from shoal.relay.status import StatusServer
from tests.helpers import free_port, wait_for
from tests.nats_server import NatsServer

STREAM = "shoal-kv-faults"


@pytest.fixture
async def relay(nats_server: NatsServer) -> AsyncIterator[KvRelay]:
    made = KvRelay(RelayConfig(nats_urls=(nats_server.url,), stream=STREAM, publish_timeout=1))
    await made.start()
    await wait_for(lambda: made.connected.is_set())
    try:
        yield made
    finally:
        await made.stop()


def fed(
    relay: KvRelay, instance_id: int, buffer: int | None = 100, namespace: str = "ns"
) -> Member:
    """A member joined as a view would join it (its subscription to a worker that is not
    there waits, idle): its batches are `apply`d by the test. `buffer`: the relay's
    records queued per member from then on (None: as configured)."""
    if buffer is not None:
        relay.config.buffer = buffer
    key = (namespace, instance_id)
    card = SimpleNamespace(kv_block_size=4, display_name="m", role="aggregated", mdcsum="x")
    instance = SimpleNamespace(namespace=namespace, component="c", endpoint="e")
    relay._join(key, KvEndpoint("tcp://127.0.0.1:1"), SimpleNamespace(card=card, instance=instance))  # type: ignore[arg-type]
    return relay.members[key]


def batch(ts: float) -> KVEventBatch:
    return KVEventBatch(ts, [AllBlocksCleared()])


async def stored(url: str) -> int:
    """Messages in the stream (0 when there is none)."""
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(STREAM)).state.messages
    except NotFoundError:
        return 0
    finally:
        await nc.close()


async def test_a_stream_deleted_under_a_connected_relay_is_created_again(
    relay: KvRelay, nats_server: NatsServer
) -> None:
    member = fed(relay, 1)
    member.apply(0, batch(100.0))
    await wait_for(lambda: relay.stats.relayed == 1)
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().delete_stream(STREAM)
    finally:
        await nc.close()
    member.apply(1, batch(101.0))  # no stream takes it: the relay makes one again

    async def in_stream() -> bool:
        return await stored(nats_server.url) >= 1 and relay.stats.relayed == 2

    await wait_for(in_stream, timeout=10)


async def test_a_relay_whose_stream_was_made_with_another_max_age_says_so(
    relay: KvRelay, nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The stream is used as it is, never altered: a second relay started with another
    `--max-age` says which settings it found instead of its own, in its log and status."""
    other = KvRelay(RelayConfig(nats_urls=(nats_server.url,), stream=STREAM, max_age=3600))
    await other.start()
    try:
        await wait_for(lambda: other.connected.is_set())
        assert other.status()["stream_differs"] == {"max_age": {"stream": 600.0, "flag": 3600}}
        assert relay.status()["stream_differs"] == {}
    finally:
        await other.stop()
    assert "max_age 600.0 (not 3600" in caplog.text


async def test_a_relay_with_a_max_age_under_the_duplicate_window_makes_its_stream(
    nats_server: NatsServer,
) -> None:
    """`--max-age 60`: the relay asked for a stream keeping message ids 120 s, longer than
    its records, which JetStream refuses ("duplicates window can not be larger then max
    age"): it never made its stream nor relayed a record. Now the duplicate window is the
    max age when that is shorter (a record is resent within seconds: 60 s covers it), and
    the stream so made is not reported as differing from the flags."""
    relay = KvRelay(RelayConfig(nats_urls=(nats_server.url,), stream=STREAM, max_age=60))
    await relay.start()
    try:
        await wait_for(lambda: relay.connected.is_set(), message="the stream made")
        member = fed(relay, 1)
        member.apply(0, batch(100.0))
        await wait_for(lambda: relay.stats.relayed == 1)
        assert relay.status()["stream_differs"] == {}
    finally:
        await relay.stop()
    nc = await nats.connect(nats_server.url)
    try:
        config = (await nc.jetstream().stream_info(STREAM)).config
    finally:
        await nc.close()
    assert (config.max_age, config.duplicate_window) == (60.0, 60.0)


async def records(url: str) -> list[tuple[str, str]]:
    """(kind, Shoal-Seq) of every record in the stream, in its order."""
    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info(STREAM)
        sub = await nc.jetstream().subscribe(
            f"{layout.SUBJECT_PREFIX}.>", stream=STREAM, ordered_consumer=True
        )
        got = []
        for _ in range(info.state.messages):
            msg = await sub.next_msg(timeout=5)
            headers = msg.headers or {}
            got.append((headers.get(layout.KIND, ""), headers.get(layout.SEQ, "")))
        return got
    finally:
        await nc.close()


async def test_an_instance_back_under_the_same_id_is_published_after_its_left(
    relay: KvRelay, nats_server: NatsServer
) -> None:
    """A worker restarted with the same instance id (its KV endpoint changed: left, joined
    again in one view): the new run's records go to the subject after everything the old
    run had queued and its `left`, never among them."""
    old = fed(relay, 1, buffer=1000)
    for seq in range(400):  # more than a window: the old run is still sending
        old.apply(seq, batch(100.0 + seq))
    relay._leave(relay.members.pop(old.key))
    new = fed(relay, 1)
    for seq in range(3):
        new.apply(seq, batch(1000.0 + seq))
    await wait_for(lambda: relay.stats.relayed == 403, timeout=10)
    kinds = [kind for kind, _ in await records(nats_server.url)]
    assert kinds.index("left") == 401, kinds  # joined, 400 batches, left
    assert kinds[402:] == ["joined"] + ["batch"] * 3  # (the new run's own)


async def test_every_run_and_namespace_of_an_instance_id_has_its_left_stored(
    relay: KvRelay, nats_server: NatsServer
) -> None:
    """`joined` and `left` had the message id `{instance}:{kind}`: a worker back under the
    same id that left again within the stream's duplicate window, or the same id in another
    namespace, had its `left` refused as a duplicate, and a reader not following it kept its
    batches for good. Now control ids name the namespace and the run (and batch ids the
    namespace): every `left` is stored and a reader keeps nothing of the three runs."""
    for namespace, first in (("ns", 0.0), ("ns", 1000.0), ("other", 2000.0)):
        member = fed(relay, 1, namespace=namespace)
        member.apply(0, batch(first + 100.0))  # (batch 0 of each: ids apart by ts, namespace)
        relay._leave(relay.members.pop(member.key))
    await wait_for(lambda: relay.stats.relayed == 3 and not relay._departing, timeout=10)
    nc = await nats.connect(nats_server.url)
    reader = KvStreamReader(nats_server.url, STREAM)
    kinds: dict[str, list[str]] = {}  # per subject (the members take turns: subjects mix)
    try:
        js = nc.jetstream()
        total = (await js.stream_info(STREAM)).state.messages
        sub = await js.subscribe(f"{layout.SUBJECT_PREFIX}.>", stream=STREAM, ordered_consumer=True)
        for _ in range(total):
            msg = await sub.next_msg(timeout=5)
            kinds.setdefault(msg.subject, []).append((msg.headers or {}).get(layout.KIND, ""))
            reader.record(msg.subject, msg.headers or {}, msg.data)
    finally:
        await nc.close()
    assert kinds == {
        layout.subject("ns", 1): ["joined", "batch", "left"] * 2,  # (the runs never mix)
        layout.subject("other", 1): ["joined", "batch", "left"],
    }
    assert not reader.instances and reader.ledger.bytes == 0


async def test_a_reader_whose_stream_is_deleted_and_made_again_reads_the_new_one(
    relay: KvRelay, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream deleted and made again (by the relay; or a NATS server back without its
    storage) numbers its records from 1: a frontend reading it goes on from the new stream's
    start (what it held of every instance dropped), not from its old place."""
    monkeypatch.setattr(kv_stream, "STREAM_CHECK", 0.2, raising=False)
    reader = KvStreamReader(nats_server.url, STREAM)
    applied: list[float] = []
    purges: list[int] = []
    reader.follow(("ns", 1), lambda b: applied.append(b.ts), lambda: purges.append(1))
    reader.start()
    try:
        member = fed(relay, 1)
        for seq in range(50):
            member.apply(seq, batch(100.0 + seq))
        await wait_for(lambda: len(applied) == 50, timeout=10)
        nc = await nats.connect(nats_server.url)
        try:
            await nc.jetstream().delete_stream(STREAM)
        finally:
            await nc.close()
        for seq in range(50, 60):  # the first finds no stream: the relay makes it again
            member.apply(seq, batch(100.0 + seq))
        await wait_for(lambda: applied[-1:] == [159.0], timeout=10)
        assert purges  # what it held may be wrong: dropped
        assert reader.describe()["last_record"] == 10
    finally:
        await reader.close()


async def test_a_relay_follows_more_instances_than_zmqs_default_socket_bound(
    relay: KvRelay,
) -> None:
    """1,100 members: one SUB socket each (and a DEALER while one replays), past libzmq's
    default of 1,023 sockets a context, every subscription runs."""
    for instance_id in range(1, 1101):
        fed(relay, instance_id)
    tasks = [m.subscription.task for m in relay.members.values() if m.subscription]
    assert len(tasks) == 1100 and None not in tasks
    await asyncio.sleep(0)  # (one turn of the loop: each subscription's first step, its socket)
    failed = [task for task in tasks if task is not None and task.done()]
    assert not failed, f"{len(failed)} subscriptions died"


async def test_acknowledgements_nats_py_drops_send_their_records_again_at_once(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """nats-py queued up to 524,288 acknowledgements (128 MiB) for the relay whatever its
    records in flight; one it dropped past that (a slow consumer) was taken for a NATS error
    (`nats_error`, in `/health`) and its record waited the publish timeout to be sent again.
    Now the queue holds about twice the relay's budget of records in flight (here 16, and
    `ANSWER_BYTES` made 1: a few answers), and a dropped answer is counted, logged, and its
    record sent again at once (same id): every batch is stored once, in order."""
    from shoal.relay import acks

    monkeypatch.setattr(acks, "ANSWER_BYTES", 1, raising=False)
    config = RelayConfig(
        nats_urls=(nats_server.url,), stream=STREAM, publish_timeout=60, inflight_records=16
    )
    relay = KvRelay(config)
    await relay.start()
    try:
        await wait_for(lambda: relay.connected.is_set())
        member = fed(relay, 1, buffer=1000)
        for seq in range(300):
            member.apply(seq, batch(100.0 + seq))
        stats = (
            relay.stats
        )  # (a record stored whose answer was dropped: a duplicate when sent again)
        await wait_for(lambda: stats.relayed + stats.duplicates == 300, timeout=30)
        assert stats.answers_dropped > 0, "no answer dropped: the queue was not bounded"
        assert relay.nats_error is None
    finally:
        await relay.stop()
    assert await records(nats_server.url) == [("joined", "")] + [
        ("batch", str(seq)) for seq in range(300)
    ]
    assert any("dropped acknowledgements" in r.getMessage() for r in caplog.records)


class TokenNats(NatsServer):
    """A `nats-server -js` that takes clients with one token only (`--auth`)."""

    token = "right-token-5f1e"

    def command(self) -> list[str]:
        return [*super().command(), "--auth", self.token]


@pytest.mark.parametrize("refused", ["a wrong token", "no server"])
async def test_a_relay_that_cannot_make_its_first_connection_says_why_without_the_token(
    refused: str,
) -> None:
    """nats-py retries a first connection for ever (`max_reconnect_attempts=-1`), telling
    only the error callback, which the relay heard only for a connection it already had:
    its `/health` said "connecting" for ever, and the log nothing, whether NATS refused
    the token or was not there."""
    with TokenNats() as server:
        port = server.port if refused == "a wrong token" else free_port()
        url = f"nats://wrong-token-9c2d@127.0.0.1:{port}"
        relay = KvRelay(RelayConfig(nats_urls=(url,), stream="shoal-kv-auth"))
        status = StatusServer(relay, SimpleNamespace(status=MembershipStatus()))  # type: ignore[arg-type]
        await relay.start()
        try:
            why = "Authorization Violation" if refused == "a wrong token" else "Connect call failed"
            await wait_for(lambda: why in str(relay.nats_error), timeout=10, message=why)
            code, body = status.health()
            assert code == 503 and why in body["unhealthy"]["nats"]
            assert "wrong-token" not in json.dumps(body)
        finally:
            await relay.stop()


async def test_records_sent_as_nats_is_lost_are_never_stored_before_those_sent_first(
    nats_server: NatsServer,
) -> None:
    """1,000 members joining at once take turns within the relay's budget, so a member's
    records go out over several rounds. NATS killed mid-flight: nats-py kept the records
    published after its socket broke (before its disconnect callback) and those its flusher
    had not written, and sent them first on its next connection; the relay then sent again
    what was lost on the broken socket, same ids. So a member's later batches were stored
    before its `joined` and first batches (`16..19, joined, 0..15`; one member of 1,000 in 4
    outages of 5), and a reader applied 16..19 and skipped 0..15 as seen: lost, untold. Now
    nothing published on a lost connection is sent on the next: after three outages every
    subject's records are stored in order, and the relay's budget is all returned."""
    relay = KvRelay(
        RelayConfig(nats_urls=(nats_server.url,), stream=STREAM, max_bytes=-1, publish_timeout=2)
    )
    await relay.start()
    stats = relay.stats
    try:
        for outage in range(3):
            await wait_for(lambda: relay.connected.is_set(), timeout=30)
            members = [fed(relay, 1 + outage * 1000 + i, buffer=1000) for i in range(1000)]
            for seq in range(20):
                for member in members:
                    member.apply(seq, batch(100.0 + seq))
            await wait_for(lambda: stats.flying_records > 500, message="records in flight")
            nats_server.stop()  # (SIGKILL, with records in flight)
            await wait_for(lambda: not relay.connected.is_set(), message="the relay saw it")
            nats_server.start()
            await wait_for(lambda: not stats.queued_bytes and not stats.flying_records, timeout=120)
            assert not any(m.pending or m.inflight for m in members) and stats.flying == 0
    finally:
        await relay.stop()
    nc = await nats.connect(nats_server.url)
    per_subject: dict[str, list[tuple[str, str]]] = {}
    try:
        js = nc.jetstream()
        total = (await js.stream_info(STREAM)).state.messages
        sub = await js.subscribe(f"{layout.SUBJECT_PREFIX}.>", stream=STREAM, ordered_consumer=True)
        for _ in range(total):
            msg = await sub.next_msg(timeout=5)
            headers = msg.headers or {}
            kind_seq = (headers.get(layout.KIND, ""), headers.get(layout.SEQ, ""))
            per_subject.setdefault(msg.subject, []).append(kind_seq)
    finally:
        await nc.close()
    expected = [("joined", "")] + [("batch", str(seq)) for seq in range(20)]
    out_of_order = {s: r for s, r in per_subject.items() if r != expected}
    assert len(per_subject) == 3000
    assert not out_of_order, f"{len(out_of_order)} subjects: {next(iter(out_of_order.items()))}"


async def test_a_relay_whose_stream_cannot_be_made_for_another_streams_subjects_says_so(
    nats_server: NatsServer,
) -> None:
    """Another stream already takes the relay's subjects (the stream of an earlier
    `--stream` name, say): NATS refuses to make the relay's with "subjects overlap", which the
    relay took for another relay having made it meanwhile, asked for it, and reported only
    that: `/health` said "stream ... not ready: stream not found" for as long as it ran. It
    now says NATS's own reason."""
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().add_stream(
            name="shoal-kv-older", subjects=[f"{layout.SUBJECT_PREFIX}.>"]
        )
        relay = KvRelay(RelayConfig(nats_urls=(nats_server.url,), stream=STREAM))
        status = StatusServer(relay, SimpleNamespace(status=MembershipStatus()))  # type: ignore[arg-type]
        await relay.start()
        try:
            await wait_for(lambda: relay.nats_error is not None and "not ready" in relay.nats_error)
            code, body = status.health()
            assert code == 503
            assert "overlap" in body["unhealthy"]["nats"], body
        finally:
            await relay.stop()
    finally:
        await nc.close()
