"""CPU per request of the API-key path, in process (not a test): what `--auth keys` and
`--limits` add, free of sockets, of the worker and of a busy machine's noise.

    PYTHONPATH=$PWD/src .venv/bin/python -m bench.keys_path
    PYTHONPATH=$PWD/src .venv/bin/python -m bench.keys_path --base ../main   # and main's

Each request goes the frontend's way for a request with a key (`Frontend.handle`: the bearer
checked, the body's model read, the allow-list, then `Gate.handle`), to a fake worker that
answers a chat completion with its usage at once, through a fake client connection. Modes:

  plain            the fake worker alone (what the figures are over)
  keys             `--auth keys`, usage recorded (`UsageBook.record`), local windows
  limits           `--limits` on a throwaway redis-server, a key whose limits are never reached
                   (rpm and tpm 10^11, as bench/gateway.py's `shoal-limits`)
  limits-per-req   the same with no allowance: Redis decides every request (a key whose limit
                   is small); in a tree without allowances, what `--limits` costs always

Figures: user+system CPU time of this process over `--requests` requests (after a warm-up),
per request, minus `plain`'s; the best of `--repeat` runs. The redis-server's own CPU is not
in them. `--base DIR` runs the same in a subprocess on DIR/src and prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SECRET = b"sk-bench"
BODY = json.dumps(
    {"model": "bench-model", "messages": [{"role": "user", "content": "Hello! " * 8}],
     "max_tokens": 16}
).encode()  # fmt: skip
ANSWER = json.dumps(
    {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion", "created": 1764000000,
     "model": "bench-model", "choices": [{"index": 0, "finish_reason": "length",
     "message": {"role": "assistant", "content": "word " * 16}}],
     "usage": {"prompt_tokens": 14, "completion_tokens": 16, "total_tokens": 30}}
).encode()  # fmt: skip
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"x-shoal-instance: w1\r\n\r\n%s" % (len(ANSWER), ANSWER)
)
MODES = ("plain", "keys", "limits", "limits-per-req")


class Conn:
    """A client connection that keeps nothing: `HttpConnection`'s part the key path uses."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.extra_headers = b""
        self.keep_alive = True
        self.writable = True
        self.ended: asyncio.Future[None] | None = None

    def produce_later(self, work: Any) -> None:
        pass

    def follow(self, flow: Any) -> None:
        pass

    def close_after_response(self) -> None:
        pass

    def write(self, data: bytes) -> None:
        if self.extra_headers:  # spliced after the status line, as the server does
            at = data.index(b"\r\n") + 2
            data = data[:at] + self.extra_headers + data[at:]

    def finish(self, error: Any = None) -> None:
        self.end()

    def send_error(self, error: Any) -> None:
        raise RuntimeError(f"refused: {error}")

    def end(self) -> None:
        self.extra_headers = b""
        if self.ended is not None:
            self.ended.set_result(None)
            self.ended = None


def forward(request: Any, client: Any, kind: Any, fields: Any = None) -> None:
    client.write(RESPONSE)
    client.finish()


async def measure(mode: str, requests: int, repeat: int, redis_url: str | None) -> float:
    """CPU µs per request of `mode` (best of `repeat`)."""
    from shoal.discovery.grants import Grant, hash_secret
    from shoal.frontend.http.server import Request
    from shoal.frontend.keys import limits as limits_module
    from shoal.frontend.keys.gate import Gate
    from shoal.frontend.keys.keys import KeyRing
    from shoal.frontend.keys.limits import Limits
    from shoal.frontend.keys.usage import UsageBook
    from shoal.frontend.proxy.proxy import decode_fields

    loop = asyncio.get_running_loop()
    conn = Conn(loop)
    headers = [(b"host", b"x"), (b"content-type", b"application/json"),
               (b"authorization", b"Bearer " + SECRET)]  # fmt: skip
    request = Request(b"POST", b"/v1/chat/completions", headers, BODY, keep_alive=True, http11=True)
    ring = KeyRing(["default"])
    made = Grant(
        workspace="default", name="bench", hash=hash_secret(SECRET), rpm=10**11, tpm=10**11
    )
    ring.put(made.key, made.to_json())
    share = getattr(limits_module, "LEASE_SHARE", None)
    if mode == "limits-per-req" and share is not None:
        limits_module.LEASE_SHARE = 10**12  # no allowance: Redis decides every request
    limits = Limits(redis_url if mode.startswith("limits") else None, prefix=f"bench{os.getpid()}:")
    await limits.start()
    gate = Gate(limits, forward, UsageBook("http://127.0.0.1:9").record)  # type: ignore[arg-type]

    from shoal.frontend.keys import windows

    # A tree whose request path reads `max_tokens` with the other fields and tells the gate
    # the request's estimate (made once); an older one estimates in the limits, of the body.
    with_tokens = hasattr(windows, "MAX_DECLARED")
    # A tree whose gate hands the fields decoded with the estimate's to the proxy.
    with_fields = "fields" in inspect.signature(Gate.handle).parameters

    async def one() -> None:
        grant = ring.check(request.header(b"authorization"))
        assert grant is not None
        body = request.body
        ended = conn.ended = loop.create_future()
        if with_tokens:  # (as `Endpoints.handle`)
            fields = decode_fields(body, too_deep=request.too_deep, with_tokens=True)  # type: ignore[call-overload]
            model = fields.model or ""
            KeyRing.admit(grant, model)
            tokens = windows.estimate(len(body), fields.max_completion_tokens, fields.max_tokens)
            if with_fields:
                gate.handle(request, conn, "chat", grant, model, tokens, fields)  # type: ignore[arg-type]
            else:
                gate.handle(request, conn, "chat", grant, model, tokens)  # type: ignore[arg-type,call-arg]
        else:
            model = decode_fields(body).model or ""
            KeyRing.admit(grant, model)
            gate.handle(request, conn, "chat", grant, model)  # type: ignore[arg-type,call-arg]
        if conn.ended is not None:
            await ended  # Redis decides: its answer comes in another turn of the loop

    def plain() -> None:
        forward(request, conn, "chat")

    best = float("inf")
    try:
        for attempt in range(repeat + 1):  # the first is a warm-up
            started = time.process_time()
            for _ in range(requests):
                if mode == "plain":
                    plain()
                else:
                    await one()
            cost = (time.process_time() - started) / requests * 1e6
            if attempt:
                best = min(best, cost)
    finally:
        await limits.stop()
        if share is not None:
            limits_module.LEASE_SHARE = share
    return best


async def run_all(args: argparse.Namespace, redis_url: str) -> dict[str, float]:
    return {mode: await measure(mode, args.requests, args.repeat, redis_url) for mode in args.modes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.keys_path", description=__doc__)
    p.add_argument("--requests", type=int, default=20_000, help="per run (default 20,000)")
    p.add_argument("--repeat", type=int, default=3, help="runs per mode; the best counts")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    p.add_argument("--base", type=Path, help="also run on DIR/src (a worktree of the base)")
    p.add_argument("--redis", help="use this Redis URL instead of a throwaway redis-server")
    p.add_argument("--json", action="store_true", help="print the figures as JSON only")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    import uvloop

    from bench.gateway_targets import Session, start_redis

    session = Session(Path(tempfile.mkdtemp(prefix="shoal-bench-keys-")), pin=False)
    try:
        redis_url = args.redis or start_redis(session)
        ours = uvloop.run(run_all(args, redis_url))
        base: dict[str, float] | None = None
        if args.base is not None:
            argv2 = [sys.executable, "-m", "bench.keys_path", "--json", "--redis", redis_url,
                     "--requests", str(args.requests), "--repeat", str(args.repeat),
                     "--modes", ",".join(args.modes)]  # fmt: skip
            env = {
                **os.environ,
                "PYTHONPATH": f"{args.base.resolve() / 'src'}{os.pathsep}{Path.cwd()}",
            }
            out = subprocess.run(argv2, env=env, capture_output=True, text=True, check=True)
            base = json.loads(out.stdout)
    finally:
        session.stop_all()
    if args.json:
        print(json.dumps(ours))
        return 0
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.requests:,} requests a run, best of {args.repeat}; CPU µs per request "
          f"(added: over plain). Load average: {load}")  # fmt: skip
    head = "| mode | this tree | added |" + (" base | added |" if base else "")
    print(head)
    print("| --- " * (head.count("|") - 1) + "|")
    for mode in args.modes:
        row = f"| {mode} | {ours[mode]:.1f} | {ours[mode] - ours['plain']:+.1f} |"
        if base is not None:
            row += f" {base[mode]:.1f} | {base[mode] - base['plain']:+.1f} |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
