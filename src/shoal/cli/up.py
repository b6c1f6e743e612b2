"""`shoal up`: a whole fleet on this machine in one command.

Starts a frontend (in this process) and `--workers` mocker workers (child processes) on the
default SQLite store, shows progress while they start, then prints the API URL and examples
to paste. `SHOAL_*` variables configure `shoal up` as its flags do; workers get none of them,
only the flags `shoal up` passes (engine, model, store, log level). A `shoal worker` started in another terminal finds the same store and joins.
Ctrl-C or SIGTERM drains the frontend, then the workers (SIGTERM: they drain too); a second
Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from shoal.cli.catalog import add_catalog_port_flag, start_catalog
from shoal.cli.common import COUNT, add_flag, on_stop_signals, parse_ready_line, run_event_loop
from shoal.cli.frontend import add_frontend_flags, start_frontend
from shoal.frontend import Frontend, FrontendConfig
from shoal.open_files import with_start_limit
from shoal.store import default_store_url

log = logging.getLogger(__name__)

START_TIMEOUT = 60.0
STOP_TIMEOUT = 40.0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "up",
        help="start a frontend and mocker workers on this machine",
        description="Start an OpenAI-compatible frontend and N mocker workers, ready to curl.",
    )
    add_flag(parser, "--workers", 2, type=COUNT, help="mocker workers to start (default 2)")
    add_flag(
        parser,
        "--model",
        "mock-llm",
        help="the model name the workers serve (default mock-llm)",
    )
    add_frontend_flags(parser)
    add_catalog_port_flag(parser)


@dataclass
class Worker:
    number: int
    proc: asyncio.subprocess.Process
    log_path: Path
    instance: str = ""


def _say(message: str) -> None:
    print(message, flush=True)


def _die_with_parent() -> None:
    """In the child: get SIGTERM if `shoal up` dies without stopping us (Linux only)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def worker_env() -> dict[str, str]:
    """A worker's environment: this one without any `SHOAL_*` setting. Those were meant for
    `shoal up` (`SHOAL_PORT` is the frontend's port, `SHOAL_HOST` its address) and it
    consumed them; a worker gets what is its own as flags."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    return {**env, "PYTHONUNBUFFERED": "1"}


async def start_worker(
    number: int, model: str, store_url: str, log_dir: Path, log_level: str = "INFO"
) -> Worker:
    """Spawn `shoal worker --engine mocker` in its own session (Ctrl-C is ours to forward)."""
    log_path = log_dir / f"worker-{number}.log"
    with log_path.open("wb") as log_file:
        command = [sys.executable, "-m", "shoal.cli.main", "--log-level", log_level, "worker"]
        command += ["--engine", "mocker", "--model", model, "--store", store_url]
        proc = await asyncio.create_subprocess_exec(
            *with_start_limit(command),  # (not this process's raised open-file limit)
            stdout=asyncio.subprocess.PIPE,
            stderr=log_file,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            env=worker_env(),
        )
    return Worker(number, proc, log_path)


async def wait_ready(worker: Worker, deadline: float) -> None:
    """Read the worker's stdout until its ready line; `RuntimeError` if it exits or is late."""
    assert worker.proc.stdout is not None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"worker {worker.number} not ready in {START_TIMEOUT:.0f}s")
        try:
            line = await asyncio.wait_for(worker.proc.stdout.readline(), remaining)
        except TimeoutError:
            continue
        if not line:
            await worker.proc.wait()
            raise RuntimeError(f"worker {worker.number} exited with {worker.proc.returncode}")
        ready = parse_ready_line(line.decode(errors="replace"), "worker")
        if ready is not None:
            worker.instance = ready["instance"]
            return


async def stop_workers(workers: list[Worker], *, force: bool = False) -> None:
    """SIGTERM (drain) or SIGKILL each worker, and wait for them all."""
    for worker in workers:
        if worker.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGKILL if force else signal.SIGTERM)
    waits = [w.proc.wait() for w in workers if w.proc.returncode is None]
    if waits:
        _, pending = await asyncio.wait(
            [asyncio.ensure_future(w) for w in waits], timeout=STOP_TIMEOUT
        )
        if pending:
            for worker in workers:
                if worker.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        worker.proc.kill()
            await asyncio.wait(pending, timeout=5)


def banner(url: str, model: str, workers: int, store_url: str) -> str:
    store_flag = "" if store_url == default_store_url() else f" --store {store_url}"
    return f"""
shoal is up: {workers} mocker worker{"s" if workers != 1 else ""} serving `{model}`.

  OpenAI API   {url}/v1
  models       {url}/v1/models
  health       {url}/health
  metrics      {url}/metrics

Try it with curl:

  curl {url}/v1/chat/completions \\
    -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

or with the OpenAI Python client (pip install openai):

  from openai import OpenAI

  client = OpenAI(base_url="{url}/v1", api_key="unused")
  reply = client.chat.completions.create(
      model="{model}", messages=[{{"role": "user", "content": "Hello!"}}]
  )
  print(reply.choices[0].message.content)

Add a worker from another terminal: shoal worker --model {model}{store_flag}
Press Ctrl-C to stop.
"""


async def up(args: argparse.Namespace) -> int:
    store_url = args.store or default_store_url()
    stop = asyncio.Event()
    on_stop_signals(stop)
    log_dir = Path(platformdirs.user_log_dir("shoal")) / "up"
    log_dir.mkdir(parents=True, exist_ok=True)

    _say(f"shoal up: store {store_url}")
    frontend = await start_frontend(
        FrontendConfig(store_url=store_url, host=args.host, port=args.port, router=args.router),
        "shoal up: cannot start the frontend",
    )
    if frontend is None:
        return 1
    _say(f"  frontend     listening on {frontend.url}")
    catalog = await start_catalog(args.host, args.catalog_port, store_url)  # None if it failed
    if catalog is not None:
        _say(f"  catalog      {catalog.url}/docs: shoal catalog apply -f FILE")

    workers: list[Worker] = []
    code = 0
    try:
        code = await _start_fleet(args, frontend, workers, store_url, log_dir, stop)
        if code == 0:
            _say(banner(frontend.url, args.model, len(workers), store_url))
            await stop.wait()
    finally:
        code = await _shutdown(frontend, workers, stop) or code
        if catalog is not None:
            await catalog.stop()
    return code


async def _start_fleet(
    args: argparse.Namespace,
    frontend: Frontend,
    workers: list[Worker],
    store_url: str,
    log_dir: Path,
    stop: asyncio.Event,
) -> int:
    deadline = time.monotonic() + START_TIMEOUT
    for number in range(1, args.workers + 1):
        workers.append(await start_worker(number, args.model, store_url, log_dir, args.log_level))
    _say(f"  workers      starting {len(workers)} (logs in {log_dir})")

    async def ready(worker: Worker) -> None:
        await wait_ready(worker, deadline)
        _say(f"  worker {worker.number}     ready: instance {worker.instance}")

    starting = asyncio.ensure_future(asyncio.gather(*(ready(w) for w in workers)))
    stopped = asyncio.ensure_future(stop.wait())
    either: list[asyncio.Future[Any]] = [starting, stopped]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if stop.is_set():
        starting.cancel()
        await asyncio.wait([starting])  # let the readers finish, and retrieve their outcome
        if not starting.cancelled():
            starting.exception()
        return 130
    try:
        starting.result()
    except RuntimeError as exc:
        print(f"shoal up: {exc}; its log:", file=sys.stderr)
        for worker in workers:
            if worker.proc.returncode is not None or not worker.instance:
                tail = worker.log_path.read_text(errors="replace").splitlines()[-20:]
                print("\n".join(f"    {line}" for line in tail), file=sys.stderr)
                break
        return 1
    instances = {int(w.instance, 16) for w in workers}
    while not stop.is_set():
        model = frontend.registry.models.get(args.model)
        routable = (
            {u.instance_id for ws in model.routable_sets for u in ws.routable} if model else set()
        )
        if instances <= routable:
            _say(f"  frontend     routing `{args.model}` to {len(instances)} worker(s)")
            return 0
        if time.monotonic() > deadline:
            print("shoal up: the frontend did not see the workers in time", file=sys.stderr)
            return 1
        await asyncio.sleep(0.05)
    return 130


async def _shutdown(frontend: Frontend, workers: list[Worker], stop: asyncio.Event) -> int:
    """Drain the frontend, then the workers; a second signal kills everything at once."""
    force = asyncio.Event()
    on_stop_signals(force)
    _say("\nshoal up: stopping (Ctrl-C again to stop at once)...")

    async def drain() -> None:
        await frontend.stop()
        await stop_workers(workers)

    draining = asyncio.ensure_future(drain())
    forced = asyncio.ensure_future(force.wait())
    either: list[asyncio.Future[Any]] = [draining, forced]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if not draining.done():
        draining.cancel()
        with contextlib.suppress(BaseException):
            await draining
        await stop_workers(workers, force=True)
        _say("shoal up: stopped at once")
        return 130
    draining.result()
    _say("shoal up: stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.log_level.upper() == "INFO":
        logging.getLogger().setLevel(logging.WARNING)  # the progress lines say what matters
    return run_event_loop(up(args))
