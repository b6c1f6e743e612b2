"""`MockerEngine`: the mocker's OpenAI API and its adapters. How it runs a request's plan
(the timing of its sequences, its stage in disaggregated serving) is `Sequences`'s.

It also answers vLLM's render endpoints (`render`): a request's token ids, the ones its
prefix cache and KV events use, for routers that hash them (vllm-router's `kv_aware`).

A client disconnect cancels the handler (the runtime serves with handler cancellation),
which ends the sequence and frees its slot: `active_sequences` and the metrics show it.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client.core import Metric

from shoal.cards import ModelType, WorkerRole, slugify
from shoal.kv import KvEndpoint
from shoal.openai import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    decode_request,
    missing_parameter,
    model_not_found,
)
from shoal.urls import redact_url
from shoal.worker.engine import Engine, EngineUnavailableError, ServedModel
from shoal.worker.engines.mocker.conformance import check_request
from shoal.worker.engines.mocker.embeddings import (
    check_encoding,
    check_size,
    embed,
    embedding_inputs,
    encoded,
)
from shoal.worker.engines.mocker.framing import CHAT, COMPLETION, json_response
from shoal.worker.engines.mocker.kv_transfer import HeldBlocks, KvSideChannel
from shoal.worker.engines.mocker.metadata import write_adapter_config, write_model_files
from shoal.worker.engines.mocker.metrics import mocker_metrics
from shoal.worker.engines.mocker.plan import (
    Plan,
    context_exceeded,
    make_plan,
    split_continuation,
)
from shoal.worker.engines.mocker.prefix_cache import PrefixCache
from shoal.worker.engines.mocker.prompts import chat_echo, prompt_ids, prompt_size, single_prompt
from shoal.worker.engines.mocker.render import generate_request, render_max_tokens
from shoal.worker.engines.mocker.sequences import Sequences
from shoal.worker.engines.mocker.tokenizer import (
    INLINE_CHARS,
    check_length,
    encode,
    render_chat,
    render_chat_content,
    tokenize,
)
from shoal.worker.engines.scratch import owned_temp_dir
from shoal.worker.kv_publisher import KvEventPublisher
from shoal.worker.protocol import IdMaker, openai_errors

INLINE_MESSAGES = 256
"""Chats of more messages are rendered in a thread (a few ms per thousand messages)."""

_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_embedding_decoder = msgspec.json.Decoder(EmbeddingRequest)


FILES_PREFIX = "shoal-mocker-"  # a mocker's published files, in the temporary directory


class MockerEngine(Sequences, Engine):
    """A simulated LLM serving `name` (and fake LoRA adapters on it) over the OpenAI API."""

    def __init__(
        self,
        name: str,
        *,
        ttft_ms: float = 50.0,
        itl_ms: float = 10.0,
        max_seqs: int = 256,
        block_size: int = 16,
        kv_blocks: int = 16384,
        speedup: float = 1.0,
        context_length: int = 8192,
        embedding_dim: int = 256,
        prefill_us_per_token: float = 0.0,
        kv_events_port: int | None = None,
        kv_events_host: str = "127.0.0.1",
        kv_events_format: str = "array",
        chat_template: str | None = None,
        die_after_tokens: int | None = None,
        role: WorkerRole | str = WorkerRole.AGGREGATED,
        kv_transfer_us_per_block: float = 0.0,
        prefill_stalls_decode: bool = False,
        stream_interval: int = 1,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        if die_after_tokens is not None and (die_after_tokens < 1 or speedup == 0):
            raise ValueError("die_after_tokens must be at least 1, and needs a speedup above 0")
        if speedup < 0 or ttft_ms < 0 or itl_ms < 0 or prefill_us_per_token < 0:
            raise ValueError(
                "speedup, ttft_ms, itl_ms and prefill_us_per_token must not be negative"
            )
        if max_seqs <= 0:
            raise ValueError(f"max_seqs must be positive, got {max_seqs}")
        if kv_transfer_us_per_block < 0:
            raise ValueError("kv_transfer_us_per_block must not be negative")
        self.role = WorkerRole(role)
        self.kv_transfer_per_block_us = kv_transfer_us_per_block
        self.held = HeldBlocks()  # blocks prefilled for remote decodes (role prefill)
        self.side_channel: KvSideChannel | None = None
        if self.role is WorkerRole.PREFILL:
            self.side_channel = KvSideChannel(self.held, kv_events_host)
        self.remote_prefills = 0  # requests prefilled here for a remote decode
        self.remote_decodes = 0  # requests decoded here from a remote prefill
        self.kv_received_blocks = 0
        self.kv_fetch_seconds = 0.0  # the KV handoff wait of remote decodes, summed
        self.computed_prompt_tokens = 0  # prefilled here: neither cached nor transferred
        self.name = "mocker"
        self.model = name
        self.ttft = ttft_ms / 1000
        self.itl = itl_ms / 1000
        self.max_seqs = max_seqs
        self.speedup = speedup
        self.context_length = context_length
        self.embedding_dim = embedding_dim
        self.prefill_per_token = prefill_us_per_token / 1e6
        self._prefill = asyncio.Lock()
        self.prefill_stalls_decode = prefill_stalls_decode
        self._no_prefill = asyncio.Event()  # set while no prefill runs (decode steps go on)
        self._no_prefill.set()
        self.publisher: KvEventPublisher | None = None
        if kv_events_port is not None:
            self.publisher = KvEventPublisher(
                kv_events_host, kv_events_port, wire_format=kv_events_format
            )
        sink = None if self.publisher is None else self.publisher.record
        self.cache = PrefixCache(kv_blocks, block_size, sink)
        self.adapters: dict[str, str] = {}  # adapter name -> path it was loaded from, redacted
        self.active_sequences = 0
        self.waiting_requests = 0
        self.cancelled_sequences = 0
        self.requests: dict[str, int] = {"chat": 0, "completions": 0, "embeddings": 0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._slots = asyncio.Semaphore(max_seqs)
        self._ids = IdMaker()
        self._dir: Path | None = None
        self._served: dict[str | None, ServedModel] = {}  # as last listed, by adapter name
        self.chat_template = chat_template  # published instead of the mocker's own
        # A test hook: the process dies (SIGKILL) once a response has streamed this many tokens.
        self.die_after_tokens = die_after_tokens
        self.stream_interval = stream_interval
        """Tokens per streamed chunk (vLLM's and SGLang's `--stream-interval`): a chunk
        goes out when its last token is produced."""

    # -- Engine interface ---------------------------------------------------------------

    async def start(self) -> None:
        self._dir = owned_temp_dir(FILES_PREFIX)  # (and those of dead mockers swept)
        self._write_model_files(self._dir / "base")
        if self.publisher is not None:
            await self.publisher.start()
        if self.side_channel is not None:
            await self.side_channel.start()

    @property
    def kv_events(self) -> KvEndpoint | None:
        return None if self.publisher is None else self.publisher.endpoint

    async def stop(self) -> None:
        if self.side_channel is not None:
            await self.side_channel.close()
        if self.publisher is not None:
            await self.publisher.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/chat/completions/render", self.render_chat_completion)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/completions/render", self.render_completion)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_get("/health", self.health)
        return app

    async def served_models(self) -> list[ServedModel]:
        # The same objects while nothing changed: the runtime skips an unchanged list by
        # identity, not by comparing thousands of adapters every second.
        base = self._base_model()
        if base != self._served.get(None):
            self._served = {None: base}
        elif len(self._served) > len(self.adapters) + 1:  # unloaded ones
            self._served = {
                k: v for k, v in self._served.items() if k is None or k in self.adapters
            }
        served = [self._served[None]]
        built = 0
        for name, path in list(self.adapters.items()):
            model = self._served.get(name)
            if model is None or model.source != path:
                model = self._served[name] = self._adapter_model(name)
                built += 1
                if built % 256 == 0:  # the first listing of thousands: yield now and then
                    await asyncio.sleep(0)
            served.append(model)
        return served

    @property
    def in_flight(self) -> int:
        return self.active_sequences + self.waiting_requests

    async def load_adapter(self, name: str, path: str) -> ServedModel:
        if name == self.model or not name:
            raise ValueError(f"invalid adapter name {name!r}")
        if self._dir is None:
            raise EngineUnavailableError("the mocker is not started")
        self.adapters[name] = redact_url(path)  # (its card's source: credentials never shown)
        target = self._dir / "adapters" / slugify(name)
        self._write_model_files(target)
        write_adapter_config(target, base_model=self.model, source=path)
        return self._adapter_model(name)

    async def unload_adapter(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise KeyError(name)
        if self._dir is not None:
            shutil.rmtree(self._dir / "adapters" / slugify(name), ignore_errors=True)

    def collect_metrics(self) -> Iterable[Metric]:
        return mocker_metrics(self)

    # -- models -------------------------------------------------------------------------

    def _write_model_files(self, target: Path) -> None:
        write_model_files(
            target,
            context_length=self.context_length,
            hidden_size=self.embedding_dim,
            kv_block_size=self.cache.block_size,
            chat_template=self.chat_template,
        )

    def _base_model(self) -> ServedModel:
        return ServedModel(
            name=self.model,
            source=f"mocker://{self.model}",
            model_types=(ModelType.CHAT, ModelType.COMPLETIONS, ModelType.EMBEDDINGS),
            context_length=self.context_length,
            kv_block_size=self.cache.block_size,
            metadata_dir=None if self._dir is None else self._dir / "base",
            role=self.role,
        )

    def _adapter_model(self, name: str) -> ServedModel:
        return ServedModel(
            name=name,
            source=self.adapters[name],
            model_types=(ModelType.CHAT, ModelType.COMPLETIONS),
            context_length=self.context_length,
            kv_block_size=self.cache.block_size,
            metadata_dir=None if self._dir is None else self._dir / "adapters" / slugify(name),
            adapter=name,
            base_model=self.model,
            role=self.role,
        )

    def _check_model(self, model: str | None) -> str:
        """`model` when it is served here; a 400 when missing, a 404 when unknown."""
        if model is None:
            raise missing_parameter("model")
        if model != self.model and model not in self.adapters:
            raise model_not_found(model)
        return model

    def _names(self) -> list[str]:
        return [self.model, *self.adapters]

    def _model_object(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "shoal"}
        if name != self.model:
            obj["parent"] = self.model
        return obj

    # -- handlers -----------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = decode_request(await request.read(), _chat_decoder)
        model = self._check_model(req.model)
        check_request(req)
        prompt, carried, tokens = await self._chat_prompt(req)
        # As vLLM: `max_completion_tokens` (OpenAI's newer name) wins over `max_tokens`.
        max_tokens = (
            req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        )
        plan = self._plan(req, model, prompt, tokens, max_tokens, chat_echo(req), carried)
        handoff = self._hands_off(req)
        plan = await self._remote_prefill(req, plan)
        self.requests["chat"] += 1
        return await self._answer(
            request, plan, CHAT, stream=req.stream, usage=req.include_usage,
            continuous=req.continuous_usage, handoff=handoff,
        )  # fmt: skip

    async def _chat_prompt(self, req: ChatRequest) -> tuple[str, str, list[int]]:
        """The prompt a chat renders to, the text of the message it continues (or ""), and
        the token ids of both: what the prefix cache and the KV events of its answer use."""
        carried = continued_message(req)
        messages = req.messages[:-1] if req.continue_final_message else req.messages
        render = functools.partial(
            render_chat,
            messages,
            add_generation_prompt=req.add_generation_prompt or req.continue_final_message,
        )
        # A chat of many messages is rendered in a thread: no request holds the loop.
        many = len(req.messages) > INLINE_MESSAGES
        prompt = await asyncio.to_thread(render) if many else render()
        # The template leaves the continued message open: it ends the prompt, unterminated.
        tokens = await tokenize(prompt + carried, self.context_length, "messages")
        return prompt, carried, tokens

    async def render_chat_completion(self, request: web.Request) -> web.StreamResponse:
        """vLLM's `POST /v1/chat/completions/render`: the chat's token ids, not answered."""
        req = decode_request(await request.read(), _chat_decoder)
        model = self._check_model(req.model)
        check_request(req)
        _, _, tokens = await self._chat_prompt(req)
        asked = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        max_tokens = render_max_tokens(asked, len(tokens), self.context_length, "messages")
        return json_response(
            generate_request(self._ids("chatcmpl"), req, model, tokens, max_tokens)
        )

    async def render_completion(self, request: web.Request) -> web.StreamResponse:
        """vLLM's `POST /v1/completions/render`: a list of one request per prompt (the mocker
        takes one prompt per request), with its token ids."""
        req = decode_request(await request.read(), _completion_decoder)
        model = self._check_model(req.model)
        check_request(req)
        tokens = await self._completion_ids(req.prompt)
        max_tokens = render_max_tokens(req.max_tokens, len(tokens), self.context_length, "prompt")
        rendered = generate_request(self._ids("cmpl"), req, model, tokens, max_tokens)
        return json_response([rendered])

    async def _completion_ids(self, prompt: str | list[Any]) -> list[int]:
        """The token ids of a completions prompt: given as ids, or its text tokenized."""
        if prompt_size(prompt) > self.context_length:  # before looking at each id
            raise context_exceeded(self.context_length, prompt_size(prompt), "prompt")
        token_ids = prompt_ids(prompt)
        if token_ids is None:
            return await tokenize(single_prompt(prompt), self.context_length, "prompt")
        if len(token_ids) > self.context_length:
            raise context_exceeded(self.context_length, len(token_ids), "prompt")
        return token_ids

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = decode_request(await request.read(), _completion_decoder)
        model = self._check_model(req.model)
        check_request(req)
        if prompt_size(req.prompt) > self.context_length:  # before looking at each id
            raise context_exceeded(self.context_length, prompt_size(req.prompt), "prompt")
        token_ids = prompt_ids(req.prompt)
        if token_ids is not None and len(token_ids) > self.context_length:
            raise context_exceeded(self.context_length, len(token_ids), "prompt")
        prompt = single_prompt(req.prompt)
        carried = ""
        if token_ids is None:
            token_ids = await tokenize(prompt, self.context_length, "prompt")
            name = model if model != self.model else ""
            prompt, carried = split_continuation(name, req.seed, prompt)
        tokens = token_ids
        echo = prompt + carried if req.echo else ""
        plan = self._plan(req, model, prompt, tokens, req.max_tokens, echo, carried)
        handoff = self._hands_off(req)
        plan = await self._remote_prefill(req, plan)
        self.requests["completions"] += 1
        return await self._answer(
            request, plan, COMPLETION, stream=req.stream, usage=req.include_usage,
            continuous=req.continuous_usage, handoff=handoff,
        )  # fmt: skip

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        req = decode_request(await request.read(), _embedding_decoder)
        if req.model != self.model:
            raise model_not_found(req.model)
        check_encoding(req.encoding_format)
        inputs = embedding_inputs(req.input)
        dims = req.dimensions or self.embedding_dim
        check_size(inputs, dims, self.embedding_dim)
        for text in inputs:
            check_length(text, self.context_length, "input")
        work = sum(map(len, inputs)) + len(inputs) * dims
        if work <= INLINE_CHARS:
            data, tokens = self._embed(inputs, dims, req.encoding_format)
        else:  # bounded above, but too long for the event loop
            data, tokens = await asyncio.to_thread(self._embed, inputs, dims, req.encoding_format)
        self.requests["embeddings"] += 1
        self.prompt_tokens += tokens
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return json_response({"object": "list", "data": data, "model": req.model, "usage": usage})

    def _embed(
        self, inputs: list[str], dims: int, encoding_format: str
    ) -> tuple[list[dict[str, Any]], int]:
        """The embedding of each input, and their tokens counted; no input over the context."""
        data = []
        tokens = 0
        for i, text in enumerate(inputs):
            count = len(encode(text)) or 1
            if count > self.context_length:
                raise context_exceeded(self.context_length, count, "input")
            tokens += count
            value = encoded(embed(text, dims), encoding_format)
            data.append({"object": "embedding", "index": i, "embedding": value})
        return data, tokens

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        models = [self._model_object(m) for m in self._names()]
        return json_response({"object": "list", "data": models})

    async def get_model(self, request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        self._check_model(model)
        return json_response(self._model_object(model))

    async def health(self, request: web.Request) -> web.StreamResponse:
        return json_response({"status": "ok"})

    def _plan(
        self,
        req: ChatRequest | CompletionRequest,
        model: str,
        prompt: str,
        tokens: list[int],
        max_tokens: int | None,
        echo: str,
        carried: str = "",
    ) -> Plan:
        return make_plan(
            req,
            model,
            prompt,
            tokens,
            max_tokens=max_tokens,
            echo=echo,
            base_model=self.model,
            context_length=self.context_length,
            carried=carried,
        )


def continued_message(req: ChatRequest) -> str:
    """With `continue_final_message`, the text of the last message (the assistant's), which
    the answer continues; else "". A 400 as vLLM's when the request cannot be continued."""
    if not req.continue_final_message:
        return ""
    if req.add_generation_prompt:
        raise ApiError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to true.",
            param="continue_final_message",
        )
    last = req.messages[-1]
    if last.role != "assistant":
        raise ApiError(
            400,
            "`continue_final_message` needs the last message to be the assistant's.",
            param="messages",
        )
    return render_chat_content(last.content)
