"""`RenderThreads`: the process's threads for the tokenizers' work, bounded in number.

Each worker set's tokenizer runs the chats it cannot prepare on the event loop in a thread
of its own (`PromptTokenizer.submit`), ended once its work is done: with hundreds of sets
(adapters of one base, many models), keeping one thread per set would keep hundreds of idle
threads, and a container's pids limit counts them. At most `RENDER_THREADS` are alive at
once; a set that finds none free is refused (`NoRenderThread`) and its chat routed by
prefix. A thread is started by a thread of the process's own (`kv-thread-starter`), never
by the caller: `Thread.start` waits for the new thread to take the GIL, 6-12 ms (60-250 ms at
worst in 200) when one other thread holds it (measured), too long for the event loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

__all__ = ["RENDER_THREADS", "THREADS", "NoRenderThread", "RenderThreads"]

log = logging.getLogger(__name__)

RENDER_THREADS = 16  # tokenizers' threads alive in the process at most, however many sets

Start = tuple[Callable[[], None], Callable[[BaseException], None]]


class NoRenderThread(RuntimeError):
    """No thread for a tokenizer's work: `RENDER_THREADS` are busy, or the system refused one."""


class RenderThreads:
    """The tokenizers' threads: at most `limit` alive or being started at once. A thread is
    counted until it has ended (`is_alive`), so no more are ever seen running."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._alive: list[threading.Thread] = []
        self._starting = 0
        self._starts: queue.SimpleQueue[Start] = queue.SimpleQueue()
        self._starter: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self, target: Callable[[], None], refused: Callable[[BaseException], None]) -> None:
        """Have `target` run in a new thread, soon. `NoRenderThread` at once when `limit` are
        alive; `refused(exc)` (from the starter's thread) when the system refuses the thread."""
        with self._lock:
            self._alive = [thread for thread in self._alive if thread.is_alive()]
            if len(self._alive) + self._starting >= self.limit:
                raise NoRenderThread(f"all {self.limit} render threads are busy")
            if self._starter is None:  # (once per process: started on first need)
                starter = threading.Thread(
                    target=self._start_each, name="kv-thread-starter", daemon=True
                )
                try:
                    starter.start()
                except RuntimeError as exc:
                    raise NoRenderThread(f"no thread to start render threads: {exc}") from exc
                self._starter = starter
            self._starting += 1
        self._starts.put((target, refused))

    def _start_each(self) -> None:
        """The starter's thread: starts each thread asked for, for as long as the process runs."""
        while True:
            target, refused = self._starts.get()
            thread = threading.Thread(target=target, name="kv-tokenizer", daemon=True)
            try:
                thread.start()
            except Exception as exc:  # (the system's limit on threads or processes)
                log.warning("kv router: a render thread could not be started: %s", exc)
                with self._lock:
                    self._starting -= 1
                try:
                    refused(NoRenderThread(f"a render thread could not be started: {exc}"))
                except Exception:
                    log.exception("kv router: a refused render thread's work was not failed")
                continue
            with self._lock:
                self._starting -= 1
                self._alive.append(thread)
            del target, refused, thread


THREADS = RenderThreads(RENDER_THREADS)
