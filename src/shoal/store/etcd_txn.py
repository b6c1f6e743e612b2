"""The transactions the etcd store's reads and writes are made of, on its connection
(`shoal.store.etcd_client`): ranges read at one revision, a page at a time (at most
`PAGE_KEYS` keys a range, and about `PAGE_BYTES` a page), converted a slice at a time
between turns of the event loop (`CONVERT_SLICE`); etcd's revision now; and the
transactions of many puts or deletes (`_transactions`, `_txn`).

A page is bounded in keys by the request and in bytes by its size estimate: etcd has no
byte limit for a range, so a page's key limit follows the bytes per key of the page before
(`_PageSize`), starting small (`FIRST_PAGE_KEYS`). A page the client refuses as too large
(past the channel's message limit, `etcd_client`) is read again with fewer keys.

Several prefixes as one (`get_prefixes`): the listing is one read-only transaction with a
range per prefix, so all are read at one revision (past `MAX_TXN_OPS` prefixes, several
transactions, the later ones at the first one's revision).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import aetcd
import aetcd.rpc
import aetcd.utils

from shoal.store.base import KeyRevision, KeyValue, StoreError, distinct_prefixes
from shoal.store.etcd_client import EtcdConnection, _grpc_code

T = TypeVar("T")

MAX_TXN_OPS = 128
"""Operations etcd takes in one transaction (its `--max-txn-ops` default): a listing of more
prefixes reads them in several transactions, the later ones at the first one's revision."""
TXN_BYTES = 1024 * 1024
"""Bytes of keys and values a `put_many` sends in one transaction: etcd refuses a request
over 1.5 MiB by default (`--max-request-bytes`)."""
PAGE_KEYS = 16384
"""Keys a range reads per request: a listing of 200,000 keys is not one 80 MB message parsed
in one piece on the event loop (~0.3 s). (Pages of 4,096 keys once made a pass take 4.5 s
at 100,000 instances, 1.3 s with 16,384: etcd read the whole rest of the range for every
page of a sorted request; `_range` no longer asks for a sort.)"""
PAGE_BYTES = 8 * 1024 * 1024
"""Bytes of keys and values a page aims at (as SQLite's watch polls, `sqlite_watch.
POLL_BYTES`): 16,384 values of `MAX_VALUE_BYTES` made one page 16 GiB (past the 256 MiB a
message could have: a listing that never succeeded), held at once and parsed in one piece
on the event loop (10 ms for 7 MB)."""
FIRST_PAGE_KEYS = 8
"""Keys the first page of a listing reads, over all its ranges: nothing is known yet of the
values' sizes, and 8 of the largest (`MAX_VALUE_BYTES`) are `PAGE_BYTES`. Each later page
reads at most `PAGE_GROWTH` times as many as the one before, and no more than the bytes per
key of the one before let into `PAGE_BYTES`: cards of a few hundred bytes are read
`PAGE_KEYS` a range from the fourth page on."""
PAGE_GROWTH = 16
CONVERT_SLICE = 1024
"""Keys of a response converted between two yields to the event loop."""


def _range_of(prefix: str) -> tuple[bytes, bytes]:
    """The etcd key range [start, end) holding every key under `prefix` ("" is everything)."""
    if not prefix:
        return b"\0", b"\0"
    start = prefix.encode()
    return start, aetcd.utils.prefix_range_end(start)


def _transactions(items: list[tuple[str, bytes]]) -> Iterator[list[tuple[bytes, bytes]]]:
    """`items` in the transactions of a `put_many`: at most `MAX_TXN_OPS` keys and
    `TXN_BYTES` of keys and values each (a larger item alone), no key twice in one."""
    txn: list[tuple[bytes, bytes]] = []
    keys: set[bytes] = set()
    size = 0
    for key, value in items:
        raw = key.encode()
        cost = len(raw) + len(value)
        if txn and (len(txn) >= MAX_TXN_OPS or size + cost > TXN_BYTES or raw in keys):
            yield txn
            txn, keys, size = [], set(), 0
        txn.append((raw, value))
        keys.add(raw)
        size += cost
    if txn:
        yield txn


class _PageSize:
    """The keys the next page of a listing may read over all its ranges (`keys`): the first
    `FIRST_PAGE_KEYS`, then as many as the bytes per key of the last page let into
    `PAGE_BYTES`, growing at most `PAGE_GROWTH` times a page (values that grow from one
    page to the next are met before a page holds many of them). Over the keys a refused
    page would have read (`careful`), pages do not grow: small values before large ones
    made the page grow back past the message limit page after page (3,000 keys of 10
    bytes before 24 of 256 KiB, a 3 MiB limit: 15 pages refused, each made whole by etcd)."""

    def __init__(self) -> None:
        self.keys = FIRST_PAGE_KEYS
        self.careful = 0

    def read(self, keys: int, size: int) -> None:
        """The last page read `keys` keys in a response of `size` bytes."""
        if keys:
            per_key = max(size // keys, 1)
            grown = self.keys if self.careful > 0 else self.keys * PAGE_GROWTH
            self.keys = max(1, min(grown, PAGE_BYTES // per_key))
            self.careful -= keys

    def refused(self) -> bool:
        """The last page was refused as too large: read fewer keys (False: one was too many)."""
        if self.keys <= 1:
            return False
        self.careful = self.keys
        self.keys = max(1, self.keys // 16)
        return True

    def limits(self, ranges: int) -> tuple[int, int]:
        """How many of `ranges` ranges the next page reads, and the key limit of each."""
        taken = max(1, min(ranges, MAX_TXN_OPS, self.keys))
        return taken, max(1, min(PAGE_KEYS, self.keys // taken))


class EtcdTransactions(EtcdConnection):
    """The reads and transactions of the etcd store (see the module's docstring), each one
    request through `_call`."""

    @staticmethod
    def _kv(kv: Any) -> KeyValue:
        return KeyValue(
            key=kv.key.decode("utf-8", "replace"),
            value=bytes(kv.value),
            mod_revision=int(kv.mod_revision),
            lease=int(kv.lease),
            create_revision=int(kv.create_revision),
        )

    async def _revision_now(
        self, prefixes: Sequence[str], *, count: bool = False
    ) -> tuple[int, int]:
        """etcd's current revision and, with `count`, the keys under `prefixes` (the first
        `MAX_TXN_OPS` of them; else 0), counted in one transaction from etcd's index alone
        (no value read; 20 ms for 100,000 keys, one key otherwise)."""
        distinct = distinct_prefixes(prefixes)
        what = f"get_prefixes {', '.join(distinct)}"[:200]
        # (without `count`, one key: the first prefix itself, which a user allowed only that
        # prefix may read; b"\0" for the prefix "")
        one = distinct[0].encode() or b"\0"
        ranges = map(_range_of, distinct[:MAX_TXN_OPS]) if count else [(one, b"")]
        requests = [
            aetcd.rpc.RequestOp(
                request_range=aetcd.rpc.RangeRequest(key=start, range_end=end, count_only=True)
            )
            for start, end in ranges
        ]

        async def fn(client: Any) -> Any:
            return await client.kvstub.Txn(
                aetcd.rpc.TxnRequest(success=requests),
                timeout=self._call_timeout,
                metadata=client.metadata,
            )

        resp = await self._call(what, fn)
        keys = sum(int(op.response_range.count) for op in resp.responses) if count else 0
        return int(resp.header.revision), keys

    async def _ranges(
        self,
        prefixes: Sequence[str],
        convert: Callable[[Any], T],
        *,
        revision: int = 0,
        keys_only: bool = False,
        min_mod_revision: int = 0,
        on_answer: Callable[[], None] | None = None,
    ) -> tuple[list[T], int]:
        """The keys under `prefixes`, each converted, in key order, at one revision (the
        first transaction's when `revision` is 0), and that revision."""
        distinct = distinct_prefixes(prefixes)
        what = f"get_prefixes {', '.join(distinct)}"[:200]
        # The prefixes are sorted and none is inside another, and each range is read in key
        # order: the ranges' items, one after the other, are in key order.
        read: list[list[T]] = [[] for _ in distinct]
        # (each range with keys left to read: its index, and from where to its end)
        ranges = [(i, *_range_of(p)) for i, p in enumerate(distinct)]
        page = _PageSize()
        while ranges:
            taken, limit = page.limits(len(ranges))
            requests = [
                aetcd.rpc.RequestOp(
                    request_range=self._range(
                        start, end, revision, keys_only, min_mod_revision, limit
                    )
                )
                for _, start, end in ranges[:taken]
            ]

            async def fn(client: Any, requests: list[Any] = requests) -> bytes:
                # A read-only transaction: one revision for all its ranges. Its response as
                # it came, whose length is the page's size (`ByteSize()` encodes the whole
                # message again: 70 ms for 7 MB).
                txn = client.channel.unary_unary(
                    "/etcdserverpb.KV/Txn",
                    request_serializer=aetcd.rpc.TxnRequest.SerializeToString,
                    response_deserializer=None,
                )
                raw: bytes = await txn(
                    aetcd.rpc.TxnRequest(success=requests),
                    timeout=self._call_timeout,
                    metadata=client.metadata,
                )
                return raw

            try:
                raw = await self._call(what, fn)
            except StoreError as exc:
                if _grpc_code(exc)[0] == "RESOURCE_EXHAUSTED" and page.refused():
                    continue  # (a page past the message limit: fewer keys)
                raise
            size = len(raw)
            resp = aetcd.rpc.TxnResponse.FromString(raw)
            del raw
            if not revision and on_answer is not None:
                on_answer()
            revision = revision or int(resp.header.revision)
            more = []
            keys = 0
            for (index, _, end), op in zip(ranges[:taken], resp.responses, strict=True):
                kvs = op.response_range.kvs
                keys += len(kvs)
                for first in range(0, len(kvs), CONVERT_SLICE):
                    read[index].extend(map(convert, kvs[first : first + CONVERT_SLICE]))
                    await asyncio.sleep(0)
                if op.response_range.more and len(kvs):
                    more.append((index, kvs[len(kvs) - 1].key + b"\0", end))
            page.read(keys, size)
            del resp
            ranges = more + ranges[taken:]
        items = read[0] if len(read) == 1 else list(itertools.chain.from_iterable(read))
        return items, revision

    @staticmethod
    def _key_revision(kv: Any) -> KeyRevision:
        return KeyRevision(
            kv.key.decode("utf-8", "replace"),
            int(kv.mod_revision),
            int(kv.lease),
            int(kv.create_revision),
        )

    @staticmethod
    def _range(
        start: bytes,
        end: bytes,
        revision: int,
        keys_only: bool = False,
        min_mod: int = 0,
        limit: int = PAGE_KEYS,
    ) -> Any:
        # No `sort_order`: etcd returns a range in key order as it is, and a sorted request
        # makes it read the whole rest of the range for every page ("fetch everything; sort
        # and truncate afterwards", etcd 3.4's `applierV3backend.Range`).
        return aetcd.rpc.RangeRequest(
            key=start,
            range_end=end,
            revision=revision,
            limit=limit,
            keys_only=keys_only,
            min_mod_revision=min_mod,
        )

    async def _txn(self, what: str, requests: list[Any]) -> Any:
        """One transaction of `requests`, all of which must apply (no compare)."""

        async def fn(client: Any) -> Any:
            return await client.kvstub.Txn(
                aetcd.rpc.TxnRequest(success=requests),
                timeout=self._call_timeout,
                metadata=client.metadata,
            )

        return await self._call(what, fn)
