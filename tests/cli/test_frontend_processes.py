"""`shoal frontend --processes N`: real processes, the official openai client. Which child
answered is read from the parent's merged metrics (`process="K"` on each child's series)."""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shoal.cli.common import processes as processes_flag
from shoal.cli.main import build_parser
from tests.helpers import wait_for
from tests.processes import Process, Processes

CHAT = [{"role": "user", "content": "Tell me a story."}]


def children_of(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(child) for child in f.read().split()}


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


async def requests_by_process(metrics_url: str) -> dict[str, float]:
    """Chat requests each child answered, by its `process` label."""
    async with aiohttp.ClientSession() as session:
        text = await (await session.get(metrics_url)).text()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "shoal_frontend_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    slot = sample.labels["process"]
                    counts[slot] = counts.get(slot, 0.0) + sample.value
    return counts


async def chat(url: str) -> None:
    """One chat completion on a new connection (a new client each time: the kernel places
    each new connection on one of the children)."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="mock-llm",
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=2,
        )
    assert reply.choices[0].message.content


def test_processes_flag_takes_a_count_or_auto() -> None:
    assert processes_flag("auto") == len(os.sched_getaffinity(0))
    assert build_parser().parse_args(["frontend", "--processes", "3"]).processes == 3
    assert build_parser().parse_args(["frontend"]).processes == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["frontend", "--processes", "0"])


async def test_two_processes_serve_survive_a_killed_child_and_drain_on_sigterm(
    processes: Processes, tmp_path: Path
) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    namespace = f"procs-{uuid.uuid4().hex[:8]}"
    await processes.worker(
        store_url, "--namespace", namespace, "--lease-ttl", "2", "--ttft-ms", "5",
        "--itl-ms", "20",
    )  # fmt: skip
    front: Process = await processes.start(
        "frontend", "--store", store_url, "--port", "0", "--metrics-port", "0",
        "--namespace", namespace, "--cache-dir", str(tmp_path / "cache"),
        "--processes", "2", "--drain-timeout", "10", ready="frontend",
    )  # fmt: skip
    assert front.ready["processes"] == "2"
    url, metrics = front.url, front.ready["metrics"]
    first = children_of(front.proc.pid)
    assert len(first) == 2

    async def served_by_both() -> bool:
        await chat(url)
        counts = await requests_by_process(metrics)
        return counts.get("0", 0) > 0 and counts.get("1", 0) > 0

    await wait_for(served_by_both, timeout=20, interval=0, message="both children answer")

    # A child killed: the other serves every new connection meanwhile, and it comes back.
    killed = min(first)
    os.kill(killed, signal.SIGKILL)
    await wait_for(lambda: killed not in children_of(front.proc.pid), timeout=5)
    for _ in range(10):
        await chat(url)
    await wait_for(lambda: len(children_of(front.proc.pid) - first) == 1, timeout=10)
    restarted = (children_of(front.proc.pid) - first).pop()

    async def restarted_serves() -> bool:
        await chat(url)
        counts = await requests_by_process(metrics)
        return len(counts) == 2 and restarted in children_of(front.proc.pid)

    await wait_for(restarted_serves, timeout=20, interval=0, message="the new child answers")
    async with aiohttp.ClientSession() as session:
        text = await (await session.get(metrics)).text()
    assert 'shoal_frontend_process_restarts_total{process="0"}' in text or (
        'shoal_frontend_process_restarts_total{process="1"}' in text
    )

    # SIGTERM: both children drain (a stream in flight ends whole), the parent exits 0.
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="mock-llm",
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=20,
            stream=True,
        )
        chunks = aiter(stream)
        await anext(chunks)
        children = children_of(front.proc.pid)
        front.signal(signal.SIGTERM)
        rest = [c async for c in chunks]
    assert rest[-1].choices[0].finish_reason == "length"
    assert await front.wait(20) == 0
    assert not any(alive(pid) for pid in children)  # drained, exited and reaped
    assert front.proc.stdout is not None
    later = (await front.proc.stdout.read()).decode()
    lines = front.stdout + later.splitlines(keepends=True)
    assert sum(line.startswith("shoal frontend ready:") for line in lines) == 1, lines


async def test_processes_start_fails_whole_when_a_child_cannot_start(
    processes: Processes, tmp_path: Path
) -> None:
    """Settings every child would refuse are refused once by the parent (exit 1); a child
    that exits before it serves fails the start the same way (its error on stderr)."""
    with pytest.raises(AssertionError, match="exited with 1"):
        await processes.start(
            "frontend", "--store", f"sqlite:///{tmp_path / 's.db'}", "--port", "0",
            "--processes", "2", "--tls-certfile", str(tmp_path / "none.pem"),
            "--tls-keyfile", str(tmp_path / "none.key"), ready="frontend", timeout=30,
        )  # fmt: skip
    errors = processes.started[0].stderr()
    assert errors.count("--tls-certfile/--tls-keyfile: [Errno 2]") == 1, errors
    with pytest.raises(AssertionError, match="exited with 1"):
        await processes.start(
            "frontend", "--store", f"sqlite:///{tmp_path / 's.db'}", "--port", "0",
            "--processes", "2", "--namespace-sources", str(tmp_path / "none.json"),
            "--setup-timeout", "2", ready="frontend", timeout=30,
        )  # fmt: skip
    assert "none.json" in processes.started[1].stderr()
