"""The mocker's KV handoff between a prefill and a decode mocker, in vLLM's NixlConnector terms.

A prefill mocker answers a request whose `kv_transfer_params.do_remote_decode` is true with
`kv_transfer_params` naming itself (`remote_engine_id`, `remote_host`, `remote_port`) and the
blocks it computed (`remote_block_ids`), and holds those blocks (`HeldBlocks`) until a decode
mocker fetches them over a small TCP side channel (`KvSideChannel`: one JSON line each way)
or `HOLD_SECONDS` pass. The decode mocker (`fetch_blocks`) gets the blocks' hashes back, so
they enter its prefix cache and cost it no prefill; the transfer takes `us_per_block` per
block. Params that point nowhere (no such host, engine or blocks) are refused with a 400
naming the field, as `KvTransferError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from shoal.kv import chain_hash
from shoal.openai import ApiError

log = logging.getLogger(__name__)

HOLD_SECONDS = 120.0  # blocks never fetched are dropped after this (vLLM's abort timeout)
MAX_HELD = 1_000_000  # blocks held at once; the oldest go first beyond it
MAX_FETCH_BLOCKS = 65_536
"""Blocks one fetch may name (a million tokens at 16 a block): a fetch naming more is
refused, before it is decoded, by the decode (the request's 400) and the side channel alike."""
MAX_LINE = 2 * 1024 * 1024
"""One side-channel message, in bytes: a fetch, or its answer, of `MAX_FETCH_BLOCKS` blocks
(an answer's hashes take up to 21 bytes each). A line is decoded on the event loop (msgspec
holds the GIL whichever thread decodes): 8 MiB of block ids held it ~200 ms."""
CONNECT_TIMEOUT = 2.0
FETCH_TIMEOUT = 30.0
IDLE_TIMEOUT = 30.0
"""Seconds the side channel waits for a peer's next fetch, or for it to take an answer."""
MAX_PEERS = 256
"""Side-channel connections held at once (a decode opens one per fetch); one more is closed."""


class KvTransferError(ApiError):
    """Params a decode mocker cannot act on: a 400 naming the `kv_transfer_params` field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(
            400,
            f"kv_transfer_params.{field}: {message}",
            param=f"kv_transfer_params.{field}",
            code="kv_transfer_failed",
        )


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """What a decode request's `kv_transfer_params` say: where its prefilled blocks are."""

    engine_id: str
    host: str
    port: int
    block_ids: list[int]

    @classmethod
    def of(cls, params: dict[str, Any]) -> RemotePrefill | None:
        """The remote prefill `params` name; None when they ask for none (no
        `do_remote_prefill`); `KvTransferError` naming the field when malformed."""
        if not params.get("do_remote_prefill"):
            return None
        engine_id = params.get("remote_engine_id")
        host = params.get("remote_host")
        port = params.get("remote_port")
        block_ids = params.get("remote_block_ids")
        if not isinstance(engine_id, str) or not engine_id:
            raise KvTransferError("remote_engine_id", "must name the prefill engine")
        if not isinstance(host, str) or not host:
            raise KvTransferError("remote_host", "must name the prefill engine's host")
        if type(port) is not int or not 0 < port < 65536:
            raise KvTransferError("remote_port", "must be a port number")
        if not isinstance(block_ids, list) or not all(type(b) is int for b in block_ids):
            raise KvTransferError("remote_block_ids", "must be a list of block ids")
        if len(block_ids) > MAX_FETCH_BLOCKS:
            raise KvTransferError("remote_block_ids", f"names more than {MAX_FETCH_BLOCKS} blocks")
        return cls(engine_id, host, port, block_ids)


def prompt_blocks(tokens: list[int], block_size: int) -> list[int]:
    """The chained hash of each block of `tokens`, the partial last one included (a prefill
    computes and hands off every token's KV, as vLLM's does)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(tokens), block_size):
        parent = chain_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def covered_tokens(own: list[int], fetched: list[int], prompt_len: int, block_size: int) -> int:
    """The prompt tokens whose KV the fetched blocks hold: the leading blocks that match."""
    matched = 0
    for mine, theirs in zip(own, fetched, strict=False):
        if mine != theirs:
            break
        matched += 1
    return min(matched * block_size, prompt_len)


class _Fetch(msgspec.Struct):
    engine_id: str
    block_ids: list[int]


class _Answer(msgspec.Struct, omit_defaults=True):
    hashes: list[int] = []
    error: str = ""
    field: str = ""


class HeldBlocks:
    """Blocks a prefill computed for a remote decode, by block id, until fetched or expired."""

    def __init__(self) -> None:
        self.engine_id = str(uuid.uuid4())
        self._ids = itertools.count(1)
        self._held: OrderedDict[int, tuple[float, int]] = OrderedDict()  # id → (expiry, hash)
        self.served_blocks = 0  # blocks fetched by decode mockers

    @property
    def count(self) -> int:
        """Blocks held now (expired ones included until the next hold or fetch drops them)."""
        return len(self._held)

    def hold(self, hashes: list[int]) -> list[int]:
        """Hold the blocks of `hashes`; their ids, in order."""
        self._expire()  # (a prefill whose blocks no decode fetches frees them here)
        expires = time.monotonic() + HOLD_SECONDS
        ids = [next(self._ids) for _ in hashes]
        held = self._held
        for block_id, block_hash in zip(ids, hashes, strict=True):
            held[block_id] = (expires, block_hash)
        while len(held) > MAX_HELD:
            held.popitem(last=False)
        return ids

    def take(self, block_ids: list[int]) -> list[int] | None:
        """The hashes of `block_ids`, released; None if any of them is not held, or named
        twice (nothing is taken then)."""
        self._expire()
        held = self._held
        if len(set(block_ids)) != len(block_ids) or any(b not in held for b in block_ids):
            return None
        hashes = [held.pop(b)[1] for b in block_ids]
        self.served_blocks += len(hashes)
        return hashes

    def _expire(self) -> None:
        now = time.monotonic()
        held = self._held
        while held:
            block_id, (expires, _) = next(iter(held.items()))
            if expires > now:
                return
            del held[block_id]


class KvSideChannel:
    """The prefill mocker's side channel: answers one fetch per line with the blocks' hashes."""

    def __init__(self, blocks: HeldBlocks, host: str, port: int = 0) -> None:
        self.blocks = blocks
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._peers = 0  # connections held

    @property
    def advertised_host(self) -> str:
        """The host decodes reach the side channel at (a wildcard: this machine's name)."""
        return socket.getfqdn() if self.host in ("", "0.0.0.0", "::") else self.host

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_LINE)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer each fetch line of one peer, until it leaves, sends a line over `MAX_LINE`,
        or sends nothing (or takes no answer) for `IDLE_TIMEOUT`."""
        if self._peers >= MAX_PEERS:
            writer.transport.abort()
            return
        self._peers += 1
        try:
            while True:
                async with asyncio.timeout(IDLE_TIMEOUT):
                    line = await reader.readline()
                if not line:
                    break
                try:
                    answer = self._answer(line)
                except Exception:  # (a bug here: the peer is told, the channel goes on)
                    log.exception("answering a KV fetch failed")
                    answer = _Answer(error="the fetch failed in the prefill engine")
                writer.write(msgspec.json.encode(answer) + b"\n")
                async with asyncio.timeout(IDLE_TIMEOUT):
                    await writer.drain()
        except (OSError, ValueError, TimeoutError):  # a peer gone, silent, or a line over the limit
            writer.transport.abort()  # (a close would wait for an answer it never takes)
        finally:
            self._peers -= 1
            writer.close()

    def _answer(self, line: bytes) -> _Answer:
        if _over_bound(line):
            return _Answer(
                error=f"names more than {MAX_FETCH_BLOCKS} blocks", field="remote_block_ids"
            )
        try:
            fetch = msgspec.json.decode(line, type=_Fetch)
        except msgspec.DecodeError:
            return _Answer(error="unreadable fetch", field="remote_block_ids")
        if fetch.engine_id != self.blocks.engine_id:
            return _Answer(error=f"no engine {fetch.engine_id!r} here", field="remote_engine_id")
        if len(set(fetch.block_ids)) != len(fetch.block_ids):
            return _Answer(error="a block id named twice", field="remote_block_ids")
        hashes = self.blocks.take(fetch.block_ids)
        if hashes is None:
            return _Answer(
                error="blocks not held (fetched already, expired, or never computed)",
                field="remote_block_ids",
            )
        return _Answer(hashes=hashes)


async def fetch_blocks(remote: RemotePrefill, us_per_block: float, speedup: float) -> list[int]:
    """The hashes of `remote`'s blocks, fetched from its side channel; the transfer takes
    `us_per_block` per block (divided by `speedup`). `KvTransferError` when it points nowhere."""
    where = f"{remote.host}:{remote.port}"
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            reader, writer = await asyncio.open_connection(remote.host, remote.port, limit=MAX_LINE)
    except (OSError, TimeoutError) as exc:
        raise KvTransferError(
            "remote_host", f"no prefill engine answers at {where}: {exc}"
        ) from None
    try:
        async with asyncio.timeout(FETCH_TIMEOUT):
            fetch = _Fetch(engine_id=remote.engine_id, block_ids=remote.block_ids)
            writer.write(msgspec.json.encode(fetch) + b"\n")
            line = await reader.readline()
            if _over_bound(line):
                raise ValueError(f"an answer of more than {MAX_FETCH_BLOCKS} blocks")
            answer = msgspec.json.decode(line, type=_Answer)
    except (OSError, TimeoutError, ValueError) as exc:
        raise KvTransferError("remote_host", f"the fetch from {where} failed: {exc}") from None
    finally:
        writer.close()
    if answer.error:
        raise KvTransferError(answer.field or "remote_block_ids", f"{answer.error} ({where})")
    if us_per_block and speedup:
        await asyncio.sleep(len(answer.hashes) * us_per_block / 1e6 / speedup)
    return answer.hashes


def _over_bound(line: bytes) -> bool:
    """Whether a JSON line surely holds an array of more than `MAX_FETCH_BLOCKS` elements:
    told by its commas (a scan in C) before it is decoded, with room for the few a fetch or
    an answer has besides its array's (between its fields, in an error's message)."""
    return line.count(b",") > MAX_FETCH_BLOCKS + 16
