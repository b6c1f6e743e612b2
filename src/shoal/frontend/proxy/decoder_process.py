"""A process of the frontend's own that decodes large request bodies, so that their decode
never holds this process's interpreter lock, and with it the event loop.

A thread's decode did: msgspec holds the GIL for a whole decode (a 20 MB chat: 20-50 ms),
and the loop waited as if the decode ran on it. Here the body goes to the process through a
socket in one blocking `write` (no copy, no pickle; the GIL let go for all of it); the process
runs a function on it and answers something small (a few fields, and where the rest lies in
the body: `fields._Handed`), which this process takes in at the cost of a copy of that.

One process, started by the first call (a fresh interpreter: `python -c`, no fork of this
one), a call at a time from one thread (`fields._DECODER`). A process that died (killed, out of
memory) or leaves a read or an answer waiting `TIMEOUT` seconds is killed and reaped, and the
call made once more on a new one; a second failure raises `DecoderFailed`. `stop()` (the
frontend's, at its end) kills it; a call after that starts another.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import struct
import subprocess
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

TIMEOUT = 10.0
"""Seconds the process may leave a body unread or a call unanswered: then it is replaced."""
_SERVE = (  # (this process' paths, whatever set them: PYTHONPATH, a venv, a test runner)
    "import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
    "from shoal.frontend.proxy.decoder_process import serve; serve(int(sys.argv[1]))"
)


class DecoderFailed(Exception):
    """The decoder process died (or stopped answering) on a call, twice in a row."""


class DecoderProcess:
    """The decoder process, and the one end of its socket this process holds. Used from one
    thread only: every call, start, replacement and stop is made there."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The process' id while it runs (None before the first call and after `stop`)."""
        return None if self._process is None else self._process.pid

    def call(self, work: Callable[..., T], body: bytes, *args: Any) -> T:
        """`work(body, *args)` (a module's function: it is sent by name) run in the process;
        its answer, or `DecoderFailed`, or `RuntimeError` when `work` raised there."""
        failure: BaseException | None = None
        for _ in range(2):
            try:
                conn = self._conn or self._start()
                conn.send((work, args))
                conn.send_bytes(body)
                done, answer = conn.recv()
            except (OSError, EOFError) as exc:  # (a timeout: `BlockingIOError`, an OSError)
                log.warning("the body decoder process failed (%s): starting another", exc)
                failure = exc
                self.stop()
                continue
            if not done:
                raise RuntimeError(f"decoding a body failed in the decoder process: {answer}")
            return answer  # type: ignore[no-any-return]
        raise DecoderFailed(f"the body decoder process failed twice: {failure}") from failure

    def _start(self) -> Connection:
        ours, theirs = socket.socketpair()
        # A read or a write that waits longer fails (`BlockingIOError`): see `call`.
        waited = struct.pack("ll", int(TIMEOUT), 0)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, waited)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, waited)
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _SERVE, str(theirs.fileno()), json.dumps(sys.path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # (a frontend's stdout carries its ready line)
                pass_fds=(theirs.fileno(),),
            )
        self._conn = Connection(ours.detach())
        return self._conn

    def stop(self) -> None:
        """Kill the process and reap it (at once: it holds nothing to finish)."""
        conn, process = self._conn, self._process
        self._conn = self._process = None
        if conn is not None:
            conn.close()
        if process is not None:
            process.kill()
            process.wait()


def serve(fd: int) -> None:
    """The decoder process: calls on the socket `fd`, one at a time, until its parent closes
    it (or dies, which closes it too)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's ^C: the parent decides)
    conn = Connection(fd)
    while True:
        try:
            work, args = conn.recv()
            body = conn.recv_bytes()
        except EOFError:
            return
        try:
            answer: tuple[bool, Any] = (True, work(body, *args))
        except Exception:
            answer = (False, traceback.format_exc())
        conn.send(answer)
