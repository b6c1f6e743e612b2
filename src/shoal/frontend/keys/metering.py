"""`Metered`: a client connection that tells, once, how its response ended and what it cost.

It stands between the proxy and the client's `HttpConnection` for a request made with an API
key, passing everything through and keeping only what the end needs: the status (from the
first write's status line, or the error answered) and the last `TAIL` bytes of the body,
where an OpenAI response carries its `usage` (the JSON body's, or a stream's last event with
`stream_options.include_usage`). When the engine gives no usage, the gateway counts: one
completion token per streamed event, and the prompt as its body bytes / 4. `on_done(status,
prompt_tokens, completion_tokens, served_model)` is called once, when the response is finished
or refused; the served model is the `model` the answer names ("" if none).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from shoal.frontend.http.request import ClientConnection, FlowListener, InFlight
from shoal.openai import ApiError

TAIL = 4096
MAX_TOKENS = 10**9  # an engine's claim of usage beyond is cut here (it is charged and counted)
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_STATUS = re.compile(rb"^HTTP/1\.[01] (\d{3})")
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,400})"')

Done = Callable[[int, int, int, str], None]  # status, prompt and completion tokens, served


def usage_of(tail: bytes, events: int, request_bytes: int) -> tuple[int, int]:
    """(prompt, completion) tokens: the last `usage` in `tail`, else the gateway's count."""
    prompts = _PROMPT.findall(tail)
    completions = _COMPLETION.findall(tail)
    if prompts or completions:
        prompt = _tokens(prompts[-1]) if prompts else request_bytes // 4
        return prompt, _tokens(completions[-1]) if completions else max(events - 1, 0)
    return request_bytes // 4, max(events - 1, 0)  # (the last event is `[DONE]`)


def _tokens(digits: bytes) -> int:
    """A count an engine claims, at most `MAX_TOKENS` (never a thousand-digit int)."""
    return int(digits) if len(digits) < 10 else MAX_TOKENS


class Metered:
    """`conn` as the proxy sees it, reporting the end to `on_done` (see the module)."""

    __slots__ = (
        "_done", "conn", "events", "head", "loop", "on_done", "request_bytes", "status", "tail"
    )  # fmt: skip

    def __init__(self, conn: ClientConnection, request_bytes: int, on_done: Done) -> None:
        self.conn = conn
        self.loop = conn.loop
        self.request_bytes = request_bytes
        self.on_done = on_done
        self.status = 0
        self.tail = b""
        self.head = b""  # the first bytes: where a JSON answer names its `model`
        self.events = 0
        self._done = False

    @property
    def keep_alive(self) -> bool:
        return self.conn.keep_alive

    @property
    def writable(self) -> bool:
        return self.conn.writable

    def produce_later(self, work: InFlight) -> None:
        self.conn.produce_later(work)

    def follow(self, flow: FlowListener | None) -> None:
        self.conn.follow(flow)

    def close_after_response(self) -> None:
        self.conn.close_after_response()

    def write(self, data: bytes) -> None:
        if not self.status and (match := _STATUS.match(data)):
            self.status = int(match.group(1))
        self.events += data.count(b"data:")
        if len(self.head) < TAIL:
            self.head += data[: TAIL - len(self.head)]
        self.tail = (self.tail + data)[-TAIL:]
        self.conn.write(data)

    def finish(self, error: ApiError | None = None) -> None:
        self.conn.finish(error)
        self._end(error.status if error is not None and not self.status else self.status)

    def send_error(self, error: ApiError) -> None:
        self.conn.send_error(error)
        self._end(error.status)

    def _end(self, status: int) -> None:
        if self._done:
            return
        self._done = True
        prompt, completion = usage_of(self.tail, self.events, self.request_bytes)
        if status >= 400:
            prompt = completion = 0  # a refused or failed request is charged no tokens
        served = _MODEL.search(self.head) or _MODEL.search(self.tail)
        name = served.group(1).decode(errors="replace") if served else ""
        self.on_done(status or 499, prompt, completion, name)
