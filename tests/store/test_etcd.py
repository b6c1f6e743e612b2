"""The etcd backend beyond the shared contract: restarts, compaction, endpoints, deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aetcd
import pytest

from shoal.store import (
    KeyRevision,
    KeyValue,
    LeaseNotFoundError,
    Put,
    Resync,
    Snapshot,
    Store,
    StoreUnavailableError,
    etcd_client,
    etcd_txn,
    etcd_watch,
    open_store,
)
from shoal.store.etcd import EtcdStore, parse_url
from tests.etcd_server import EtcdServer
from tests.helpers import LoopTurns, free_port, wait_for
from tests.store.support import Recorder, as_held, held_after

pytestmark = pytest.mark.etcd


@pytest.fixture
def store(etcd_store: Store) -> Store:
    return etcd_store  # (`prefix`: tests/store/conftest.py's)


# -- URLs and connecting ----------------------------------------------------------------


async def test_a_refused_store_url_is_reported_without_its_credentials() -> None:
    """A store URL given with a password (refused: etcd:// takes none) names what is wrong,
    never the password: the message goes to stderr and the logs."""
    for url in ("etcd://alice:SECRET@h:2379", "etcd://h:2379?password=SECRET",
                "etcd://alice:SECRET@h:port", "sqlite:///x.db?password=SECRET",
                "nope://alice:SECRET@h")  :  # fmt: skip
        with pytest.raises(ValueError) as refused:
            await open_store(url)
        assert "SECRET" not in str(refused.value), str(refused.value)
        assert "***" in str(refused.value)


def test_parse_url() -> None:
    assert parse_url("etcd://a:1") == [("a", 1)]
    assert parse_url("etcd://a:1,b:2/") == [("a", 1), ("b", 2)]
    assert parse_url("etcd://a") == [("a", 2379)]
    assert parse_url("etcd://[::1]:23") == [("[::1]", 23)]
    for bad in ["etcd://", "etcd://a:x", "etcd://a:0", "etcd://a:1/path", "http://a:1"]:
        with pytest.raises(ValueError):
            parse_url(bad)


async def test_first_endpoint_dead_second_works(etcd_server: EtcdServer, prefix: str) -> None:
    url = f"etcd://127.0.0.1:{free_port()},{etcd_server.endpoint}"
    store = await open_store(url, connect_timeout=3)
    try:
        rev = await store.put(prefix + "k", b"v")
        kv = await store.get(prefix + "k")
        assert kv is not None and kv.value == b"v" and kv.mod_revision == rev
    finally:
        await store.close()


async def test_all_endpoints_dead_names_the_url() -> None:
    url = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=url.removeprefix("etcd://")):
        await open_store(url, connect_timeout=2)
    assert time.monotonic() - start < 3


async def test_silent_server_times_out_instead_of_hanging() -> None:
    """A peer that accepts TCP but never speaks: open fails within its timeout."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        url = f"etcd://127.0.0.1:{sock.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=url.removeprefix("etcd://")):
            await open_store(url, connect_timeout=1.0)
        assert time.monotonic() - start < 2.5


async def test_frozen_server_calls_time_out(own_etcd: EtcdServer, prefix: str) -> None:
    """etcd stopped (SIGSTOP) keeps its connections open: calls must still end in time."""
    store = await EtcdStore.open(own_etcd.url, call_timeout=1.0)
    assert own_etcd.proc is not None
    try:
        await store.put(prefix + "k", b"v")
        own_etcd.proc.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError, match=own_etcd.endpoint):
                await store.put(prefix + "k", b"w")
            assert time.monotonic() - start < 3
        finally:
            own_etcd.proc.send_signal(signal.SIGCONT)
        await wait_for(lambda: _reachable(store, prefix), timeout=10)
    finally:
        await store.close()


async def test_frozen_server_breaks_the_watch_by_keepalive(
    own_etcd: EtcdServer,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A watch on a silent connection notices within keepalive time + ping timeout."""
    options = {
        **etcd_client._CHANNEL_OPTIONS,
        "grpc.keepalive_time_ms": 5_000,  # etcd's minimum
        "grpc.http2.ping_timeout_ms": 1_000,
    }
    monkeypatch.setattr(etcd_client, "_CHANNEL_OPTIONS", options)
    caplog.set_level(logging.INFO, logger="shoal.store.etcd")
    store = await EtcdStore.open(own_etcd.url, call_timeout=1.0)
    assert own_etcd.proc is not None
    watch = Recorder(store.watch(prefix, 1))
    try:
        await store.put(prefix + "a", b"1")
        await wait_for(lambda: watch.of(Put))
        own_etcd.proc.send_signal(signal.SIGSTOP)
        try:
            await wait_for(
                lambda: any("broke" in r.getMessage() for r in caplog.records),
                timeout=15,
                message="the watch noticed the silent connection",
            )
        finally:
            own_etcd.proc.send_signal(signal.SIGCONT)
        await store.put(prefix + "b", b"2")  # (through the watch once it is back)
        expected = {prefix + "a": b"1", prefix + "b": b"2"}
        await wait_for(lambda: watch.ordered_state() == expected, timeout=20)
    finally:
        await watch.close()
        await store.close()


async def _reachable(store: Store, prefix: str) -> bool:
    try:
        await store.get_prefix(prefix)
        return True
    except StoreUnavailableError:
        return False


async def _unreachable(store: Store, prefix: str) -> bool:
    return not await _reachable(store, prefix)


# -- listings ---------------------------------------------------------------------------


async def test_a_listing_longer_than_a_page_is_read_whole_at_its_first_revision(
    store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hundred thousand keys are read a page at a time (`PAGE_KEYS`), every page at the
    first one's revision: a key written between two pages is not in the listing, and the
    listing is whole and in key order."""
    monkeypatch.setattr(etcd_txn, "PAGE_KEYS", 3)
    monkeypatch.setattr(etcd_watch, "HISTORY_REVISIONS", 0)  # (no replay: the keys)
    written = [f"{prefix}a/{i:02d}" for i in range(10)] + [f"{prefix}b/{i:02d}" for i in range(7)]
    for key in written:
        await store.put(key, b"v")
    assert isinstance(store, EtcdStore)
    call = store._call
    calls = 0

    async def write_after_the_first_page(what: str, fn: Any) -> Any:
        nonlocal calls
        answer = await call(what, fn)
        if not what.startswith("get_prefixes"):
            return answer
        calls += 1
        if calls == 1:
            await store.put(f"{prefix}a/05x", b"late")
        return answer

    monkeypatch.setattr(store, "_call", write_after_the_first_page)
    answered: list[int] = []  # the store answered after its first page, not its last
    snap = await store.get_prefixes(
        (f"{prefix}b/", f"{prefix}a/"), on_answer=lambda: answered.append(calls)
    )
    assert [kv.key for kv in snap.items] == written
    assert calls >= 4  # (a page at a time: the ten keys of a/ take four)
    assert answered == [1]
    late = await store.get(f"{prefix}a/05x")
    assert late is not None and late.mod_revision > snap.revision


async def test_a_listing_of_what_changed_moves_only_the_changed_values(
    store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every key comes from a `keys_only` read, a page at a time; only the values written
    after `since` are read (`min_mod_revision`), at the same revision, also when a write
    lands between the two reads."""
    monkeypatch.setattr(etcd_txn, "PAGE_KEYS", 3)
    monkeypatch.setattr(etcd_watch, "HISTORY_REVISIONS", 0)  # (no replay: the keys)
    written = [f"{prefix}a/{i:02d}" for i in range(10)]
    for key in written:
        await store.put(key, b"v")
    since = (await store.get_prefix(prefix)).revision
    for key in written[::4]:
        await store.put(key, b"w")
    assert isinstance(store, EtcdStore)
    call = store._call
    calls = 0

    async def write_between_the_reads(what: str, fn: Any) -> Any:
        nonlocal calls
        answer = await call(what, fn)
        calls += 1
        if calls == 2:  # (the first: etcd's revision, which moved since `since`)
            await store.put(written[1], b"late")
        return answer

    monkeypatch.setattr(store, "_call", write_between_the_reads)
    listing = await store.get_prefixes_changed((prefix,), since)
    monkeypatch.setattr(store, "_call", call)
    assert listing.removed is None
    assert [kv.key for kv in listing.items] == written
    values = {kv.key: kv.value for kv in listing.items if isinstance(kv, KeyValue)}
    assert values == {key: b"w" for key in written[::4]}  # not the late write
    assert all(
        isinstance(kv, KeyRevision) and kv.mod_revision <= since
        for kv in listing.items
        if kv.key not in values
    )


async def test_a_listing_of_what_changed_reads_every_value_when_most_changed(
    store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Most values written since: every value a page at a time (etcd reads a
    `min_mod_revision` range whole), still at the keys' revision."""
    monkeypatch.setattr(etcd_txn, "PAGE_KEYS", 3)
    monkeypatch.setattr(etcd_watch, "HISTORY_REVISIONS", 0)
    assert isinstance(store, EtcdStore)
    written = [f"{prefix}a/{i:02d}" for i in range(10)]
    for key in written:
        await store.put(key, b"v")
    since = (await store.get_prefix(prefix)).revision
    for key in written[:8]:
        await store.put(key, b"w")
    ranges = store._ranges
    asked: list[int] = []

    async def recorded(*args: Any, min_mod_revision: int = 0, **kwargs: Any) -> Any:
        asked.append(min_mod_revision)
        return await ranges(*args, min_mod_revision=min_mod_revision, **kwargs)

    monkeypatch.setattr(store, "_ranges", recorded)
    listing = await store.get_prefixes_changed((prefix,), since)
    assert asked == [0, 0]  # (the keys, then every value)
    assert [kv.key for kv in listing.items] == written
    values = {kv.key: kv.value for kv in listing.items if isinstance(kv, KeyValue)}
    assert values == {key: b"w" for key in written[:8]}


async def test_a_listing_of_what_changed_when_etcd_did_not_move_is_one_index_read(
    own_etcd: EtcdServer, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No write anywhere since `since`: an empty delta from one count of one key, not a
    read of every key. (An etcd of its own: another test's write would move the revision.)"""
    store = await open_store(own_etcd.url)
    assert isinstance(store, EtcdStore)
    try:
        for i in range(5):
            await store.put(f"{prefix}a/{i}", b"v")
        since = (await store.get_prefix(prefix)).revision
        call = store._call
        whats: list[str] = []

        async def counted(what: str, fn: Any) -> Any:
            whats.append(what)
            return await call(what, fn)

        monkeypatch.setattr(store, "_call", counted)
        answered: list[bool] = []
        quiet = await store.get_prefixes_changed(
            (prefix,), since, on_answer=lambda: answered.append(True)
        )
        assert (quiet.items, quiet.removed, quiet.revision) == ([], [], since)
        assert len(whats) == 1 and answered == [True]
    finally:
        await store.close()


async def test_a_listing_of_what_changed_is_replayed_from_etcds_history(
    store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recent `since`: the writes after it, replayed from etcd's history, up to the
    revision read first (a write after it is the next listing's). Applied to what a reader
    held at `since`, the delta gives what every key read at that revision gives."""
    assert isinstance(store, EtcdStore)
    a = prefix + "a/"
    lease = await store.grant(60.0, keepalive=False)
    for i in range(5):
        await store.put(f"{a}{i}", b"v", lease=lease.id if i == 4 else 0)
    for i in range(20):  # (more keys than the revisions to replay: a replay is cheaper)
        await store.put(f"{a}k{i:02d}", b"v")
    at_since = await store.get_prefix(a)
    since = at_since.revision
    await store.put(a + "0", b"changed")
    await store.delete(a + "1")
    await store.put(a + "1", b"again")
    await store.delete(a + "2")
    await store.put(a + "9", b"new")
    await store.delete(a + "9")
    await store.put(prefix + "b/outside", b"x")
    await lease.revoke()  # (a + "4" ends with its lease)
    revision_now = store._revision_now

    async def then_a_late_write(prefixes: Any, *, count: bool = False) -> tuple[int, int]:
        now = await revision_now(prefixes, count=count)
        if count:  # (the revision the listing is at)
            await store.put(a + "3", b"late")
        return now

    monkeypatch.setattr(store, "_revision_now", then_a_late_write)
    listing = await store.get_prefixes_changed((a,), since)
    assert listing.removed == [a + "2", a + "4", a + "9"]
    assert [(kv.key, kv.value) for kv in listing.items if isinstance(kv, KeyValue)] == [
        (a + "0", b"changed"),
        (a + "1", b"again"),
    ]
    assert len(listing.items) == 2
    held = {kv.key: kv for kv in at_since.items}
    whole, _ = await store._ranges((a,), store._kv, revision=listing.revision)
    assert held_after(held, listing, since) == as_held(Snapshot(whole, listing.revision))
    assert (await store.get(a + "3")) is not None  # (the late write: after the listing)
    assert all(kv.value == b"v" for kv in whole if kv.key == a + "3")


@pytest.mark.parametrize("why", ["too far back", "fewer keys", "compacted", "too many bytes"])
async def test_a_listing_of_what_changed_reads_the_keys_when_the_history_will_not_do(
    own_etcd: EtcdServer, prefix: str, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """Further back than `HISTORY_REVISIONS` or than the keys listed, past a compaction,
    or more than `HISTORY_BYTES` of writes anywhere since: every key (without the values
    not written since), and still right."""
    store = await open_store(own_etcd.url)
    assert isinstance(store, EtcdStore)
    try:
        a = prefix + "a/"
        # (more keys than revisions since, but where the keys are fewer)
        filler = [] if why == "fewer keys" else [f"{a}k{i}" for i in range(10)]
        for key in [f"{a}{i}" for i in range(3)] + filler:
            await store.put(key, b"v")
        since = (await store.get_prefix(a)).revision
        await store.put(a + "0", b"changed")
        await store.delete(a + "1")
        if why == "too far back":
            monkeypatch.setattr(etcd_watch, "HISTORY_REVISIONS", 1)
            await store.put(prefix + "b/outside", b"x")
        elif why == "fewer keys":  # (2 keys listed, 3 revisions since)
            await store.put(prefix + "b/outside", b"x")
        elif why == "compacted":
            client, _ = await store._current()
            await client.compact((await store.get_prefix(a)).revision, physical=True)
        else:
            monkeypatch.setattr(etcd_watch, "HISTORY_BYTES", 1000)
            await store.put(prefix + "b/outside", b"x" * 2000)
        listing = await store.get_prefixes_changed((a,), since)
        assert listing.removed is None
        assert [kv.key for kv in listing.items] == [a + "0", a + "2", *filler]
        values = {kv.key: kv.value for kv in listing.items if isinstance(kv, KeyValue)}
        assert values == {a + "0": b"changed"}
    finally:
        await store.close()


# -- errors and leases ------------------------------------------------------------------


async def test_put_under_a_missing_lease_is_lease_not_found(store: Store, prefix: str) -> None:
    with pytest.raises(LeaseNotFoundError):
        await store.put(prefix + "k", b"v", lease=0x5EED)
    with pytest.raises(LeaseNotFoundError):
        await store.create(prefix + "k", b"v", lease=0x5EED)


async def test_revoked_lease_is_not_renewed_and_revoke_is_idempotent(
    store: Store, prefix: str
) -> None:
    lease = await store.grant(10, keepalive=False)
    await lease.keepalive()
    await store.revoke(lease.id)
    await store.revoke(lease.id)  # a missing lease is not an error
    assert await store._keepalive(lease.id, 10) is False
    with pytest.raises(LeaseNotFoundError):
        await lease.keepalive()
    assert lease.lost.is_set()


async def test_keepalive_while_etcd_is_down_is_unavailable(own_etcd: EtcdServer) -> None:
    store = await open_store(own_etcd.url)
    try:
        lease = await store.grant(5, keepalive=False)
        own_etcd.stop()
        with pytest.raises(StoreUnavailableError):
            await lease.keepalive()
        assert not lease.lost.is_set()
    finally:
        await store.close()


async def test_long_lease_is_left_to_etcd(store: Store, prefix: str) -> None:
    """Only leases below etcd's minimum TTL are expired by the store itself."""
    lease = await store.grant(3, keepalive=False)
    assert isinstance(store, EtcdStore)
    assert lease.id not in store._short_leases
    short = await store.grant(0.5, keepalive=False)
    assert short.id in store._short_leases
    await store.put(prefix + "short", b"x", lease=short.id)
    await wait_for(lambda: _absent(store, prefix + "short"), timeout=3)
    assert await store._keepalive(lease.id, 3) is True
    await lease.revoke()


async def _absent(store: Store, key: str) -> bool:
    return await store.get(key) is None


async def test_calls_after_close_are_unavailable(etcd_server: EtcdServer, prefix: str) -> None:
    store = await open_store(etcd_server.url)
    await store.close()
    with pytest.raises(StoreUnavailableError, match="closed"):
        await store.put(prefix + "k", b"v")


# -- watches ----------------------------------------------------------------------------


async def test_watch_ends_when_the_store_closes(etcd_server: EtcdServer, prefix: str) -> None:
    store = await open_store(etcd_server.url)
    snap = await store.get_prefix(prefix)
    watch = Recorder(store.watch(prefix, snap.revision + 1))
    await store.put(prefix + "a", b"1")
    await wait_for(lambda: watch.events)
    await store.close()
    await asyncio.wait_for(watch.task, 5)
    assert [type(e) for e in watch.events] == [Put]


async def test_close_ends_a_watch_that_is_waiting_for_etcd(
    own_etcd: EtcdServer, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="shoal.store.etcd")
    store = await open_store(own_etcd.url)
    own_etcd.stop()
    watch = Recorder(store.watch(prefix, 1))
    await wait_for(lambda: sum("broke" in r.getMessage() for r in caplog.records) >= 3)
    start = time.monotonic()
    await store.close()
    await asyncio.wait_for(watch.task, 5)
    assert time.monotonic() - start < 1.0
    assert watch.events == []


async def test_watch_resumes_after_etcd_restart(own_etcd: EtcdServer, prefix: str) -> None:
    watcher = await open_store(own_etcd.url)
    writer = await open_store(own_etcd.url)
    try:
        await writer.put(prefix + "gone", b"0")
        snap = await watcher.get_prefix(prefix)
        watch = Recorder(watcher.watch(prefix, snap.revision + 1))
        await writer.put(prefix + "a", b"1")
        await wait_for(lambda: watch.of(Put), message="the watch is live")

        own_etcd.stop()
        await wait_for(lambda: _unreachable(watcher, prefix), timeout=5)
        await asyncio.to_thread(own_etcd.start)
        await wait_for(lambda: _reachable(writer, prefix), timeout=20)
        await writer.delete(prefix + "gone")
        await writer.put(prefix + "b", b"2")
        expected = {prefix + "a": b"1", prefix + "b": b"2"}
        # (caught up by the changes it missed, replayed in order, or by a `Resync`)
        await wait_for(lambda: watch.ordered_state() == expected, timeout=20, message="caught up")
        # And it is live again: a later change arrives as an event.
        rev = await writer.put(prefix + "c", b"3")
        await wait_for(lambda: any(e.revision == rev for e in watch.of(Put)), timeout=10)
        await watch.close()
    finally:
        await watcher.close()
        await writer.close()


async def test_watch_started_while_etcd_is_down_follows_when_it_returns(
    own_etcd: EtcdServer, prefix: str
) -> None:
    """Nothing written while etcd was down: once back, the watch follows from where it
    was asked to start, with nothing to read again."""
    store = await open_store(own_etcd.url)
    try:
        await store.put(prefix + "a", b"1")
        snap = await store.get_prefix(prefix)
        own_etcd.stop()
        watch = Recorder(store.watch(prefix, snap.revision + 1), {prefix + "a": b"1"})
        await asyncio.to_thread(own_etcd.start)
        # (the client's channel may wait out a reconnect backoff before it sees etcd back)
        await wait_for(lambda: _reachable(store, prefix), timeout=20)
        rev = await store.put(prefix + "b", b"2")
        await wait_for(lambda: any(e.revision == rev for e in watch.of(Put)), timeout=20)
        assert watch.ordered_state() == {prefix + "a": b"1", prefix + "b": b"2"}
        assert not watch.of(Resync)
        rev = await store.put(prefix + "b", b"2")
        await wait_for(lambda: any(e.revision == rev for e in watch.of(Put)), timeout=10)
        await watch.close()
    finally:
        await store.close()


async def test_compacted_start_revision_gives_a_resync(
    etcd_server: EtcdServer, store: Store, prefix: str
) -> None:
    first = await store.put(prefix + "a", b"1")
    await store.put(prefix + "a", b"2")
    await store.put(prefix + "b", b"3")
    await store.delete(prefix + "b")
    current = (await store.get_prefix(prefix)).revision
    client = aetcd.Client(host="127.0.0.1", port=etcd_server.client_port, timeout=5)
    try:
        await client.compact(current, physical=True)
    finally:
        await client.close()

    watch = Recorder(store.watch(prefix, first))
    try:
        await wait_for(lambda: watch.events, timeout=10)
        resync = watch.events[0]
        assert isinstance(resync, Resync), watch.events
        assert resync.revision >= current
        assert [(kv.key, kv.value) for kv in resync.items] == [(prefix + "a", b"2")]
        rev = await store.put(prefix + "c", b"4")
        await wait_for(lambda: watch.of(Put), timeout=10)
        assert [(type(e), e.revision) for e in watch.events[1:]] == [(Put, rev)]
    finally:
        await watch.close()


async def test_watch_of_everything_and_of_one_prefix(store: Store, prefix: str) -> None:
    snap = await store.get_prefix("")
    everything = Recorder(store.watch("", snap.revision + 1))
    mine = Recorder(store.watch(prefix + "x/", snap.revision + 1))
    try:
        await store.put(prefix + "x/1", b"a")
        await store.put(prefix + "y", b"b")
        await wait_for(
            lambda: len([e for e in everything.of(Put) if e.key.startswith(prefix)]) == 2
        )
        await wait_for(lambda: mine.events)
        assert [e.key for e in mine.of(Put)] == [prefix + "x/1"]  # type: ignore[attr-defined]
    finally:
        await everything.close()
        await mine.close()


async def test_a_watch_of_several_prefixes_receives_no_change_between_them(
    store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Discovery watches `instances/{ns}/` and `models/{ns}/`: the changes of the
    namespaces sorted between them never travel to that watch (with one covering range
    they did, so with N namespaces each change reached about N/2 watches)."""
    decoded: list[str] = []
    event = EtcdStore._event

    def counting(e: object) -> object:
        decoded.append(e.kv.key.decode())  # type: ignore[attr-defined]
        return event(e)

    monkeypatch.setattr(EtcdStore, "_event", staticmethod(counting))
    a, b = prefix + "a/b/", prefix + "c/b/"
    snap = await store.get_prefixes((a, b))
    watch = Recorder(store.watch_prefixes((a, b), snap.revision + 1))
    try:
        await wait_for(lambda: _stream_open(store), message="the watch is open")
        for other in ("a/c/", "b/", "c/a/"):  # sorted between the two prefixes
            await store.put(prefix + other + "k", b"other")
        rev = await store.put(b + "k", b"mine")
        await wait_for(lambda: watch.of(Put), message="the change of the watch arrives")
        assert [(e.key, e.revision) for e in watch.of(Put)] == [(b + "k", rev)]  # type: ignore[attr-defined]
        assert decoded == [b + "k"]
    finally:
        await watch.close()


async def test_a_watch_of_several_prefixes_started_late_is_in_revision_order(
    store: Store, prefix: str
) -> None:
    """Changes interleaved under two prefixes after the listing and before the watch is
    open: the watch holds them in revision order (etcd's watchers catching up on history
    would send one prefix's share, then the other's)."""
    a, b = prefix + "a/", prefix + "b/"
    snap = await store.get_prefixes((a, b))
    for n in range(10):
        await store.put(a + "k", str(n).encode())
        await store.put(b + "k", str(n).encode())
        await store.delete(a + "k")
    watch = Recorder(store.watch_prefixes((a, b), snap.revision + 1))
    try:
        await store.put(a + "k", b"last")
        expected = {a + "k": b"last", b + "k": b"9"}
        await wait_for(lambda: watch.ordered_state() == expected, message="caught up")
        rev = await store.put(b + "k", b"live")  # and it goes on live
        await wait_for(lambda: any(e.revision == rev for e in watch.of(Put)), message="live")
        assert watch.ordered_state() == {a + "k": b"last", b + "k": b"live"}
    finally:
        await watch.close()


async def test_a_watch_of_several_prefixes_started_late_replays_what_came_since(
    store: Store, prefix: str
) -> None:
    """The same, over more keys than changes since: the changes are replayed from etcd's
    history in revision order, every one of them once, and nothing is read again."""
    a, b = prefix + "a/", prefix + "b/"
    for i in range(40):
        await store.put(f"{a}filler{i:02d}", b"f")
    snap = await store.get_prefixes((a, b))
    written: list[int] = []
    for n in range(10):
        written.append(await store.put(a + "k", str(n).encode()))
        written.append(await store.put(b + "k", str(n).encode()))
        await store.delete(a + "k")
        written.append(written[-1] + 1)
    watch = Recorder(store.watch_prefixes((a, b), snap.revision + 1), as_state(snap))
    try:
        rev = await store.put(a + "k", b"last")
        await wait_for(lambda: any(e.revision == rev for e in watch.events), message="caught up")
        assert not watch.of(Resync)
        assert [e.revision for e in watch.events] == [*written, rev]
        assert watch.ordered_state() == {**as_state(snap), a + "k": b"last", b + "k": b"9"}
    finally:
        await watch.close()


async def test_a_broken_watch_of_several_prefixes_replays_what_it_missed(
    store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream breaks and changes land before it is back: they come replayed, in
    revision order, none twice, none read again; then it goes on live."""
    assert isinstance(store, EtcdStore)
    a, b = prefix + "a/", prefix + "b/"
    for i in range(40):
        await store.put(f"{b}filler{i:02d}", b"f")
    snap = await store.get_prefixes((a, b))
    watch = Recorder(store.watch_prefixes((a, b), snap.revision + 1), as_state(snap))
    back = asyncio.Event()
    pause = store._pause

    async def held(delay: float) -> None:
        await back.wait()
        await pause(0)

    monkeypatch.setattr(store, "_pause", held)
    writer = await open_store(store.url)
    try:
        first = await writer.put(a + "1", b"1")
        await wait_for(lambda: [e.revision for e in watch.events] == [first])
        for call in list(store._watch_calls):
            call.cancel()  # (the stream breaks, as when the connection goes)
        await wait_for(lambda: not store._watch_calls, message="the stream broke")
        missed = [await writer.put(b + "1", b"1")]
        await writer.delete(a + "1")
        missed += [missed[-1] + 1, await writer.put(a + "2", b"2")]
        back.set()
        live = await writer.put(b + "2", b"2")
        await wait_for(lambda: any(e.revision == live for e in watch.events), message="live")
        assert not watch.of(Resync)
        assert [e.revision for e in watch.events] == [first, *missed, live]
        expected = {**as_state(snap), b + "1": b"1", a + "2": b"2", b + "2": b"2"}
        assert watch.ordered_state() == expected
    finally:
        await watch.close()
        await writer.close()


async def test_a_catch_up_and_a_large_transaction_reach_the_consumer_a_batch_per_loop_turn(
    etcd_server: EtcdServer, store: Store, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The events of a catch-up replay (after a cut) and of one etcd response (a large
    transaction) were yielded to the consumer all in one turn of the event loop: discovery,
    which handles each event without awaiting, held a frontend's loop 340-608 ms over 4,000
    re-tainted cards. Now the watch yields to the loop every `WATCH_BATCH` events."""
    assert isinstance(store, EtcdStore)
    a, b = prefix + "a/", prefix + "b/"
    keys = [f"{a}{i:04d}" for i in range(300)]
    client = aetcd.Client(host="127.0.0.1", port=etcd_server.client_port, timeout=5)

    async def write_all(value: bytes) -> None:
        for first in range(0, len(keys), 100):  # (etcd takes at most 128 operations a txn)
            puts = [client.transactions.put(k.encode(), value) for k in keys[first:][:100]]
            await client.transaction(compare=[], success=puts, failure=[])

    back = asyncio.Event()
    pause = store._pause

    async def held(delay: float) -> None:
        await back.wait()
        await pause(0)

    monkeypatch.setattr(store, "_pause", held)
    turns = LoopTurns()
    values: list[bytes] = []

    async def consume(snap: Snapshot) -> None:
        async for event in store.watch_prefixes((a, b), snap.revision + 1):
            turns.note()
            assert isinstance(event, Put)
            values.append(event.value)

    consumer: asyncio.Task[None] | None = None
    try:
        await write_all(b"0")
        consumer = asyncio.create_task(consume(await store.get_prefixes((a, b))))
        await wait_for(lambda: store._watch_calls, message="watching")
        await write_all(b"live")  # three responses of 100 events
        await wait_for(lambda: len(values) == 300, message="the live changes")
        for call in list(store._watch_calls):
            call.cancel()  # (the stream breaks, as when the connection goes)
        await wait_for(lambda: not store._watch_calls, message="the stream broke")
        await write_all(b"missed")  # three revisions: replayed, not read
        back.set()
        await wait_for(lambda: len(values) == 600, message="the catch-up")
        assert values == [b"live"] * 300 + [b"missed"] * 300
        assert turns.most_per_turn <= etcd_watch.WATCH_BATCH
    finally:
        if consumer is not None:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
        await turns.stop()
        await client.close()


def as_state(snap: Any) -> dict[str, bytes]:
    return {kv.key: kv.value for kv in snap.items}


@pytest.mark.parametrize("reader", ["a listing of what changed", "a watch of two prefixes"])
async def test_a_delete_at_the_compacted_revision_is_not_lost(
    own_etcd: EtcdServer, prefix: str, reader: str
) -> None:
    """etcd compacted at the revision just after the reader's, which drops that revision's
    deletes, and calls compacted only a watch that starts below it: the replay starts at
    the reader's revision, so it is told, and every key is read instead."""
    store = await open_store(own_etcd.url)
    assert isinstance(store, EtcdStore)
    try:
        a, b = prefix + "a/", prefix + "b/"
        for i in range(10):
            await store.put(f"{a}{i}", b"v")
        snap = await store.get_prefixes((a, b))
        await store.delete(a + "0")  # at snap.revision + 1
        client, _ = await store._current()
        await client.compact(snap.revision + 1, physical=True)
        last = await store.put(b + "x", b"x")
        state = as_state(snap)
        if reader == "a listing of what changed":
            listing = await store.get_prefixes_changed((a, b), snap.revision)
            assert listing.removed is None  # (every key, not a delta)
            held = as_state(snap)
            state = {
                kv.key: kv.value if isinstance(kv, KeyValue) else held[kv.key]
                for kv in listing.items
            }
        else:
            watch = Recorder(store.watch_prefixes((a, b), snap.revision + 1), state)
            await wait_for(lambda: any(e.revision >= last for e in watch.events))
            await watch.close()
            state = watch.state
        assert state == as_state(await store.get_prefixes((a, b)))
    finally:
        await store.close()


async def test_the_prefix_of_every_key_is_replayed_too(own_etcd: EtcdServer) -> None:
    """The prefix "" (every key; etcd's range end b"\0", no end): a delta of everything."""
    store = await open_store(own_etcd.url)
    assert isinstance(store, EtcdStore)
    try:
        for i in range(10):
            await store.put(f"k/{i}", b"v")
        since = (await store.get_prefix("")).revision
        await store.put("k/0", b"w")
        await store.delete("k/1")
        listing = await store.get_prefixes_changed(("",), since)
        assert listing.removed == ["k/1"]
        assert [(kv.key, kv.value) for kv in listing.items if isinstance(kv, KeyValue)] == [
            ("k/0", b"w")
        ]
    finally:
        await store.close()


def _stream_open(store: Store) -> bool:
    assert isinstance(store, EtcdStore)
    return bool(store._watch_calls)


# -- a three-member cluster: failover between endpoints ---------------------------------


class Cluster:
    """Three etcd members on loopback; members can be killed to force a failover."""

    def __init__(self, size: int = 3) -> None:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        self.dir = tempfile.mkdtemp(prefix="shoal-etcd-cluster-")
        self.members = [(f"m{i}", free_port(), free_port()) for i in range(size)]
        initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, _, p in self.members)
        self.log = open(os.path.join(self.dir, "etcd.log"), "ab")  # noqa: SIM115
        self.procs: list[subprocess.Popen[bytes]] = []
        for name, c, p in self.members:
            cmd = [
                binary,
                f"--name={name}",
                f"--data-dir={self.dir}/{name}",
                f"--listen-client-urls=http://127.0.0.1:{c}",
                f"--advertise-client-urls=http://127.0.0.1:{c}",
                f"--listen-peer-urls=http://127.0.0.1:{p}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{p}",
                f"--initial-cluster={initial}",
                "--initial-cluster-state=new",
                "--log-level=error",
            ]
            self.procs.append(subprocess.Popen(cmd, stdout=self.log, stderr=self.log))

    def endpoint(self, i: int) -> str:
        return f"127.0.0.1:{self.members[i][1]}"

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        for i in range(len(self.members)):
            while True:
                try:
                    url = f"http://{self.endpoint(i)}/health"
                    with urllib.request.urlopen(url, timeout=1) as resp:
                        if b'"health":"true"' in resp.read():
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd cluster not healthy; see {self.log.name}")
                time.sleep(0.05)  # (polling the members' health, with a deadline)

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(10)

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        c.wait_healthy()
        yield c
    finally:
        c.close()


async def test_failover_to_another_member_keeps_calls_and_watches_going(
    cluster: Cluster, prefix: str
) -> None:
    url = "etcd://" + ",".join(cluster.endpoint(i) for i in range(3))
    store = await open_store(url)
    assert isinstance(store, EtcdStore)
    try:
        await store.put(prefix + "a", b"1")
        snap = await store.get_prefix(prefix)
        watch = Recorder(store.watch(prefix, snap.revision + 1), {prefix + "a": b"1"})
        await store.put(prefix + "b", b"2")
        await wait_for(lambda: watch.of(Put))
        assert store._index == 0
        cluster.kill(0)

        async def put_c() -> bool:
            try:
                await store.put(prefix + "c", b"3")
                return True
            except StoreUnavailableError:
                return False

        await wait_for(put_c, timeout=20, message="a put succeeds on another member")
        assert store._index != 0
        expected = {prefix + "a": b"1", prefix + "b": b"2", prefix + "c": b"3"}
        await wait_for(lambda: watch.ordered_state() == expected, timeout=20, message="caught up")
        rev = await store.put(prefix + "d", b"4")
        await wait_for(lambda: any(e.revision == rev for e in watch.of(Put)), timeout=10)
        await watch.close()
    finally:
        await store.close()


async def test_a_read_of_200_prefixes_is_one_revision_past_etcds_transaction_limit(
    store: Store, prefix: str
) -> None:
    """etcd refuses a transaction of more than 128 operations (`--max-txn-ops`): a listing
    of more prefixes reads them in several, all at the first one's revision."""
    prefixes = [f"{prefix}{i:03d}/" for i in range(200)]
    for p in prefixes[::50]:
        await store.put(p + "k", b"v")
    snap = await store.get_prefixes(prefixes)
    assert [kv.key for kv in snap.items] == [p + "k" for p in prefixes[::50]]
    assert all(kv.mod_revision <= snap.revision for kv in snap.items)
