"""The tests' own servers answer on ports their own process holds: a port taken between the
pick and the bind is picked again at the first start, and is an error at a restart."""

from __future__ import annotations

import socket

import pytest

from tests.nats_server import NatsServer
from tests.throwaway_server import _holder_of


def test_a_first_start_on_a_port_another_server_answers_picks_a_port_of_its_own() -> None:
    with NatsServer() as other:
        server = NatsServer()
        try:
            server.port = other.port  # taken between the pick and the bind
            server.start()
            assert server.proc is not None and other.proc is not None
            assert server.port != other.port
            assert _holder_of(server.port) == server.proc.pid
            assert _holder_of(other.port) == other.proc.pid
        finally:
            server.close()


def test_a_restart_on_a_port_another_process_took_during_the_outage_says_so() -> None:
    server = NatsServer()
    try:
        server.start()
        port = server.port
        server.stop()
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            # the squatter accepts but never speaks NATS, so only the holder check can tell
            with pytest.raises(RuntimeError, match=f"holds port\\(s\\) \\[{port}\\]"):
                server.start(timeout=5.0)
        assert server.port == port
    finally:
        server.close()


def test_a_first_start_whose_port_was_held_only_a_moment_picks_a_port_of_its_own() -> None:
    """The server could not bind a port another process held a moment and let go of before
    the check of who holds it (CI: etcd's "bind: address already in use", its port free
    again): that was an error, not a port to pick again. Its own log now says so."""

    class Once(NatsServer):
        tries = 0

        def command(self) -> list[str]:
            Once.tries += 1
            if Once.tries == 1:  # (as a server that lost the race for its port says)
                return ["sh", "-c", "echo 'listen tcp: bind: address already in use'; exit 1"]
            return super().command()

    server = Once()
    try:
        server.start()
        assert Once.tries == 2 and server.proc is not None
        assert _holder_of(server.port) == server.proc.pid
    finally:
        server.close()
