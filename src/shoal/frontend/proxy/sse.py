"""Server-sent events as a stream that may migrate reads them (migration.py): what of an
OpenAI chunk it keeps (`Chunk`), the data of one event (`payload`), whether a body may start
a stream (`sse_start`), and a chat choice that only opens the message (`opening`)."""

from __future__ import annotations

from typing import Any

import msgspec


class Delta(msgspec.Struct, gc=False):  # (decoded JSON: no cycles)
    content: Any = None
    tool_calls: Any = None
    function_call: Any = None
    role: Any = msgspec.UNSET  # (UNSET: not there at all)
    reasoning_content: Any = None  # (a reasoning parser's: vLLM, SGLang)
    reasoning: Any = None  # (newer vLLM's name for it)


class Choice(msgspec.Struct, gc=False):  # (decoded JSON: no cycles)
    delta: Delta | None = None
    text: Any = None
    finish_reason: Any = None


class Chunk(msgspec.Struct, gc=False):  # (decoded JSON: no cycles)
    id: Any = None
    created: Any = None
    model: Any = None
    choices: list[Choice] | None = None
    usage: Any = None


decode_chunk = msgspec.json.Decoder(Chunk).decode
decode_chunks = msgspec.json.Decoder(list[Chunk]).decode
DONE = b"data: [DONE]\n\n"
AFTER_DONE = b"\n\n" + DONE


def payload(event: bytes) -> bytes | None:
    """The data of one SSE event, stripped: its `data:` lines' values joined by newlines
    (after other fields, `event:`, `id:`, comments, or a blank line), None without one."""
    if event.startswith(b"data:") and b"\n" not in event:
        return event[5:].strip()  # (the usual event: one line)
    values = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
    if not values:
        return None
    return b"\n".join(v[1:] if v[:1] == b" " else v for v in values).strip()


def sse_start(data: bytes) -> bool:
    """Whether `data`, the first bytes of a response body, may start an SSE stream (a read
    may end inside the first `data:`)."""
    return data.startswith((b"data:", b":")) or (len(data) < 5 and b"data:".startswith(data))


def opening(choice: Choice) -> bool:
    """A chat choice that only opens the message (`role`, empty content)."""
    delta = choice.delta
    if delta is None or choice.finish_reason is not None or delta.role is msgspec.UNSET:
        return False
    return not delta.content and not delta.tool_calls


def has_role(choice: Choice) -> bool:
    return choice.delta is not None and choice.delta.role is not msgspec.UNSET
