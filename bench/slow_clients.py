"""Slow clients (not a test): N connections that each send one header line a second, and the
latency of normal requests to a frontend before and while they are open.

    shoal worker --model mock-llm --ttft-ms 1 --itl-ms 1 &
    shoal frontend --port 18800 &
    .venv/bin/python -m bench.slow_clients --port 18800 --clients 1000

The frontend's `--header-timeout` (10 s by default) closes each slow connection in the end;
the figures are taken while all of them are open.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp

BODY = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def slow_client(port: int, stop: asyncio.Event) -> None:
    """A request head sent one header line a second, never finished."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /live HTTP/1.1\r\nhost: x\r\n")
        while not stop.is_set():
            await asyncio.sleep(1)
            writer.write(b"x-slow: 1\r\n")
            await writer.drain()
    except OSError:
        pass  # closed by the frontend's header timeout


async def latencies(session: aiohttp.ClientSession, url: str, count: int) -> list[float]:
    out = []
    for _ in range(count):
        started = time.perf_counter()
        async with session.post(url, json=BODY) as response:
            await response.read()
            assert response.status == 200, response.status
        out.append(time.perf_counter() - started)
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="the frontend's port")
    parser.add_argument("--clients", type=int, default=1000, help="slow connections")
    parser.add_argument("--requests", type=int, default=50, help="normal requests timed")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        before = await latencies(session, url, args.requests)
        slow = [asyncio.create_task(slow_client(args.port, stop)) for _ in range(args.clients)]
        await asyncio.sleep(5)  # all of them open and trickling
        during = await latencies(session, url, args.requests)
        stop.set()
        await asyncio.gather(*slow)
    print(
        f"p50 {statistics.median(before) * 1000:.2f} ms before, "
        f"{statistics.median(during) * 1000:.2f} ms with {args.clients} slow clients open "
        f"(max {max(during) * 1000:.2f} ms)"
    )


if __name__ == "__main__":
    asyncio.run(main())
