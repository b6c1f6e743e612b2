"""A real server binary on a free loopback port for the tests (etcd, NATS, Redis): found or
refused with the script that installs it, started in a directory of its own, waited for until
it answers on ports its own process holds, killed for an outage, started again, removed at the
end."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Self


class ThrowawayServer:
    """Subclasses name the binary and say how to start it (`command`) and when it answers
    (`answers`); `stop()` then `start()` is an outage, the data directory is kept across it."""

    name: str  # the binary, e.g. "nats-server"
    fallback: str  # where Debian's package puts it
    ensure: str  # the script that installs it

    def __init__(self) -> None:
        binary = shutil.which(self.name) or self.fallback
        if not os.path.exists(binary):
            raise RuntimeError(f"{self.name} is not installed: run {self.ensure} (Debian package)")
        self.binary = binary
        self.data_dir = tempfile.mkdtemp(prefix=f"shoal-{self.name}-")
        self.proc: subprocess.Popen[bytes] | None = None
        self._started = False
        self.log = open(os.path.join(self.data_dir, f"{self.name}.log"), "ab")  # noqa: SIM115

    def command(self) -> list[str]:
        raise NotImplementedError

    def pick_ports(self) -> None:
        """Choose the free ports `command` listens on (called once, and again after a
        collision at the first start)."""
        raise NotImplementedError

    def ports(self) -> list[int]:
        """The loopback ports the server listens on."""
        raise NotImplementedError

    def answers(self) -> bool:
        """One probe: True once the server serves (OSError counts as not yet)."""
        raise NotImplementedError

    def start(self, timeout: float = 15.0) -> None:
        """Start the server and wait until it answers on ports its own process holds.

        A port that was free when picked may be taken before the server binds it; then the
        answer comes from another server (say a sibling test's etcd), and a test that stops
        "its" server would stop nothing. At the first start the ports are picked again; at a
        restart (after an outage, clients know the ports) it is an error that says so."""
        first = self.proc is None and not self._started
        for _ in range(5 if first else 1):
            if self._start_once(timeout):
                self._started = True
                return
            self.stop()
            if not first:
                break
            self.pick_ports()
        raise RuntimeError(
            f"{self.name}: another process holds port(s) {self.ports()}; see {self.log.name}"
        )

    def _start_once(self, timeout: float) -> bool:
        """True once the server answers on its own ports, False when another process does."""
        logged = os.path.getsize(self.log.name)  # (what this start writes comes after)
        self.proc = subprocess.Popen(self.command(), stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if not all(_holder_of(port) is None for port in self.ports()):
                    return False  # it could not bind: another process holds a port
                if _said_in_use(self.log.name, logged):
                    return False  # (one that held it a moment, gone by now: CI, 1 of 2,781)
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; see {self.log.name}"
                )
            try:
                answered = self.answers()
            except OSError:
                answered = False
            if answered:
                holders = {_holder_of(port) for port in self.ports()}
                if holders == {self.proc.pid}:
                    return True
                if any(pid is not None and pid != self.proc.pid for pid in holders):
                    return False
            time.sleep(0.05)  # polling a child process for readiness, with a deadline
        raise RuntimeError(f"{self.name} not up within {timeout}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self.log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on 127.0.0.1 or any address at `port` (/proc/net/tcp*)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def _holder_of(port: int) -> int | None:
    """The pid of the process listening on `port`, or None when nothing listens (or it is
    not ours to see)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return int(pid)
    return -1  # listening, by a process we cannot see


def _said_in_use(log: str, start: int) -> bool:
    """Whether the server's log, from byte `start`, says a port it wanted was in use."""
    with open(log, "rb") as f:
        f.seek(start)
        return b"address already in use" in f.read().lower()
