"""A real etcd server on free loopback ports, for tests: start, stop (an outage), restart."""

from __future__ import annotations

import urllib.request

from tests.helpers import free_port
from tests.throwaway_server import ThrowawayServer


class EtcdServer(ThrowawayServer):
    """One etcd member with its own data directory; `stop()`/`start()` keep the data.

    As a context manager: started for the block, closed after it.
    """

    name = "etcd"
    fallback = "/usr/bin/etcd"
    ensure = "scripts/ensure-etcd.sh"

    def __init__(self) -> None:
        super().__init__()
        self.pick_ports()

    def pick_ports(self) -> None:
        self.client_port = free_port()
        self.peer_port = free_port()

    def ports(self) -> list[int]:
        return [self.client_port, self.peer_port]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"etcd://{self.endpoint}"

    def command(self) -> list[str]:
        c, p = self.client_port, self.peer_port
        return [
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
        ]

    def answers(self) -> bool:
        with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as resp:
            return b'"health":"true"' in resp.read()
