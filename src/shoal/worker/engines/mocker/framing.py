"""The bytes of the mocker's answers: whole JSON bodies, and stream chunks pre-encoded per request.

A stream's chunks differ only in their choice, so the common head (id, object, created,
model) is encoded once per request and each chunk is a few byte concatenations: the
speedup-0 path measures the gateway, not the mocker's JSON encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from shoal.openai import SSE_EVENT_END, SSE_EVENT_START
from shoal.worker.protocol import IdMaker, now

_encode = msgspec.json.Encoder().encode
_CLOSE = b"}" + SSE_EVENT_END


@dataclass(frozen=True, slots=True)
class AnswerKind:
    """What sets one kind of answer (chat or text completion) apart: its names, and the choice
    of its stream chunks encoded around the text or the finish reason."""

    id_prefix: str
    object: str
    chunk_object: str
    opening: bytes
    """The choice of the chunk before any text (chat's role), or b"" for no such chunk."""
    text_open: bytes
    text_close: bytes
    finish_open: bytes

    @property
    def chat(self) -> bool:
        return self.object == "chat.completion"


CHAT = AnswerKind(
    id_prefix="chatcmpl",
    object="chat.completion",
    chunk_object="chat.completion.chunk",
    opening=b'{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null}',
    text_open=b'{"index":0,"delta":{"content":',
    text_close=b'},"logprobs":null,"finish_reason":null}',
    finish_open=b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"',
)
COMPLETION = AnswerKind(
    id_prefix="cmpl",
    object="text_completion",
    chunk_object="text_completion",
    opening=b"",
    text_open=b'{"index":0,"text":',
    text_close=b',"logprobs":null,"finish_reason":null}',
    finish_open=b'{"index":0,"text":"","logprobs":null,"finish_reason":"',
)


class Chunks:
    """The `data: {...}` events of one streamed answer, built from parts encoded once."""

    def __init__(
        self, kind: AnswerKind, ids: IdMaker, model: str, usage: bool, prompt_tokens: int = 0
    ) -> None:
        head = {
            "id": ids(kind.id_prefix),
            "object": kind.chunk_object,
            "created": now(),
            "model": model,
        }
        start = SSE_EVENT_START + _encode(head)[:-1]
        tail = (b'],"usage":null}' if usage else b"]}") + SSE_EVENT_END
        self._head = start + b',"choices":['
        self._tail = tail
        self._text_open = self._head + kind.text_open
        self._text_close = kind.text_close + tail
        self._finish_open = self._head + kind.finish_open
        self._finish_close = b'"}' + tail
        self._opening = self._head + kind.opening + tail if kind.opening else b""
        self._usage_head = start + b',"choices":[],"usage":'
        self._prompt_tokens = prompt_tokens
        self._counted_close = kind.text_close + b'],"usage":'

    def first(self) -> bytes:
        """The event before any text (chat's role), or b"" where the kind has none."""
        return self._opening

    def piece(self, text: str, tokens: int | None = None) -> bytes:
        """The event carrying `text`; with `tokens`, the usage so far (the stream's
        `continuous_usage_stats`): the prompt's tokens and the `tokens` generated."""
        if tokens is None:
            return self._text_open + _encode(text) + self._text_close
        p = self._prompt_tokens
        usage = {"prompt_tokens": p, "completion_tokens": tokens, "total_tokens": p + tokens}
        return self._text_open + _encode(text) + self._counted_close + _encode(usage) + _CLOSE

    def last(self, finish_reason: str) -> bytes:
        """The event carrying the finish reason."""
        return self._finish_open + finish_reason.encode() + self._finish_close

    def usage(self, usage: dict[str, int]) -> bytes:
        """The usage event (`stream_options.include_usage`)."""
        return self._usage_head + _encode(usage) + b"}" + SSE_EVENT_END


def whole_answer(
    kind: AnswerKind,
    ids: IdMaker,
    model: str,
    text: str,
    finish_reason: str,
    usage: dict[str, int],
    extra: dict[str, Any] | None = None,
) -> web.Response:
    """A whole (not streamed) chat or text completion; `extra` adds top-level members
    (a prefill's `kv_transfer_params`)."""
    choice: dict[str, Any] = {"index": 0}
    if kind.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    return json_response(
        {
            "id": ids(kind.id_prefix),
            "object": kind.object,
            "created": now(),
            "model": model,
            "choices": [choice],
            "usage": usage,
            **(extra or {}),
        }
    )


def json_response(body: dict[str, Any] | list[Any]) -> web.Response:
    """`body` as a JSON response."""
    return web.Response(body=_encode(body), content_type="application/json")
