"""`Metered`: a client connection that tells, once, how its response ended and what it cost.

It stands between the proxy and the client's `HttpConnection` for a request made with an API
key, passing everything through and keeping only what the end needs: the status (from the
first write's status line, or the error answered) and the last `TAIL` bytes of the body,
where an OpenAI response carries its `usage` (the JSON body's, or a stream's last event with
`stream_options.include_usage`), and the `USAGE` bytes from the last `"usage"` key
written: an engine may answer more after it (vLLM's `prompt_logprobs`, asked for by the
client, can be far longer than the tail), and the tail alone then charged no completion
tokens. A key's stream whose client asked for no usage event asks the engine for it all the
same (`Proxy.ask_usage`), and the event is kept from the client (`HiddenUsage`): the client
sees the stream it asked for. When the engine gives no usage (a provider that sends none,
an engine that ignores the option), the gateway counts: one completion token per streamed
event, and the prompt as its body bytes / 4. A request refused or failed costs no
tokens; one whose client left after it was forwarded, before its answer began (499), costs
its prompt as the gateway counts it: leaving early never makes the work asked for free.
The gate's `done(grant, model, status, prompt_tokens, completion_tokens, served_model,
reserved, shared, minute)` is called once, when the response is finished or refused; the served model is the `model` the
answer names ("" if none), `reserved` the tokens `Limits` reserved for it when it was admitted
(`shared`: in Redis) in `minute`. Per write: a count of `data:`, a `rfind` of `"usage"` and two slices, no
regular expression; the usage is looked for once, at the end: in the tail, else after the
last `"usage"`. A `"usage"` counts only as a key: followed by `:` and an object (whitespace
between); the same text in a string (a prompt's token echoed in `prompt_logprobs`, a client's
own words) is skipped, so it cannot hide the real usage written before it. One whose `:` is
not written yet waits for the next write to say.
"""

from __future__ import annotations

import re
from typing import Protocol

import msgspec

from shoal.discovery.grants import Grant
from shoal.frontend.http.request import BodyBudget, ClientConnection, FlowListener, InFlight
from shoal.openai import ApiError

TAIL = 4096
USAGE = 512  # bytes kept from the last `"usage"` key: the object's counts come first
_USAGE_KEY = b'"usage"'
MAX_TOKENS = 10**9  # an engine's claim of usage beyond is cut here (it is charged and counted)
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_BOTH = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)\s*,\s*"completion_tokens"\s*:\s*(\d+)')
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,400})"')


class EndListener(Protocol):
    """What a `Metered` response tells its end to (the gate)."""

    records_usage: bool  # the served model is looked for only then

    def done(
        self,
        grant: Grant,
        model: str,
        status: int,
        prompt: int,
        completion: int,
        served: str,
        reserved: int = 0,
        shared: bool = False,
        minute: int = 0,
    ) -> None: ...


def usage_of(tail: bytes, events: int, request_bytes: int) -> tuple[int, int]:
    """(prompt, completion) tokens: the last `usage` in `tail`, else the gateway's count
    (the prompt as its bytes / 4, one completion token per event but the last, `[DONE]`)."""
    at = tail.rfind(b'"prompt_tokens"')
    if at >= 0 and (both := _BOTH.match(tail, at)) is not None:  # the usual order: one look
        return _tokens(both.group(1)), _tokens(both.group(2))
    prompt = _last(_PROMPT, b'"prompt_tokens"', tail)
    completion = _last(_COMPLETION, b'"completion_tokens"', tail)
    return (
        request_bytes // 4 if prompt < 0 else prompt,
        max(events - 1, 0) if completion < 0 else completion,
    )


def _last(pattern: re.Pattern[bytes], name: bytes, tail: bytes) -> int:
    """The number after the last `name` in `tail` (-1 if none): found from the end."""
    end = len(tail)
    while (at := tail.rfind(name, 0, end)) >= 0:
        if (match := pattern.match(tail, at)) is not None:
            return _tokens(match.group(1))
        end = at  # a `name` without a number (in a string): look further back
    return -1


def _last_key(data: bytes, end: int) -> int:
    """Where the last `"usage"` of `data` before `end` that may be a key starts (-1 if
    none)."""
    while (at := data.rfind(_USAGE_KEY, 0, end)) >= 0:
        if _is_key(data[at : at + 64]) is not False:
            return at
        end = at
    return -1


def _is_key(text: bytes) -> bool | None:
    """Whether `text`, starting with `"usage"`, is the key of an object (`"usage": {`);
    None when it ends before that can be told."""
    at = len(_USAGE_KEY)
    for wanted in b":{":
        while at < len(text) and text[at] in b" \t\r\n":
            at += 1
        if at == len(text):
            return None
        if text[at] != wanted:
            return False
        at += 1
    return True


def _tokens(digits: bytes) -> int:
    """A count an engine claims, at most `MAX_TOKENS` (never a thousand-digit int)."""
    return int(digits) if len(digits) < 10 else MAX_TOKENS


class _Event(msgspec.Struct, gc=False):
    """The members of an event's data the usage event is told by, as their JSON text: a long
    event is checked, never made into objects (20,000 of them: 60 ms)."""

    choices: msgspec.Raw = msgspec.Raw()
    usage: msgspec.Raw = msgspec.Raw()


_decode_event = msgspec.json.Decoder(_Event).decode
_NULL_USAGE = b',"usage":null'
_CHUNKED = b"\r\ntransfer-encoding: chunked\r\n"


def _usage_only(payload: bytes) -> bool:
    """Whether an event's data is the usage event: no choices, a `usage` object."""
    try:
        event = _decode_event(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return False
    choices, usage = memoryview(event.choices), memoryview(event.usage)  # (never copied)
    empty = 2 <= len(choices) <= 64 and choices[0] == 91 and not bytes(choices[1:-1]).strip()
    return empty and len(usage) > 1 and usage[0] == 123  # (`[]`, whitespace inside; a `{`)


class HiddenUsage:
    """The usage event a key's stream asked its engine for, not its client (`Proxy.ask_usage`),
    taken out of the body as the proxy writes it: the event whose `choices` are empty and whose
    `usage` is an object (OpenAI's and vLLM's form), the whole event (its other fields, `id:`,
    `event:`, comments, and its blank line: an `id:` left alone was an event without data, on
    which the official client fails), with any line ends SSE allows (LF, CRLF, CR), and the
    `"usage":null` such engines add to every other chunk once asked. The proxy writes a chunked
    stream as whole chunks of whole lines (the first write after the head), and nothing else of
    it is looked at unless it holds a `"usage"`; only the end of a removed event may come in
    the next chunk (`owed`: the last bytes before it, until its blank line; `lf`: the LF of a
    CRLF whose CR ended it, as `sse.Unfinished` may cut them), and fields before
    its data in an earlier one (an engine's packet ending there) are gone already: they join
    the next event, `[DONE]` (harmless: it has its data). An answer
    that is not a chunked 200, or a chunk unlike the proxy's, goes as it is from there (the
    client may see the event: an HTTP/1.0 client's stream is never asked for it)."""

    __slots__ = ("head", "lf", "off", "owed")

    def __init__(self) -> None:
        self.head = True  # the first write, which starts with the response's head, is to come
        self.off = False
        self.owed = b""  # the last bytes of a removed event whose blank line is still to come
        self.lf = False  # a removed event ended with a CR at the end of its chunk

    def take(self, data: bytes) -> bytes:
        """What of `data`, one write of the proxy's, the client gets."""
        start = 0
        if self.head:
            self.head = False
            start = data.find(b"\r\n\r\n") + 4
            if not data.startswith(b"HTTP/1.1 200 ") or _CHUNKED not in data[: max(start, 0)]:
                self.off = True
        if self.off or (not self.owed and not self.lf and _USAGE_KEY not in data):
            return data
        pieces, at, changed = [data[:start]], start, False
        try:
            while at < len(data):
                line = data.index(b"\r\n", at)
                size = int(data[at:line], 16)
                begin, end = line + 2, line + 2 + size
                if not size or data[end : end + 2] != b"\r\n":
                    if size:
                        raise ValueError("not a chunk")
                    pieces.append(data[at:])  # (the last chunk)
                    break
                payload = data[begin:end]
                kept = self._events(payload)
                if kept is payload:
                    pieces.append(data[at : end + 2])
                elif kept:  # (a chunk left empty is no chunk: an empty one ends the body)
                    pieces.append(b"%x\r\n%s\r\n" % (len(kept), kept))
                changed |= kept is not payload
                at = end + 2
        except ValueError:
            self.off = True
            return data
        return b"".join(pieces) if changed else data

    def _events(self, events: bytes) -> bytes:
        """`events` (a chunk's: whole lines) without the usage event and `"usage":null`."""
        kept = events
        if self.lf:  # (the CRLF ending the removed event, cut after its CR)
            self.lf = False
            kept = kept[1:] if kept[:1] == b"\n" else kept
        if self.owed:  # (the removed event goes on to its blank line)
            owed, self.owed = self.owed, b""
            end = _after_blank(owed + kept, 0) - len(owed)
            if end < 0:  # (no blank line yet: all of it is the removed event's)
                self.owed = (owed + kept)[-2:]
                return b""
            self.lf = end == len(kept) and kept[-1:] == b"\r"
            kept = kept[end:]
        if _NULL_USAGE in kept:  # (only a member can be: a string's `"` is escaped)
            kept = kept.replace(_NULL_USAGE, b"")
        at = 0
        while (found := kept.find(_USAGE_KEY, at)) >= 0:
            line = max(kept.rfind(b"\n", 0, found), kept.rfind(b"\r", 0, found)) + 1
            ends = [i for c in (b"\n", b"\r") if (i := kept.find(c, found)) >= 0]
            if not ends:
                break  # (a line not ended in this chunk: not the proxy's)
            end = min(ends)  # (the line's end: a line is judged once, however many keys)
            at = end
            if (
                not _is_key(kept[found : found + 64]) or not kept.startswith(b"data:", line)
                or not _usage_only(kept[line + 5 : end])
            ):  # fmt: skip
                continue
            start = _event_start(kept, line)
            after = _after_blank(kept, end)
            if after < 0:  # (its blank line, maybe more of its fields, in the next chunk)
                self.owed = kept[-2:]
                after = len(kept)
            else:
                self.lf = after == len(kept) and kept[-1:] == b"\r"
            kept, at = kept[:start] + kept[after:], start
        return kept


_BLANKS = (b"\n\n", b"\r\r", b"\n\r")
"""An empty line after a line's end (LF, CR, or the LF of a CRLF, then a line end): any
`\n\r` is one (CRLF CRLF, LF CRLF, CRLF CR), as SSE allows every mix (`sse.py`'s rule)."""


def _after_blank(data: bytes, at: int) -> int:
    """Where the first empty line of `data` after the line end at `at` ends (-1: none)."""
    found = [i for blank in _BLANKS if (i := data.find(blank, at)) >= 0]
    if not found:
        return -1
    end = min(found) + 2
    return end + 1 if data[end - 1] == 13 and data[end : end + 1] == b"\n" else end


def _event_start(data: bytes, line: int) -> int:
    """Where the event whose line starts at `line` starts: after the last empty line before
    it; a line end at the chunk's start is kept (a blank line, or the LF of a CRLF that
    `sse.Unfinished` cut after its CR: either ends the event before); 0: the chunk's start,
    whose lines are the event's."""
    found = [i for blank in _BLANKS if (i := data.rfind(blank, 0, line)) >= 0]
    if not found:
        if not line or data[0] not in b"\r\n":
            return 0
        return 2 if data.startswith(b"\r\n") else 1
    end = max(found) + 2
    return end + 1 if data[end - 1] == 13 and data[end : end + 1] == b"\n" else end


class Metered:
    """`conn` as the proxy sees it, reporting the end to `on_done` (see the module)."""

    __slots__ = (
        "_done", "conn", "events", "gate", "grant", "head", "hidden", "loop", "minute", "model",
        "request_bytes", "reserved", "shared", "status", "tail", "unsure", "usage", "work",
    )  # fmt: skip

    def __init__(
        self,
        conn: ClientConnection,
        request_bytes: int,
        gate: EndListener,
        grant: Grant,
        model: str,
        hide_usage: bool = False,
    ) -> None:
        self.conn = conn
        self.hidden = HiddenUsage() if hide_usage else None
        self.loop = conn.loop
        self.request_bytes = request_bytes
        self.gate = gate
        self.grant = grant
        self.model = model
        self.status = 0
        self.tail = b""
        self.head = b""  # the first bytes: where a JSON answer names its `model`
        self.usage = b""  # from the last `"usage"` key written, at most `USAGE` bytes
        self.unsure = b""  # the `usage` before, while the last is not known to be a key
        self.events = 0
        self.reserved = 0  # tokens reserved for it when admitted (`Limits.admit`)...
        self.shared = False  # ... in Redis, or in the local windows...
        self.minute = 0  # ... in this minute (Redis' window, or the local one)
        self.work: InFlight | None = None  # what produces the response (`produce_later`)
        self._done = False

    @property
    def keep_alive(self) -> bool:
        return self.conn.keep_alive

    @property
    def writable(self) -> bool:
        return self.conn.writable

    @property
    def bodies(self) -> BodyBudget:
        return self.conn.bodies

    def produce_later(self, work: InFlight) -> None:
        """`work` produces the response; this stands for it on the connection, so that a
        client that leaves ends the request here whatever `work` does when cancelled."""
        self.work = work
        self.conn.produce_later(self)

    def cancel(self) -> None:
        """The client left: `work` is cancelled, and the request ends (once) if `work` did
        not end it. A large body's members decoded again once admitted (a rename) were
        cancelled without a word: the key's `max_parallel` slot was held for good."""
        work, self.work = self.work, None
        if work is not None:
            work.cancel()
        self._end(self.status)

    def follow(self, flow: FlowListener | None) -> None:
        self.conn.follow(flow)

    def close_after_response(self) -> None:
        self.conn.close_after_response()

    def write(self, data: bytes) -> None:
        out = data if self.hidden is None else self.hidden.take(data)
        if not self.status:  # the first write starts with the status line (the proxy's)
            code = data[9:12]
            self.status = int(code) if data[:7] == b"HTTP/1." and code.isdigit() else 0
        self.events += data.count(b"data:")
        if not self.head:
            self.head = data[:TAIL]
        elif len(self.head) < TAIL:
            self.head += data[: TAIL - len(self.head)]
        if (at := _last_key(data, len(data))) >= 0:
            usage = data[at : at + USAGE]
            if _is_key(usage) is None and (sure := _last_key(data, at)) >= 0:
                self.usage = data[sure : sure + USAGE]  # stands unless the last is a key
            self._found(usage)
        elif 0 < len(self.usage) < USAGE:  # the object goes on in this write
            self.usage += data[: USAGE - len(self.usage)]
            if self.unsure:
                self._found(self.usage, self.unsure)
        elif _USAGE_KEY in (edge := self.tail[-6:] + data[:6]):  # the key across two writes
            self._found((edge[edge.index(_USAGE_KEY) : 6] + data)[:USAGE])
        self.tail = data[-TAIL:] if len(data) >= TAIL else (self.tail + data)[-TAIL:]
        if out:
            self.conn.write(out)

    def _found(self, usage: bytes, before: bytes | None = None) -> None:
        """`usage` starts with `"usage"`: kept if a key, or until the next write tells."""
        verdict = _is_key(usage)
        if verdict is None:  # its `:` (or its object) is not written yet
            self.unsure = self.usage if before is None else before
            self.usage = usage
        elif verdict:
            self.usage, self.unsure = usage, b""
        elif before is not None:  # the text of a string after all: the usage before stands
            self.usage, self.unsure = before, b""

    def write_if_open(self, data: bytes) -> bool:
        if not self.conn.writable:
            return False
        self.write(data)
        return True

    def finish(self, error: ApiError | None = None) -> None:
        self.conn.finish(error)
        self._end(error.status if error is not None and not self.status else self.status)

    def send_error(self, error: ApiError) -> None:
        self.conn.send_error(error)
        self._end(error.status)

    def _end(self, status: int) -> None:
        self.work = None  # (it holds this connection: no cycle left for the collector)
        if self._done:
            return
        self._done = True
        gate, grant = self.gate, self.grant
        prompt = completion = 0  # a refused or failed request is charged no tokens
        served = ""  # (and what nobody reads is not looked for: tpm, or usage recorded)
        if not status:  # the client left before an answer began: the proxy had it (a
            status = 499  # refusal has its status), its prompt is charged as the gateway
            prompt = self.request_bytes // 4  # counts it (the instance may have read it)
        elif status < 400 and (gate.records_usage or grant.tpm is not None):
            if self.unsure:  # the last `"usage"` was never followed by its `:`
                self.usage, self.unsure = self.unsure, b""
            tail = self.tail  # (the usage after the last `"usage"`, when the tail has none)
            text = tail if _PROMPT.search(tail) or not self.usage else self.usage
            prompt, completion = usage_of(text, self.events, self.request_bytes)
        if gate.records_usage:
            found = _MODEL.search(self.head) or _MODEL.search(self.tail)
            served = found.group(1).decode(errors="replace") if found else ""
        gate.done(
            grant, self.model, status, prompt, completion, served,
            self.reserved, self.shared, self.minute,
        )  # fmt: skip
