"""A real Redis on a free loopback port, for tests: start, stop (an outage), start again.

Debian's `redis-server` (scripts/ensure-redis.sh installs it), without persistence: a
restarted server is empty, as a Redis that lost its memory would be.
"""

from __future__ import annotations

import socket

from tests.helpers import free_port
from tests.throwaway_server import ThrowawayServer


class RedisServer(ThrowawayServer):
    name = "redis-server"
    fallback = "/usr/bin/redis-server"
    ensure = "scripts/ensure-redis.sh"

    def __init__(self) -> None:
        super().__init__()
        self.pick_ports()

    def pick_ports(self) -> None:
        self.port = free_port()

    def ports(self) -> list[int]:
        return [self.port]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.data_dir, "--loglevel", "warning"]  # fmt: skip

    def answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
