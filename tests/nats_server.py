"""A real `nats-server -js` on a free loopback port, for tests: start, stop (an outage), restart
with its storage kept."""

from __future__ import annotations

import os
import socket

from tests.helpers import free_port
from tests.throwaway_server import ThrowawayServer


class NatsServer(ThrowawayServer):
    """One JetStream server with its own storage directory; `stop()`/`start()` keep it."""

    name = "nats-server"
    fallback = "/usr/sbin/nats-server"
    ensure = "scripts/ensure-nats.sh"

    def __init__(self) -> None:
        super().__init__()
        self.pick_ports()

    def pick_ports(self) -> None:
        self.port = free_port()

    def ports(self) -> list[int]:
        return [self.port]

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [self.binary, "-js", "-a", "127.0.0.1", "-p", str(self.port),
                "-sd", os.path.join(self.data_dir, "js")]  # fmt: skip

    def answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            return sock.recv(4).startswith(b"INFO")
