"""How long a frontend's event loop is held while it takes 10 MB and 30 MB chat bodies, in
process (not a test).

    PYTHONPATH=src:. .venv/bin/python -m bench.body_stall [--rounds 3] [--router prefix]

A frontend in this process, on uvloop as `shoal frontend` runs, with `--max-body` 64 MiB,
over a SQLite store, in front of a mocker worker process (`shoal worker --engine mocker`,
which refuses the bodies for its context length: the frontend's work before that is what is
judged). A client thread sends each body once per round (encoded before, written with one
`sendall`, which lets go of the GIL). Meanwhile a probe callback asks to run every 1 ms; how
late it runs is how long the loop was held (by a callback, by another thread holding the GIL,
or by the machine's other work: wall time), and the CPU time of the loop's thread between two
of its runs is the loop's own work (not the waits for the GIL or a core). Prints, per body,
the longest of each round, and the same for rounds of no request (the control).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from bench.gateway_targets import Session, start_worker
from bench.keys_stall import WORDS

MODEL = "bench-model"
PROBE_INTERVAL = 0.001


def chat(size: int, messages: int) -> bytes:
    """A chat request of about `size` bytes in `messages` messages."""
    text = " ".join(WORDS[i % len(WORDS)] for i in range(size // 3))[:size]
    per = max(1, size // messages)
    turns = [
        {"role": "user" if i % 2 else "assistant", "content": text[i * per : (i + 1) * per]}
        for i in range(messages)
    ]
    return json.dumps({"model": MODEL, "max_tokens": 1, "messages": turns}).encode()


def send(port: int, body: bytes) -> bytes:
    """POST `body` on a connection of its own; the answer's status line."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        sock.sendall(body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    return status + b" " + rest.partition(b"\r\n\r\n")[2][:80]


class Probe:
    """A callback every `PROBE_INTERVAL`: the most it ran late since `reset`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.worst = 0.0
        self.worst_cpu = 0.0
        self._due = time.perf_counter() + PROBE_INTERVAL
        self._cpu = time.thread_time()
        self._handle = loop.call_later(PROBE_INTERVAL, self._tick)

    def _tick(self) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.worst = max(self.worst, now - self._due)
        self.worst_cpu = max(self.worst_cpu, cpu - self._cpu)
        self._due, self._cpu = now + PROBE_INTERVAL, cpu
        self._handle = self.loop.call_later(PROBE_INTERVAL, self._tick)

    def reset(self) -> None:
        self.worst = self.worst_cpu = 0.0

    def stop(self) -> None:
        self._handle.cancel()


async def measure(args: argparse.Namespace, store: str, cache: Path) -> None:
    from shoal.frontend import Frontend, FrontendConfig

    config = FrontendConfig(
        store_url=store, port=0, router=args.router, cache_dir=cache, max_body=64 << 20
    )
    front = Frontend(config)
    await front.start()
    deadline = time.monotonic() + 60
    while MODEL not in front.registry.models:
        if time.monotonic() > deadline:
            raise RuntimeError("the worker's model never became routable")
        await asyncio.sleep(0.1)
    bodies = {
        "10 MB, 1 message": chat(10_000_000, 1),
        "10 MB, 40,000 messages": chat(10_000_000, 40_000),
        "30 MB, 1 message": chat(30_000_000, 1),
        "30 MB, 120,000 messages": chat(30_000_000, 120_000),
    }
    probe = Probe(asyncio.get_running_loop())
    worst: dict[str, list[tuple[float, float]]] = {name: [] for name in ["no request", *bodies]}
    answers: dict[str, set[bytes]] = {name: set() for name in bodies}
    try:
        await asyncio.to_thread(send, front.port, bodies["10 MB, 1 message"])  # (warm up)
        for _ in range(args.rounds):
            probe.reset()
            await asyncio.sleep(0.3)
            worst["no request"].append((probe.worst, probe.worst_cpu))
            for name, body in bodies.items():
                probe.reset()
                answers[name].add(await asyncio.to_thread(send, front.port, body))
                await asyncio.sleep(0.05)  # (what the request left behind, in its window)
                worst[name].append((probe.worst, probe.worst_cpu))
    finally:
        probe.stop()
        await front.stop()
    print(
        f"--router {args.router}, {args.rounds} rounds; per round, the longest lateness of a "
        "1 ms callback / the most CPU of the loop's thread between two of its runs, ms:"
    )
    for name, values in worst.items():
        said = b" / ".join(sorted(answers.get(name, set()))).decode()[:24]
        figures = "  ".join(f"{w * 1e3:5.1f} /{c * 1e3:5.1f}" for w, c in values)
        print(f"  {name:<24} {figures}   {said}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--router", default="round-robin")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import uvloop

    tmp = Path(tempfile.mkdtemp(prefix="shoal-body-stall-"))
    session = Session(tmp, pin=False)
    store = f"sqlite:///{tmp / 'store.db'}"
    try:
        start_worker(session, MODEL, store)
        uvloop.run(measure(args, store, tmp / "cache"))
    finally:
        session.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
