"""`PromptTokenizer`: a prompt's token ids as the worker computes them, for KV-aware routing.

Loaded from a worker set's verified metadata files: `tokenizer.json` (Hugging Face
`tokenizers`) and the chat template of `tokenizer_config.json`, rendered in a sandboxed
`jinja2` environment (templates come from workers, so they get no access to Python). As
vLLM does, a chat is rendered with the generation prompt and tokenized without special
tokens added; a completion prompt is tokenized with them. Messages reach the template whole
(tool calls, their ids, names), as the engine passes them.

A template is untrusted work, so rendering is bounded (`BoundedSandbox`, in `sandbox`):
every loop iteration, call and attribute read checks a time budget (`RENDER_SECONDS`, and
`RENDER_SECONDS_PER_MB` of chat: a client's long chat is not the template's fault), every
string built (`*`, `+`, `~`, string methods and filters) is checked against a size limit
(the text the chat holds, tool calls' arguments included, plus `MAX_TEXT`), before it is
built where its size can be foreseen, an operation not known quick is given nothing over
`OP_BOUND`, and the output stops at `MAX_TEXT`. Rendering and tokenizing run in the
tokenizer's own thread (`submit`, one per tokenizer at a time: a bad template occupies at most
one thread), started for the work queued and ended once none is left, with `RENDER_THREADS`
alive in the process at most (`shoal.frontend.kv.threads`: a set that finds none free has its
chat routed by prefix), so that many sets do not keep as many idle threads. A template that overruns on a small chat (`SMALL_CHAT`) is disabled for good
(`disabled` says why: the set is routed by prefix, `/health` shows it); on a larger chat,
whose size may explain it, only that request is routed by prefix. A render still running
past its deadline (stuck where no check runs) is interrupted from the event loop
(`overran`: an exception raised in its thread) and the tokenizer gets a fresh thread.

Only what can be hashed is tokenized: the text is cut to a size that holds the tokens
asked for (`chat`/`completion` with `wanted`, doubling the cut in the rare case it did
not), `CUT_MARGIN` more tokens kept past them so the cut cannot change the ones hashed.

Chats repeat themselves (a system prompt, a growing history), so a rendered chat is cut at
the tokenizer's special tokens and each segment, after the same segments, is tokenized and
hashed once and kept (`PromptChain`, `CHAIN_CACHE_BYTES` in all per tokenizer, shared by its
users, least recently used out):
the tokenizer itself tokenizes the text between special tokens independently (they are
matched first), so the ids are the same, at a fraction of the cost. Whether a tokenizer
does is checked when it is loaded (`splits_cleanly`); one that does not tokenizes whole.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from types import EllipsisType
from typing import Any, TypeVar

import jinja2
import msgspec
from tokenizers import Tokenizer

from shoal.bounds import check_json_depth
from shoal.frontend.kv.chain import (
    CHARS_PER_TOKEN,
    CUT_MARGIN,
    Deferred,
    PromptChain,
    special_split,
    splits_cleanly,
)
from shoal.frontend.kv.sandbox import (
    MAX_TEXT,
    OP_BOUND,
    RENDER_SECONDS,
    BoundedSandbox,
    TemplateOverrun,
)
from shoal.frontend.kv.sizes import chars, text_size
from shoal.frontend.kv.threads import RENDER_THREADS, THREADS, NoRenderThread
from shoal.kv import token_block_hashes

__all__ = [
    "MAX_TEXT",
    "RENDER_SECONDS",
    "RENDER_THREADS",
    "Deferred",
    "NoRenderThread",
    "PromptTokenizer",
    "TemplateOverrun",
]

T = TypeVar("T")

# Tokenizing runs on the event loop or in one thread per tokenizer at a time: `tokenizers`' own
# thread pool would only spin on the other cores (measured: 1.5 times the CPU for a chat's pieces).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
RENDER_SECONDS_PER_MB = 1.0  # beyond `RENDER_SECONDS`: a client's long chat is no overrun
CHAIN_CACHE_BYTES = 64 << 20  # tokenized segments of chats kept per tokenizer (not per set)
INLINE_CHAT = 32_768  # characters: a chat this small is first prepared on the event loop,
INLINE_MESSAGES = 256  # of this many messages at most,
# (gets `INLINE_SECONDS` of CPU time, gives no operation not known quick more than `INLINE_OP`)
INLINE_TEXT = 65_536  # builds no string longer than the chat and this,
SMALL_CHAT = OP_BOUND // 2  # characters and items: a template that overruns on a chat this
# small is disabled (on a larger one, the request is routed by prefix: the chat may explain it)
INLINE_NEW = 8192  # and tokenizes at most this much new text; else all of it is left to
# the tokenizer's thread (`Deferred`), where the full budgets apply


def read_files(tokenizer_file: Path, config_file: Path | None) -> tuple[Tokenizer, dict[str, Any]]:
    """A tokenizer and its config from the files on disk (`tokenizers` holds the GIL while
    it parses: ~100 ms for a real model's); raises OSError if a file cannot be read, and
    ValueError or `tokenizers`' `Exception` if its content is refused."""
    config: dict[str, Any] = {}
    if config_file is not None:
        text = config_file.read_text()
        check_json_depth(text)  # (a worker's file: `TooDeep` is a ValueError)
        loaded = json.loads(text)
        config = loaded if isinstance(loaded, dict) else {}
    # (read here: `Tokenizer.from_file` raises a bare `Exception` for a missing file too)
    return Tokenizer.from_buffer(tokenizer_file.read_bytes()), config


def prompt_chain(tokenizer: Tokenizer) -> PromptChain | None:
    """The cache of chat segments tokenized by `tokenizer`; None if it does not tokenize
    the text between its special tokens alone (`splits_cleanly`). A function of the
    tokenizer alone: the worker sets that share a tokenizer share it, one
    `CHAIN_CACHE_BYTES` for all, and its probe (the whole vocabulary read: 80-200 ms of the
    GIL for 65,000 tokens) is made once."""
    split, special_ids = special_split(tokenizer)
    if split is None or not splits_cleanly(tokenizer, special_ids):
        return None
    encode = functools.partial(_encode, tokenizer, special_tokens=False)
    return PromptChain(
        CHAIN_CACHE_BYTES, split, special_ids, encode, functools.partial(_plain_many, tokenizer)
    )


class Job(Future[T]):
    """Work queued for a tokenizer's thread (`PromptTokenizer.submit`). Cancelled before it
    runs (its request stopped waiting), it is skipped, and lets go of its work at once (a
    chat's messages) rather than when the thread comes to it."""

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        super().__init__()
        self.work: tuple[Callable[..., T], tuple[Any, ...]] | None = (fn, args)

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self.work = None
        return True


class PromptTokenizer:
    """Tokenizes chat messages (through the chat template) and completion prompts."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        config: dict[str, Any],
        chain: PromptChain | EllipsisType | None = ...,
    ) -> None:
        """`chain`: the tokenizer's segment cache (`prompt_chain`), shared with the other
        users of `tokenizer`; by default one of its own is made."""
        self.tokenizer = tokenizer
        self.chain = prompt_chain(tokenizer) if isinstance(chain, EllipsisType) else chain
        self.specials = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.template: jinja2.Template | None = None
        self.env = BoundedSandbox()
        if isinstance(template, str):
            self.template = self.env.from_string(template)
        self.disabled = ""  # why the template is no longer rendered ("" while it is)
        self._queue: deque[Job[Any]] | None = None  # the work of this tokenizer's thread, if any
        self._rendering: tuple[int, float] | None = None  # (thread, deadline) of a render
        self.watched = False  # the event loop checks on the render in progress
        self._lock = threading.Lock()

    @classmethod
    def load(cls, tokenizer_file: Path, config_file: Path | None) -> PromptTokenizer:
        """From the files on disk; raises (OSError, ValueError, jinja2 errors) if unusable."""
        return cls(*read_files(tokenizer_file, config_file))

    # -- the worker thread ----------------------------------------------------------------

    def submit(self, fn: Callable[..., T], *args: Any) -> Job[T]:
        """Run `fn(*args)` in this tokenizer's thread, after the work queued there; the
        thread is started if there is none (`THREADS`: `NoRenderThread` when none can be,
        raised here or set on the job). Cancel the job when its result is no longer wanted:
        the thread then never runs it (it would hold the thread, and the work queued behind
        it, for nothing)."""
        job = Job(fn, args)
        with self._lock:
            if self._queue is None:
                queue: deque[Job[Any]] = deque()
                serve = functools.partial(self._serve, queue)
                THREADS.start(serve, functools.partial(self._refused, queue))
                self._queue = queue
            self._queue.append(job)
        return job

    def _refused(self, queue: deque[Job[Any]], exc: BaseException) -> None:
        """No thread could be started for `queue`: its work fails with `exc`."""
        with self._lock:
            if self._queue is queue:
                self._queue = None
            jobs = list(queue)
            queue.clear()
        for job in jobs:
            if job.set_running_or_notify_cancel():
                job.set_exception(exc)

    def _serve(self, queue: deque[Job[Any]]) -> None:
        """The tokenizer's thread: runs `queue`'s work in order (skipping the cancelled) and
        ends once it is empty, or once the tokenizer gave the thread up (`overran`, `close`)."""
        try:
            while True:
                with self._lock:
                    if self._queue is not queue or not queue:
                        if self._queue is queue:
                            self._queue = None
                        return
                    job = queue.popleft()
                if job.set_running_or_notify_cancel():
                    assert job.work is not None  # (let go of only when cancelled)
                    (fn, args), job.work = job.work, None
                    try:
                        result = fn(*args)
                    except BaseException as exc:  # (as `ThreadPoolExecutor` does)
                        job.set_exception(exc)
                    else:
                        job.set_result(result)
                    del fn, args
                del job
        except TemplateOverrun:  # (`overran`'s interruption landing past the render)
            pass

    def _give_up_thread(self) -> list[Job[Any]]:
        """Leave this tokenizer's thread to end after the work it is doing (the caller holds
        `_lock`); the work queued behind it, to cancel."""
        queue, self._queue = self._queue, None
        return list(queue or ())

    def overran(self, now: float) -> bool:
        """Called from the event loop: if a render has run past twice its budget (it ignored
        the checks, stuck in C code), disable the template, interrupt the render and give
        the tokenizer a new thread (on its next work). True when it did."""
        with self._lock:
            rendering = self._rendering
            if rendering is None or now < rendering[1] + RENDER_SECONDS:
                return False
            self._rendering = None
            self.disable(f"the chat template ran past {RENDER_SECONDS:g}s")
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(rendering[0]), ctypes.py_object(TemplateOverrun)
            )
            queued = self._give_up_thread()
        for job in queued:
            job.cancel()
        return True

    @property
    def rendering(self) -> bool:
        """Whether a render is in progress in this tokenizer's thread."""
        return self._rendering is not None

    def disable(self, reason: str) -> None:
        if not self.disabled:
            self.disabled = reason

    def close(self) -> None:
        with self._lock:
            queued = self._give_up_thread()
        for job in queued:
            job.cancel()

    # -- tokenizing -----------------------------------------------------------------------

    @property
    def renders(self) -> bool:
        """Whether chats can be tokenized: a template that is not disabled."""
        return self.template is not None and not self.disabled

    def chat(self, messages: list[Any], wanted: int | None = None) -> list[int] | None:
        """The ids of a chat as the template renders it (the first `wanted` of them, and a
        few more, when given); None without a usable template. Raises `TemplateOverrun`
        (the template is then disabled) or any error the template raises."""
        if not self.renders:
            return None
        text = self.render(messages)
        if self.chain is not None:
            return self.chain.tokens(text, wanted)
        return self._cut_and_encode(text, wanted, special_tokens=False)

    def chat_hashes(
        self, messages: list[Any], sizes: Iterable[int], max_blocks: int, *, inline: bool = False
    ) -> dict[int, list[int]] | None:
        """The block hashes of the chat's first `max_blocks` blocks, per block size; None
        without a usable template. Raises as `chat` does; `inline` (on the event loop),
        `Deferred` for a chat that needs more work than the loop may do (`INLINE_*`)."""
        if not self.renders:
            return None
        text = self.render(messages, inline=inline)
        chain = self.chain
        budget = INLINE_NEW if inline else None
        if chain is None:
            if budget is not None and len(text) > budget:
                raise Deferred
            tokens = self._cut_and_encode(text, max_blocks * max(sizes), special_tokens=False)
            return {size: token_block_hashes(tokens, size, limit=max_blocks) for size in sizes}
        return {size: chain.hashes(text, size, max_blocks, budget) for size in sizes}

    def render(self, messages: list[Any], *, inline: bool = False) -> str:
        """The template's text for `messages` (its first `MAX_TEXT` characters). `inline`:
        on the event loop, within the `INLINE_*` bounds, else `Deferred` (and the template
        is judged by a render in the thread, never disabled by this one). `TemplateOverrun`
        disables the template when the chat is small (`SMALL_CHAT`), else fails this chat."""
        assert self.template is not None
        if inline and len(messages) > INLINE_MESSAGES:
            raise Deferred  # (before looking at each)
        if inline and sum(len(m) for m in messages if isinstance(m, msgspec.Raw)) > 2 * INLINE_CHAT:
            raise Deferred  # (a large body's messages: before decoding them)
        plain = [_message(m) for m in messages]
        size = sum(text_size(m) for m in plain)  # (nested too: a tool call's arguments)
        if inline:
            if size > INLINE_CHAT:
                raise Deferred
            try:
                return self.env.render(
                    self.template,
                    0.0,  # (inline: its own budget)
                    size + INLINE_TEXT,
                    True,
                    messages=plain,
                    add_generation_prompt=True,
                    **self.specials,
                )
            except TemplateOverrun:
                raise Deferred from None
        deadline = time.monotonic() + RENDER_SECONDS + RENDER_SECONDS_PER_MB * size / 1e6
        with self._lock:
            self._rendering = (threading.get_ident(), deadline)
        try:
            return self.env.render(
                self.template,
                deadline,
                MAX_TEXT + size,
                messages=plain,
                add_generation_prompt=True,
                **self.specials,
            )
        except TemplateOverrun as exc:
            if chars(plain, SMALL_CHAT) <= SMALL_CHAT:  # else the chat's size may explain it
                self.disable(str(exc) or f"the chat template ran past {RENDER_SECONDS:g}s")
            raise
        finally:
            with self._lock:
                self._rendering = None

    def completion(self, prompt: Any, wanted: int | None = None) -> list[int] | None:
        """The ids of a completions prompt: text is tokenized, token ids are taken as they are."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._cut_and_encode(prompt, wanted, special_tokens=True)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        return None

    def _cut_and_encode(self, text: str, wanted: int | None, *, special_tokens: bool) -> list[int]:
        """The ids of `text`, or of a cut of it holding at least `wanted` + `CUT_MARGIN` of
        them (the ids past `wanted` near the cut may differ from the whole text's: dropped)."""
        if wanted is None:
            return self._encode_all(text, special_tokens)
        cut = (wanted + CUT_MARGIN) * CHARS_PER_TOKEN
        while True:
            ids = self._encode_all(text[:cut], special_tokens)
            if cut >= len(text):
                return ids
            if len(ids) >= wanted + CUT_MARGIN:
                return ids[:wanted]
            cut *= 2  # tokens longer than CHARS_PER_TOKEN on average: cut further out

    def _encode_all(self, text: str, special_tokens: bool) -> list[int]:
        if special_tokens or self.chain is None:
            return self._encode(text, special_tokens=special_tokens)
        return self.chain.tokens(text)

    def _encode(self, text: str, *, special_tokens: bool) -> list[int]:
        return _encode(self.tokenizer, text, special_tokens=special_tokens)


def _encode(tokenizer: Tokenizer, text: str, *, special_tokens: bool) -> list[int]:
    """`text`'s ids; without the offsets `encode` also computes (three times faster)."""
    return list(tokenizer.encode_batch_fast([text], add_special_tokens=special_tokens)[0].ids)


def _plain_many(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each of `texts` (pieces of a chat, no special token), in one call."""
    encoded = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    return [list(e.ids) for e in encoded]


def _token_text(value: Any) -> str:
    """A special token from the config: a string, or an `AddedToken`-like dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _message(message: Any) -> Any:
    """A message as the template sees it: whole, its content parts joined as text, None
    as empty (as engines do for text-only templates). A large body's message comes as
    its JSON text (`msgspec.Raw`), decoded here one at a time."""
    if isinstance(message, msgspec.Raw):
        message = msgspec.json.decode(message)
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, str):
        return message
    return {**message, "content": _content_text(content)}


def _content_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("text")
        )
    return content if isinstance(content, str) else ""
