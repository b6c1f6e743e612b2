"""A real server binary on a free loopback port for the tests (etcd, NATS, Redis): found or
refused with the script that installs it, started in a directory of its own, waited for until
it answers, killed for an outage, started again, removed at the end."""

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
        self.log = open(os.path.join(self.data_dir, f"{self.name}.log"), "ab")  # noqa: SIM115

    def command(self) -> list[str]:
        raise NotImplementedError

    def answers(self) -> bool:
        """One probe: True once the server serves (OSError counts as not yet)."""
        raise NotImplementedError

    def start(self, timeout: float = 15.0) -> None:
        self.proc = subprocess.Popen(self.command(), stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}; see {self.log.name}"
                )
            try:
                if self.answers():
                    return
            except OSError:
                pass
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
