"""`etcd://host:port[,host:port]`: the store on an etcd v3 cluster, through `aetcd`.

Revisions are etcd's own: reads report the response header's revision, each key its
`mod_revision`, and watch events the revision of their change. Leases are etcd leases.

The backend in its parts, each with its own docstring: `etcd_client` (the connection: one
client at a time, deadlines, failover, errors), `etcd_txn` (the ranges and transactions the
reads and writes are made of), `etcd_watch` (the watches, and the replay of etcd's history)
and `etcd_leases` (leases, and the short ones the store revokes itself). `EtcdStore`, here,
puts them together: its reads and writes.

Failure handling:

- Every call has a deadline (`call_timeout`) and fails with `StoreUnavailableError`
  when etcd cannot be reached; nothing waits forever. With several endpoints a transport
  failure moves the client to the next one (`etcd_client`).
- A watch runs on its own gRPC stream. When the stream breaks, the watch backs off, opens
  a new stream and catches up on what came between: replayed from etcd's history when
  that is recent, else read (a `Resync`). It holds no queue of its own (`etcd_watch`).
- Several prefixes as one (`get_prefixes`, `watch_prefixes`): the listing is one read-only
  transaction with a range per prefix, so all are read at one revision (`etcd_txn`); the
  watch has one etcd watcher per prefix, all on one gRPC stream (`etcd_watch`).
- A listing of what changed since a recent revision (`get_prefixes_changed`) is replayed
  from etcd's history (`etcd_watch`: "History"), else read without the unchanged values.
- etcd raises lease TTLs to a minimum (2 s with the default election timing): the store
  revokes a shorter lease it granted itself once that TTL passes without a renewal
  (`etcd_leases`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import aetcd
import aetcd.rpc

from shoal.store.base import (
    KeyRevision,
    KeyValue,
    Listing,
    Snapshot,
    StoreError,
    StoreUnavailableError,
    check_key,
    check_prefix,
    check_value,
    checked_items,
    checked_keys,
)
from shoal.store.etcd_client import parse_url as parse_url  # (re-exported)
from shoal.store.etcd_leases import EtcdLeases
from shoal.store.etcd_txn import CONVERT_SLICE, _transactions
from shoal.store.etcd_watch import EtcdWatches


class EtcdStore(EtcdWatches, EtcdLeases):
    """A `Store` on etcd v3. Open it with `EtcdStore.open(url)` (or `shoal.store.open_store`)."""

    # -- key-value ----------------------------------------------------------------------

    async def get_prefix(self, prefix: str) -> Snapshot:
        check_prefix(prefix)
        return await self.get_prefixes((prefix,))

    async def get_prefixes(
        self, prefixes: Sequence[str], *, on_answer: Callable[[], None] | None = None
    ) -> Snapshot:
        """One revision for every range: the first transaction's, which the later ones (past
        `MAX_TXN_OPS` prefixes) and the later pages (a page is bounded in keys and bytes) read
        at. Each response is converted a slice at a time, yielding to the event loop."""
        items, revision = await self._ranges(prefixes, self._kv, on_answer=on_answer)
        return Snapshot(items, revision)

    async def get_prefixes_changed(
        self,
        prefixes: Sequence[str],
        since: int,
        *,
        on_answer: Callable[[], None] | None = None,
    ) -> Listing:
        """What changed since `since`, from etcd's history when it is recent: nothing when
        etcd's revision is still `since` (one index lookup: no write at all since, so none
        under `prefixes`), else the writes of the revisions after it replayed by a watcher
        (`_replay`). Failing that, every key without its value (`keys_only`), then at the
        same revision the values written after `since` (`min_mod_revision`): a pass over a
        quiet fleet moves the keys and their revisions, not 100,000 cards. Past etcd's
        compaction of that revision (it compacted between the two reads), every value is
        read again."""
        if since <= 0:  # (every value: the default)
            return await super().get_prefixes_changed(prefixes, since, on_answer=on_answer)
        now, _ = await self._revision_now(prefixes)
        if on_answer is not None:
            on_answer()
            on_answer = None
        if now == since:
            return Listing([], since, removed=[])
        if await self._worth_replaying(prefixes, since, now):
            replayed = await self._replay(prefixes, since, now)
            if replayed is not None:
                return await self._delta(replayed, now)
        keys, revision = await self._ranges(
            prefixes, self._key_revision, keys_only=True, on_answer=on_answer
        )
        # etcd reads a `min_mod_revision` range whole, unpaged: when most values changed,
        # every value a page at a time is less (80,000 keys of 1 KB: 1.2 s against 0.8).
        most = sum(kv.mod_revision > since for kv in keys) * 2 > len(keys)
        try:
            changed, _ = await self._ranges(
                prefixes, self._kv, revision=revision, min_mod_revision=0 if most else since + 1
            )
        except StoreError as exc:
            if isinstance(exc, StoreUnavailableError) or "compacted" not in str(exc):
                raise
            return await super().get_prefixes_changed(prefixes, since)
        values = {kv.key: kv for kv in changed}
        items: list[KeyValue | KeyRevision] = []
        for first in range(0, len(keys), CONVERT_SLICE * 16):
            items.extend(
                values.get(kv.key, kv) if kv.mod_revision > since else kv
                for kv in keys[first : first + CONVERT_SLICE * 16]
            )
            await asyncio.sleep(0)
        return Listing(items, revision)

    async def _delta(self, events: list[Any], now: int) -> Listing:
        """A delta listing at `now` from the replayed `events`: each key as its last one left
        it, `CONVERT_SLICE` events per turn of the event loop (a replay of 20,000 cards put
        at once was converted in one piece: 46 ms)."""
        latest: dict[bytes, Any] = {}
        for first in range(0, len(events), CONVERT_SLICE * 16):
            latest.update(
                (event.kv.key, event) for event in events[first : first + CONVERT_SLICE * 16]
            )
            await asyncio.sleep(0)
        items: list[KeyValue | KeyRevision] = []
        removed: list[str] = []
        keys = sorted(latest)
        for first in range(0, len(keys), CONVERT_SLICE):
            for key in keys[first : first + CONVERT_SLICE]:
                event = latest[key]
                if event.type == aetcd.rpc.Event.DELETE:
                    removed.append(key.decode("utf-8", "replace"))
                else:
                    items.append(self._kv(event.kv))
            await asyncio.sleep(0)
        return Listing(items, now, removed=removed)

    async def get(self, key: str) -> KeyValue | None:
        check_key(key)

        async def fn(client: Any) -> Any:
            return await client.get(key.encode())

        resp = await self._call(f"get {key!r}", fn)
        return None if resp is None else self._kv(resp)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        check_key(key)
        check_value(key, value)
        data = bytes(value)

        async def fn(client: Any) -> Any:
            return await client.put(key.encode(), data, lease=lease or None)

        resp = await self._call(f"put {key!r}", fn)
        return int(resp.header.revision)

    async def put_many(self, items: Sequence[tuple[str, bytes]], *, lease: int = 0) -> int:
        """One transaction of puts per `MAX_TXN_OPS` keys (fewer past `TXN_BYTES`, and a key
        given twice starts the next: etcd refuses both), one after the other. The keys of a
        transaction share its revision; a watch gets a `Put` for each."""
        revision = 0
        for txn in _transactions(await checked_items(items)):
            requests = [
                aetcd.rpc.RequestOp(
                    request_put=aetcd.rpc.PutRequest(key=raw, value=data, lease=lease)
                )
                for raw, data in txn
            ]

            what = f"put_many of {len(txn)} keys from {txn[0][0].decode()!r}"
            revision = int((await self._txn(what, requests)).header.revision)
        return revision

    async def create(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        check_key(key)
        check_value(key, value)
        raw, data = key.encode(), bytes(value)

        async def fn(client: Any) -> Any:
            tx = client.transactions
            return await client.transaction(
                compare=[tx.create(raw) == 0],
                success=[tx.put(raw, data, lease=lease or None)],
                failure=[],
            )

        succeeded, _ = await self._call(f"create {key!r}", fn)
        return bool(succeeded)

    async def delete(self, key: str) -> bool:
        check_key(key)

        async def fn(client: Any) -> Any:
            return await client.delete(key.encode())

        return await self._call(f"delete {key!r}", fn) is not None

    async def delete_many(self, keys: Sequence[str]) -> int:
        """One transaction of deletes per `MAX_TXN_OPS` keys (a key given twice starts the
        next: etcd refuses both), one after the other; a watch gets a `Delete` for each."""
        deleted = 0
        for txn in _transactions([(key, b"") for key in await checked_keys(keys)]):
            requests = [
                aetcd.rpc.RequestOp(request_delete_range=aetcd.rpc.DeleteRangeRequest(key=raw))
                for raw, _ in txn
            ]

            what = f"delete_many of {len(txn)} keys from {txn[0][0].decode()!r}"
            reply = await self._txn(what, requests)
            deleted += sum(int(r.response_delete_range.deleted) for r in reply.responses)
        return deleted

    # -- lifecycle ----------------------------------------------------------------------

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closed_event.set()
        self._stop_keepalives()
        for call in list(self._watch_calls):
            call.cancel()
        self._watch_calls.clear()
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None
        # Clients left behind by a failover, still closing (each within 5 s).
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._client is not None:
            client, self._client = self._client, None
            await self._close_client(client)
