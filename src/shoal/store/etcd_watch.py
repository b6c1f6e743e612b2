"""The etcd store's watches, and the replay of etcd's history that catches one up (and
serves a listing of what changed since a revision: `EtcdStore.get_prefixes_changed`).

- A watch runs on its own gRPC stream. When the stream breaks (etcd died, restarted,
  lost its leader), the watch backs off (50 ms doubling to 2 s, with jitter), opens a new
  stream watching from etcd's current revision and catches up on what came between:
  replayed from etcd's history when that is recent and moves less than the keys (the
  changes, in revision order: see "History" below), else it reads the prefix and yields a
  `Resync` with it (also when etcd reports the start revision compacted, or its revision
  went back); then it passes on the changes after that.
- A watch holds no queue of its own: what its consumer has not read waits in etcd (and in
  the stream's HTTP/2 window, a few MiB). Every watcher asks etcd to split a response over
  its request bound (`--max-request-bytes`, 1.5 MiB by default) into fragments: a watch
  left unread past etcd's buffer was caught up in one response holding every change it
  missed (250 values of 1 MiB: 232 MiB held at once, up to the 256 MiB a message may have,
  past which the stream broke), now a fragment at a time.
- Several prefixes as one (`watch_prefixes`): the watch has one etcd watcher per prefix,
  all on one gRPC stream: etcd sends a stream's live changes in revision order whichever
  watcher they belong to, and the stream breaks (and catches up) as one. Only a watcher
  catching up on history sends its share alone, out of order with the others'; so the
  watchers of several prefixes never catch up themselves: when the store moved since the
  start revision they start at etcd's current revision, and what came before is replayed
  (below) or read (a `Resync`), as after every break. A change older than one already
  yielded (a watcher that raced its creation) is caught and resynced by a read. No other
  key's change travels to the watcher (a range covering the prefixes would carry, for
  discovery's instances and cards of one namespace, those of every namespace sorted
  between them: with N namespaces each change reached N/2 watches).
- History: etcd keeps every revision until compacted, and a watcher from a past revision
  replays it; but 3.4 does not say when a watcher catching up is done (before 3.4.25 its
  progress notification may come before the events), and several watchers catching up
  send each one's share in turn. So a replay (`_replay`) is one watcher over the whole
  keyspace, read up to the revision it must reach: that revision is some key's write.
  It serves `get_prefixes_changed` (a delta since the reader's revision: a reconcile
  pass) and the watch's catch-up; it is used at most `HISTORY_REVISIONS` back and when
  fewer revisions than keys are to be replayed (counted from etcd's index), and it gives
  up past `HISTORY_BYTES` or `HISTORY_TIMEOUT`, or for good when etcd refuses to let this
  user watch the whole keyspace: then the keys are read, as before.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import aetcd.rpc

from shoal.store.base import (
    Delete,
    Event,
    Put,
    Resync,
    StoreError,
    StoreUnavailableError,
    check_prefix,
    distinct_prefixes,
)
from shoal.store.etcd_client import _grpc_code
from shoal.store.etcd_txn import CONVERT_SLICE, EtcdTransactions, _range_of

log = logging.getLogger("shoal.store.etcd")  # (the backend's one logger, as it always was)

WATCH_BATCH = 64
"""Events a watch hands its consumer between two yields to the event loop: a catch-up
replay, or one response of a large transaction, is thousands of events, and a consumer
that handles each without awaiting (discovery) held the loop for all of them (4,000
re-tainted cards: 340-608 ms)."""
HISTORY_REVISIONS = 2000
"""A listing of what changed replays etcd's history when `since` is at most this many
revisions back, and fewer than the keys it lists (`EtcdStore._replay`); else it reads
every key. A watch of several prefixes catches up the same way."""
HISTORY_BYTES = 16 * 1024 * 1024
"""Bytes of keys and values a replay receives, of any key, before it gives up."""
HISTORY_TIMEOUT = 2.0
"""Seconds a replay may take before it gives up (etcd syncs a watcher that catches up on
history every 100 ms)."""
OPENING_WATCHES = 16
"""Watches of one store instance that open their stream and catch up at once; the others
wait their turn. A frontend following 10,000 namespaces opens 10,000 watches at its start,
and all of them again when etcd comes back: each one's steps are short, but all were ready
in the same turn of the event loop (3,000 watches: a 1.1 s hold at the start, 0.5 s after a
restart)."""
BACKOFF_START = 0.05
BACKOFF_CAP = 2.0


def _jitter(delay: float) -> float:
    """Between half of `delay` and all of it, so that clients do not retry in step."""
    return delay * (0.5 + random.random() / 2)


class _StreamBroken(Exception):
    """A watch stream ended or failed; the watch must resync."""


class _Compacted(Exception):
    """etcd no longer has the history the watch asked for."""


class _OutOfOrder(Exception):
    """One prefix's watcher delivered a change older than one already yielded."""


class EtcdWatches(EtcdTransactions):
    """The watches of one store instance on etcd, each on a gRPC stream of its own, and the
    replay of etcd's history (see the module's docstring)."""

    def __init__(self, url: str, *, call_timeout: float = 5.0) -> None:
        super().__init__(url, call_timeout=call_timeout)
        self._watch_calls: set[Any] = set()
        self._replay_allowed = True  # (False once etcd refused to replay its history)
        self._opening = asyncio.Semaphore(OPENING_WATCHES)

    async def _replay(self, prefixes: Sequence[str], since: int, now: int) -> list[Any] | None:
        """The changes after `since` up to `now` under `prefixes`, in revision order (etcd's
        events), from etcd's history: one watcher over the whole keyspace. It must see every
        key, not only the prefixes: the write at revision `now` (every revision is a write
        of some key), at the end of a response that is not a fragment (etcd splits one by
        size, a revision's changes too), is the sign that the replay is complete, since
        etcd 3.4 does not say when a catching-up watcher is done (before 3.4.25 its progress
        notification may come before the events). None (the caller reads the keys instead) when the history is compacted,
        the watch is refused (a user who may read only some prefixes: not tried again), or
        the replay passes `HISTORY_BYTES` or `HISTORY_TIMEOUT`."""
        ranges = [_range_of(p) for p in distinct_prefixes(prefixes)]
        replayed: list[Any] = []
        received = 0
        client, generation = await self._current()
        call: Any = None
        try:
            async with asyncio.timeout(min(HISTORY_TIMEOUT, self._call_timeout)):
                call = aetcd.rpc.WatchStub(client.channel).Watch(metadata=client.metadata)
                self._watch_calls.add(call)
                await call.write(
                    aetcd.rpc.WatchRequest(
                        create_request=aetcd.rpc.WatchCreateRequest(
                            # From `since`, not after it: etcd calls a watch compacted
                            # only when it starts below the compaction, whose deletes it
                            # dropped (the changes at `since` are the reader's already).
                            key=b"\0",
                            range_end=b"\0",
                            start_revision=max(since, 1),
                            fragment=True,  # (`HISTORY_BYTES` is checked a slice at a time)
                        )
                    )
                )
                seen = since
                async for resp in call:
                    if resp.compact_revision:
                        return None
                    if resp.canceled:
                        if "permission" in resp.cancel_reason.lower():
                            self._replay_allowed = False
                        log.debug("etcd replay from %d canceled: %s", since, resp.cancel_reason)
                        return None
                    events = resp.events
                    for first in range(0, len(events), CONVERT_SLICE):
                        for event in events[first : first + CONVERT_SLICE]:
                            kv = event.kv
                            revision = kv.mod_revision
                            if revision > now or revision <= since:
                                continue  # (the next listing's, or the reader's)
                            seen = max(seen, revision)
                            key = kv.key
                            received += len(key) + len(kv.value)
                            # (an end of b"\0": no end, the prefix "")
                            if any(
                                start <= key and (key < end or end == b"\0")
                                for start, end in ranges
                            ):
                                replayed.append(event)
                        if received > HISTORY_BYTES:
                            return None
                        await asyncio.sleep(0)
                    if seen >= now and not resp.fragment:
                        break  # (a fragment's last revision may go on in the next one)
                else:
                    return None
        except TimeoutError:
            log.debug("etcd replay from %d to %d ran out of time", since, now)
            return None
        except (Exception, asyncio.CancelledError) as exc:
            err = self._failure(exc, "replay", generation)  # (re-raises a cancellation)
            if _grpc_code(exc)[0] == "PERMISSION_DENIED":
                self._replay_allowed = False
            log.debug("etcd replay from %d failed: %s", since, err)
            return None
        finally:
            if call is not None:
                self._watch_calls.discard(call)
                call.cancel()
        return replayed

    async def _worth_replaying(self, prefixes: Sequence[str], since: int, now: int) -> bool:
        """Whether a replay from `since` to `now` is allowed, and moves less than reading
        the keys: at most `HISTORY_REVISIONS` back, and fewer revisions than keys (a replay
        receives the writes of every key: for prefixes of few keys in a busy etcd, reading
        those keys is less). Counting the keys is one more read (from etcd's index)."""
        if not (since < now <= since + HISTORY_REVISIONS and self._replay_allowed):
            return False
        _, count = await self._revision_now(prefixes, count=True)
        return now - since <= count

    def watch(self, prefix: str, start_revision: int) -> AsyncIterator[Event]:
        check_prefix(prefix)
        return self.watch_prefixes((prefix,), start_revision)

    def watch_prefixes(
        self, prefixes: Sequence[str], start_revision: int
    ) -> AsyncGenerator[Event, None]:
        distinct = distinct_prefixes(prefixes)
        self._check_open()
        return self._watch(distinct, start_revision)

    async def _watch(
        self, prefixes: tuple[str, ...], start_revision: int
    ) -> AsyncGenerator[Event, None]:
        """One etcd watcher per prefix, all on one gRPC stream (see the module doc)."""
        prefix = ", ".join(prefixes)  # for the log
        ranges = [_range_of(p) for p in prefixes]
        several = len(prefixes) > 1
        # Every change at or below `delivered` is the consumer's (yielded, or held by a
        # `Resync`), except, at `delivered` itself, those of keys not in `at_delivered`: a
        # transaction's changes under two prefixes come from two watchers, and a stream may
        # break between them.
        delivered = start_revision - 1
        at_delivered: set[str] | None = None  # None: every change at `delivered` is
        broken = False  # the last stream broke: changes after `delivered` may be lost
        whole = False  # what was yielded is out of order: only a read of every key will do
        backoff = BACKOFF_START
        handed = 0  # events yielded: every `WATCH_BATCH` of them, a turn of the event loop
        opening: asyncio.Semaphore | None = None  # (this watch's turn to open, while held)
        while not self._closed:
            # A single watcher from `delivered + 1` gets the history in order from etcd. Else
            # the watchers start at etcd's current revision, and what came before it is
            # replayed (`_replay`: in revision order) or read (a `Resync`): every change
            # after that comes through the watchers, none is lost between.
            from_history = not (several or broken or whole)
            floor = delivered + 1
            # (from the revision before `floor`: a compaction at `floor` itself dropped
            # its deletes, and etcd says so only of a watch that starts below it)
            stream = self._watch_stream(ranges, prefix, max(floor - 1, 1) if from_history else 0)
            # A turn to open and catch up (`OPENING_WATCHES`), released before anything is
            # yielded: a consumer that does not read holds no other watch back.
            opening = self._opening
            await opening.acquire()
            try:
                try:
                    created = await anext(stream)
                except StopAsyncIteration:
                    raise _StreamBroken("watch stream ended") from None
                backoff = BACKOFF_START
                if not from_history and created < delivered:
                    whole = True  # (etcd's revision went back: restored from a backup)
                # (from the revision before `delivered` when a change at it may be lost)
                since = delivered if at_delivered is None else delivered - 1
                if whole or (not from_history and created > since):
                    try:
                        replayed = None
                        if not whole and await self._worth_replaying(prefixes, since, created):
                            replayed = await self._replay(prefixes, since, created)
                        if replayed is None:
                            snap = await self.get_prefixes(prefixes)
                    except StoreError as exc:
                        level = (
                            logging.DEBUG
                            if isinstance(exc, StoreUnavailableError)
                            else logging.WARNING
                        )
                        log.log(level, "watch %r: resync read failed: %s", prefix, exc)
                        raise _StreamBroken(f"resync read failed: {exc}") from exc
                    opening.release()
                    opening = None
                    if replayed is None:
                        yield Resync(snap.items, snap.revision)
                        delivered, at_delivered = snap.revision, None
                    else:
                        for e in replayed:  # (after `since`: at `delivered`, some may be)
                            event = self._event(e)
                            held = at_delivered is not None and event.key in at_delivered
                            if held and event.revision == delivered:
                                continue  # (the consumer's already)
                            yield event
                            handed += 1
                            if handed % WATCH_BATCH == 0:
                                await asyncio.sleep(0)
                        delivered, at_delivered = created, None
                    whole = False
                if opening is not None:
                    opening.release()
                    opening = None
                if broken:
                    broken = False
                    self._watch_state(None)
                floor = delivered + 1
                while True:
                    try:
                        batch = await anext(stream)
                    except StopAsyncIteration:
                        raise _StreamBroken("watch stream ended") from None
                    for event in batch:
                        if event.revision < floor:
                            continue  # the consumer's already
                        if event.revision < delivered:
                            # Another prefix's watcher is ahead of this one (it caught up
                            # on history): what was yielded is out of order. Read again.
                            raise _OutOfOrder(
                                f"revision {event.revision} after {delivered}; resyncing"
                            )
                        if event.revision > delivered:
                            delivered, at_delivered = event.revision, set()
                        if at_delivered is not None:
                            at_delivered.add(event.key)
                        yield event
                        handed += 1
                        if handed % WATCH_BATCH == 0:
                            await asyncio.sleep(0)
            except _OutOfOrder as exc:
                log.info("watch %r: %s", prefix, exc)
                whole = True
            except _Compacted as exc:
                log.info("watch %r from %s: %s; resyncing", prefix, delivered + 1, exc)
                whole = True
            except (_StreamBroken, StoreError) as exc:
                if self._closed:
                    return
                if opening is None:
                    # etcd going away breaks every watch at once: a few handle it per turn
                    # of the event loop, as a few open (3,000 in one turn: 200-300 ms). The
                    # turn is held across a yield: the others wait for the next one.
                    await self._opening.acquire()
                    opening = self._opening
                    await asyncio.sleep(0)
                # (once per outage: while it lasts, every watch fails again at each attempt,
                # and a frontend of 3,000 namespaces logged 11,000 lines in one restart)
                level = logging.DEBUG if broken else logging.INFO
                log.log(level, "watch %r broke (%s); catching up", prefix, exc)
                broken = True
                why = str(exc) if self.url in str(exc) else f"etcd store {self.url}: {exc}"
                self._watch_state(
                    exc if isinstance(exc, StoreError) else StoreUnavailableError(why)
                )
                opening.release()  # (not held through the backoff)
                opening = None
                await self._pause(_jitter(backoff))
                backoff = min(backoff * 2, BACKOFF_CAP)
            finally:
                if opening is not None:
                    opening.release()
                await stream.aclose()

    async def _watch_stream(
        self, ranges: list[tuple[bytes, bytes]], prefix: str, start_revision: int
    ) -> AsyncGenerator[Any, None]:
        """One etcd watch stream with a watcher on each of `ranges` from `start_revision`
        (0: after etcd's current revision); `prefix` names it in errors. Yields, once every
        watcher is created, the highest revision etcd reported at their creation (a watcher
        started at or below it catches up on history), then each response's events.

        Raises `_Compacted` when the history is gone and `_StreamBroken` on any failure.
        """
        client, generation = await self._current()
        # "hasleader": etcd cancels the watch if its member loses the cluster leader.
        metadata = (*(client.metadata or ()), ("hasleader", "true"))
        call: Any = None
        early: list[list[Put | Delete]] = []  # events of a watcher before the others exist

        def check(resp: Any) -> None:
            if resp.compact_revision:
                raise _Compacted(f"history compacted up to {resp.compact_revision}")
            if resp.canceled:
                raise _StreamBroken(f"watch canceled by etcd: {resp.cancel_reason}")

        try:
            try:
                call = aetcd.rpc.WatchStub(client.channel).Watch(metadata=metadata)
                self._watch_calls.add(call)
                created = -1
                async with asyncio.timeout(self._call_timeout):
                    for start, end in ranges:
                        await call.write(
                            aetcd.rpc.WatchRequest(
                                create_request=aetcd.rpc.WatchCreateRequest(
                                    key=start,
                                    range_end=end,
                                    start_revision=start_revision,
                                    fragment=True,  # (see `_watch`: a response is a slice)
                                )
                            )
                        )
                    responses = call.__aiter__()
                    waiting = len(ranges)
                    while waiting:
                        resp = await anext(responses)
                        check(resp)
                        if resp.created:
                            waiting -= 1
                            created = max(created, int(resp.header.revision))
                        if resp.events:
                            early.append([self._event(e) for e in resp.events])
            except StopAsyncIteration:
                raise _StreamBroken("watch stream closed before creation") from None
            except (_Compacted, _StreamBroken):
                raise
            except (Exception, asyncio.CancelledError) as exc:
                err = self._failure(exc, f"watch {prefix!r}", generation)
                raise _StreamBroken(str(err)) from exc
            yield created
            for batch in early:
                yield batch
            early.clear()
            while True:
                try:
                    resp = await anext(responses)
                except StopAsyncIteration:
                    raise _StreamBroken("watch stream closed by etcd") from None
                except (Exception, asyncio.CancelledError) as exc:
                    err = self._failure(exc, f"watch {prefix!r}", generation)
                    raise _StreamBroken(str(err)) from exc
                check(resp)
                events = resp.events
                for first in range(0, len(events), CONVERT_SLICE):
                    if first:
                        await asyncio.sleep(0)
                    yield [self._event(e) for e in events[first : first + CONVERT_SLICE]]
        finally:
            if call is not None:
                self._watch_calls.discard(call)
                call.cancel()

    @staticmethod
    def _event(e: Any) -> Put | Delete:
        key = e.kv.key.decode("utf-8", "replace")
        revision = int(e.kv.mod_revision)
        if e.type == aetcd.rpc.Event.DELETE:
            return Delete(key, revision)
        return Put(key, bytes(e.kv.value), revision)
