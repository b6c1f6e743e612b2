"""`Unread`: how long a client has read nothing of the answer waiting for it, the bound of
`--send-timeout` (nginx's `send_timeout`), judged at each of the server's sweeps.

The wait is timed whenever bytes wait in the connection's write buffer and the bytes not yet
taken by the client (that buffer and, on Linux, what its socket holds unacknowledged:
`SIOCOUTQ`) did not shrink since the last sweep: while writing is paused (more than the
transport's high-water mark waits), and below it too, where a client that reads nothing was
otherwise never dropped (a keep-alive or linger `close()` waits for the bytes to go, for
good). Below the mark, an answer that grew since the last sweep starts a new wait (the
client may have read meanwhile: the growth hides it); one that keeps growing reaches the
mark, where writing pauses and nothing hides it. The socket's count tells a client that
reads from one that does not while the buffer waits for the kernel's room (it takes bytes
in bursts, a third of its send buffer at a time: megabytes on a fast link).
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios

_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None)  # (Linux's `SIOCOUTQ` on a socket)


def socket_unsent(transport: asyncio.Transport) -> int:
    """Bytes the socket of `transport` holds that the client did not acknowledge (0 where
    this cannot be told: not Linux, no socket)."""
    sock = transport.get_extra_info("socket")
    if sock is None or _OUTQ is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0])
    except (OSError, ValueError):  # (not a socket this ioctl knows: macOS)
        return 0


class Unread:
    """The wait of one connection's client (`HttpConnection`)."""

    __slots__ = ("since", "unsent")

    def __init__(self) -> None:
        self.since = 0.0  # since when the client read nothing (0.0: nothing waits)
        self.unsent = 0  # bytes not taken by the client at the last sweep (read since: fewer)

    def overdue(
        self, transport: asyncio.Transport, paused: bool, now: float, timeout: float
    ) -> bool:
        """Whether the client read nothing for more than `timeout` seconds (0: no limit) at
        `now`, with writing `paused` or not."""
        unsent = transport.get_write_buffer_size()
        if unsent:
            unsent += socket_unsent(transport)
        if not unsent:
            self.since = 0.0
        elif not self.since or unsent < self.unsent or (unsent > self.unsent and not paused):
            self.since = now  # a new wait: it read since the last sweep, or may have
        elif timeout and now - self.since > timeout:
            return True
        self.unsent = unsent
        return False
