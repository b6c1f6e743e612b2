"""What the connections of one server (`server.py`) share: the server as they see it
(`Listener`), and the request body bytes they may hold together (`BodyBudget`).

Each connection holds a body while it arrives, and the bodies of requests waiting their turn
behind the one answered (pipelined): up to `max_body` each, and `MAX_PIPELINED` waiting. With
no bound across connections, a client sending large bodies slowly on many connections held
the frontend's memory at will (40 connections of 15 MiB each: 600 MB, no key nor model
needed). Past the budget, the request whose bytes crossed it is refused (503): the others go on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, TypeVar

from shoal.frontend.http import head
from shoal.frontend.http.request import BodyBudget, Request

C = TypeVar("C")  # the connection (`server.HttpConnection`: this module does not import it)


class Listener(head.Limits, Protocol[C]):
    """What a connection `C` reads of its `HttpServer` (floats as properties: `forward.Gateway`)."""

    handler: Callable[[Request, C], None]
    loop: asyncio.AbstractEventLoop
    connections: set[C]
    bodies: BodyBudget  # the request body bytes its connections hold together, at most
    closing: bool
    max_connections: int

    def admit(self, conn: C) -> bool: ...  # (one of `connections`, if room)
    @property
    def keepalive_timeout(self) -> float: ...
    @property
    def header_timeout(self) -> float: ...
    @property
    def body_timeout(self) -> float: ...
    @property
    def send_timeout(self) -> float: ...
