"""What an exchange with an instance (`upstream.py`) answers to, and how it fails.

`ResponseSink` receives one response. The failures, one class each:

- `UpstreamError`: the connection failed or returned something unusable (a 502 when no
  instance is left).
  - `UpstreamTimeout`: a wait ran out (a 504 when no instance is left).
  - `ConnectRefused`: refused or reset before anything was sent: another instance costs nothing.
  - `OutOfFiles`: the gateway itself could open no socket (its limit of open files): no
    instance's fault, and none other would fare better (a 503).
- `FramingTooLarge`: what made a chunked response malformed (the parser's errors are others).
"""

from __future__ import annotations

from typing import Protocol

from mypy_extensions import mypyc_attr


@mypyc_attr(native_class=False)  # (a compiled build: a builtin exception's subclass)
class UpstreamError(ConnectionError):
    """The connection to an instance failed or returned something unusable."""


@mypyc_attr(native_class=False)
class FramingTooLarge(ValueError):
    """A chunked response's framing (chunk lines, extensions, trailer section) between two
    of its body bytes over the bound of a head: the response is malformed."""


@mypyc_attr(native_class=False)
class UpstreamTimeout(UpstreamError):
    """A wait on an instance ran out: its connect, or its answer after it took the request
    (then no stale connection: it was read). 504 when no instance is left."""


@mypyc_attr(native_class=False)
class OutOfFiles(UpstreamError):
    """This process (or the system) is at its limit of open files (EMFILE, ENFILE): a
    connect failed before it left the gateway. Blamed on the instance as a refused connect,
    it inhibited every instance in turn, and their clients got 502s naming them."""


@mypyc_attr(native_class=False)
class ConnectRefused(UpstreamError):
    """The instance refused or reset the connection: nothing was sent, little time was spent,
    so trying another instance costs nothing (a dead worker, not a slow one)."""


class ResponseSink(Protocol):
    """Receives one response from an `UpstreamConnection`."""

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]], chunked: bool) -> bool:
        """The status and headers; return False to abandon the response (the connection closes)."""

    def on_body(self, data: bytes) -> None:
        """A piece of body, before the end (`on_complete`) or a failure in its packet."""

    def on_packet(self, bodies: list[bytes]) -> None:
        """A packet from the worker was parsed: its pieces of body (none for a packet of the
        head alone), to pass on now. The list is the connection's, emptied after the call:
        a sink keeps its pieces, never the list. (One call per packet, not one per piece:
        a stream's every event is a packet.) Raising fails the response (`on_failure`)."""

    def on_complete(self) -> None: ...

    def on_failure(self, exc: Exception) -> None:
        """The connection failed before the response was complete."""
