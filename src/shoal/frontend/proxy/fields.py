"""The only parts of a request body the gateway reads (`Fields`: `model`, `stream`, for
prefix-aware routing the prompt, and for a key's tpm the completion it allows), decoded with a
depth bound, once per request (a key's request too: the gate hands its fields to the proxy),
and the one rewrite it makes (`rewrite_model`, for a virtual model's target that names the
model otherwise). A body of `LARGE_BODY` bytes or more is decoded in a thread of its own
(`fields_later`): one decode of 9 MB holds the interpreter 3-5 ms (more under load), which
the event loop's callback then does not add to the rest of the request's start. A large
body the gateway may rebuild (a rename, disagg.py's stages) is decoded as its top-level
members, its fields read from those (`decode_with_members`): one pass over it, not two.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable
from typing import Any, Generic, Literal, TypeVar, overload

import msgspec

from shoal.bounds import MAX_DEPTH, TooDeep, check_json_depth
from shoal.frontend.http import errors
from shoal.frontend.http.request import ClientConnection, Request
from shoal.frontend.registry.router import prefix_message
from shoal.openai import ApiError

log = logging.getLogger(__name__)
T = TypeVar("T")

PROMPT_CHARS = 8192  # how much of the prompt prefix-aware routing looks at
LARGE_BODY = 256 << 10  # (the server's `METER_FROM`: a body it judged piece by piece as it came)
"""A body this large is decoded in `_DECODER`'s thread (`fields_later`), and keeps its
messages undecoded (`msgspec.Raw`); a smaller one is decoded on the event loop, at once."""
RAW_MESSAGES_FROM = LARGE_BODY
# One thread, one body at a time: decoding holds the interpreter, so more threads decode no
# faster and leave the event loop a smaller share of it (as the catalog's `_DECODER`).
_DECODER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="body-fields")


NO_KV_TRANSFER_PARAMS = msgspec.Raw(b"null")
"""`Fields.kv_transfer_params` of a body without them (this very object)."""
ABSENT = msgspec.Raw()
"""`TokenFields`' value of a member the body does not have (empty)."""


class Fields(msgspec.Struct):
    """The only parts of a request body the gateway reads."""

    model: str | None = None
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

    messages: list[msgspec.Raw] | None = None
    prompt: Any = None
    input: Any = None


class TokenFields(Fields):
    """`Fields` and the completion a request allows, which a key's tpm reserves when it is
    admitted (`keys.windows.estimate`): its top-level members as their JSON text, whatever
    they hold (judged by the estimate; the worker judges the request)."""

    max_tokens: msgspec.Raw = ABSENT
    max_completion_tokens: msgspec.Raw = ABSENT


class PromptTokenFields(PromptFields):
    """`PromptFields` and `TokenFields`' members: a key's request to a prefix-aware router,
    decoded once for both."""

    max_tokens: msgspec.Raw = ABSENT
    max_completion_tokens: msgspec.Raw = ABSENT


class LargePromptTokenFields(LargePromptFields):
    """`LargePromptFields` and `TokenFields`' members."""

    max_tokens: msgspec.Raw = ABSENT
    max_completion_tokens: msgspec.Raw = ABSENT


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


_READ = frozenset(LargePromptTokenFields.__struct_fields__)  # every member `Fields` read
_PROMPT = frozenset(("messages", "prompt", "input"))


def decode_with_members(
    body: bytes,
    *,
    with_prompt: bool = False,
    too_deep: bool | None = None,
    with_tokens: bool = False,
) -> tuple[Fields, Members]:
    """`decode_fields` of a body, and its top-level members, in one pass over it: the members,
    then the fields of the few that hold them (a body rebuilt from its members, by a rename
    or disagg.py's stages, is not parsed once for its fields and again for its members).
    Without the prompt, that costs what the fields alone do; with it, its members are read
    again (a list of messages, from their text)."""
    _refuse_too_deep(body, too_deep)
    try:
        members = _decode_members(body)
    except msgspec.ValidationError as exc:
        raise errors.bad_request(f"Invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise errors.bad_request(f"The request body is not valid JSON: {exc}") from None
    read = _READ if with_prompt else _READ - _PROMPT
    wanted = _encode({name: value for name, value in members.items() if name in read})
    fields: Fields
    if with_tokens:
        fields = decode_fields(wanted, with_prompt=with_prompt, too_deep=False, with_tokens=True)
    else:
        fields = decode_fields(wanted, with_prompt=with_prompt, too_deep=False)
    return fields, members


class InThread(Generic[T]):
    """`work()` run in `_DECODER`'s thread (a large body's decode), then `done(its result)`,
    or `done(error)`: the `ApiError` to answer, on the event loop. Until then it is the
    connection's response in progress: a client that leaves cancels it, and `done` is not
    called."""

    __slots__ = ("done", "future")

    def __init__(
        self, client: ClientConnection, work: Callable[[], T], done: Callable[[T | ApiError], None]
    ) -> None:
        self.done = done
        self.future = client.loop.run_in_executor(_DECODER, work)
        client.produce_later(self)
        self.future.add_done_callback(self._finished)

    def cancel(self) -> None:
        self.future.cancel()

    def _finished(self, future: asyncio.Future[T]) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            self.done(future.result())
        elif isinstance(exc, ApiError):
            self.done(exc)
        else:  # a bug: the request's alone
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
) -> InThread[Fields] | InThread[tuple[Fields, Members]]:
    """`decode_fields` of a large body (`LARGE_BODY`), in the decoder's thread (`InThread`);
    `with_members`: of its top-level members, in one pass (`decode_with_members`), which
    are kept as `request.members` for a body rebuilt from them."""
    if with_members:

        def kept(decoded: tuple[Fields, Members] | ApiError) -> None:
            if isinstance(decoded, ApiError):
                done(decoded)
            else:
                fields, request.members = decoded
                done(fields)

        both = functools.partial(
            decode_with_members,
            request.body,
            with_prompt=with_prompt,
            too_deep=request.too_deep,
            with_tokens=with_tokens,
        )
        return InThread(client, both, kept)
    decode: Callable[[], Fields] = functools.partial(
        decode_fields,
        request.body,
        with_prompt=with_prompt,
        too_deep=request.too_deep,
        with_tokens=with_tokens,
    )
    return InThread(client, decode, done)


def members_later(
    body: bytes, client: ClientConnection, done: Callable[[Members | ApiError], None]
) -> InThread[Members]:
    """The top-level members of a large body that passed `decode_fields`, for
    `rewrite_model`, in the decoder's thread (`InThread`)."""
    return InThread(client, functools.partial(_decode_members, body), done)


async def members_of(body: bytes) -> Members:
    """The top-level members of a body that passed `decode_fields`, for a body rebuilt from
    them (disagg.py's stages): a large one's (`LARGE_BODY`) decoded in the decoder's thread,
    awaited (`members_later` answers a connection instead), a smaller one's at once."""
    if len(body) < LARGE_BODY:
        return _decode_members(body)
    return await asyncio.get_running_loop().run_in_executor(_DECODER, _decode_members, body)


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
