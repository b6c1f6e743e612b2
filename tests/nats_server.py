"""A real `nats-server -js` on a free loopback port, for tests: start, stop (an outage), restart
with its storage kept."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from tests.helpers import free_port


class NatsServer:
    """One JetStream server with its own storage directory; `stop()`/`start()` keep it."""

    def __init__(self) -> None:
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        if not os.path.exists(binary):
            raise RuntimeError(
                "nats-server is not installed: run scripts/ensure-nats.sh (Debian nats-server)"
            )
        self.binary = binary
        self.data_dir = tempfile.mkdtemp(prefix="shoal-nats-")
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = open(os.path.join(self.data_dir, "nats.log"), "ab")  # noqa: SIM115

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 15.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port),
             "-sd", os.path.join(self.data_dir, "js")],
            stdout=self.log,
            stderr=self.log,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.proc.returncode}; see {self.log.name}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                    if sock.recv(4).startswith(b"INFO"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"nats-server not up within {timeout}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self.log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
