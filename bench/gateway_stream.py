"""Streaming load generator for bench/gateway.py: closed-loop chat completions read as SSE.

    .venv/bin/python -m bench.gateway_stream --url http://127.0.0.1:8000 --model mock \\
        [--concurrency 32] [--duration 10] [--max-tokens 128] [--api-key KEY]

Each of `--concurrency` connections sends a streaming chat completion, reads the response to
its end, and sends the next, until `--duration` seconds have passed (requests in flight then
are finished and counted). Prints one JSON object: requests/s, time to first token (the first
SSE event that carries content), streamed tokens/s (events with content per second).

Raw asyncio streams and httptools (HTTP/1.1 keep-alive, chunked or not) keep the client's own
cost per token low, so that on a small machine the gateway, not the client, is what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

# An SSE event with text in its delta: `"content":"x` or `"content": "x` (not "" and not null).
CONTENT = re.compile(rb'"content":\s?"[^"]')


@dataclass
class Totals:
    requests: int = 0
    ok: int = 0
    errors: int = 0
    incomplete: int = 0
    content_events: int = 0
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what)


class Response:
    """httptools callbacks for one response: status, body split into SSE events."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.complete = False
        self.headers_done = False
        self.body_framed = False  # content-length or chunked: the parser sees the end
        self.buffer = b""
        self.content_events = 0
        self.first_content: float | None = None
        self.done = False
        self.error_body = b""
        self.keep_alive = False  # read when the message completes: httptools forgets it after

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        if lname == b"content-length" or (
            lname == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self.body_framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error_body = (self.error_body + body)[:300]
            return
        buffer = self.buffer + body
        *events, self.buffer = buffer.split(b"\n\n")
        for event in events:
            if CONTENT.search(event):
                self.content_events += 1
                if self.first_content is None:
                    self.first_content = time.perf_counter()
            elif b"[DONE]" in event:
                self.done = True

    def on_message_complete(self) -> None:
        self.complete = True
        # After `feed_data` returns, `should_keep_alive()` answers False whatever the response
        # said (llhttp resets its flags once the message is complete): asked then, every stream
        # would open a new connection.
        self.keep_alive = bool(self.parser.should_keep_alive())


async def connection(
    host: str, port: int, request: bytes, deadline: float, totals: Totals, end: list[float]
) -> None:
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    try:
        while time.perf_counter() < deadline:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            assert reader is not None
            response = Response(time.perf_counter())
            writer.write(request)
            eof = False
            while not response.complete:
                data = await reader.read(65536)
                if not data:
                    eof = True
                    break
                response.parser.feed_data(data)
            now = time.perf_counter()
            end[0] = max(end[0], now)
            if eof and not response.complete:
                if response.headers_done and not response.body_framed:
                    response.complete = True  # body delimited by the connection's end
                else:
                    totals.error("connection closed before the response ended")
            if response.complete:
                totals.requests += 1
                totals.latency.append(now - response.sent)
                if response.status != 200:
                    totals.error(f"HTTP {response.status}: {response.error_body[:200]!r}")
                else:
                    totals.ok += 1
                    totals.content_events += response.content_events
                    if response.first_content is not None:
                        totals.ttft.append(response.first_content - response.sent)
                    if not response.done:
                        totals.incomplete += 1
            if eof or not response.keep_alive:
                writer.close()
                reader = writer = None
    except OSError as exc:
        totals.error(f"{type(exc).__name__}: {exc}")
    finally:
        if writer is not None:
            writer.close()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args: argparse.Namespace) -> dict[str, object]:
    url = urlsplit(args.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    body = json.dumps(
        {
            "model": args.model,
            "messages": [{"role": "user", "content": args.prompt}],
            "max_tokens": args.max_tokens,
            "stream": True,
        }
    ).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Authorization: Bearer {args.api_key}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    totals = Totals()
    start = time.perf_counter()
    end = [start]
    deadline = start + args.duration
    await asyncio.gather(
        *(connection(host, port, request, deadline, totals, end) for _ in range(args.concurrency))
    )
    elapsed = max(end[0] - start, 1e-9)
    ok = totals.ok
    return {
        "requests": totals.requests,
        "ok": totals.ok,
        "errors": totals.errors,
        "incomplete": totals.incomplete,
        "error_samples": totals.error_samples,
        "elapsed_s": elapsed,
        "requests_per_s": totals.requests / elapsed,
        "content_events": totals.content_events,
        "tokens_per_request": totals.content_events / ok if ok else 0.0,
        "tokens_per_s": totals.content_events / elapsed,
        "ttft_p50_ms": ms(percentile(totals.ttft, 0.5)),
        "ttft_p99_ms": ms(percentile(totals.ttft, 0.99)),
        "latency_p50_ms": ms(percentile(totals.latency, 0.5)),
        "latency_p99_ms": ms(percentile(totals.latency, 0.99)),
    }


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt", default="Tell me a story about a shoal of fish.")
    parser.add_argument("--api-key", default="sk-bench")
    args = parser.parse_args(argv)
    try:
        import uvloop

        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
