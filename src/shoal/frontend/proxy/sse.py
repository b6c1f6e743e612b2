"""Server-sent events as a stream that may migrate reads them (migration.py): what of an
OpenAI chunk it keeps (`Chunk`), the data of one event (`payload`), whether a body may start
a stream (`sse_start`), and a chat choice that only opens the message (`opening`); the
start of an event held from the client until its end (`Unfinished`, forward.py), and the
error event that ends a stream whose instance failed (`break_event`)."""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.openai import error_body, sse_event


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


def ends_done(events: bytes) -> bool:
    """Whether `events`, whole events, end with the event `data: [DONE]`."""
    return events.endswith(DONE) and (len(events) == len(DONE) or events.endswith(AFTER_DONE))


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


MAX_HELD = 1 << 20
"""Bytes of a stream's unfinished event held until its end (a migration holds as many, its
`MAX_EVENT`); past them they go to the client as they came."""
_BLANK_LINES = (b"\n\n", b"\r\r", b"\n\r")
"""An empty line, which ends an event: a line's end (LF, CR, or the LF of a CRLF) right after
another (any "\n\r" is one: CRLF CRLF, LF CRLF, CRLF CR; SSE allows every mix)."""
ENDED = (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n")  # (a packet ending an event: no search)


def whole_events(data: bytes) -> int:
    """The length of `data`'s whole events: to the end of its last blank line, 0 for none."""
    if data.endswith(ENDED):  # (the usual packet: no search)
        return len(data)
    end = 0
    for blank in _BLANK_LINES:  # (one found, the others are looked for only after it)
        at = data.rfind(blank, max(end - 1, 0))
        if at >= 0 and at + 2 > end:
            end = at + 2
    if end and data[end - 1] == 13 and data[end : end + 1] == b"\n":
        end += 1  # (the blank line's CRLF)
    return end


def _ends_event(data: bytes) -> bool:
    return any(blank in data for blank in _BLANK_LINES)


class Unfinished:
    """The start of a stream's event whose end has not come, held from the client: a client
    that got half an event when the stream broke read the gateway's error event as its end,
    and failed decoding it (the official client: a JSON decode error, the error unread).
    Held in pieces, joined only when the event ends (an event dripped in small reads is not
    copied at each); past `MAX_HELD` it goes as it came (the client then has half an event).
    A blank line may be cut anywhere between reads, the relayed bytes before the first piece
    held included (`before`): the last two bytes seen (`tail`) are checked with each read."""

    __slots__ = ("pieces", "size", "tail")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.size = 0
        self.tail = b""  # the last two bytes taken (held or relayed)

    def take(self, data: bytes, before: bytes = b"") -> bytes:
        """What of `data`, after the pieces held (or after `before`, the last bytes relayed,
        when none is), goes to the client now; the rest is held."""
        pieces = self.pieces
        if pieces:
            tail, self.tail = self.tail, (self.tail + data[-2:])[-2:]
            if (b"\n" not in data and b"\r" not in data) or not (
                _ends_event(data) or _ends_event(tail + data[:2])
            ):  # (no line ends here: the event goes on)
                pieces.append(data)
                self.size += len(data)
                return self.release() if self.size > MAX_HELD else b""
            data = b"".join([*pieces, data])
            pieces.clear()
            before = b""
        else:
            self.tail = (before + data[-2:])[-2:]
        end = whole_events(data)
        if not end and before:  # (an event ended across the last bytes relayed and these)
            end = max(whole_events(before[-2:] + data[:2]) - len(before[-2:]), 0)
        self.size = len(data) - end
        if not self.size:
            return data
        if self.size > MAX_HELD:  # (all of it goes)
            self.size = 0
            return data
        pieces.append(data[end:] if end else data)
        return data[:end]

    def release(self) -> bytes:
        """Every piece held, for the client (at the stream's end, or over the bound)."""
        data = b"".join(self.pieces)
        self.pieces.clear()
        self.size = 0
        return data


def break_event(failure: Exception, tail: bytes) -> bytes:
    """The gateway's error event ending a stream whose instance failed, after `tail`, the
    last piece the client has. The client has whole events (the start of one held was
    dropped), or a packet's whole lines (ending with a newline), or an event over `MAX_HELD`
    as it came: those are ended first, the error event would be part of them. Empty
    after `data: [DONE]`: the stream was whole, and nothing may follow its end."""
    if ends_done(tail):
        return b""
    event = sse_event(
        error_body(
            f"The model instance failed while streaming: {failure}",
            type="server_error",
            code="upstream_error",
        )
    )
    if tail and not tail.endswith(ENDED):
        event = (b"\n" if tail.endswith(b"\n") else b"\n\n") + event
    return event
