"""The transactions the etcd store's reads and writes are made of, on its connection
(`shoal.store.etcd_client`): ranges read at one revision, a page at a time (`PAGE_KEYS`),
converted a slice at a time between turns of the event loop (`CONVERT_SLICE`); etcd's
revision now; and the transactions of many puts or deletes (`_transactions`, `_txn`).

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

from shoal.store.base import KeyRevision, KeyValue, distinct_prefixes
from shoal.store.etcd_client import EtcdConnection

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
        for i in range(0, len(distinct), MAX_TXN_OPS):
            # (each range with keys left to read: its index, and from where to its end)
            ranges = [(i + j, *_range_of(p)) for j, p in enumerate(distinct[i : i + MAX_TXN_OPS])]
            while ranges:
                requests = [
                    aetcd.rpc.RequestOp(
                        request_range=self._range(start, end, revision, keys_only, min_mod_revision)
                    )
                    for _, start, end in ranges
                ]

                async def fn(client: Any, requests: list[Any] = requests) -> Any:
                    # A read-only transaction: one revision for all its ranges.
                    return await client.kvstub.Txn(
                        aetcd.rpc.TxnRequest(success=requests),
                        timeout=self._call_timeout,
                        metadata=client.metadata,
                    )

                resp = await self._call(what, fn)
                if not revision and on_answer is not None:
                    on_answer()
                revision = revision or int(resp.header.revision)
                more = []
                for (index, _, end), op in zip(ranges, resp.responses, strict=True):
                    kvs = op.response_range.kvs
                    for first in range(0, len(kvs), CONVERT_SLICE):
                        read[index].extend(map(convert, kvs[first : first + CONVERT_SLICE]))
                        await asyncio.sleep(0)
                    if op.response_range.more and len(kvs):
                        more.append((index, kvs[len(kvs) - 1].key + b"\0", end))
                ranges = more
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
        start: bytes, end: bytes, revision: int, keys_only: bool = False, min_mod: int = 0
    ) -> Any:
        # No `sort_order`: etcd returns a range in key order as it is, and a sorted request
        # makes it read the whole rest of the range for every page ("fetch everything; sort
        # and truncate afterwards", etcd 3.4's `applierV3backend.Range`).
        return aetcd.rpc.RangeRequest(
            key=start,
            range_end=end,
            revision=revision,
            limit=PAGE_KEYS,
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
