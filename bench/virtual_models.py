"""CPU per request of the gateway's request path, in one process: a fleet model, an alias
(the body's `model` rewritten) and a virtual model named like its fleet model (forwarded as
it came), with an A/B of the fleet workload against another checkout (`--base DIR`).

Each run is a child process holding a frontend, a raw HTTP/1.1 upstream that answers at once,
and `--concurrency` keep-alive client connections, all on one uvloop; it reports the process's
CPU time over the requests it made (after a warm-up). Everything but the gateway is the same
code in every run, so differences are the gateway's. Rounds interleave the runs.

    .venv/bin/python -m bench.virtual_models --base /tmp/shoal-base
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httptools

BODY = b'{"model":"%s","messages":[{"role":"user","content":"Tell me a story about a shoal."}],"max_tokens":16}'
ANSWER = (
    b'{"id":"x","object":"chat.completion","created":1,"model":"mock-llm","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"Once upon a time."},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":8,"completion_tokens":5,"total_tokens":13}}'
)
METADATA = b'{"model": "mock-llm"}'
NAMES = {"fleet": "mock-llm", "alias": "gpt-fast", "passthrough": "mock-llm"}


class Upstream(asyncio.Protocol):
    """Answers every request at once: the metadata file, or a fixed chat completion."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        body = METADATA if self.url.startswith(b"/metadata") else ANSWER
        self.transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )


class Client(asyncio.Protocol):
    """One keep-alive connection sending `request` again as soon as each answer completes."""

    def __init__(self, request: bytes, budget: list[int], done: asyncio.Future[None]) -> None:
        self.request = request
        self.budget = budget
        self.done = done
        self.parser = httptools.HttpResponseParser(self)
        self.failures = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        if self.parser.get_status_code() != 200:
            self.failures += 1
        self.send()

    def send(self) -> None:
        if self.budget[0] <= 0:
            if not self.done.done():
                self.done.set_result(None)
            return
        self.budget[0] -= 1
        self.transport.write(self.request)


async def load(port: int, name: str, requests: int, concurrency: int) -> int:
    body = BODY % name.encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    loop = asyncio.get_running_loop()
    budget = [requests]
    done: asyncio.Future[None] = loop.create_future()
    clients = []
    for _ in range(concurrency):
        _, client = await loop.create_connection(
            lambda: Client(request, budget, done), "127.0.0.1", port
        )
        clients.append(client)
    for client in clients:
        client.send()
    await done
    await asyncio.sleep(0.05)  # the last answers in flight
    for client in clients:
        client.transport.close()
    return sum(c.failures for c in clients)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise RuntimeError("the frontend did not load the model in time")


async def child(workload: str, requests: int, concurrency: int) -> dict[str, Any]:
    from shoal.cards import ModelCard, slugify
    from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelKey
    from shoal.frontend import Frontend, FrontendConfig
    from shoal.store import open_store

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    store = await open_store(f"memory://bench-{os.getpid()}")
    lease = await store.grant(60)
    lease.start_keepalive()
    discovery = Discovery(store)
    endpoint = EndpointId("default", "backend", "generate")
    info = InstanceInfo("default", "backend", "generate", lease.id, f"{url}/v1", url)
    card = ModelCard.build(
        display_name="mock-llm", slug=slugify("mock-llm"), source="bench/mock-llm",
        model_types=["chat"], context_length=4096,
        metadata_files={"config.json": {
            "url": f"{url}/metadata/config.json",
            "checksum": "sha256:" + hashlib.sha256(METADATA).hexdigest(),
            "size": len(METADATA),
        }},
    )  # fmt: skip
    await discovery.register_instance(info, lease=lease.id)
    await discovery.register_model(ModelKey(endpoint, lease.id), card, lease=lease.id)
    name = NAMES[workload]
    if workload != "fleet":
        from shoal.discovery import FleetTarget, Route, publish_route

        await publish_route(store, Route("default", name, (FleetTarget("mock-llm"),)))
    with tempfile.TemporaryDirectory() as cache:
        config = FrontendConfig(port=0, cache_dir=Path(cache), drain_timeout=1)
        frontend = Frontend(config, discovery=discovery)
        await frontend.start()
        routes = getattr(frontend, "routes", None)
        await until(lambda: "mock-llm" in frontend.registry.models)
        await until(lambda: workload == "fleet" or (routes is not None and name in routes.models))
        await load(frontend.port, name, 2000, concurrency)  # warm-up
        cpu, wall = time.process_time(), time.perf_counter()
        failures = await load(frontend.port, name, requests, concurrency)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        await frontend.stop()
    server.close()
    await store.close()
    import shoal

    return {
        "workload": workload,
        "tree": str(Path(shoal.__file__).parents[2]),
        "cpu_us_per_request": cpu / requests * 1e6,
        "requests_per_s": requests / wall,
        "failures": failures,
    }


def run(tree: Path, workload: str, requests: int, concurrency: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    out = subprocess.run(
        [sys.executable, "-m", "bench.virtual_models", "--child", workload,
         "--requests", str(requests), "--concurrency", str(concurrency)],
        env=env, check=True, capture_output=True, text=True,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=sorted(NAMES))
    parser.add_argument("--base", type=Path, help="another checkout: its fleet workload is B")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--workloads", default="fleet,alias,passthrough", help="comma-separated, of this tree"
    )
    args = parser.parse_args()
    if args.child:
        import uvloop

        print(json.dumps(uvloop.run(child(args.child, args.requests, args.concurrency))))
        return
    here = Path(__file__).resolve().parents[1]
    plan = [("this tree", here, w) for w in args.workloads.split(",")]
    if args.base is not None:
        plan.insert(1, ("base", args.base, "fleet"))
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for label, tree, workload in plan:
            result = run(tree, workload, args.requests, args.concurrency)
            assert result["failures"] == 0, result
            results.setdefault((label, workload), []).append(result)
    print("| tree | workload | CPU µs/request (median) | min | max | requests/s (median) |")
    print("|---|---|---|---|---|---|")
    for (label, workload), runs in results.items():
        cpu = [r["cpu_us_per_request"] for r in runs]
        rps = statistics.median(r["requests_per_s"] for r in runs)
        print(
            f"| {label} | {workload} | {statistics.median(cpu):.1f} | {min(cpu):.1f} | "
            f"{max(cpu):.1f} | {rps:,.0f} |"
        )


if __name__ == "__main__":
    main()
