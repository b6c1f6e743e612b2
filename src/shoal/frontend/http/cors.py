"""Cross-origin resource sharing: which browser pages may call the gateway, and the
preflight answer that tells them so.

Off unless origins are configured (`--cors-origin`, `*` for any). An allowed origin is
echoed back with `Vary: Origin`, so a shared cache never serves one origin's answer to another.
"""

from __future__ import annotations

from collections.abc import Iterable

METHODS = b"GET, HEAD, POST, OPTIONS"
MAX_AGE = b"600"  # seconds a browser may reuse a preflight answer


class Cors:
    """The configured origins, and the header lines each kind of answer carries."""

    def __init__(self, origins: Iterable[str]) -> None:
        self.origins = frozenset(origin.rstrip("/").encode() for origin in origins)
        self.any = b"*" in self.origins

    def allows(self, origin: bytes) -> bool:
        return self.any or origin in self.origins

    @staticmethod
    def response_headers(origin: bytes) -> bytes:
        """The lines added to an actual response to an allowed origin."""
        return (
            b"access-control-allow-origin: " + origin + b"\r\n"
            b"access-control-expose-headers: x-shoal-instance\r\n"
            b"vary: origin\r\n"
        )

    @staticmethod
    def preflight_headers(origin: bytes, requested_headers: bytes | None) -> bytes:
        """The lines of a preflight answer: the methods, and the headers the page asked for."""
        lines = [
            b"access-control-allow-origin: ", origin, b"\r\n",
            b"access-control-allow-methods: ", METHODS, b"\r\n",
            b"access-control-max-age: ", MAX_AGE, b"\r\n",
            b"vary: origin, access-control-request-method, access-control-request-headers\r\n",
        ]  # fmt: skip
        if requested_headers:
            lines += (b"access-control-allow-headers: ", requested_headers, b"\r\n")
        return b"".join(lines)
