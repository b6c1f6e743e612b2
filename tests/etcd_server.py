"""A real etcd server on free loopback ports, for tests: start, stop (an outage), restart."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

from tests.helpers import free_port


class EtcdServer:
    """One etcd member with its own data directory; `stop()`/`start()` keep the data.

    As a context manager: started for the block, closed after it.
    """

    def __init__(self) -> None:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(binary):
            raise RuntimeError(
                "etcd is not installed: run scripts/ensure-etcd.sh (Debian etcd-server)"
            )
        self.binary = binary
        self.data_dir = tempfile.mkdtemp(prefix="shoal-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # noqa: SIM115

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def start(self, timeout: float = 15.0) -> None:
        c, p = self.client_port, self.peer_port
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--name=default",
                f"--data-dir={self.data_dir}/data",
                f"--listen-client-urls=http://127.0.0.1:{c}",
                f"--advertise-client-urls=http://127.0.0.1:{c}",
                f"--listen-peer-urls=http://127.0.0.1:{p}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{p}",
                f"--initial-cluster=default=http://127.0.0.1:{p}",
                "--log-level=error",
                "--heartbeat-interval=50",
                "--election-timeout=500",
            ],
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as resp:
                    if b'"health":"true"' in resp.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd not healthy within {timeout}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self.log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
