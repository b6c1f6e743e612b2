"""A client connection keeps its attributes in slots. It has more of them (40) than the 30
keys CPython 3.11 shares among the instances of a class, so without slots each connection's
attributes lived in an ordinary dict, and every read of one on the request path cost a hash
lookup (the ~880 instructions an event the eighth session's stream bench could not place)."""

from __future__ import annotations

from bench.request_path import Bench, Transport

from shoal.frontend.http.server import HttpConnection

SHARED_KEYS_MAX = 30  # CPython 3.11's `SHARED_KEYS_MAX_SIZE`


async def test_a_client_connection_serves_requests_with_its_attributes_in_slots() -> None:
    bench = Bench(chunks=16)
    client = HttpConnection(bench.server)
    client.connection_made(Transport())  # type: ignore[arg-type]
    bench.client = client
    for mode in ("plain", "stream", "whole"):
        bench.serve(mode, 3)  # every attribute a request sets goes in a slot (else it raises)
    bench.check()
    assert not hasattr(client, "__dict__"), "the connection has an instance dict again"
    slots = set(HttpConnection.__slots__)
    assert len(slots) > SHARED_KEYS_MAX  # (the reason for them: else a shared-key dict would do)
    unset = [name for name in slots if not hasattr(client, name)]  # (read before set: raises)
    assert not unset, f"slots __init__ does not set: {unset}"
    client.connection_lost(None)
