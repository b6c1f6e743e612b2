"""The only parts of a request body the gateway reads (`Fields`: `model`, `stream`, for
prefix-aware routing the prompt, and for a key's tpm the completion it allows), decoded with a
depth bound, once per request (a key's request too: the gate hands its fields to the proxy),
and the rewrites it makes (`rewrite_model`, for a virtual model's target that names the
model otherwise; `asking_usage`, for a key's stream whose client asked no usage event). A
body of `LARGE_BODY` bytes or more is decoded in the decoder process
(`fields_later`, `decoder_process.py`): a decode holds the interpreter lock from start to end
(a 20 MB chat: 20-50 ms), and the event loop with it when it runs in this process, in a thread
or not. The process hands back the small fields, and where the rest lies in the body. A large
body the gateway may rebuild (a rename, disagg.py's stages) is handed back with its top-level
members too (`with_members`), in the same pass; a body of more than `MAX_MEMBERS` top-level
members is refused (an OpenAI body has a few dozen; a million held this process seconds).
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import functools
import itertools
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any, Generic, Literal, TypeVar, overload

import msgspec

from shoal.bounds import MAX_DEPTH, TooDeep, check_json_depth
from shoal.frontend.http import errors
from shoal.frontend.http.request import ClientConnection, Request
from shoal.frontend.proxy import continuation
from shoal.frontend.proxy.decoder_process import DecoderProcess
from shoal.frontend.registry.router import prefix_message
from shoal.openai import ApiError

log = logging.getLogger(__name__)
T = TypeVar("T")

PROMPT_CHARS = 8192  # how much of the prompt prefix-aware routing looks at
LARGE_BODY = 256 << 10  # (the server's `METER_FROM`: a body it judged piece by piece as it came)
"""A body this large is decoded in the decoder process (`fields_later`), and keeps its
messages undecoded (`msgspec.Raw`); a smaller one is decoded on the event loop, at once."""
RAW_MESSAGES_FROM = LARGE_BODY
MAX_MEMBERS = 1024
"""Top-level members of a large body the gateway rebuilds (a rename, disagg.py's stages) at
most: past them, a 400."""
PROMPT_CUT_CHARS = 1 << 20
PROMPT_CUT_ITEMS = 1 << 16
"""A large body's `prompt` or `input` is handed over cut to its first this many characters
of text and list items in all: routing reads its start (the kv policy at most 1,024 blocks of
tokens: 64 Ki ids of 64-token blocks, some 512 K characters), and taking in millions of
decoded ids would hold this process' interpreter as the decode did."""
# The thread that drives the decoder process: one body at a time, in the order they came.
_DECODER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="body-fields")
DECODER_PROCESS = DecoderProcess()


NO_KV_TRANSFER_PARAMS = msgspec.Raw(b"null")
"""`Fields.kv_transfer_params` of a body without them (this very object)."""
ABSENT = msgspec.Raw()
"""`TokenFields`' value of a member the body does not have (empty)."""


MAX_MODEL_NAME = 1024  # characters of a body's `model` (a 15 MB one was quoted in its 404)


class Fields(msgspec.Struct):
    """The only parts of a request body the gateway reads."""

    model: Annotated[str, msgspec.Meta(max_length=MAX_MODEL_NAME)] | None = None
    stream: bool | None = None
    # Set by the gateway alone (disagg.py): they make a worker connect where they say.
    kv_transfer_params: msgspec.Raw = NO_KV_TRANSFER_PARAMS


class PromptFields(Fields):
    """`Fields` and the prompt, for prefix-aware routing."""

    messages: list[dict[str, Any]] | None = None  # whole: a chat template reads every field
    prompt: Any = None
    input: Any = None


class LargePromptFields(Fields):
    """`PromptFields` of a large body: each message is kept as its JSON text, decoded when
    read (the prefix looks at the first few; a template's render, in the tokenizer's
    thread, at all of them one by one): decoding 40,000 messages at once held the event
    loop 45 ms."""

    messages: Sequence[msgspec.Raw] | None = None  # (handed over: `RawMessages`)
    prompt: Any = None
    input: Any = None


class TokenFields(Fields):
    """`Fields` and the completion a request allows (per choice, and its choices), which a
    key's tpm reserves when it is admitted (`keys.windows.estimate`), and the `stream_options`
    its metering reads (`asking_usage`): top-level members as their JSON text, whatever they
    hold (judged by the estimate; the worker judges the request)."""

    max_tokens: msgspec.Raw = ABSENT
    max_completion_tokens: msgspec.Raw = ABSENT
    n: msgspec.Raw = ABSENT
    best_of: msgspec.Raw = ABSENT
    stream_options: msgspec.Raw = ABSENT


class PromptTokenFields(PromptFields):
    """`PromptFields` and `TokenFields`' members: a key's request to a prefix-aware router,
    decoded once for both."""

    max_tokens: msgspec.Raw = ABSENT
    max_completion_tokens: msgspec.Raw = ABSENT
    n: msgspec.Raw = ABSENT
    best_of: msgspec.Raw = ABSENT
    stream_options: msgspec.Raw = ABSENT


class LargePromptTokenFields(LargePromptFields):
    """`LargePromptFields` and `TokenFields`' members."""

    max_tokens: msgspec.Raw = ABSENT
    max_completion_tokens: msgspec.Raw = ABSENT
    n: msgspec.Raw = ABSENT
    best_of: msgspec.Raw = ABSENT
    stream_options: msgspec.Raw = ABSENT


WithTokens = TokenFields | PromptTokenFields | LargePromptTokenFields
"""The fields of a key's request: what the router reads, and what its tpm estimate reads."""


_decode_fields = msgspec.json.Decoder(Fields).decode
_decode_token_fields = msgspec.json.Decoder(TokenFields).decode
_decode_prompt_fields = msgspec.json.Decoder(PromptFields).decode
_decode_large_prompt_fields = msgspec.json.Decoder(LargePromptFields).decode
_decode_prompt_token_fields = msgspec.json.Decoder(PromptTokenFields).decode
_decode_large_prompt_token_fields = msgspec.json.Decoder(LargePromptTokenFields).decode
Members = dict[str, msgspec.Raw]
"""A JSON object's top-level members, each as its JSON text."""
_decode_members = msgspec.json.Decoder(Members).decode
_encode = msgspec.json.encode


def rewrite_model(body: bytes, model: str, members: Members | None = None) -> bytes:
    """`body` (a JSON object that passed `decode_fields`, so within the depth bound) with its
    `model` set to `model`; every other top-level member is kept byte for byte (decoded only
    as far as the top level, unless its `members` are given: a large body's, decoded in a
    thread by `members_later`, which this only encodes)."""
    members = _decode_members(body) if members is None else dict(members)
    members["model"] = msgspec.Raw(_encode(model))
    return _encode(members)


USAGE_ASKED = msgspec.Raw(b'{"include_usage":true}')
_TRUE = msgspec.Raw(b"true")
_ASK_USAGE = b'"stream_options":' + USAGE_ASKED + b","


def asking_usage(body: bytes, options: msgspec.Raw, members: Members | None = None) -> bytes | None:
    """`body`, a stream's that passed `decode_fields`, asking its engine for the usage event
    (`stream_options.include_usage`), its `stream_options` (`options`; `ABSENT`: none) merged
    with it; None when it asks already (as engines read a boolean: `continuation.asked`),
    asks for the usage in every chunk (vLLM's `continuous_usage_stats`: the client would get
    that), or its `stream_options` is no object. A body without them gets them as its first
    member (one copy, never decoded); with them, it is rebuilt from its top-level `members`
    (a large body's, decoded with its fields: `Request.members`), decoded here only if small:
    a large one without them is left as it is (None). `members` get them too."""
    if options is ABSENT:
        start = body.find(b"{") + 1
        if members is not None:
            members["stream_options"] = USAGE_ASKED
        return b"".join((body[:start], _ASK_USAGE, memoryview(body)[start:]))
    first = bytes(memoryview(options)[:1])
    if first != b"{" and (len(options) != 4 or bytes(options) != b"null"):
        return None
    given = {} if first != b"{" else _decode_members(options)
    if any(continuation.asked(given.get(k)) for k in ("include_usage", "continuous_usage_stats")):
        return None
    if members is None:
        if len(body) >= LARGE_BODY:
            return None
        members = _decode_members(body)
    members["stream_options"] = msgspec.Raw(_encode({**given, "include_usage": _TRUE}))
    return _encode(members)


@overload
def decode_fields(
    body: bytes,
    *,
    with_prompt: bool = False,
    too_deep: bool | None = None,
    with_tokens: Literal[True],
) -> WithTokens: ...
@overload
def decode_fields(
    body: bytes,
    *,
    with_prompt: bool = False,
    too_deep: bool | None = None,
    with_tokens: Literal[False] = False,
) -> Fields: ...
@overload
def decode_fields(
    body: bytes, *, with_prompt: bool = False, too_deep: bool | None = None, with_tokens: bool
) -> Fields: ...
def decode_fields(
    body: bytes,
    *,
    with_prompt: bool = False,
    too_deep: bool | None = None,
    with_tokens: bool = False,
) -> Fields:
    """The routing fields of a body (`with_prompt`: the prompt too; `with_tokens`: and those
    of a key's tpm, `TokenFields`' members); `ApiError` 400 if it is not a JSON object with a
    `model`, or nests deeper than `shoal.bounds.MAX_DEPTH` (checked before any decoder sees
    it, here unless `too_deep` says already: `Request.too_deep`, judged as a large body
    arrived)."""
    _refuse_too_deep(body, too_deep)
    fields: Fields
    try:
        try:
            if not with_prompt:
                fields = _decode_token_fields(body) if with_tokens else _decode_fields(body)
            elif len(body) < RAW_MESSAGES_FROM:
                if with_tokens:
                    fields = _decode_prompt_token_fields(body)
                else:
                    fields = _decode_prompt_fields(body)
            elif with_tokens:
                fields = _decode_large_prompt_token_fields(body)
            else:
                fields = _decode_large_prompt_fields(body)
        except msgspec.ValidationError:
            if not with_prompt:
                raise
            # An odd prompt is no reason to refuse: route without a prefix hint, and let the
            # worker judge it (the error, if any, is about `model` or `stream`).
            fields = _decode_token_fields(body) if with_tokens else _decode_fields(body)
    except msgspec.ValidationError as exc:
        raise errors.bad_request(f"Invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise errors.bad_request(f"The request body is not valid JSON: {exc}") from None
    if not fields.model:
        raise errors.bad_request("You must provide a model parameter.", param="model")
    return fields


def _refuse_too_deep(body: bytes, too_deep: bool | None) -> None:
    """`ApiError` 400 when `body` nests deeper than `MAX_DEPTH` (`too_deep`: already judged)."""
    # (`check_json_depth`'s first step inline: a body with fewer openers than the bound is
    # within it, which is nearly every body)
    if too_deep is None and body.count(b"[") + body.count(b"{") > MAX_DEPTH:
        try:
            check_json_depth(body)
        except TooDeep:
            too_deep = True
    if too_deep:
        raise errors.bad_request(
            f"The request body is not accepted: {TooDeep(MAX_DEPTH)}."
        ) from None


Done = Callable[[T | ApiError], None]  # (what `InThread` calls with its result, or the error)


class InThread(Generic[T]):
    """`work()` run in `_DECODER`'s thread (a call of the decoder process), then `done(its
    result)`, or `done(error)`: the `ApiError` to answer, on the event loop. Until then it is
    the connection's response in progress: a client that leaves cancels it, and `done` is not
    called. The `size` bytes of its body count in the server's budget until then (they wait
    for the one thread; uncounted, they queued without bound): a 503 if they cross it."""

    __slots__ = ("bodies", "done", "future", "size")

    def __init__(self, client: ClientConnection, work: Callable[[], T], done: Done[T], size: int = 0) -> None:  # fmt: skip
        self.done, self.bodies, self.size = done, client.bodies, size
        if self.bodies.hold(size):
            self.future = client.loop.run_in_executor(_DECODER, work)
        else:
            self.size, self.future = 0, client.loop.create_future()
            self.future.set_exception(errors.bodies_held(self.bodies.limit))
        client.produce_later(self)
        self.future.add_done_callback(self._finished)

    def cancel(self) -> None:
        self.future.cancel()

    def _finished(self, future: asyncio.Future[T]) -> None:
        self.bodies.give(self.size)
        self.size = 0
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            self.done(future.result())
        elif isinstance(exc, ApiError):
            self.done(exc)
        else:  # a bug, or the decoder process failed twice: the request's alone
            log.error("decoding a request body failed", exc_info=exc)
            self.done(errors.internal_error())


def fields_later(
    request: Request,
    client: ClientConnection,
    done: Callable[[Fields | ApiError], None],
    *,
    with_prompt: bool = False,
    with_tokens: bool = False,
    with_members: bool = False,
) -> InThread[Fields]:
    """`decode_fields` of a large body (`LARGE_BODY`), in the decoder process (`InThread`;
    the request's body is read there first: if it came in pieces, joined there);
    `with_members`: its top-level members too, in the same pass, kept as `request.members`
    for a body rebuilt from them."""
    decode = functools.partial(_fields_elsewhere, request, with_prompt, with_tokens, with_members)
    return InThread(client, decode, done, request.size)


def members_later(
    body: bytes, client: ClientConnection, done: Callable[[Members | ApiError], None]
) -> InThread[Members]:
    """The top-level members of a large body that passed `decode_fields`, for
    `rewrite_model`, decoded in the decoder process (`InThread`)."""
    return InThread(client, functools.partial(_members_elsewhere, body), done, len(body))


async def stop_decoder() -> None:
    """End the decoder process (a frontend's stop), once the bodies given before are decoded;
    a body given after starts another."""
    await asyncio.get_running_loop().run_in_executor(_DECODER, DECODER_PROCESS.stop)


# -- handing fields over from the decoder process ------------------------------------------


class RawMessages(Sequence[msgspec.Raw]):
    """A large body's messages as the decoder process hands them over: where each lies in the
    body (`starts`, `ends`), made a `msgspec.Raw` of the body's bytes (no copy) when read.
    Taking in a list of 400,000 of them at once would hold the interpreter ~40 ms."""

    __slots__ = ("_ends", "_starts", "_view")

    def __init__(self, body: bytes, starts: array.array[int], ends: array.array[int]) -> None:
        self._view = memoryview(body)
        self._starts = starts
        self._ends = ends

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, index: int) -> msgspec.Raw: ...
    @overload
    def __getitem__(self, index: slice) -> list[msgspec.Raw]: ...
    def __getitem__(self, index: int | slice) -> msgspec.Raw | list[msgspec.Raw]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return msgspec.Raw(self._view[self._starts[index] : self._ends[index]])

    def __iter__(self) -> Iterator[msgspec.Raw]:
        view = self._view
        for start, end in zip(self._starts, self._ends, strict=True):
            yield msgspec.Raw(view[start:end])


Spans = tuple["array.array[int]", "array.array[int]"]
"""Where values lie in a body: their starts, and their ends."""


class _Handed(msgspec.Struct):
    """`Fields` as the decoder process hands them over: the small ones as they are, the
    members kept as JSON text as where they lie in the body (`start, end`), a prompt cut."""

    kind: str  # the class of the fields
    model: str | None
    stream: bool | None
    raws: dict[str, tuple[int, int]]  # each present `msgspec.Raw` member
    messages: Any  # `Spans` of a `RawMessages`, or None
    prompt: Any
    input: Any
    members: Any = None  # `with_members`: the top-level members' names and `Spans`


class _Refused(msgspec.Struct):
    """`decode_fields`' `ApiError` (a 400) as the decoder process hands it over."""

    message: str
    param: str | None


_KINDS = {
    kind.__name__: kind for kind in (Fields, TokenFields, LargePromptFields, LargePromptTokenFields)
}
_SPANNED = (
    "kv_transfer_params",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "stream_options",
)


def _fields_elsewhere(
    request: Request, with_prompt: bool, with_tokens: bool, with_members: bool = False
) -> Fields:
    """`decode_fields` of `request`'s body, in the decoder process (in `_DECODER`'s thread);
    `with_members`: its top-level members too, set as `request.members`."""
    body = request.body
    handed = DECODER_PROCESS.call(
        _handed, body, with_prompt, request.too_deep, with_tokens, with_members
    )
    if isinstance(handed, _Refused):
        raise errors.bad_request(handed.message, param=handed.param)
    view = memoryview(body)
    members: dict[str, Any] = {k: msgspec.Raw(view[a:b]) for k, (a, b) in handed.raws.items()}
    kind = _KINDS[handed.kind]
    if kind is LargePromptFields or kind is LargePromptTokenFields:
        if handed.messages is not None:
            members["messages"] = RawMessages(body, *handed.messages)
        members["prompt"], members["input"] = handed.prompt, handed.input
    if handed.members is not None:
        request.members = _members_at(view, *handed.members)
    return kind(model=handed.model, stream=handed.stream, **members)


def _members_elsewhere(body: bytes) -> Members:
    """`_decode_members` of `body`, in the decoder process (in `_DECODER`'s thread)."""
    spans = DECODER_PROCESS.call(_member_spans, body)
    if isinstance(spans, _Refused):
        raise errors.bad_request(spans.message, param=spans.param)
    return _members_at(memoryview(body), *spans)


def _members_at(view: memoryview, names: list[str], spans: Spans) -> Members:
    starts, ends = spans
    return {name: msgspec.Raw(view[a:b]) for name, a, b in zip(names, starts, ends, strict=True)}


def _handed(
    body: bytes, with_prompt: bool, too_deep: bool | None, with_tokens: bool, with_members: bool
) -> _Handed | _Refused:
    """(In the decoder process.) `decode_fields` of `body`, to hand over."""
    try:
        fields = decode_fields(
            body, with_prompt=with_prompt, too_deep=too_deep, with_tokens=with_tokens
        )
    except ApiError as exc:
        return _Refused(exc.message, exc.param)
    spans = _member_spans(body) if with_members else None
    if isinstance(spans, _Refused):  # (refused only if a rebuild asks for them: `members_of`)
        spans = None
    raws: dict[str, tuple[int, int]] = {}
    for name in _SPANNED:  # (those absent: the class' own default, the very object)
        raw = getattr(fields, name, ABSENT)
        if raw is not NO_KV_TRANSFER_PARAMS and raw is not ABSENT:
            (start,), (end,) = _spans(body, [raw])
            raws[name] = (start, end)
    messages = getattr(fields, "messages", None)
    room = [PROMPT_CUT_CHARS, PROMPT_CUT_ITEMS]
    return _Handed(
        type(fields).__name__,
        fields.model,
        fields.stream,
        raws,
        None if messages is None else _spans(body, messages),
        _cut(getattr(fields, "prompt", None), room),
        _cut(getattr(fields, "input", None), room),
        spans,
    )


def _member_spans(body: bytes) -> tuple[list[str], Spans] | _Refused:
    """(In the decoder process.) `_decode_members` of a body that passed `decode_fields`:
    names, and where values lie; refused past `MAX_MEMBERS` (taking in a million spans would
    hold this process' interpreter as their decode did)."""
    members = _decode_members(body)
    if len(members) > MAX_MEMBERS:
        message = (
            f"The request body has {len(members):,} top-level members, over the "
            f"{MAX_MEMBERS:,} a request rebuilt by the gateway may have."
        )
        return _Refused(message, None)
    try:
        return list(members), _spans(body, list(members.values()))
    except _OutOfOrder:
        message = "The request body names a top-level member more than once."
        return _Refused(message, None)


class _OutOfOrder(Exception):
    """`_spans` was given values out of the body's order (a member named twice keeps its first
    place and its last value): each would be searched for from the body's start again."""


def _spans(body: bytes, raws: Sequence[msgspec.Raw]) -> Spans:
    """Where each of `raws` (JSON text decoded from `body`, in the body's order) lies in
    `body`. A value's bytes found elsewhere in the body are as good as its own: the same
    text. Usually found at C speed: the items of an array written with one separator (as
    `json.dumps` or `JSON.stringify` write them) lie end to end; else one by one (~0.3 us
    each), each from where the one before ended: in all, one pass over the body
    (`_OutOfOrder` if one is not found past the one before)."""
    kind = "I" if len(body) < 1 << 32 else "Q"
    lengths = array.array(kind, map(len, raws))
    first = body.find(raws[0]) if raws else -1  # type: ignore[arg-type]
    for sep in (b", ", b","):
        if first >= 0 and body.startswith(sep.join(raws), first):  # type: ignore[arg-type]
            steps = map(operator.add, lengths, itertools.repeat(len(sep)))
            starts = array.array(kind, itertools.accumulate(steps, initial=first))
            starts.pop()
            return starts, array.array(kind, map(operator.add, starts, lengths))
    starts, at = array.array(kind), 0
    for raw in raws:
        start = body.find(raw, at)  # type: ignore[arg-type]
        if start < 0:  # (out of order: a search from the start each, quadratic in all)
            raise _OutOfOrder
        starts.append(start)
        at = start + len(raw)
    return starts, array.array(kind, map(operator.add, starts, lengths))


def _cut(value: Any, room: list[int]) -> Any:
    """`value` (a prompt, or an input) with at most `room`'s characters of text and items of
    lists and objects (used up as they are kept): its start (`PROMPT_CUT_CHARS`)."""
    if isinstance(value, str):
        value = value[: room[0]]
        room[0] -= len(value)
    elif isinstance(value, list):
        kept = value[: max(0, room[1])]
        room[1] -= len(kept)
        value = [_cut(item, room) for item in kept]
    elif isinstance(value, dict):
        pairs = list(itertools.islice(value.items(), max(0, room[1])))
        room[1] -= len(pairs)
        value = {key: _cut(item, room) for key, item in pairs}
    return value


async def members_of(body: bytes) -> Members:
    """The top-level members of a body that passed `decode_fields`, for a body rebuilt from
    them (disagg.py's stages): a large one's (`LARGE_BODY`) decoded in the decoder process,
    awaited (`members_later` answers a connection instead), a smaller one's at once."""
    if len(body) < LARGE_BODY:
        return _decode_members(body)
    return await asyncio.get_running_loop().run_in_executor(_DECODER, _members_elsewhere, body)


async def encode_members(members: Members) -> bytes:
    """The JSON text of a body rebuilt from `members` (`members_of`): a large one encoded in
    the decoder's thread, awaited (10 MB of them: a copy of 1-2 ms), a smaller one at once."""
    if sum(map(len, members.values())) < LARGE_BODY:
        return _encode(members)
    return await asyncio.get_running_loop().run_in_executor(_DECODER, _encode, members)


def prompt_text(fields: Fields, limit: int = PROMPT_CHARS) -> str:
    """The start of the prompt as text: chat messages, a completion prompt or embedding input."""
    if not isinstance(fields, PromptFields | LargePromptFields):
        return ""
    parts: list[str] = []
    size = 0
    if fields.messages:
        for message in fields.messages:
            message = prefix_message(message, limit)  # (a large body's: `msgspec.Raw`)
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(
                    piece
                    for p in content
                    if isinstance(p, dict) and isinstance(piece := p.get("text"), str)
                )
            text = f"{message.get('role')}:{content[:limit] if isinstance(content, str) else ''}\n"
            parts.append(text)
            size += len(text)
            if size >= limit:
                break
        return "".join(parts)[:limit]
    value = fields.prompt if fields.prompt is not None else fields.input
    if isinstance(value, list) and value:
        value = value[0] if isinstance(value[0], str | list) else value
    if isinstance(value, list):
        value = ",".join(str(t) for t in value[: limit // 4] if type(t) is int)
    return value[:limit] if isinstance(value, str) else ""


def prompt_hint(fields: Fields, extract: Callable[[Fields], str] | None = None) -> str:
    """The router's prompt (`extract`, else `prompt_text`), or no hint at all: prompt
    extraction never fails a request."""
    try:
        return (extract or prompt_text)(fields)
    except Exception:  # an odd value prompt_text did not foresee: route without a hint
        log.debug("no prefix hint for an odd prompt", exc_info=True)
        return ""
