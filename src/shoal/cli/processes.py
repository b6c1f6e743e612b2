"""`shoal frontend --processes N`: N frontend processes on one port, and their supervisor.

The parent reserves the port (bound with `SO_REUSEPORT`, never listening, so `--port 0`
resolves once and no other program takes the port while a child restarts), then starts N
children (`python -m shoal.cli.frontend_child`, the frontend's settings on their stdin), each
in a session of its own: a closed terminal's SIGHUP or a Ctrl-C reaches the parent alone,
which forwards it (a child still importing died of it, and the parent exited 1). Each
child is a whole frontend: its own event loop, registry, watches and router, listening on
the port with `SO_REUSEPORT`, so the kernel spreads new connections over the children
evenly (a shared accept queue would let whichever loop wakes first take a burst) and
each child builds its own TLS context from the files. A child also serves its own
`/metrics` on a private loopback port and names it in its ready line (`frontend-process`).

The parent prints the one `shoal frontend ready:` line once every child is ready; restarts
a child that dies, after a backoff (0.5 s doubling to 30 s, back to 0.5 s once a child has
lived 30 s), and kills one whose private port stops answering (`_watch`); forwards SIGINT,
SIGTERM and SIGHUP to every child (as SIGTERM), which drain, and exits 0 when all drained
(a child still running `STOP_GRACE` after its drain timeout is killed: exit 1). A child that
fails before its first ready line fails the start (exit 1; its error is on the shared stderr).
`/metrics` is the parent's: the children's metrics merged, each sample labelled
`process="K"` (the child's slot, kept across restarts), plus the parent's own
`shoal_frontend_process*` series; served on `--metrics-port` when given, else
on a loopback port the children fetch it from to answer `/metrics` on the API port.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import pickle
import re
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shoal.cli.common import on_stop_signals, parse_ready_line, print_ready
from shoal.frontend import FrontendConfig
from shoal.frontend.config import server_tls, url_host
from shoal.worker.http_server import STATUS_MAX_CONNECTIONS, STATUS_SEND_TIMEOUT, BoundedRunner

log = logging.getLogger(__name__)

CHILD = "frontend-process"
"""The component of a child's ready line (the parent reads it; it never reaches stdout)."""
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
SCRAPE_TIMEOUT = 5.0
WATCH_INTERVAL = 5.0
"""Seconds between two probes of a ready child's private server (each bounded as long)."""
WATCH_MISSES = 3
"""Probes in a row a child may leave unanswered before it is killed (and started again)."""
STOP_GRACE = 10.0
"""Seconds a child may take to exit after its `--drain-timeout`, once sent SIGTERM, before
it is killed (a child stopped or stuck must not keep the parent, and the port, for ever)."""
MAX_CHILD_METRICS_BYTES = 64 * 1024 * 1024
"""The largest `/metrics` answer of a child that is merged (30 MB at 10,000 models)."""


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` with `SO_REUSEPORT` and not listening: it holds the
    port (resolving 0) for the children, and no connection is ever queued on it.

    `OSError` (address in use) when a server or another group of processes holds the
    port: `SO_REUSEPORT` alone would let a second group join this one's and take half its
    connections. Once bound it keeps `SO_REUSEPORT` only: a server binding with
    `SO_REUSEADDR`, as most do, is refused even while no child listens (all restarting),
    and the children (`SO_REUSEPORT`, this user) still join."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    if port:  # (a port of its own, 0, is nobody's)
        with socket.socket(family, kind, proto) as probe:  # (refused by any holder)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (TIME_WAIT is none)
            probe.bind(address)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (the bind, as above)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
    except OSError:
        sock.close()
        raise
    return sock


class Child:
    """One slot: its current process, whether it served once, its metrics URL."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self.metrics_url: str | None = None
        self.url: str | None = None
        self.restarts = 0
        self.answered = 0  # probes its current process answered (`Supervisor._watch`)
        self.stopped_with: int | str | None = None  # the exit of the child the stop ended
        self.serving = False  # its current process printed its ready line


class Supervisor:
    """Runs `processes` frontend children on `config`'s port (see the module doc)."""

    def __init__(self, config: FrontendConfig, processes: int) -> None:
        self.config = config
        self.children = [Child(slot) for slot in range(processes)]
        self.stopping = False
        self.failed = asyncio.Event()  # a child exited before its first ready line
        self._stop_requested = asyncio.Event()  # ends a slot's backoff
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_runner: web.AppRunner | None = None
        self.child_command = (sys.executable, "-m", "shoal.cli.frontend_child")
        self._rendering: asyncio.Future[bytes] | None = None  # the merge in progress

    async def run(self) -> int:
        stop = asyncio.Event()
        on_stop_signals(stop)
        try:  # once here, not N times from the children
            server_tls(self.config.tls_certfile, self.config.tls_keyfile)
        except (OSError, ValueError, ssl.SSLError) as exc:
            print(f"shoal frontend: --tls-certfile/--tls-keyfile: {exc}", file=sys.stderr)
            return 1
        try:
            reserved = reserve_port(self.config.host, self.config.port)
        except OSError as exc:
            print(
                f"shoal frontend: cannot listen on {self.config.host}:{self.config.port}: {exc}",
                file=sys.stderr,
            )
            return 1
        with reserved:
            try:
                merged = await self._serve_metrics()
            except OSError as exc:
                print(f"shoal frontend: --metrics-port: {exc}", file=sys.stderr)
                return 1
            port = reserved.getsockname()[1]
            child_config = replace(self.config, port=port, metrics_port=None, reuse_port=True)
            self._tasks = [
                asyncio.create_task(self._keep(child, child_config, merged))
                for child in self.children
            ]
            all_ready = asyncio.create_task(self._all_ready())
            failed = asyncio.create_task(self.failed.wait())
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait(
                (all_ready, failed, stopped, *self._tasks), return_when=asyncio.FIRST_COMPLETED
            )
            for task in (all_ready, failed, stopped):
                task.cancel()
            ended = [task for task in self._tasks if task.done()]  # (a slot is never let go)
            code = 1 if self.failed.is_set() or ended else 0
            if code == 0 and not stop.is_set():
                url = self.children[0].url
                fields = {"metrics": merged} if self.config.metrics_port is not None else {}
                print_ready("frontend", url=url, processes=len(self.children), **fields)
                log.info("frontend serving on %s in %d processes", url, len(self.children))
                await stop.wait()
            log.info("stopping: draining the frontend processes")
            drained = await self._stop()
            return code if code else (0 if drained else 1)

    async def _all_ready(self) -> None:
        for child in self.children:
            await child.ready.wait()

    async def _keep(self, child: Child, config: FrontendConfig, merged: str) -> None:
        """Run the slot's child, again after it dies or its supervision fails (with a
        backoff), until stopping. A child that was never ready fails the start."""
        backoff = BACKOFF_FIRST
        while not self.stopping:
            started = time.monotonic()
            try:
                code: int | str = await self._run_once(child, config, merged)
            except Exception as exc:  # a fault of the supervision: this slot starts again
                log.exception("frontend process slot %d failed: %s", child.slot, exc)
                code = f"a supervision error ({type(exc).__name__})"
                await self._end(child)
            if self.stopping:
                # A child still starting had nothing to drain: the stop's SIGTERM may find
                # it before its handler (importing) and end it, which is no failed drain.
                starting = not child.serving and code == -signal.SIGTERM
                child.stopped_with = 0 if starting else code
                return
            if not child.ready.is_set():
                self.failed.set()
                return
            if time.monotonic() - started >= BACKOFF_MAX:
                backoff = BACKOFF_FIRST
            log.warning(
                "frontend process %d (slot %d) exited with %s; restarting in %gs",
                child.proc.pid if child.proc else 0,
                child.slot,
                code,
                backoff,
            )
            child.metrics_url = None
            with contextlib.suppress(TimeoutError):  # a stop ends the backoff: none to start
                await asyncio.wait_for(self._stop_requested.wait(), backoff)
            if self.stopping:
                return
            backoff = min(backoff * 2, BACKOFF_MAX)
            child.restarts += 1

    @staticmethod
    async def _end(child: Child) -> None:
        """Kill the slot's child if it still runs (its output is no longer read)."""
        proc = child.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def _run_once(self, child: Child, config: FrontendConfig, merged: str) -> int:
        """Start the child, read its ready line, pass its later stdout on; its exit code."""
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.child_command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                start_new_session=True,  # (a terminal's signals are ours to forward)
            )
        except OSError as exc:  # no process, no memory: as if it died at once
            log.error("cannot start a frontend process (slot %d): %s", child.slot, exc)
            return -1
        child.proc, child.serving = proc, False
        assert proc.stdin is not None and proc.stdout is not None
        with contextlib.suppress(OSError):  # it died at once: its exit code says so
            proc.stdin.write(
                pickle.dumps(
                    (
                        config,
                        self._child_role(merged),
                        os.getpid(),
                        logging.getLogger().level,
                    )
                )
            )
            await proc.stdin.drain()
        proc.stdin.close()
        if self.stopping:  # a stop signal came while it started: it never saw it
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        watch: asyncio.Task[None] | None = None
        try:
            while line := await _read_line(proc.stdout):
                text = line.decode(errors="replace")
                fields = parse_ready_line(text, CHILD) if line.endswith(b"\n") else None
                if fields is None:
                    with contextlib.suppress(OSError, ValueError):  # our stdout is gone: dropped
                        sys.stdout.write(text)
                        sys.stdout.flush()
                    continue
                child.url, child.metrics_url = fields["url"], fields["metrics"]
                child.serving = True
                child.ready.set()
                if watch is None:
                    watch = asyncio.create_task(self._watch(child, proc, child.metrics_url))
            return await proc.wait()
        finally:
            if watch is not None:
                watch.cancel()

    async def _watch(self, child: Child, proc: asyncio.subprocess.Process, url: str) -> None:
        """Kill the child once its private server leaves `WATCH_MISSES` probes in a row
        unanswered (stopped, or its loop stuck): it would keep its share of the port's new
        connections, each left hanging, and exits are all `_keep` sees. Any HTTP answer
        will do (the server answers 404 but for `/metrics`, which is not asked: a render)."""
        probe = url.rsplit("/", 1)[0] + "/live"
        child.answered, misses, last = 0, 0, time.monotonic()
        timeout = aiohttp.ClientTimeout(total=WATCH_INTERVAL)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while proc.returncode is None and not self.stopping:
                await asyncio.sleep(WATCH_INTERVAL)
                try:
                    async with session.get(probe) as response:
                        await response.read()
                    child.answered, misses, last = child.answered + 1, 0, time.monotonic()
                except (aiohttp.ClientError, TimeoutError):
                    misses += 1
                if misses >= WATCH_MISSES and proc.returncode is None and not self.stopping:
                    log.error(
                        "frontend process %d (slot %d) has not answered for %.0fs: killed",
                        proc.pid, child.slot, time.monotonic() - last,
                    )  # fmt: skip
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    return

    async def _stop(self) -> bool:
        """Drain every child (SIGTERM), killing one still running `--drain-timeout` plus
        `STOP_GRACE` later; whether every child running at the stop exited 0 (a slot waiting
        out its backoff has none)."""
        self.stopping = True
        self._stop_requested.set()
        for child in self.children:
            if child.proc is not None and child.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        # Each slot's task ends once its child exited (one starting now is sent SIGTERM).
        pending: set[asyncio.Task[None]] = set(self._tasks)
        if pending:
            _, pending = await asyncio.wait(pending, timeout=self.config.drain_timeout + STOP_GRACE)
        if pending:
            for child in self.children:
                proc = child.proc
                if proc is not None and proc.returncode is None:
                    log.error(
                        "frontend process %d (slot %d) still runs %gs after SIGTERM: killed",
                        proc.pid, child.slot, self.config.drain_timeout + STOP_GRACE,
                    )  # fmt: skip
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            _, pending = await asyncio.wait(pending, timeout=STOP_GRACE)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        drained = not pending and all(c.stopped_with in (None, 0) for c in self.children)
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        return drained

    async def _serve_metrics(self) -> str:
        """Serve the merged `/metrics`: on `--metrics-port` when given, else on a loopback
        port that the children ask for `/metrics` on the API port. Its URL."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        # (bounded as a worker's status server: connections, heads, idle and unread answers)
        runner = BoundedRunner(
            app,
            max_connections=STATUS_MAX_CONNECTIONS,
            send_timeout=STATUS_SEND_TIMEOUT,
            access_log=None,
        )
        await runner.setup()
        self._metrics_runner = runner
        given = self.config.metrics_port
        host = self.config.host if given is not None else "127.0.0.1"
        family = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, given or 0), family=family, backlog=64)
        await web.SockSite(runner, sock).start()
        return f"http://{url_host(host)}:{sock.getsockname()[1]}/metrics"

    def _child_role(self, merged: str) -> str | None:
        """What a child's API port does for `/metrics`: None (404: the parent serves it on
        `--metrics-port`), or the URL of the merged metrics it answers with."""
        return None if self.config.metrics_port is not None else merged

    async def _metrics(self, _: web.Request) -> web.Response:
        """The merged metrics; requests that come while a merge is in progress share it
        (each child's `/metrics` on the public API port asks here: N scrapes a request)."""
        if self._rendering is None:
            rendering = self._rendering = asyncio.ensure_future(self._render())
            rendering.add_done_callback(lambda _: setattr(self, "_rendering", None))
        body = await asyncio.shield(self._rendering)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def _render(self) -> bytes:
        bodies = await self.scrape()
        return await asyncio.to_thread(  # (seconds at 10,000 models)
            merge_bodies, bodies, lambda shown: generate_latest(registry_of(self._own(shown)))
        )

    async def scrape(self) -> dict[int, list[bytes]]:
        """Each ready child's metrics body, in pieces, by slot (a child down now, or whose
        answer is over `MAX_CHILD_METRICS_BYTES`, is left out: logged)."""
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(slot: int, url: str) -> list[bytes] | None:
                try:
                    async with session.get(url) as response:
                        if response.status != 200:
                            return None
                        pieces, size = [], 0
                        async for piece in response.content.iter_any():
                            size += len(piece)
                            if size > MAX_CHILD_METRICS_BYTES:
                                log.warning(
                                    "frontend process slot %d: its /metrics are left out: "
                                    "over %d bytes", slot, MAX_CHILD_METRICS_BYTES,
                                )  # fmt: skip
                                return None
                            pieces.append(piece)
                        return pieces
                except (aiohttp.ClientError, TimeoutError):
                    return None

            wanted = [(c.slot, c.metrics_url) for c in self.children if c.metrics_url]
            bodies = await asyncio.gather(*(one(slot, url) for slot, url in wanted))
        return {slot: b for (slot, _), b in zip(wanted, bodies, strict=True) if b is not None}

    def _own(self, shown: set[int]) -> list[Metric]:
        """The parent's own series; `shown`: the slots whose metrics are in this answer (a
        child that is running but did not answer is not up)."""
        up = GaugeMetricFamily(
            "shoal_frontend_processes_up",
            "Frontend processes running, ready and answering (their metrics shown), by slot",
            labels=["process"],
        )
        restarts = CounterMetricFamily(
            "shoal_frontend_process_restarts",
            "Times the supervisor restarted a frontend process, by slot",
            labels=["process"],
        )
        for child in self.children:
            alive = child.proc is not None and child.proc.returncode is None
            up.add_metric([str(child.slot)], 1.0 if alive and child.slot in shown else 0.0)
            restarts.add_metric([str(child.slot)], child.restarts)
        return [up, restarts]


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_VALUE = r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|Inf|NaN)"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*(?:\\.[^"\\\n]*)*"'
_SAMPLE = re.compile(
    rf"({_NAME})(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})?( {_VALUE}(?: -?[0-9]+)?)"
)
_HEADER = re.compile(rf"# (HELP|TYPE) ({_NAME})(?: (.*))?")
_TYPES = frozenset(("counter", "gauge", "histogram", "summary", "untyped"))
_LABELS = re.compile(_LABEL)  # one label of a sample's labels (`_SAMPLE` checked them all)


class Unreadable(ValueError):
    """A child's `/metrics` text that is not Prometheus' text format."""


def relabel(slot: int, text: str) -> dict[str, tuple[list[str], list[str]]]:
    """The families of one child's metrics text, by name, in their order: each one's
    header lines (`# HELP`, `# TYPE`) and its sample lines with `process="slot"` added (a
    `process` label of the child's own is replaced). Lines are checked, never parsed into
    objects: a large fleet's text is 30 MB. `Unreadable` names the first bad line."""
    process = f'process="{slot}"'
    families: dict[str, tuple[list[str], list[str]]] = {}
    current = families[""] = ([], [])  # samples before any header
    for number, line in enumerate(text.split("\n"), 1):
        if not line:
            continue
        if line[0] == "#":
            header = _HEADER.fullmatch(line)
            if header is None:
                continue  # a comment
            kind, name, rest = header.groups()
            if kind == "TYPE" and rest not in _TYPES:
                raise Unreadable(f"line {number}: {line[:200]!r}")
            current = families.setdefault(name, ([], []))
            current[0].append(line)
            continue
        sample = _SAMPLE.fullmatch(line)
        if sample is None:
            raise Unreadable(f"line {number}: {line[:200]!r}")
        name, labels, value = sample.groups()
        if labels and 'process="' in labels:  # (maybe only in a value: split to be sure)
            labels = ",".join(
                label for label in _LABELS.findall(labels) if not label.startswith('process="')
            )
        if labels:
            current[1].append(f"{name}{{{labels.rstrip(',')},{process}}}{value}")
        else:
            current[1].append(f"{name}{{{process}}}{value}")
    return families


def merge_bodies(
    bodies: dict[int, list[bytes]], own: Callable[[set[int]], bytes] = lambda _: b""
) -> bytes:
    """`merge` of the children's bodies as they were read (in pieces, UTF-8), then `own` of
    the slots it merged."""
    shown: set[int] = set()
    texts = {slot: b"".join(body).decode(errors="replace") for slot, body in bodies.items()}
    merged = merge(texts, shown)
    return merged + own(shown)


def merge(texts: dict[int, str], shown: set[int] | None = None) -> bytes:
    """One metrics text of every child's (by slot), each sample labelled with its child's
    slot (`process`); a child whose text cannot be read is left out (logged), the others
    added to `shown`.
    Each family is written once, with the first child's header, then every child's samples.
    Counts are not summed here: a gauge such as the instances a process knows is the same
    fleet seen N times; `sum without (process)` where a total is meant. CPU-heavy: run it
    in a thread."""
    families: dict[str, tuple[list[str], list[list[str]]]] = {}
    for slot, text in sorted(texts.items()):
        try:
            relabelled = relabel(slot, text)
        except Unreadable as exc:
            log.warning("frontend process slot %d: its /metrics are left out: %s", slot, exc)
            continue
        if shown is not None:
            shown.add(slot)
        for name, (header, samples) in relabelled.items():
            merged = families.get(name)
            if merged is None:
                merged = families[name] = (header, [])
            elif not merged[0]:
                merged[0].extend(header)
            merged[1].append(samples)
    lines = [
        line for header, parts in families.values() for part in (header, *parts) for line in part
    ]
    lines.append("")
    return "\n".join(lines).encode()


class _Families:
    """A collector of ready-made metric families, for `generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def registry_of(families: list[Metric]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return registry


async def _read_line(stream: asyncio.StreamReader) -> bytes:
    """The next line of `stream` with its newline; a line over the reader's limit comes in
    pieces of the limit (the last ends with the newline); b"" at the end."""
    try:
        return await stream.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        return exc.partial  # the end, after a last line without a newline
    except asyncio.LimitOverrunError as exc:
        return await stream.readexactly(exc.consumed)


async def supervise(config: FrontendConfig, processes: int) -> int:
    return await Supervisor(config, processes).run()


# The child's side.


def die_with_parent(parent: int) -> None:
    """Get SIGTERM when the parent dies (Linux), so no orphan keeps serving the port."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


async def fetch(url: str) -> bytes:
    """The body of GET `url` (the parent's merged metrics)."""
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT * 2)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        response.raise_for_status()
        return await response.read()
