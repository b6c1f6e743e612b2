"""One frontend of several on one port (`shoal frontend --processes N`): the child process
the supervisor in `shoal.cli.processes` starts, its settings read from stdin."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import sys

from shoal.cli.common import on_stop_signals, print_ready, run_event_loop
from shoal.cli.frontend import start_frontend
from shoal.cli.processes import CHILD, die_with_parent, fetch
from shoal.frontend import FrontendConfig
from shoal.frontend.http.listener import HttpServer


async def serve_child(config: FrontendConfig, merged: str | None) -> int:
    """Serve as one frontend of several. `/metrics` on the API port: 404 when `merged` is
    None (the parent serves it on `--metrics-port`, as one frontend would), else the whole
    frontend's, fetched from the parent at `merged`."""
    stop = asyncio.Event()
    on_stop_signals(stop)
    # A stop signal while discovery loads (a large fleet takes its time) ends the start: the
    # parent waits for every child before it exits.
    starting = asyncio.create_task(
        start_frontend(config, f"shoal frontend (process {os.getpid()})")
    )
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return 0
    frontend = starting.result()
    if frontend is None:
        return 1
    metrics = HttpServer(frontend._serve_metrics, max_body=0, max_connections=16)
    await metrics.start("127.0.0.1", 0)
    if merged is None:
        frontend.metrics_server = metrics  # closed by `stop()`
    else:
        frontend.metrics_source = lambda: fetch(merged)
    print_ready(CHILD, url=frontend.url, metrics=f"http://127.0.0.1:{metrics.port}/metrics")
    await stop.wait()
    await frontend.stop()
    await metrics.close(0)
    return 0


def main() -> int:
    config, merged, parent, level = pickle.load(sys.stdin.buffer)
    assert isinstance(config, FrontendConfig) and (merged is None or isinstance(merged, str))
    die_with_parent(parent)
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{os.getpid()}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run_event_loop(serve_child(config, merged))


if __name__ == "__main__":
    sys.exit(main())
