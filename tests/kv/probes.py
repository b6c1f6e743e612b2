"""Probes of how long an event loop is held: from inside (CPU time between two runs of a
timer) and from outside (`/live` asked from another thread, as
../shared/tools/stall_probe.py does)."""

from __future__ import annotations

import asyncio
import gc
import http.client
import statistics
import threading
import time


class LoopProbe:
    """The longest the event loop was held between two runs of a 1 ms timer, in CPU time
    of its thread (what other processes on a shared machine take does not count), less
    the time the garbage collector took meanwhile (a pause of the whole process, whatever
    runs: the test process's heap makes it far longer than a frontend's)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._gc = 0.0
        self._gc_start = 0.0
        self._t0 = time.thread_time()
        self._gc0 = 0.0
        gc.callbacks.append(self._collected)
        self._task = asyncio.create_task(self._run())

    def _collected(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.thread_time()
        else:
            self._gc += time.thread_time() - self._gc_start

    async def _run(self) -> None:
        while True:
            self._t0, self._gc0 = time.thread_time(), self._gc
            await asyncio.sleep(0.001)
            self._tick()

    def _tick(self) -> None:
        self.worst = max(self.worst, time.thread_time() - self._t0 - (self._gc - self._gc0))

    async def stop(self) -> float:
        """The worst hold, the one that ends now included (a hold just before `stop` is
        otherwise never seen: its timer has not run yet)."""
        self._tick()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        gc.callbacks.remove(self._collected)
        return self.worst


class LiveProbe:
    """Asks `/live` every 5 ms from another thread, as ../shared/tools/stall_probe.py does."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            conn.request("GET", "/live")
            conn.getresponse().read()
            self.latencies.append(time.perf_counter() - t0)
            time.sleep(0.005)

    def stop(self) -> float:
        """The median latency."""
        self._stop.set()
        self._thread.join()
        return statistics.median(self.latencies)
