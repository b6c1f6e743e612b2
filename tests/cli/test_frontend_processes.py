"""`shoal frontend --processes N`: real processes, the official openai client. Which child
answered is read from the parent's merged metrics (`process="K"` on each child's series)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import ssl
import sys
import uuid
from pathlib import Path

import aiohttp
import openai
import pytest
import trustme
from prometheus_client.parser import text_string_to_metric_families

from shoal.cli.common import cpu_quota
from shoal.cli.common import processes as processes_flag
from shoal.cli.main import build_parser
from shoal.cli.processes import reserve_port
from shoal.frontend import Frontend, FrontendConfig
from shoal.frontend.registry.watcher import ModelWatcher
from tests.helpers import free_port, refused_past, wait_for
from tests.processes import Process, Processes, shoal

CHAT = [{"role": "user", "content": "Tell me a story."}]


def children_of(pid: int) -> set[int]:
    """Live (not zombie) children of `pid`, from /proc/*/stat."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[1] == str(pid) and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


async def scrape(metrics_url: str) -> str:
    async with aiohttp.ClientSession() as session:
        return await (await session.get(metrics_url)).text()


async def requests_by_process(metrics_url: str) -> dict[str, float]:
    """Chat requests each child answered, by its `process` label."""
    return requests_of(await scrape(metrics_url))


def requests_of(text: str) -> dict[str, float]:
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
    cores, quota = len(os.sched_getaffinity(0)), cpu_quota()
    assert processes_flag("auto") == min(cores, cores if quota is None else quota)
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

    # A child killed: every request succeeds meanwhile (the other child takes every new
    # connection, and the new child joins the port only once it has loaded the fleet).
    killed = min(first)
    os.kill(killed, signal.SIGKILL)

    failures: list[Exception] = []

    async def one_chat() -> None:
        try:
            await chat(url)
        except Exception as exc:
            failures.append(exc)

    async def restarted_serves() -> bool:
        await asyncio.gather(*(one_chat() for _ in range(8)))
        text = await scrape(metrics)
        restarted = [
            slot for slot in ("0", "1")
            if f'shoal_frontend_process_restarts_total{{process="{slot}"}} 1.0' in text
        ]  # fmt: skip
        return len(restarted) == 1 and requests_of(text).get(restarted[0], 0) > 0

    await wait_for(restarted_serves, timeout=20, interval=0, message="the new child answers")
    assert failures == []
    assert killed not in children_of(front.proc.pid)
    assert len(children_of(front.proc.pid)) == 2
    async with aiohttp.ClientSession() as session:
        for _ in range(4):  # with --metrics-port, no process serves /metrics on the API port
            async with session.get(f"{url}/metrics") as response:
                assert response.status == 404

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
    assert errors.count("cannot load the certificate") == 1, errors
    with pytest.raises(AssertionError, match="exited with 1"):
        await processes.start(
            "frontend", "--store", f"sqlite:///{tmp_path / 's.db'}", "--port", "0",
            "--processes", "2", "--namespace-sources", str(tmp_path / "none.json"),
            "--setup-timeout", "2", ready="frontend", timeout=30,
        )  # fmt: skip
    assert "none.json" in processes.started[1].stderr()


async def test_a_process_of_several_joins_the_port_only_once_it_has_loaded_the_fleet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted child listening before its first snapshot would take its share of new
    connections and answer them from an empty registry (404) while its siblings could
    have served them."""
    loading, release = asyncio.Event(), asyncio.Event()
    resync = ModelWatcher._resync

    async def slow_resync(self: ModelWatcher) -> None:
        loading.set()
        await release.wait()
        await resync(self)

    monkeypatch.setattr(ModelWatcher, "_resync", slow_resync)
    port = free_port()
    config = FrontendConfig(
        store_url=f"sqlite:///{tmp_path / 's.db'}",
        port=port,
        cache_dir=tmp_path / "cache",
        reuse_port=True,
    )
    frontend = Frontend(config)
    starting = asyncio.create_task(frontend.start())
    try:
        await asyncio.wait_for(loading.wait(), 10)
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        release.set()
        await asyncio.wait_for(starting, 10)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
    finally:
        release.set()
        with contextlib.suppress(Exception):
            await starting
        await frontend.stop()


async def test_two_processes_serve_https_and_the_whole_frontends_metrics_on_the_api_port(
    processes: Processes, tmp_path: Path
) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    ca_file, cert_file, key_file = (tmp_path / f"{n}.pem" for n in ("ca", "cert", "key"))
    ca.cert_pem.write_to_path(str(ca_file))
    cert.private_key_pem.write_to_path(str(key_file))
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(str(cert_file), append=i > 0)
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    await processes.worker(store_url, "--lease-ttl", "2", "--ttft-ms", "1", "--itl-ms", "1")
    front = await processes.start(
        "frontend", "--store", store_url, "--port", "0",
        "--cache-dir", str(tmp_path / "cache"), "--processes", "2",
        "--tls-certfile", str(cert_file), "--tls-keyfile", str(key_file), ready="frontend",
    )  # fmt: skip
    assert front.url.startswith("https://")
    context = ssl.create_default_context(cafile=str(ca_file))
    seen: set[str] = set()
    for _ in range(40):  # new connections, so both processes take some
        async with openai.AsyncOpenAI(
            base_url=f"{front.url}/v1",
            api_key="x",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(verify=context),
        ) as client:
            reply = await client.chat.completions.create(
                model="mock-llm",
                messages=CHAT,  # type: ignore[arg-type]
                max_tokens=2,
            )
        assert reply.choices[0].message.content
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as http:
            # without --metrics-port, whichever process answers shows the whole frontend's
            text = await (await http.get(f"{front.url}/metrics")).text()
        seen = set(requests_of(text))
        if seen == {"0", "1"}:
            break
    assert seen == {"0", "1"}
    assert "metrics" not in front.ready
    front.signal(signal.SIGTERM)
    assert await front.wait(20) == 0


@pytest.mark.parametrize("processes", ["1", "2"])
async def test_a_missing_certificate_is_one_line_naming_the_files(
    tmp_path: Path, processes: str
) -> None:
    cert, key = tmp_path / "absent-cert.pem", tmp_path / "absent-key.pem"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shoal.cli.main", "frontend", "--store", "memory://",
        "--port", "0", "--processes", processes,
        "--tls-certfile", str(cert), "--tls-keyfile", str(key),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        _, err = await proc.communicate()
    assert proc.returncode != 0
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert str(cert) in lines[0] and str(key) in lines[0] and "No such file" in lines[0]


async def test_a_stop_signal_ends_a_process_of_several_still_loading_discovery(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A child of `--processes N` that gets SIGTERM (forwarded by its parent) while it loads
    a large fleet stops then, as one frontend does: the parent waits for every child, so a
    child that waited for its load to end kept `shoal frontend` from stopping as long."""
    from shoal.cli.frontend_child import serve_child

    loading = asyncio.Event()

    async def endless_load(self: ModelWatcher) -> None:  # the store answered; loading goes on
        self.store_answered.set()
        loading.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(ModelWatcher, "start", endless_load)
    config = FrontendConfig(
        store_url="memory://child-stop-while-loading", port=free_port(), cache_dir=tmp_path,
        reuse_port=True,
    )  # fmt: skip
    serving = asyncio.create_task(serve_child(config, None))
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loading.wait(), 10)
        os.kill(os.getpid(), signal.SIGTERM)  # (serve_child's handler sets its stop event)
        assert await asyncio.wait_for(serving, 10) == 0
    finally:
        serving.cancel()
        with contextlib.suppress(BaseException):
            await serving
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
async def test_a_stop_signal_to_the_whole_group_during_the_start_drains_and_exits_0(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """A closed terminal (SIGHUP) or Ctrl-C (SIGINT) signals the whole process group: the
    children still starting, before their handlers, die of it. The parent took such a death
    for a child that failed its start (or a failed drain), and exited 1, not 0 as for the
    same signal once they serve."""
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    with (tmp_path / "frontend.log").open("wb") as err:
        proc = await shoal(
            "frontend", "--store", store_url, "--port", "0", "--processes", "2",
            "--cache-dir", str(tmp_path / "cache"),
            stdout=asyncio.subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
    try:
        await wait_for(lambda: len(children_of(proc.pid)) == 2, timeout=30, interval=0.005,
                       message="both children started")  # fmt: skip
        children = children_of(proc.pid)
        os.killpg(proc.pid, sig)  # (as the terminal does: every process of the group)
        code = await asyncio.wait_for(proc.wait(), 30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, (tmp_path / "frontend.log").read_text()
    await wait_for(lambda: not any(map(alive, children)), timeout=10, message="children gone")


async def test_a_second_process_group_on_the_same_port_is_refused(
    processes: Processes, tmp_path: Path
) -> None:
    """`SO_REUSEPORT` let a second `--processes` frontend join the port of a running one
    and take half of its connections (a stale instance, a port typed twice): it is refused
    as a single process is, with the port named."""
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    first = await processes.start(
        "frontend", "--store", store_url, "--port", "0", "--processes", "2",
        "--cache-dir", str(tmp_path / "cache-1"), ready="frontend",
    )  # fmt: skip
    port = first.url.rsplit(":", 1)[1]
    with pytest.raises(AssertionError, match="exited with 1"):
        await processes.start(
            "frontend", "--store", store_url, "--port", port, "--processes", "2",
            "--cache-dir", str(tmp_path / "cache-2"), ready="frontend", timeout=30,
        )  # fmt: skip
    assert f"cannot listen on 127.0.0.1:{port}" in processes.started[1].stderr()
    assert first.proc.returncode is None  # (the first serves on)


def test_the_reserved_port_refuses_a_plain_server_while_no_child_listens() -> None:
    """While every child restarts, only the parent's reservation holds the port: a server
    that binds with `SO_REUSEADDR` (most do) took it, and the children then failed to
    start for ever. It is refused; a child (`SO_REUSEPORT`) still joins."""
    reserved = reserve_port("127.0.0.1", 0)
    port = reserved.getsockname()[1]
    try:
        intruder = socket.socket()
        intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with intruder, pytest.raises(OSError) as refused:
            intruder.bind(("127.0.0.1", port))
            intruder.listen()
        assert refused.value.errno == errno.EADDRINUSE
        child = socket.socket()
        child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        with child:
            child.bind(("127.0.0.1", port))
            child.listen()
        with pytest.raises(OSError, match="in use"):
            reserve_port("127.0.0.1", port)  # (another group's reservation: refused too)
    finally:
        reserved.close()


async def test_processes_serve_metrics_on_an_ipv6_host(
    processes: Processes, tmp_path: Path
) -> None:
    """`--host ::1` with `--metrics-port`: the parent's metrics server took the default
    family (IPv4) and failed to start where one process starts."""
    front = await processes.start(
        "frontend", "--store", f"sqlite:///{tmp_path / 'store.db'}", "--host", "::1",
        "--port", "0", "--metrics-port", "0", "--processes", "2",
        "--cache-dir", str(tmp_path / "cache"), ready="frontend",
    )  # fmt: skip
    metrics = front.ready["metrics"]
    assert "[::1]" in metrics, metrics
    assert "shoal_frontend_processes_up" in await scrape(metrics)


async def test_the_parents_metrics_server_refuses_connections_past_its_bound(
    processes: Processes, tmp_path: Path
) -> None:
    """The parent's merged `/metrics` (`--metrics-port`) was aiohttp's plain runner: any
    number of connections, a silent one held for good, so a client could use up the
    parent's file descriptors (which its children's restarts need). It is bounded as a
    worker's status server is: past 128 connections a new one is answered 503
    `too_many_connections` and closed."""
    front = await processes.start(
        "frontend", "--store", f"sqlite:///{tmp_path / 'store.db'}", "--host", "127.0.0.1",
        "--port", "0", "--metrics-port", "0", "--processes", "2",
        "--cache-dir", str(tmp_path / "cache"), ready="frontend",
    )  # fmt: skip
    metrics = front.ready["metrics"]
    host, port = metrics.removeprefix("http://").split("/", 1)[0].rsplit(":", 1)
    for _, held_writer in await refused_past(host, int(port), 128):
        held_writer.close()

    async def scraped() -> bool:  # (once the server has seen them go)
        return "shoal_frontend_processes_up" in await scrape(metrics)

    await wait_for(scraped, message="/metrics never answered once the connections went")
