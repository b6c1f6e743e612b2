"""A provider's secret masked in what its answers carry back (`proxy.routed`), in every form a
provider may write it.

A provider quoting the key it was given may write it as it is, JSON-escaped (`/` as `\\/`,
any character as `\\u002f` or `\\u002F`), URL-encoded (`%2F`, `%2f`), HTML-escaped (`&#x2F;`,
`&#47;`, up to two leading zeros), or mixing those from one character to the next. Every
character of a secret but its letters, digits and `-._` (which no JSON, URL or HTML encoder
escapes: they are matched as they are) may take each of those forms: `pattern` is one regular
expression for a secret, compiled once (cached: `MAX_PATTERNS` secrets), off the event loop
when the secret is resolved or refreshed (`virtual.RouteTable`), so the request path finds it
made. A match is replaced by as many `*` as its bytes, so a `Content-Length` still holds.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

MAX_PATTERNS = 1024  # secrets whose pattern is kept
LONGEST_FORM = 8  # bytes of the longest form of one character (`&#x002F;`, `&#00126;`)
_AS_IS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._")
_SHORT_ESCAPES = frozenset(b'/"\\')  # JSON's `\/`, `\"`, `\\`


def _hex(digits: str) -> bytes:
    """`digits` (hexadecimal) in either case."""
    return b"".join(f"[{d}{d.upper()}]".encode() if d.isalpha() else d.encode() for d in digits)


def _forms(byte: int) -> bytes:
    """The expression of one character of a secret: each form it may be written in."""
    char = re.escape(bytes((byte,)))
    if byte in _AS_IS:
        return char
    two = _hex(f"{byte:02x}")
    forms = [char, b"%" + two, b"\\\\u00" + two]
    forms.append(b"&#[xX]0{0,2}" + _hex(f"{byte:x}") + b";")
    forms.append(b"&#0{0,2}" + str(byte).encode() + b";")
    if byte in _SHORT_ESCAPES:
        forms.append(b"\\\\" + char)
    return b"(?:" + b"|".join(forms) + b")"


@functools.lru_cache(maxsize=MAX_PATTERNS)
def pattern(secret: bytes) -> tuple[re.Pattern[bytes], int]:
    """Every form of `secret` (see the module), and the bytes of its longest."""
    expression = re.compile(b"".join(_forms(byte) for byte in secret))
    return expression, sum(1 if byte in _AS_IS else LONGEST_FORM for byte in secret)


def _stars(match: re.Match[bytes]) -> bytes:
    return b"*" * (match.end() - match.start())


def mask(data: bytes, patterns: Iterable[re.Pattern[bytes]]) -> bytes:
    """`data` with every form of the secrets of `patterns` masked."""
    for secret in patterns:
        data = secret.sub(_stars, data)
    return data


class Masked:
    """A body with every form of `secrets` masked, wherever packets cut it: the bytes that may
    start a form not yet whole (the longest form's, less one) wait for the next packet (or
    the end)."""

    __slots__ = ("held", "keep", "patterns")

    def __init__(self, *secrets: bytes) -> None:
        self.patterns: list[re.Pattern[bytes]] = []
        longest = 1
        for secret in secrets:
            if not secret:
                continue
            expression, size = pattern(secret)
            if expression not in self.patterns:
                self.patterns.append(expression)
                longest = max(longest, size)
        self.keep = longest - 1
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        """What of `data` (and the bytes held before it) can go now, masked."""
        data = mask(self.held + data, self.patterns)
        cut = max(len(data) - self.keep, 0)
        self.held = data[cut:]
        return data[:cut]

    def rest(self) -> bytes:
        """The bytes held at the end of the body (too short to hold a form of a secret)."""
        held, self.held = self.held, b""
        return held

    def headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """`headers` with every form of the secrets masked in their values."""
        patterns = self.patterns
        values = b"\n".join([value for _, value in headers])  # (one search a secret)
        if not any(secret.search(values) for secret in patterns):
            return headers
        return [(name, mask(value, patterns)) for name, value in headers]
