"""The store contract, proved on every backend: memory, SQLite and a real etcd server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.store import (
    MAX_VALUE_BYTES,
    Delete,
    InvalidKeyError,
    KeyValue,
    Lease,
    LeaseKeeper,
    Resync,
    Store,
    StoreError,
    StoreUnavailableError,
    ValueTooLargeError,
    open_store,
)
from tests.helpers import free_port, wait_for
from tests.store.conftest import Backend
from tests.store.support import Recorder, as_held, held_after

ROOT = Path(__file__).resolve().parents[2]


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.store.holder", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


async def test_watch_after_list_misses_nothing(store: Store, prefix: str) -> None:
    await store.put(prefix + "a", b"1")
    snap = await store.get_prefix(prefix)
    # A change between the read and the watch's start.
    await store.put(prefix + "b", b"2")
    await store.delete(prefix + "a")
    mirror = Recorder(
        store.watch(prefix, snap.revision + 1), {kv.key: kv.value for kv in snap.items}
    )
    await store.put(prefix + "c", b"3")
    try:
        await wait_for(lambda: mirror.state == {prefix + "b": b"2", prefix + "c": b"3"})
        keys = [(type(e).__name__, getattr(e, "key", None)) for e in mirror.events]
        assert keys == [("Put", prefix + "b"), ("Delete", prefix + "a"), ("Put", prefix + "c")]
        revisions = [e.revision for e in mirror.events]
        assert revisions == sorted(revisions) and revisions[0] > snap.revision
    finally:
        await mirror.close()


async def test_reads_report_the_revision_and_writes_advance_it(store: Store, prefix: str) -> None:
    r1 = await store.put(prefix + "k", b"v1")
    r2 = await store.put(prefix + "k", b"v2")
    assert r2 > r1
    kv = await store.get(prefix + "k")
    assert kv is not None and kv.value == b"v2" and kv.mod_revision == r2
    snap = await store.get_prefix(prefix)
    assert snap.revision >= r2 and [i.key for i in snap.items] == [prefix + "k"]
    assert await store.delete(prefix + "k") is True
    assert await store.delete(prefix + "k") is False
    assert await store.get(prefix + "k") is None


async def test_get_prefix_returns_only_keys_under_the_prefix_sorted(
    store: Store, prefix: str
) -> None:
    for k in ["b", "a", "c/d"]:
        await store.put(prefix + "x/" + k, k.encode())
    await store.put(prefix + "y", b"other")
    snap = await store.get_prefix(prefix + "x/")
    assert [kv.key for kv in snap.items] == [prefix + "x/a", prefix + "x/b", prefix + "x/c/d"]


async def test_create_if_absent_creates_once(store: Store, prefix: str) -> None:
    assert await store.create(prefix + "once", b"first") is True
    assert await store.create(prefix + "once", b"second") is False
    kv = await store.get(prefix + "once")
    assert kv is not None and kv.value == b"first"


async def test_create_if_absent_is_atomic_across_processes(backend: Backend, prefix: str) -> None:
    key = prefix + "race"
    if not backend.multiprocess:
        stores = [await backend.open() for _ in range(8)]
        results = await asyncio.gather(*(s.create(key, b"x") for s in stores))
        assert sorted(results) == [False] * 7 + [True]
        return
    start_at = time.time() + 2.0
    procs = [spawn(backend.url, "create", key, f"p{i}", str(start_at)) for i in range(2)]
    results = [p.communicate(timeout=30) for p in procs]
    outs = [out.strip() for out, _ in results]
    assert sorted(outs) == ["lost", "won"], [err[-2000:] for _, err in results]


async def test_revoke_deletes_leased_keys_at_once(store: Store, prefix: str) -> None:
    lease = await store.grant(30)
    await store.put(prefix + "leased", b"x", lease=lease.id)
    await store.put(prefix + "kept", b"y")
    snap = await store.get_prefix(prefix)
    mirror = Recorder(
        store.watch(prefix, snap.revision + 1), {kv.key: kv.value for kv in snap.items}
    )
    try:
        await lease.revoke()
        assert await store.get(prefix + "leased") is None
        assert await store.get(prefix + "kept") is not None
        await wait_for(lambda: any(isinstance(e, Delete) for e in mirror.events))
        assert mirror.state == {prefix + "kept": b"y"}
    finally:
        await mirror.close()


async def test_leased_key_vanishes_when_holder_is_killed(
    backend: Backend, store: Store, prefix: str
) -> None:
    if not backend.multiprocess:
        pytest.skip("memory:// lives in one process; lease expiry is tested without a kill below")
    ttl = 2.0
    key = prefix + "held"
    proc = spawn(backend.url, "lease", key, str(ttl))
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        assert line.startswith("ready"), line
        snap = await store.get_prefix(prefix)
        assert [kv.key for kv in snap.items] == [key]
        mirror = Recorder(store.watch(prefix, snap.revision + 1), {key: b"held"})
        proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            await wait_for(lambda: mirror.state == {}, timeout=ttl + 5)
            assert time.monotonic() - killed_at <= ttl + 1.0
            assert any(isinstance(e, Delete) and e.key == key for e in mirror.events)
        finally:
            await mirror.close()
    finally:
        proc.kill()
        proc.communicate()


async def test_lease_without_keepalive_expires_within_ttl(store: Store, prefix: str) -> None:
    lease = await store.grant(1.0, keepalive=False)
    await store.put(prefix + "k", b"x", lease=lease.id)
    start = time.monotonic()
    await wait_for(lambda: _absent(store, prefix + "k"), timeout=5)
    assert time.monotonic() - start <= 2.0


async def _absent(store: Store, key: str) -> bool:
    return await store.get(key) is None


async def test_kept_alive_lease_outlives_its_ttl(store: Store, prefix: str) -> None:
    lease = await store.grant(1.0)
    await store.put(prefix + "k", b"x", lease=lease.id)
    renewed = lease.last_renewed
    await wait_for(lambda: lease.last_renewed > renewed + 1.2, timeout=5)
    assert await store.get(prefix + "k") is not None
    await lease.revoke()


async def test_watch_resyncs_after_outage_and_loses_no_delete(
    backend: Backend, prefix: str
) -> None:
    watcher = await backend.open()
    writer = await backend.open()
    try:
        await writer.put(prefix + "b", b"2")
        snap = await watcher.get_prefix(prefix)
        mirror = Recorder(
            watcher.watch(prefix, snap.revision + 1), {kv.key: kv.value for kv in snap.items}
        )
        await writer.put(prefix + "a", b"1")
        await wait_for(lambda: prefix + "a" in mirror.state, message="the watch is live")
        async with backend.outage(watcher):
            if backend.name != "etcd":
                # The writer still reaches the store: changes the watcher cannot see.
                await writer.delete(prefix + "b")
                await writer.put(prefix + "c", b"3")
        if backend.name == "etcd":
            await wait_for(lambda: _reachable(writer, prefix), timeout=20)
            await writer.delete(prefix + "b")
            await writer.put(prefix + "c", b"3")
        try:
            expected = {prefix + "a": b"1", prefix + "c": b"3"}
            await wait_for(lambda: mirror.state == expected, timeout=20)
            assert any(isinstance(e, Resync) for e in mirror.events)
        finally:
            await mirror.close()
    finally:
        await watcher.close()
        await writer.close()


async def test_a_watch_tells_the_stores_listeners_when_it_loses_the_store_and_has_it_back(
    backend: Backend, prefix: str
) -> None:
    """A watch catches up on its own and never raises when the store goes out: its reader
    learnt of an outage, and of its end, only at its next read of its own (a frontend's
    `/health`, up to a reconcile interval late). Now the store's `watch_listeners` are
    told: the error when a watch loses the store, None when it has it back."""
    store = await backend.open()
    told: list[StoreError | None] = []
    store.watch_listeners.append(told.append)
    try:
        mirror = Recorder(store.watch(prefix, (await store.get_prefix(prefix)).revision + 1))
        try:
            await store.put(prefix + "a", b"1")
            await wait_for(lambda: mirror.events, message="the watch is live")
            assert told == []
            async with backend.outage(store):
                await wait_for(lambda: told, timeout=20, message="told of the loss")
                assert isinstance(told[0], StoreError), told
            await wait_for(lambda: told[-1] is None, timeout=30, message="told it is back")
        finally:
            await mirror.close()
    finally:
        await store.close()


async def _reachable(store: Store, prefix: str) -> bool:
    try:
        await store.get_prefix(prefix)
        return True
    except Exception:
        return False


async def test_lost_lease_is_regranted_and_keys_reput(backend: Backend, prefix: str) -> None:
    holder = await backend.open()
    observer = await backend.open()
    key = prefix + "owned"

    async def put_owned(lease: object) -> None:
        await holder.put(key, b"mine", lease=keeper.lease.id if keeper.lease else 0)

    keeper = LeaseKeeper(holder, ttl=1.0, on_granted=put_owned)
    try:
        first = await keeper.start()
        run = asyncio.create_task(keeper.run())
        async with backend.outage(holder):
            await wait_for(lambda: first.lost.is_set(), timeout=10, message="holder told of loss")
        await wait_for(lambda: keeper.grants >= 2 and keeper.held, timeout=20)
        kv = await wait_for(lambda: observer.get(key), timeout=20)
        assert keeper.lease is not None and keeper.lease.id != first.id
        await wait_for(lambda: _leased_by(observer, key, keeper.lease.id), timeout=10)  # type: ignore[union-attr]
        assert kv.value == b"mine"
        assert not run.done(), "the keeper's loop must survive the outage"
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
    finally:
        await holder.close()
        await observer.close()


async def _leased_by(store: Store, key: str, lease_id: int) -> bool:
    kv = await store.get(key)
    return kv is not None and kv.lease == lease_id


async def test_value_over_limit_is_refused_naming_the_key(store: Store, prefix: str) -> None:
    with pytest.raises(ValueTooLargeError, match="big"):
        await store.put(prefix + "big", b"x" * (MAX_VALUE_BYTES + 1))
    assert await store.get(prefix + "big") is None


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "bad key", "nul\x00", "é"])
async def test_invalid_key_is_refused_naming_it(store: Store, key: str) -> None:
    with pytest.raises(InvalidKeyError, match="invalid key"):
        await store.put(key, b"x")


async def test_unreachable_store_fails_fast_naming_the_url(
    backend: Backend, tmp_path: Path
) -> None:
    if backend.name == "memory":
        pytest.skip("memory:// is always reachable")
    if backend.name == "etcd":
        url = f"etcd://127.0.0.1:{free_port()}"
    else:
        blocker = tmp_path / "file"
        blocker.write_text("not a directory")
        url = f"sqlite:///{blocker}/store.db"
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=url.split("://")[1].split("/")[0] or "store"):
        await open_store(url, connect_timeout=2.0)
    assert time.monotonic() - start < 5.0


async def test_a_key_deleted_and_created_again_has_a_new_create_revision(
    store: Store, prefix: str
) -> None:
    key = prefix + "k"
    first = await store.put(key, b"llama")
    await store.put(key, b"llama, tainted")
    kv = await store.get(key)
    assert kv is not None and kv.create_revision == first < kv.mod_revision
    await store.delete(key)
    again = await store.put(key, b"mistral")
    (listed,) = (await store.get_prefix(prefix)).items
    assert listed.create_revision == again > first
    assert await store.create(prefix + "c", b"x")
    created = await store.get(prefix + "c")
    assert created is not None and created.create_revision == created.mod_revision


async def test_expired_lease_is_never_read_even_by_a_short_lived_reader(
    backend: Backend, prefix: str
) -> None:
    """No client is alive while the lease runs out: a store opened afterwards for one read
    (as `shoal ls` does) must not return the dead holder's key."""
    ttl = 2.0
    key = prefix + "dead"
    if backend.multiprocess:
        proc = spawn(backend.url, "lease", key, str(ttl))
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
            assert line.startswith("ready"), line
        finally:
            proc.kill()
            proc.communicate()
    else:
        holder = await backend.open()
        lease = await holder.grant(ttl, keepalive=False)
        await holder.put(key, b"held", lease=lease.id)
        await holder.close()
    died = time.monotonic()
    # The lease outlives its holder by at most TTL; a fresh reader after TTL + 1 s sees no key.
    await asyncio.sleep(ttl + 1.0 - (time.monotonic() - died))
    for read in ("get_prefix", "get"):
        reader = await backend.open()
        try:
            if read == "get_prefix":
                assert [kv.key for kv in (await reader.get_prefix(prefix)).items] == []
            else:
                assert await reader.get(key) is None
        finally:
            await reader.close()


async def test_watch_ends_when_its_store_is_closed(backend: Backend, prefix: str) -> None:
    store = await backend.open()
    snap = await store.get_prefix(prefix)
    mirror = Recorder(store.watch(prefix, snap.revision + 1))
    await store.put(prefix + "a", b"1")
    await wait_for(lambda: mirror.state == {prefix + "a": b"1"}, message="the watch is live")
    await store.close()
    await wait_for(lambda: mirror.task.done(), timeout=10, message="the watch ended on close")
    assert (
        mirror.task.cancelled()
        or mirror.task.exception() is None
        or isinstance(mirror.task.exception(), StoreError)
    )


async def test_close_stops_the_keepalive_of_every_lease_granted(backend: Backend) -> None:
    def lease_tasks() -> set[asyncio.Task[object]]:
        return {t for t in asyncio.all_tasks() if t.get_name().startswith("lease-")}

    before = lease_tasks()
    for _ in range(5):
        store = await backend.open()
        await store.grant(30)
        await store.close()
    await wait_for(lambda: lease_tasks() <= before, timeout=5, message="keepalive tasks stopped")


async def test_nothing_at_or_below_a_resync_follows_it(backend: Backend, prefix: str) -> None:
    if backend.name == "etcd":
        pytest.skip("the etcd outage is a server restart; covered by the resync test above")
    watcher = await backend.open()
    writer = await backend.open()
    try:
        await writer.put(prefix + "a", b"1")
        snap = await watcher.get_prefix(prefix)
        stream = watcher.watch(prefix, snap.revision + 1)
        first = asyncio.ensure_future(anext(stream))  # the watch is set up
        await asyncio.sleep(0)
        async with backend.outage(watcher):
            pass
        # Changes after the reconnection, before the consumer reads anything.
        await writer.put(prefix + "b", b"2")
        await writer.delete(prefix + "b")
        head = await first  # read before the rest: one reader of the stream at a time
        mirror = Recorder(stream, {kv.key: kv.value for kv in snap.items})
        mirror.events.append(head)
        mirror._apply(head)
        last = await writer.put(prefix + "c", b"3")
        await wait_for(lambda: any(e.revision >= last for e in mirror.events))
        try:
            assert mirror.ordered_state() == {prefix + "a": b"1", prefix + "c": b"3"}
        finally:
            await mirror.close()
    finally:
        await watcher.close()
        await writer.close()


async def test_keeper_re_puts_until_it_succeeds_after_a_failed_re_put(
    backend: Backend, prefix: str
) -> None:
    holder = await backend.open()
    observer = await backend.open()
    key = prefix + "owned"
    failures = [StoreUnavailableError("the store blinked during the re-put")]

    async def put_owned(lease: Lease) -> None:
        if keeper.grants > 1 and failures:
            raise failures.pop()
        await holder.put(key, b"mine", lease=lease.id)

    keeper = LeaseKeeper(holder, ttl=1.0, on_granted=put_owned)
    run: asyncio.Task[None] | None = None
    try:
        first = await keeper.start()
        await holder.revoke(first.id)  # lost behind the holder's back
        run = asyncio.create_task(keeper.run())
        await wait_for(lambda: not failures, timeout=10, message="the re-put failed once")
        lease = await wait_for(
            lambda: keeper.lease if keeper.held and keeper.lease is not first else None
        )
        await wait_for(lambda: _leased_by(observer, key, lease.id), timeout=10)
        assert not run.done()
    finally:
        if run is not None:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        await holder.close()
        await observer.close()


async def test_keeper_revoked_while_running_stops_and_its_keys_stay_gone(
    backend: Backend, prefix: str
) -> None:
    holder = await backend.open()
    key = prefix + "owned"

    async def put_owned(lease: Lease) -> None:
        await holder.put(key, b"mine", lease=lease.id)

    keeper = LeaseKeeper(holder, ttl=1.0, on_granted=put_owned)
    try:
        await keeper.start()
        run = asyncio.create_task(keeper.run())
        await asyncio.sleep(0)
        await keeper.revoke()
        await asyncio.wait_for(run, timeout=5)  # revoke means stop: run() returns
        assert keeper.grants == 1
        assert await holder.get(key) is None
    finally:
        await holder.close()


async def test_a_replaced_lease_outlives_the_re_put_by_one_ttl_then_ends(
    backend: Backend, prefix: str
) -> None:
    """Readers following instances and models on separate watches must see the new
    registration before the old one goes: never a moment with neither."""
    holder = await backend.open()
    observer = await backend.open()
    only_old = prefix + "only-under-the-old-lease"

    async def put_owned(lease: Lease) -> None:
        await holder.put(prefix + "owned", str(lease.id).encode(), lease=lease.id)

    keeper = LeaseKeeper(holder, ttl=1.0, on_granted=put_owned)
    try:
        first = await keeper.start()
        await holder.put(only_old, b"x", lease=first.id)
        first.lost.set()  # lost to the holder (an outage), alive on the server
        await keeper.tick()
        assert keeper.lease is not first
        assert await observer.get(only_old) is not None  # not revoked at the re-put
        await wait_for(
            lambda: _gone(observer, only_old), timeout=1.0 + 2.0, message="old lease ended"
        )
    finally:
        await keeper.revoke()
        await holder.close()
        await observer.close()


async def _gone(store: Store, key: str) -> bool:
    return await store.get(key) is None


async def test_several_prefixes_are_read_at_one_revision(backend: Backend, prefix: str) -> None:
    """A writer puts `a/k` then `b/k` with the same counter: read at one revision, `a` is
    never behind `b` nor more than one step ahead. Keys outside the prefixes stay out."""
    reader = await backend.open()
    writer = await backend.open()
    a, b = prefix + "a/", prefix + "b/"
    try:
        await writer.put(prefix + "c/k", b"outside")
        await writer.put(prefix + "ab/k", b"between the prefixes, outside both")

        async def write() -> None:
            for n in range(40):
                await writer.put(a + "k", str(n).encode())
                await writer.put(b + "k", str(n).encode())

        task = asyncio.create_task(write())
        try:
            while not task.done():
                snap = await reader.get_prefixes((b, a, a + "k"))
                keys = [kv.key for kv in snap.items]
                assert keys in ([], [a + "k"], [a + "k", b + "k"]), keys
                if len(keys) == 2:
                    ahead = int(snap.items[0].value) - int(snap.items[1].value)
                    assert ahead in (0, 1), f"read across revisions: {snap.items}"
                assert all(kv.mod_revision <= snap.revision for kv in snap.items)
                await asyncio.sleep(0)  # the memory store never waits: let the writer run
        finally:
            await task
    finally:
        await reader.close()
        await writer.close()


async def test_a_listing_of_what_changed_brings_a_reader_at_since_to_the_whole_listing(
    store: Store, prefix: str
) -> None:
    """`get_prefixes_changed(prefixes, since)` gives a reader that holds the keys at `since`
    what `get_prefixes` would: every key with its revisions, lease and value. Whole (a value
    left out only at or below `since`) or a delta (the keys written since, and the keys
    gone since: deleted, recreated, or their lease ended)."""
    a, b = prefix + "a/", prefix + "b/"
    lease = await store.grant(60.0, keepalive=False)
    ending = await store.grant(60.0, keepalive=False)
    await store.put(a + "kept", b"1")
    await store.put(a + "changed", b"2")
    await store.put(a + "recreated", b"3")
    await store.put(a + "deleted", b"4")
    await store.put(b + "leased", b"4", lease=lease.id)
    await store.put(b + "ended", b"5", lease=ending.id)
    await store.put(prefix + "c/outside", b"5")
    for i in range(10):  # (etcd: more keys than revisions since, so it replays its history)
        await store.put(f"{a}filler{i}", b"f")
    at_since = await store.get_prefixes((a, b))
    since = at_since.revision
    await store.put(a + "changed", b"2'")
    await store.delete(a + "recreated")
    await store.put(a + "recreated", b"3'")
    await store.delete(a + "deleted")
    await store.put(b + "new", b"6")
    await ending.revoke()
    await store.put(prefix + "c/outside", b"5'")
    await store.put(prefix + "c/new", b"7")
    answered: list[bool] = []
    listing = await store.get_prefixes_changed(
        (b, a), since, on_answer=lambda: answered.append(True)
    )
    full = await store.get_prefixes((a, b))
    assert answered == [True]
    assert listing.revision == full.revision  # (nothing written between the two)
    held = {kv.key: kv for kv in at_since.items}
    assert held_after(held, listing, since) == as_held(full)
    if listing.removed is not None:
        assert set(listing.removed) <= {a + "deleted", b + "ended"} | set(held)
    # Since revision 0 every value is sent; since the latest, none need be.
    everything = await store.get_prefixes_changed((a, b), 0)
    assert everything.removed is None
    assert all(isinstance(kv, KeyValue) for kv in everything.items)
    assert held_after({}, everything, 0) == as_held(full)
    latest = await store.get_prefixes_changed((a, b), full.revision)
    assert held_after({kv.key: kv for kv in full.items}, latest, full.revision) == as_held(full)
    await lease.revoke()


async def test_a_watch_of_several_prefixes_follows_them_as_one(
    backend: Backend, prefix: str
) -> None:
    """Changes under any of the prefixes in revision order, none from outside them, and
    after an outage the changes missed, or a `Resync` holding every prefix at one revision."""
    watcher = await backend.open()
    writer = await backend.open()
    a, b = prefix + "a/", prefix + "b/"
    try:
        await writer.put(a + "1", b"1")
        await writer.put(b + "1", b"1")
        snap = await watcher.get_prefixes((a, b))
        mirror = Recorder(
            watcher.watch_prefixes((a, b), snap.revision + 1),
            {kv.key: kv.value for kv in snap.items},
        )
        try:
            await writer.put(prefix + "c/1", b"outside")
            await writer.put(prefix + "ab/1", b"between the prefixes, outside both")
            await writer.put(b + "2", b"2")
            await writer.delete(a + "1")
            await writer.put(a + "3", b"3")
            await wait_for(lambda: mirror.state == {b + "1": b"1", b + "2": b"2", a + "3": b"3"})
            outside = (prefix + "c", prefix + "ab")
            assert not [e for e in mirror.events if getattr(e, "key", a).startswith(outside)]
            async with backend.outage(watcher):
                if backend.name != "etcd":
                    await writer.delete(b + "1")
                    await writer.put(a + "4", b"4")
            if backend.name == "etcd":
                await wait_for(lambda: _reachable(writer, prefix), timeout=20)
                await writer.delete(b + "1")
                await writer.put(a + "4", b"4")
            expected = {b + "2": b"2", a + "3": b"3", a + "4": b"4"}
            await wait_for(lambda: mirror.ordered_state() == expected, timeout=20)
            resyncs = [e for e in mirror.events if isinstance(e, Resync)]
            # (etcd, down during the outage, replays what it missed from its history)
            assert resyncs or backend.name == "etcd", mirror.events
            for resync in resyncs:
                assert {kv.key[: len(a)] for kv in resync.items} == {a, b}, resync
        finally:
            await mirror.close()
    finally:
        await watcher.close()
        await writer.close()


async def test_a_replaced_lease_retired_now_ends_what_it_held_at_once(
    store: Store, prefix: str
) -> None:
    """A lease believed lost but alive on the server (etcd restores leases after a restart)
    is replaced, and ended one TTL after the re-put. `retire_now` (a drain) ends it at once:
    the drain's taints reach only the new registrations, so none may stay under the old."""
    leases: list[int] = []

    async def put_owned(lease: Lease) -> None:
        leases.append(lease.id)
        await store.put(f"{prefix}owned-{len(leases)}", b"mine", lease=lease.id)

    keeper = LeaseKeeper(store, ttl=30.0, on_granted=put_owned)
    first = await keeper.start()
    first.lost.set()  # (lost as far as the keeper knows; the store still has it)
    await keeper.tick()
    assert keeper.lease is not None and keeper.lease.id != first.id
    assert await store.get(prefix + "owned-1") is not None  # (kept one TTL: make before break)
    await keeper.retire_now()
    assert await store.get(prefix + "owned-1") is None
    assert await store.get(prefix + "owned-2") is not None
    await keeper.revoke()
