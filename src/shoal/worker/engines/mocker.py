"""`MockerEngine`: a simulated LLM with no weights, for tests, demos and benchmarks.

Text is derived from a hash of the prompt, so the same request always gets the same
answer. Timing follows a simple model: a sequence waits for one of `max_seqs` slots, then
its first token comes after `ttft_ms` scaled by the share of the prompt not found in the
simulated prefix cache, and each next token after `itl_ms`; all times are divided by
`speedup`. With `prefill_us_per_token`, the first token instead waits for the prefill of
the uncached prompt tokens (`ttft_ms` is then unused), one prefill at a time (as a GPU's
compute is shared), which makes a prefix cache hit as valuable as it is on a real engine.

Prompts are tokenized with a real `tokenizers` model (`mocker_tokenizer`), published as
`tokenizer.json` with the chat template in `tokenizer_config.json`; with `kv_events_port`
set, every block the prefix cache stores or evicts is published in vLLM's KV event format. `speedup=0` answers at once on a path kept as cheap as possible (no queue,
no cache), for measuring gateway overhead.

A client disconnect cancels the handler (the runtime serves with handler cancellation),
which ends the sequence and frees its slot: `active_sequences` and the metrics show it.
"""

from __future__ import annotations

import array
import asyncio
import base64
import bisect
import contextlib
import hashlib
import itertools
import json
import math
import re
import shutil
import sys
import tempfile
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shoal.cards import ModelType, slugify
from shoal.kv import KvEndpoint
from shoal.worker.engine import Engine, EngineUnavailableError, ServedModel
from shoal.worker.engines.mocker_tokenizer import build_tokenizer, tokenizer_json
from shoal.worker.engines.prefix_cache import PrefixCache
from shoal.worker.kv_publisher import KvEventPublisher
from shoal.worker.protocol import (
    SSE_DONE,
    SSE_HEADERS,
    IdMaker,
    OpenAIError,
    decode_request,
    model_not_found,
    now,
    openai_errors,
)

# -- requests ---------------------------------------------------------------------------
#
# The mocker stands in for vLLM, so every field that would change a real answer either
# behaves as vLLM's does (`stop`, `seed`, `echo`, `ignore_eos`, `include_stop_str_in_output`,
# `max_tokens`) or is refused with a 400 naming it (`unsupported()`). Sampling parameters
# are checked for type and range (OpenAI's) and leave the synthetic text as it is.

Positive = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
"""vLLM's guided decoding fields: the mocker cannot constrain its text."""


class _Generation(msgspec.Struct, kw_only=True):
    """The fields chat and text completions share."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Positive | None = None
    stop: str | list[str] | None = None
    n: int = 1
    seed: int | None = None
    echo: bool = False
    temperature: Temperature | None = None
    top_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Refused when set to anything that would change the answer (see `unsupported`).
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    def unsupported(self) -> str | None:
        """The first field set to something the mocker cannot honour, if any."""
        if self.n != 1:
            return "n"
        if self.logit_bias:
            return "logit_bias"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format"
        if self.min_tokens:
            return "min_tokens"
        if self.stop_token_ids:
            return "stop_token_ids"
        if self.bad_words:
            return "bad_words"
        if self.prompt_logprobs is not None:
            return "prompt_logprobs"
        for name in _GUIDED:
            if getattr(self, name) is not None:
                return name
        return None


class ChatRequest(_Generation, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs"
        if self.top_logprobs:
            return "top_logprobs"
        if self.tools and self.tool_choice != "none":
            return "tools"
        if self.functions and self.function_call != "none":
            return "functions"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"
        if self.function_call not in (None, "none", "auto"):
            return "function_call"
        if self.audio is not None:
            return "audio"
        return super().unsupported()


class CompletionRequest(_Generation, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.logprobs is not None:
            return "logprobs"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1):
            return "best_of"
        return super().unsupported()


def check_request(req: _Generation) -> None:
    """Refuse, as vLLM does, what the mocker cannot answer faithfully; the 400 names the field."""
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(
            400,
            "stream_options is only allowed when stream is true.",
            param="stream_options",
        )
    field = req.unsupported()
    if field is not None:
        raise OpenAIError(
            400,
            f"The mocker does not support `{field}` as given: it would change the answer, "
            "and the mocker cannot honour it.",
            param=field,
            code="unsupported_parameter",
        )


class EmbeddingRequest(msgspec.Struct):
    model: str
    input: str | list[Any]
    dimensions: Annotated[int, msgspec.Meta(ge=1, le=8192)] | None = None
    encoding_format: str = "float"


_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_embedding_decoder = msgspec.json.Decoder(EmbeddingRequest)
_encode = msgspec.json.Encoder().encode

# -- text -------------------------------------------------------------------------------

_WORDS = (
    "the of and to in is that it for was on are as with his they at be this from have or "
    "by one had not but what all were when we there can an your which their said if do will "
    "each about how up out them then she many some so these would other into has more her two "
    "like him see time could no make than first been its who now people my made over did down "
    "only way find use may water long little very after words called just where most know get "
    "through back much go good new write our me man too any day same right look think also "
    "around another came come work three word must because does part even place well such here "
    "take why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read last "
    "never us left end along while might next sound below saw something thought both few those "
    "always looked show large often together asked house world going want school important until "
    "form food keep children feet land side without boy once animals life enough took sometimes "
    "four head above kind began almost live page got earth need far hand high year mother light "
    "parts country father let night following picture being study second eyes soon times story"
)
_VOCAB = _WORDS.split()
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407
_MASK = (1 << 64) - 1

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def tokenize(text: str) -> list[str]:
    """The mocker's word split: words and punctuation marks (the tokenizer's pre-tokens)."""
    return _TOKEN_RE.findall(text)


TOKENIZER = build_tokenizer(_VOCAB)


def encode(text: str) -> list[int]:
    """The token ids of `text`, as the published `tokenizer.json` gives them."""
    return list(TOKENIZER.encode(text, add_special_tokens=False).ids)


def render_chat(messages: Iterable[ChatMessage]) -> str:
    """The prompt a chat becomes, as `CHAT_TEMPLATE` renders it."""
    parts = [f"<|{m.role}|>\n{render_chat_content(m.content)}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def render_chat_content(content: str | list[dict[str, Any]] | None) -> str:
    """A message's content as text: content parts (`[{"type": "text", ...}]`) joined."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content or ""


def _seed(*parts: object) -> int:
    digest = hashlib.blake2b("\x1e".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def generate(seed: int, count: int) -> list[str]:
    """`count` deterministic word pieces (`"word"`, `" word"`, ...) from `seed`."""
    pieces = []
    x = seed
    vocab, size = _VOCAB, len(_VOCAB)
    for i in range(count):
        x = (x * _LCG_A + _LCG_C) & _MASK
        word = vocab[(x >> 33) % size]
        pieces.append(word if i == 0 else " " + word)
    return pieces


def apply_stop(
    pieces: list[str], stop: list[str], *, include: bool = False
) -> tuple[list[str], bool]:
    """Cut the text at the first stop string completed; returns the pieces kept and whether
    one was.

    As an engine checks the stop strings after each token, the stop string completed by
    the earliest piece wins (the first listed on a tie), and every piece up to the one
    that completed it counts as generated: it is kept, truncated, possibly to "". The
    text ends before the stop string, or after it with `include` (vLLM's
    `include_stop_str_in_output`).
    """
    text = "".join(pieces)
    ends = list(itertools.accumulate(map(len, pieces)))
    best: tuple[int, int] | None = None  # (index of the completing piece, where the text ends)
    for s in stop:
        start = text.find(s) if s else -1
        if start < 0:
            continue
        last = bisect.bisect_left(ends, start + len(s))
        if best is None or last < best[0]:
            best = (last, start + len(s) if include else start)
    if best is None:
        return pieces, False
    last, cut = best
    starts = [0, *ends[:last]]
    kept = [piece[: max(cut - start, 0)] for piece, start in zip(pieces, starts, strict=False)]
    return kept, True


def embed(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for `text`."""
    raw = hashlib.shake_128(text.encode()).digest(dimensions * 2)
    values = array.array("H", raw)
    vec = [v / 32767.5 - 1.0 for v in values]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


# -- the engine -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one request will produce, worked out before any waiting."""

    model: str
    prompt_tokens: list[int]
    pieces: list[str]
    finish_reason: str
    echo: str = ""
    """Text the answer starts with before the generated pieces (`echo`), not counted."""

    @property
    def text(self) -> str:
        return self.echo + "".join(self.pieces)

    def streamed_pieces(self) -> list[str]:
        """The text of each streamed chunk: the echo goes with the first piece."""
        if not self.echo:
            return self.pieces
        first = self.pieces[0] if self.pieces else ""
        return [self.echo + first, *self.pieces[1:]]

    @property
    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_tokens), len(self.pieces)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class MockerEngine(Engine):
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
    ) -> None:
        if speedup < 0 or ttft_ms < 0 or itl_ms < 0 or prefill_us_per_token < 0:
            raise ValueError(
                "speedup, ttft_ms, itl_ms and prefill_us_per_token must not be negative"
            )
        if max_seqs <= 0:
            raise ValueError(f"max_seqs must be positive, got {max_seqs}")
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
        self.publisher: KvEventPublisher | None = None
        if kv_events_port is not None:
            self.publisher = KvEventPublisher(kv_events_host, kv_events_port)
        sink = None if self.publisher is None else self.publisher.record
        self.cache = PrefixCache(kv_blocks, block_size, sink)
        self.adapters: dict[str, str] = {}  # adapter name -> path it was loaded from
        self.active_sequences = 0
        self.waiting_requests = 0
        self.cancelled_sequences = 0
        self.requests: dict[str, int] = {"chat": 0, "completions": 0, "embeddings": 0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._slots = asyncio.Semaphore(max_seqs)
        self._ids = IdMaker()
        self._dir: Path | None = None
        self._model_json = _encode(name)

    # -- Engine interface ---------------------------------------------------------------

    async def start(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="shoal-mocker-"))
        self._write_metadata(self._dir / "base")
        if self.publisher is not None:
            await self.publisher.start()

    @property
    def kv_events(self) -> KvEndpoint | None:
        return None if self.publisher is None else self.publisher.endpoint

    async def stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[openai_errors], client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_get("/health", self.health)
        return app

    async def served_models(self) -> list[ServedModel]:
        base = self._base_model()
        return [base, *(self._adapter_model(name) for name in self.adapters)]

    @property
    def in_flight(self) -> int:
        return self.active_sequences + self.waiting_requests

    async def load_adapter(self, name: str, path: str) -> ServedModel:
        if name == self.model or not name:
            raise ValueError(f"invalid adapter name {name!r}")
        if self._dir is None:
            raise EngineUnavailableError("the mocker is not started")
        self.adapters[name] = path
        target = self._dir / "adapters" / slugify(name)
        self._write_metadata(target)
        (target / "adapter_config.json").write_text(
            json.dumps(
                {
                    "base_model_name_or_path": self.model,
                    "peft_type": "LORA",
                    "r": 8,
                    "lora_alpha": 16,
                    "target_modules": ["q_proj", "v_proj"],
                    "source": path,
                },
                indent=2,
            )
        )
        return self._adapter_model(name)

    async def unload_adapter(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise KeyError(name)
        if self._dir is not None:
            shutil.rmtree(self._dir / "adapters" / slugify(name), ignore_errors=True)

    def collect_metrics(self) -> Iterable[Metric]:
        labels = ["model"]
        value = [self.model]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge(
            "shoal_mocker_active_sequences", "Sequences holding a slot.", self.active_sequences
        )
        yield gauge(
            "shoal_mocker_waiting_requests", "Requests queued for a slot.", self.waiting_requests
        )
        yield gauge("shoal_mocker_max_sequences", "Concurrent sequence slots.", self.max_seqs)
        yield gauge(
            "shoal_mocker_kv_blocks_total", "Simulated KV cache blocks.", self.cache.capacity
        )
        yield gauge(
            "shoal_mocker_kv_blocks_used",
            "KV blocks held by running sequences.",
            self.cache.blocks_in_use,
        )
        yield gauge("shoal_mocker_kv_usage_ratio", "Share of KV blocks in use.", self.cache.usage)
        yield gauge(
            "shoal_mocker_prefix_cache_blocks", "Block hashes in the prefix cache.", len(self.cache)
        )
        yield counter(
            "shoal_mocker_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache.",
            self.cache.queried_tokens,
        )
        yield counter(
            "shoal_mocker_prefix_cache_hits_tokens",
            "Prompt tokens found in the prefix cache.",
            self.cache.hit_tokens,
        )
        yield counter("shoal_mocker_prompt_tokens", "Prompt tokens processed.", self.prompt_tokens)
        yield counter("shoal_mocker_generation_tokens", "Tokens generated.", self.generation_tokens)
        yield counter(
            "shoal_mocker_cancelled_sequences",
            "Sequences ended by a client disconnect.",
            self.cancelled_sequences,
        )
        requests = CounterMetricFamily(
            "shoal_mocker_requests", "Requests by kind.", labels=["model", "kind"]
        )
        for kind, n in self.requests.items():
            requests.add_metric([self.model, kind], n)
        yield requests

    # -- metadata -----------------------------------------------------------------------

    def _write_metadata(self, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        config = {
            "architectures": ["MockerForCausalLM"],
            "model_type": "mocker",
            "max_position_embeddings": self.context_length,
            "vocab_size": len(_VOCAB),
            "hidden_size": self.embedding_dim,
            "kv_block_size": self.cache.block_size,
        }
        tokenizer = {
            "model_max_length": self.context_length,
            "bos_token": "<|begin|>",
            "eos_token": "<|end|>",
            "unk_token": "[UNK]",
            "chat_template": CHAT_TEMPLATE,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        (target / "config.json").write_text(json.dumps(config, indent=2))
        (target / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=2))
        (target / "tokenizer.json").write_text(tokenizer_json(tuple(_VOCAB)))

    def _base_model(self) -> ServedModel:
        return ServedModel(
            name=self.model,
            source=f"mocker://{self.model}",
            model_types=(ModelType.CHAT, ModelType.COMPLETIONS, ModelType.EMBEDDINGS),
            context_length=self.context_length,
            kv_block_size=self.cache.block_size,
            metadata_dir=None if self._dir is None else self._dir / "base",
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
        )

    # -- handlers -----------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.model and model not in self.adapters:
            raise model_not_found(model)

    def _plan(
        self,
        req: _Generation,
        prompt: str,
        tokens: list[int],
        max_tokens: int | None,
        echo: str = "",
    ) -> _Plan:
        """What `req` will produce for `prompt` (its `tokens`), worked out up front."""
        if len(tokens) > self.context_length:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.context_length} tokens; "
                f"the prompt has {len(tokens)}.",
                param="messages",
                code="context_length_exceeded",
            )
        room = self.context_length - len(tokens)
        model = req.model
        seed = "" if req.seed is None else req.seed
        seed_value = _seed(model if model != self.model else "", seed, prompt)
        if max_tokens is None and req.ignore_eos:
            count, finish = room, "length"  # never an end of sequence: up to the context
        elif max_tokens is None:
            count, finish = min(16 + seed_value % 113, room), "stop"
        elif max_tokens > room:
            raise OpenAIError(
                400,
                f"max_tokens {max_tokens} plus the prompt's {len(tokens)} tokens exceeds the "
                f"context length {self.context_length}.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        else:
            count, finish = max_tokens, "length"
        pieces = generate(seed_value, count)
        stop = req.stop
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            pieces, hit = apply_stop(pieces, stops, include=req.include_stop_str_in_output)
            if hit:
                finish = "stop"
        return _Plan(model, tokens, pieces, finish, echo)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = decode_request(await request.read(), _chat_decoder)
        self._check_model(req.model)
        check_request(req)
        prompt = render_chat(req.messages)
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        plan = self._plan(req, prompt, encode(prompt), max_tokens, _chat_echo(req))
        self.requests["chat"] += 1
        usage = req.stream_options is not None and req.stream_options.include_usage
        if req.stream:
            return await self._stream(request, plan, _ChatChunks, usage)
        await self._run_to_end(plan)
        return _json(
            {
                "id": self._ids("chatcmpl"),
                "object": "chat.completion",
                "created": now(),
                "model": plan.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": plan.text},
                        "logprobs": None,
                        "finish_reason": plan.finish_reason,
                    }
                ],
                "usage": plan.usage,
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = decode_request(await request.read(), _completion_decoder)
        self._check_model(req.model)
        check_request(req)
        prompt = _single_prompt(req.prompt)
        token_ids = _prompt_ids(req.prompt)
        tokens = encode(prompt) if token_ids is None else token_ids
        plan = self._plan(req, prompt, tokens, req.max_tokens, prompt if req.echo else "")
        self.requests["completions"] += 1
        usage = req.stream_options is not None and req.stream_options.include_usage
        if req.stream:
            return await self._stream(request, plan, _CompletionChunks, usage)
        await self._run_to_end(plan)
        return _json(
            {
                "id": self._ids("cmpl"),
                "object": "text_completion",
                "created": now(),
                "model": plan.model,
                "choices": [
                    {
                        "index": 0,
                        "text": plan.text,
                        "logprobs": None,
                        "finish_reason": plan.finish_reason,
                    }
                ],
                "usage": plan.usage,
            }
        )

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        req = decode_request(await request.read(), _embedding_decoder)
        if req.model != self.model:
            raise model_not_found(req.model)
        if req.encoding_format not in ("float", "base64"):
            raise OpenAIError(
                400, "encoding_format must be 'float' or 'base64'.", param="encoding_format"
            )
        inputs = _embedding_inputs(req.input)
        dims = req.dimensions or self.embedding_dim
        data = []
        tokens = 0
        for i, text in enumerate(inputs):
            tokens += len(encode(text)) or 1
            vec = embed(text, dims)
            value: list[float] | str = vec
            if req.encoding_format == "base64":
                packed = array.array("f", vec)
                if sys.byteorder != "little":
                    packed.byteswap()
                value = base64.b64encode(packed.tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        self.requests["embeddings"] += 1
        self.prompt_tokens += tokens
        return _json(
            {
                "object": "list",
                "data": data,
                "model": req.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        return _json({"object": "list", "data": [self._model_object(m) for m in self._names()]})

    async def get_model(self, request: web.Request) -> web.StreamResponse:
        model = request.match_info["model"]
        self._check_model(model)
        return _json(self._model_object(model))

    async def health(self, request: web.Request) -> web.StreamResponse:
        return _json({"status": "ok"})

    def _names(self) -> list[str]:
        return [self.model, *self.adapters]

    def _model_object(self, name: str) -> dict[str, Any]:
        obj: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "shoal"}
        if name != self.model:
            obj["parent"] = self.model
        return obj

    # -- simulation ---------------------------------------------------------------------

    async def _run_to_end(self, plan: _Plan) -> None:
        """Simulate a whole sequence for a non-streaming answer."""
        if self.speedup == 0:
            self._count(plan)
            return
        async with contextlib.aclosing(self._produce(plan, stream=False)) as tokens:
            async for _ in tokens:
                pass

    def _count(self, plan: _Plan) -> None:
        self.prompt_tokens += len(plan.prompt_tokens)
        self.generation_tokens += len(plan.pieces)

    async def _produce(self, plan: _Plan, *, stream: bool) -> AsyncGenerator[str, None]:
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
                await asyncio.sleep(first + step * max(len(plan.pieces) - 1, 0))
                self.generation_tokens += len(plan.pieces)
                finished = True
                return
            for i, piece in enumerate(plan.pieces):
                delay = start + first + step * i - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
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
        async with self._prefill:
            await asyncio.sleep(tokens * self.prefill_per_token / self.speedup)

    async def _stream(
        self, request: web.Request, plan: _Plan, chunks: type[_Chunks], usage: bool
    ) -> web.StreamResponse:
        fmt = chunks(self._ids, plan.model, usage)
        if self.speedup == 0:
            # Every event at once, in one plain response: the cheapest stream to send.
            self._count(plan)
            body = [fmt.first()]
            body.extend(fmt.piece(p) for p in plan.streamed_pieces())
            body.append(fmt.last(plan.finish_reason))
            if usage:
                body.append(fmt.usage(plan.usage))
            body.append(SSE_DONE)
            return web.Response(body=b"".join(body), headers=SSE_HEADERS)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        if first := fmt.first():
            await response.write(first)
        echo = plan.echo  # sent with the first piece, as vLLM sends the prompt
        async with contextlib.aclosing(self._produce(plan, stream=True)) as pieces:
            async for piece in pieces:
                await response.write(fmt.piece(echo + piece if echo else piece))
                echo = ""
        if echo:
            await response.write(fmt.piece(echo))
        await response.write(fmt.last(plan.finish_reason))
        if usage:
            await response.write(fmt.usage(plan.usage))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response


# -- SSE chunks, pre-encoded per request --------------------------------------------------


class _Chunks:
    """Builds the `data: {...}` lines of one streamed answer from pre-encoded parts."""

    kind = ""
    obj = ""

    def __init__(self, ids: IdMaker, model: str, usage: bool) -> None:
        head = {"id": ids(self.kind), "object": self.obj, "created": now(), "model": model}
        self.head = b"data: " + _encode(head)[:-1] + b',"choices":['
        self.tail = b'],"usage":null}\n\n' if usage else b"]}\n\n"
        self.usage_head = b"data: " + _encode(head)[:-1] + b',"choices":[],"usage":'

    def usage(self, usage: dict[str, int]) -> bytes:
        return self.usage_head + _encode(usage) + b"}\n\n"

    def first(self) -> bytes:
        raise NotImplementedError

    def piece(self, text: str) -> bytes:
        raise NotImplementedError

    def last(self, finish_reason: str) -> bytes:
        raise NotImplementedError


class _ChatChunks(_Chunks):
    kind = "chatcmpl"
    obj = "chat.completion.chunk"

    def first(self) -> bytes:
        return (
            self.head
            + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}'
            + self.tail
        )

    def piece(self, text: str) -> bytes:
        return (
            self.head
            + b'{"index":0,"delta":{"content":'
            + _encode(text)
            + b'},"logprobs":null,"finish_reason":null}'
            + self.tail
        )

    def last(self, finish_reason: str) -> bytes:
        return (
            self.head
            + b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"'
            + finish_reason.encode()
            + b'"}'
            + self.tail
        )


class _CompletionChunks(_Chunks):
    kind = "cmpl"
    obj = "text_completion"

    def first(self) -> bytes:
        return b""

    def piece(self, text: str) -> bytes:
        return (
            self.head
            + b'{"index":0,"text":'
            + _encode(text)
            + b',"logprobs":null,"finish_reason":null}'
            + self.tail
        )

    def last(self, finish_reason: str) -> bytes:
        return (
            self.head
            + b'{"index":0,"text":"","logprobs":null,"finish_reason":"'
            + finish_reason.encode()
            + b'"}'
            + self.tail
        )


# -- helpers ------------------------------------------------------------------------------


def _json(body: dict[str, Any]) -> web.Response:
    return web.Response(body=_encode(body), content_type="application/json")


def _chat_echo(req: ChatRequest) -> str:
    """With `echo`, the last message's text when it is the assistant's (vLLM's extension: the
    answer continues it)."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant":
        return ""
    return render_chat_content(last.content)


def _single_prompt(prompt: str | list[Any]) -> str:
    """A completions prompt as text: a string, `[string]`, token ids, or `[[token ids]]`."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str | list):
        return _single_prompt(prompt[0])
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return " ".join(map(str, prompt))
    if not prompt:
        raise OpenAIError(400, "The prompt must not be empty.", param="prompt")
    raise OpenAIError(
        400,
        "The mocker takes one prompt per request: a string, a list of token ids, or a "
        "list holding one of those.",
        param="prompt",
    )


def _prompt_ids(prompt: str | list[Any]) -> list[int] | None:
    """The token ids of a completions prompt given as ids (`[ids]` or `[[ids]]`), else None."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    return None


def _embedding_inputs(value: str | list[Any]) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise OpenAIError(400, "The input must not be empty.", param="input")
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [" ".join(map(str, value))]
    if all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value):
        return [" ".join(map(str, v)) for v in value]
    raise OpenAIError(
        400, "input must be a string, a list of strings, or token id lists.", param="input"
    )
