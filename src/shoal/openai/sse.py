"""Server-Sent Events as OpenAI streams them: `data: <json>\n\n` per chunk, then `[DONE]`."""

from __future__ import annotations

SSE_DONE = b"data: [DONE]\n\n"
"""The last event of every OpenAI stream."""

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
}
"""The response headers of a stream."""


SSE_EVENT_START = b"data: "
SSE_EVENT_END = b"\n\n"
"""What an event's data stands between: for framing pre-encoded parts without `sse_event`."""


def sse_event(data: bytes) -> bytes:
    """One event carrying `data` (encoded JSON, without a newline)."""
    return SSE_EVENT_START + data + SSE_EVENT_END
