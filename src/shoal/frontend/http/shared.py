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
from collections import deque
from collections.abc import Callable
from typing import Protocol, TypeVar

from shoal.frontend.http import head
from shoal.frontend.http.request import Request

C = TypeVar("C")  # the connection (`server.HttpConnection`: this module does not import it)


class BodyBudget:
    """Bytes of request bodies held (`held`), at most `limit` (`take` says whether they fit).

    Invariant: `held` is the sum, over the server's connections, of the body being read and
    the bodies of requests parsed and not yet handed to the handler; a connection gives back
    what it took when it hands a request on, and all it still holds when it stops or closes.
    """

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        """Count `size` more bytes held; False if they cross the limit (counted all the same:
        the connection gives them back with the rest of its body)."""
        self.held += size
        return self.held <= self.limit

    def give(self, size: int) -> None:
        self.held -= size

    def hold(self, size: int) -> bool:
        """Count `size` bytes of a body handed on that still waits, whole (a large one, for
        the decoder's one thread: `fields.InThread`), if they fit; else count nothing."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def let_go(self, reading: int, waiting: deque[Request] | None) -> None:
        """Give back `reading` bytes (a body no more read), and the bodies of the requests
        `waiting` if given (emptied: they are dropped, never answered)."""
        if waiting:
            reading += sum(request.size for request in waiting)
            waiting.clear()
        self.held -= reading


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
