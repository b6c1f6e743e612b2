"""`Sequences`: how the mocker runs a request's plan and answers it: the timing of its
sequences, and its stage in disaggregated serving.

A sequence waits for one of `max_seqs` slots, then its first token comes after `ttft_ms`
scaled by the share of the prompt not found in the simulated prefix cache, and each next
token after `itl_ms`; all times are divided by `speedup`. With `prefill_us_per_token`, the
first token instead waits for the prefill of the uncached prompt tokens (`ttft_ms` is then
unused), one prefill at a time (as a GPU's compute is shared), which makes a prefix cache
hit as valuable as it is on a real engine. With `prefill_stalls_decode` too, a prefill
stalls the decode steps of every other sequence of the worker for its duration (an engine
that runs prefill and decode on one GPU). `speedup=0` answers at once on a path kept as
cheap as possible (no queue, no cache), for measuring gateway overhead.

With `role` prefill or decode it is one stage of disaggregated serving (`kv_transfer`): a
prefill answers `kv_transfer_params.do_remote_decode` with the params of the blocks it holds
for the decode; a decode given `do_remote_prefill` params fetches those blocks first and
spends no prefill on the tokens they cover.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import time
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from shoal.cards import WorkerRole
from shoal.openai import SSE_DONE, SSE_HEADERS, ApiError, ChatRequest, CompletionRequest
from shoal.worker.engines.mocker.framing import AnswerKind, Chunks, whole_answer
from shoal.worker.engines.mocker.kv_transfer import (
    HeldBlocks,
    KvSideChannel,
    RemotePrefill,
    covered_tokens,
    fetch_blocks,
    prompt_blocks,
)
from shoal.worker.engines.mocker.plan import Plan
from shoal.worker.engines.mocker.prefix_cache import PrefixCache
from shoal.worker.protocol import IdMaker


class Sequences:
    """The sequences of a `MockerEngine`: a plan run in a slot, timed, and answered whole or
    streamed; the KV handoff of a prefill or decode stage. `MockerEngine` builds and owns
    the state they read, declared here."""

    role: WorkerRole
    speedup: float
    ttft: float  # seconds
    itl: float  # seconds
    prefill_per_token: float  # seconds
    prefill_stalls_decode: bool
    stream_interval: int
    die_after_tokens: int | None
    cache: PrefixCache
    held: HeldBlocks
    side_channel: KvSideChannel | None
    kv_transfer_per_block_us: float
    _ids: IdMaker
    _slots: asyncio.Semaphore
    _prefill: asyncio.Lock
    _no_prefill: asyncio.Event
    # counted for the metrics
    active_sequences: int
    waiting_requests: int
    cancelled_sequences: int
    prompt_tokens: int
    computed_prompt_tokens: int
    generation_tokens: int
    remote_prefills: int
    remote_decodes: int
    kv_received_blocks: int
    kv_fetch_seconds: float

    def _hands_off(self, req: ChatRequest | CompletionRequest) -> bool:
        """Whether this prefill mocker is asked to hold the prompt's KV for a remote decode."""
        params = req.kv_transfer_params
        if not params or params.get("do_remote_decode") is not True:
            return False
        if self.side_channel is None:
            raise ApiError(
                400,
                f"kv_transfer_params.do_remote_decode: this worker's role is {self.role}, "
                "not prefill: it hands off no KV cache.",
                param="kv_transfer_params.do_remote_decode",
            )
        if req.stream:
            raise ApiError(
                400,
                "kv_transfer_params.do_remote_decode needs a whole answer: set stream to false.",
                param="stream",
            )
        return True

    async def _remote_prefill(self, req: ChatRequest | CompletionRequest, plan: Plan) -> Plan:
        """A request prefilled elsewhere: fetch its blocks, so its prefill costs nothing here."""
        remote = RemotePrefill.of(req.kv_transfer_params or {})
        if remote is None:
            return plan
        started = time.perf_counter()
        hashes = await fetch_blocks(remote, self.kv_transfer_per_block_us, self.speedup)
        self.kv_fetch_seconds += time.perf_counter() - started
        size = self.cache.block_size
        tokens = plan.prompt_tokens
        covered = covered_tokens(prompt_blocks(tokens, size), hashes, len(tokens), size)
        self.remote_decodes += 1
        self.kv_received_blocks += len(hashes)
        return dataclasses.replace(plan, transferred=covered)

    def _handoff_params(self, plan: Plan) -> dict[str, Any]:
        """Hold the prompt's blocks for a remote decode; the params that name them."""
        assert self.side_channel is not None
        block_ids = self.held.hold(prompt_blocks(plan.prompt_tokens, self.cache.block_size))
        self.remote_prefills += 1
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_engine_id": self.held.engine_id,
            "remote_host": self.side_channel.advertised_host,
            "remote_port": self.side_channel.port,
            "tp_size": 1,
        }

    async def _answer(
        self,
        request: web.Request,
        plan: Plan,
        kind: AnswerKind,
        *,
        stream: bool,
        usage: bool,
        continuous: bool = False,
        handoff: bool = False,
    ) -> web.StreamResponse:
        """Simulate `plan` and answer it, streamed (every chunk with the usage so far when
        `continuous`) or whole (with the handoff's params)."""
        if stream:
            return await self._stream(request, plan, kind, usage, continuous)
        await self._run_to_end(plan)
        extra = {"kv_transfer_params": self._handoff_params(plan)} if handoff else None
        return whole_answer(
            kind, self._ids, plan.model, plan.text, plan.finish_reason, plan.usage, extra
        )

    # -- simulation ---------------------------------------------------------------------

    async def _run_to_end(self, plan: Plan) -> None:
        """Simulate a whole sequence for a non-streaming answer."""
        if self.speedup == 0:
            self._count(plan)
            return
        async with contextlib.aclosing(self._produce(plan, stream=False)) as tokens:
            async for _ in tokens:
                pass

    def _count(self, plan: Plan) -> None:
        self.prompt_tokens += len(plan.prompt_tokens)
        self.computed_prompt_tokens += len(plan.prompt_tokens) - plan.transferred
        self.generation_tokens += len(plan.pieces)

    async def _produce(self, plan: Plan, *, stream: bool) -> AsyncGenerator[str, None]:
        """Yield each piece when the simulated engine would have produced it."""
        self.waiting_requests += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting_requests -= 1
        prompt_len = len(plan.prompt_tokens)
        blocks = math.ceil((prompt_len + len(plan.pieces)) / self.cache.block_size)
        self.active_sequences += 1
        self.cache.blocks_in_use += blocks
        finished = False
        try:
            cached = self.cache.admit(
                self.cache.block_hashes(plan.prompt_tokens), plan.prompt_tokens
            )
            cached = max(cached, plan.transferred)
            self.computed_prompt_tokens += prompt_len - cached
            loop = asyncio.get_running_loop()
            if self.prefill_per_token:
                await self._run_prefill(prompt_len - cached)
                first = 0.0  # the prefill produced the first token
            else:
                uncached = max(prompt_len - cached, 1) / max(prompt_len, 1)
                first = self.ttft * uncached / self.speedup
            start = loop.time()
            step = self.itl / self.speedup
            self.prompt_tokens += prompt_len
            if not stream:
                if (die := self.die_after_tokens) is not None and len(plan.pieces) >= die:
                    await asyncio.sleep(first + step * (die - 1))
                    _die()
                await asyncio.sleep(first + step * max(len(plan.pieces) - 1, 0))
                self.generation_tokens += len(plan.pieces)
                finished = True
                return
            for i, piece in enumerate(plan.pieces):
                delay = start + first + step * i - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.prefill_stalls_decode and not self._no_prefill.is_set():
                    stalled = loop.time()
                    await self._no_prefill.wait()  # another sequence's prefill holds the GPU
                    start += loop.time() - stalled
                self.generation_tokens += 1
                yield piece
            finished = True
        finally:
            if not finished:
                self.cancelled_sequences += 1
            self.cache.blocks_in_use -= blocks
            self.active_sequences -= 1
            self._slots.release()

    async def _run_prefill(self, tokens: int) -> None:
        """Compute `tokens` uncached prompt tokens; prefills run one at a time."""
        if tokens <= 0:
            return
        async with self._prefill:
            self._no_prefill.clear()
            try:
                await asyncio.sleep(tokens * self.prefill_per_token / self.speedup)
            finally:
                self._no_prefill.set()

    async def _stream(
        self, request: web.Request, plan: Plan, kind: AnswerKind, usage: bool, continuous: bool
    ) -> web.StreamResponse:
        chunks = Chunks(kind, self._ids, plan.model, usage, len(plan.prompt_tokens))
        interval = self.stream_interval
        if self.speedup == 0:
            # Every event at once, in one plain response: the cheapest stream to send.
            self._count(plan)
            body = [chunks.first()]
            streamed = plan.streamed_pieces()
            for at in range(0, len(streamed), interval):
                text = "".join(streamed[at : at + interval])
                sent = min(at + interval, len(streamed))
                body.append(chunks.piece(text, sent if continuous else None))
            body.append(chunks.last(plan.finish_reason))
            if usage:
                body.append(chunks.usage(plan.usage))
            body.append(SSE_DONE)
            return web.Response(body=b"".join(body), headers=SSE_HEADERS)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        if first := chunks.first():
            await response.write(first)
        text = plan.echo  # sent with the first piece, as vLLM sends the prompt
        die = self.die_after_tokens
        held = sent = 0  # tokens produced and not sent yet; tokens sent
        async with contextlib.aclosing(self._produce(plan, stream=True)) as pieces:
            async for piece in pieces:
                text += piece
                held += 1
                if held < interval:
                    continue
                sent += held
                await response.write(chunks.piece(text, sent if continuous else None))
                text, held = "", 0
                if die is not None and sent >= die:
                    _die()
        if text or held:
            sent += held
            await response.write(chunks.piece(text, sent if continuous else None))
        await response.write(chunks.last(plan.finish_reason))
        if usage:
            await response.write(chunks.usage(plan.usage))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response


def _die() -> None:
    """`die_after_tokens`: end the process as SIGKILL does, with no cleanup at all."""
    os.kill(os.getpid(), signal.SIGKILL)
