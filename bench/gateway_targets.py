"""Processes for bench/gateway.py: the mocker worker and the gateways in front of it.

Each process runs in its own process group with its output in a log file; a target is ready
when a chat completion through it succeeds. CPU time is read from /proc for a whole process
tree, so gateways that fork workers are counted in full.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.cli.common import parse_ready_line

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
API_KEY = "sk-bench"
SHOAL = [sys.executable, "-m", "shoal.cli.main", "--log-level", "WARNING"]
# LiteLLM offline: no fetches of cost maps, presets or telemetry at start.
LITELLM_ENV = {
    "LITELLM_MASTER_KEY": API_KEY,
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_TELEMETRY": "False",
    "HF_HUB_OFFLINE": "1",
}
# urllib without any proxy from the environment: every address here is on loopback.
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class StartError(Exception):
    """A target could not be started or never became ready."""


@dataclasses.dataclass
class Proc:
    """A process started in its own process group, its output in a log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.popen.poll() is not None:
            raise StartError(
                f"{self.name} exited with {self.popen.returncode}; its log ends:\n{self.tail()}"
            )

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the whole group, then SIGKILL to what is left after `grace` seconds."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


def _absolute_pythonpath() -> dict[str, str]:
    """`PYTHONPATH` with its entries made absolute: the processes run in the session's
    directory, where `PYTHONPATH=src` would find nothing, and they would import the venv's
    installed shoal instead of the tree under test."""
    value = os.environ.get("PYTHONPATH")
    if not value:
        return {}
    entries = [str(Path(entry).resolve()) for entry in value.split(os.pathsep) if entry]
    return {"PYTHONPATH": os.pathsep.join(entries)}


class Session:
    """Starts the benchmark's processes, pinned to cores or not, and stops them all."""

    def __init__(self, workdir: Path, pin: bool) -> None:
        self.workdir = workdir
        self.pin = pin
        self.procs: list[Proc] = []

    def server_prefix(self) -> list[str]:
        """Worker and gateways: core 1 when pinned."""
        return ["taskset", "-c", "1"] if self.pin else []

    def client_prefix(self) -> list[str]:
        """Load generators: core 0 when pinned."""
        return ["taskset", "-c", "0"] if self.pin else []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [*self.server_prefix(), *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={
                    **os.environ,
                    **_absolute_pythonpath(),
                    "PYTHONUNBUFFERED": "1",
                    **(env or {}),
                },
                cwd=self.workdir,
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        """Gateways first, the worker (started first) last: it drains on SIGTERM."""
        for proc in reversed(self.procs):
            proc.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# --- CPU time ---------------------------------------------------------------------------------


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """Fields 3.. of /proc/PID/stat (after the command name, which may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def tree_pids(root: int) -> list[int]:
    """`root` and all its descendants, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat_fields(entry.name)):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, ()))
    return pids


def tree_cpu_seconds(root: int) -> float:
    """User+system CPU seconds of a process tree: all threads, and children it has reaped."""
    return sum(tree_cpu_split(root))


def tree_cpu_split(root: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process tree: all threads, and children it has reaped.
    System time is the kernel's work for the tree (system calls, and the loopback's TCP
    processing a sender runs), the floor no user-space change removes."""
    user = system = 0
    for pid in tree_pids(root):
        if fields := _stat_fields(pid):
            # stat(5) fields 14-17: utime, stime, cutime, cstime.
            user += int(fields[11]) + int(fields[13])
            system += int(fields[12]) + int(fields[14])
    return user / CLK_TCK, system / CLK_TCK


def machine_busy() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = (
            int(x) for x in f.readline().split()[1:9]
        )
    # Guest time is already in user and nice; steal is time this machine did not get.
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait + steal


# --- readiness --------------------------------------------------------------------------------


def http(method: str, url: str, body: bytes | None = None, timeout: float = 5.0) -> bytes:
    request = urllib.request.Request(url, data=body, method=method)
    request.add_header("Authorization", f"Bearer {API_KEY}")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    with HTTP.open(request, timeout=timeout) as response:
        data: bytes = response.read()
        return data


def wait_until(what: str, check: Callable[[], bool], deadline_s: float, proc: Proc) -> None:
    """Poll `check` until it is true; StartError at the deadline or if `proc` exits."""
    deadline = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < deadline:
        proc.check_alive()
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
            last = f" (last error: {exc})"
        time.sleep(0.2)
    raise StartError(
        f"{proc.name}: {what} not within {deadline_s:.0f} s{last}; its log ends:\n{proc.tail()}"
    )


def chat_body(model: str, max_tokens: int, stream: bool = False) -> bytes:
    """The request every workload sends (streaming adds `"stream": true`)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story about a shoal of fish."}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def chat_ok(url: str, model: str) -> bool:
    reply = json.loads(http("POST", f"{url}/v1/chat/completions", chat_body(model, 4)))
    return bool(reply["choices"])


# --- targets ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    """Something to send the workloads to: the worker itself, or a gateway in front of it."""

    name: str
    url: str
    proc: Proc | None  # the gateway's process; None for direct
    version: str = ""
    scale: float = 1.0  # multiplies run durations


def start_worker(
    session: Session, model: str, store: str, index: int = 0, speedup: float = 0.0
) -> tuple[Proc, str]:
    """`shoal worker --engine mocker --speedup 0` (or `speedup`); returns it and its URL."""
    argv = [
        *SHOAL,
        "worker",
        *("--engine", "mocker", "--model", model, "--store", store, "--speedup", f"{speedup:g}"),
        *("--host", "127.0.0.1", "--port", str(free_port())),
        *("--status-port", str(free_port())),
    ]
    proc = session.start("worker" if index == 0 else f"worker-{index + 1}", argv)
    found: list[str] = []

    def printed_ready() -> bool:
        for line in proc.log.read_text(errors="replace").splitlines():
            if (ready := parse_ready_line(line, "worker")) is not None:
                found.append(ready["url"].rstrip("/"))
                return True
        return False

    wait_until("the ready line", printed_ready, 60, proc)
    wait_until("a chat completion", lambda: chat_ok(found[0], model), 30, proc)
    return proc, found[0]


async def _put_grant(store_url: str) -> None:
    # Imported here: only the keys targets need the store's client.
    from shoal.discovery.grants import Grant, hash_secret
    from shoal.store import open_store

    store = await open_store(store_url)
    try:
        # Limits far above what this machine can serve: checked and counted, never hit.
        made = Grant(
            workspace="default", name="bench", hash=hash_secret(API_KEY), rpm=10**11, tpm=10**11
        )
        await store.put(made.key, made.to_json())
    finally:
        await store.close()


def start_redis(session: Session) -> str:
    """A throwaway `redis-server` on a free loopback port, without persistence; its URL."""
    port = free_port()
    argv = [
        shutil.which("redis-server") or "/usr/bin/redis-server",
        *("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"),
        *("--dir", str(session.workdir), "--loglevel", "warning"),
    ]
    proc = session.start("redis", argv)

    def pong() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")

    wait_until("PONG", pong, 10, proc)
    return f"redis://127.0.0.1:{port}"


def start_shoal(
    session: Session,
    model: str,
    store: str,
    processes: int = 1,
    auth: str = "",
    base: Path | None = None,
    router: str = "round-robin",
) -> Target:
    """`shoal frontend`; with `processes` > 1, that many processes on the port (target
    `shoal-pN`), ready once its one ready line is printed (every process loaded).

    `auth` "keys" (target `shoal-keys`): `--auth keys`, with a grant for the bench's bearer
    written into the store first (no allow-list, rpm and tpm never reached); "limits" (target
    `shoal-limits`): that and `--limits` on a throwaway redis-server of its own. The load
    generators send the same bearer to every target: the requests are byte for byte the same.

    `router`: its `--router` policy. `base`: run the frontend from that source tree instead (`PYTHONPATH=BASE/src`, target
    `NAME@base`), to compare a change with what it changes in one session.
    """
    port = free_port()
    name = "shoal" if processes == 1 else f"shoal-p{processes}"
    argv = [
        *SHOAL,
        "frontend",
        *("--store", store, "--host", "127.0.0.1", "--port", str(port)),
        *("--router", router, "--cache-dir", str(session.workdir / "cache")),
        *("--processes", str(processes)),
    ]
    if auth:
        name = f"shoal-{auth}"
        asyncio.run(_put_grant(store))
        argv += ["--auth", "keys"]
    if auth == "limits":
        argv += ["--limits", start_redis(session)]
    env = None
    if base is not None:
        name += "@base"
        env = {"PYTHONPATH": str(base.resolve() / "src")}
    proc = session.start(name, argv, env=env)
    wait_until(
        "the ready line",
        lambda: "shoal frontend ready:" in proc.log.read_text(errors="replace"),
        60,
        proc,
    )
    url = f"http://127.0.0.1:{port}"

    def model_listed() -> bool:
        http("GET", f"{url}/health")
        models = json.loads(http("GET", f"{url}/v1/models"))
        return any(m.get("id") == model for m in models.get("data", []))

    wait_until("/health and the model in /v1/models", model_listed, 60, proc)
    wait_until("a chat completion", lambda: chat_ok(url, model), 30, proc)
    return Target(name, url, proc, version=git_version(base or ROOT))


def start_vllm_router(session: Session, peers: Path, workers: list[str], model: str) -> Target:
    argv = [
        str(peers / "bin" / "vllm-router"),
        *("--host", "127.0.0.1", "--port", str(free_port())),
        *("--worker-urls", *workers, "--policy", "round_robin", "--log-level", "warning"),
        # Metrics stay on, as in shoal; each router gets its own port (29000 by default).
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
    ]
    return _start_router(session, "vllm-router", argv, model, peers)


def start_sglang_router(session: Session, peers: Path, workers: list[str], model: str) -> Target:
    argv = [
        *(str(peers / "bin" / "python"), "-m", "sglang_router.launch_router"),
        *("--host", "127.0.0.1", "--port", str(free_port())),
        *("--worker-urls", *workers, "--policy", "round_robin", "--log-level", "warn"),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
    ]
    return _start_router(session, "sglang-router", argv, model, peers)


def _start_router(session: Session, name: str, argv: list[str], model: str, peers: Path) -> Target:
    proc = session.start(name, argv)
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    wait_until("a chat completion", lambda: chat_ok(url, model), 60, proc)
    return Target(name, url, proc, version=peer_version(peers, name))


def start_litellm(session: Session, peers: Path, worker: str, model: str, scale: float) -> Target:
    config = session.workdir / "litellm.yaml"
    params = {"model": f"openai/{model}", "api_base": f"{worker}/v1", "api_key": "x"}
    # JSON is YAML: no YAML library needed here.
    config.write_text(
        json.dumps(
            {
                "model_list": [{"model_name": model, "litellm_params": params}],
                "general_settings": {"master_key": API_KEY},
            },
            indent=2,
        )
    )
    port = free_port()
    argv = [
        *(str(peers / "bin" / "litellm"), "--config", str(config)),
        *("--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"),
    ]
    proc = session.start("litellm", argv, env=LITELLM_ENV)
    url = f"http://127.0.0.1:{port}"
    wait_until("a chat completion", lambda: chat_ok(url, model), 180, proc)
    return Target("litellm", url, proc, version=peer_version(peers, "litellm"), scale=scale)


def peer_version(peers: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    out = subprocess.run([str(peers / "bin" / "python"), "-c", code], capture_output=True)
    return out.stdout.decode().strip() or "?"


def git_version(root: Path = ROOT) -> str:
    out = subprocess.run(
        ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True
    )
    return out.stdout.decode().strip() or "?"


def peer_missing(name: str, peers: Path) -> str | None:
    """Why the peer gateway `name` cannot run, or None if it is installed."""
    exe = {
        "vllm-router": peers / "bin" / "vllm-router",
        "sglang-router": peers / "bin" / "python",
        "litellm": peers / "bin" / "litellm",
    }[name]
    if not exe.exists():
        return f"not installed ({exe} missing; run bash bench/install-peers.sh)"
    if name == "sglang-router":
        found = subprocess.run(
            [str(exe), "-c", "import sglang_router.launch_router"], capture_output=True
        )
        if found.returncode != 0:
            return "not installed (no sglang_router; run bash bench/install-peers.sh)"
    return None
