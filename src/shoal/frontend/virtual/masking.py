"""A provider's secret masked in what its answers carry back (`proxy.routed`), in every form a
provider may write it.

A provider quoting the key it was given may write it as it is, JSON-escaped (`/` as `\\/`,
any character as `\\u002f` or `\\u002F`), URL-encoded (`%2F`, `%2f`), HTML-escaped (`&#x2F;`,
`&#47;`, up to `MAX_ZEROS` leading zeros; `&amp;` `&quot;` `&lt;` `&gt;` `&apos;`), any of those
escaped once more (`%252F`; in a JSON string inside a JSON string, `\\\\/`, `\\\\u002f`), or
mixing those from one character to the next. Every
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
MAX_ZEROS = 8  # leading zeros of an HTML numeric entity matched (`&#x0002F;`)
LONGEST_FORM = 14  # bytes of the longest form of one character (`&#x000000002F;`, `&#0000000047;`)
HOLD_CHARS = 16  # characters of a secret whose partial forms hold a packet's end back
_AS_IS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._")
_SHORT_ESCAPES = frozenset(b'/"')  # JSON's `\/`, `\"` (and `\\/`, `\\\"` one level down)
_NAMED = {ord("&"): b"amp|AMP", ord('"'): b"quot|QUOT", ord("<"): b"lt|LT", ord(">"): b"gt|GT"}
_NAMED[ord("'")] = b"apos"
_ESCAPING = frozenset(b"%\\&#;0123456789abcdefABCDEFuxXmpqotlgsAMPQUOTLG")  # (and the secret's)
# What a form not yet whole may end a packet with (any, generously: holding more is safe).
_PARTIAL = (
    rb"(?:%(?:2(?:5[0-9A-Fa-f]?)?|[0-9A-Fa-f])?"
    rb"|\\{1,8}(?:u(?:0(?:0[0-9A-Fa-f]?)?)?)?"
    rb"|&(?:#[xX]?[0-9A-Fa-f]{0,11}|[a-zA-Z]{1,4})?)"
)


def _hex(digits: str) -> bytes:
    """`digits` (hexadecimal) in either case."""
    return b"".join(f"[{d}{d.upper()}]".encode() if d.isalpha() else d.encode() for d in digits)


def _forms(byte: int) -> bytes:
    """The expression of one character of a secret: each form it may be written in, and the
    same escaped once more (URL-encoded twice, JSON in a JSON string). Bounded: at most
    `LONGEST_FORM` bytes each, so what a packet's end holds back is bounded too."""
    char = re.escape(bytes((byte,)))
    if byte in _AS_IS:
        return char
    two = _hex(f"{byte:02x}")
    forms = [b"%(?:25)?" + two, b"\\\\{1,4}u00" + two]
    forms.append(b"&#[xX]0{0,%d}" % MAX_ZEROS + _hex(f"{byte:x}") + b";")
    forms.append(b"&#0{0,%d}" % MAX_ZEROS + str(byte).encode() + b";")
    if byte in _NAMED:
        forms.append(b"&(?:" + _NAMED[byte] + b");")
    if byte in _SHORT_ESCAPES:
        forms.append(b"\\\\{1,4}" + char)
    if byte == ord("\\"):  # (itself escaped: 2, 4 or 8 of it)
        forms += [b"\\\\{8}", b"\\\\{4}", b"\\\\{2}"]
    forms.append(char)
    return b"(?:" + b"|".join(forms) + b")"


@functools.lru_cache(maxsize=MAX_PATTERNS)
def pattern(secret: bytes) -> tuple[re.Pattern[bytes], int]:
    """Every form of `secret` (see the module), and the bytes of its longest (its
    `hold_pattern` compiled too: both are made off the event loop)."""
    expression = re.compile(b"".join(_forms(byte) for byte in secret))
    hold_pattern(secret)
    return expression, sum(1 if byte in _AS_IS else LONGEST_FORM for byte in secret)


@functools.lru_cache(maxsize=MAX_PATTERNS)
def hold_pattern(secret: bytes) -> re.Pattern[bytes]:
    """Where the end of a packet may start a form of `secret` not yet whole: its first
    `HOLD_CHARS` characters, each in any of its forms, the last of them maybe only begun,
    then the end (or, all of them whole, anything up to the end)."""
    inner = rb"[\s\S]*" if len(secret) > HOLD_CHARS else rb"\Z"
    for byte in reversed(secret[:HOLD_CHARS]):
        inner = b"(?:" + _forms(byte) + b"(?:" + inner + rb"|\Z)|" + _PARTIAL + rb"\Z)"
    return re.compile(inner)


def _stars(match: re.Match[bytes]) -> bytes:
    return b"*" * (match.end() - match.start())


def mask(data: bytes, patterns: Iterable[re.Pattern[bytes]]) -> bytes:
    """`data` with every form of the secrets of `patterns` masked."""
    for secret in patterns:
        data = secret.sub(_stars, data)
    return data


class Masked:
    """A body with every form of `secrets` masked, wherever packets cut it: the end of a
    packet that may start a form not yet whole (`hold_pattern`: at most the longest form's
    bytes, less one) waits for the next packet (or the end); the rest goes at once, so a
    stream's events are not held back behind the next one."""

    __slots__ = ("held", "holds", "keep", "patterns", "written")

    def __init__(self, *secrets: bytes) -> None:
        self.patterns: list[re.Pattern[bytes]] = []
        self.holds: list[re.Pattern[bytes]] = []
        self.written = _ESCAPING  # every byte a form may hold: a packet ending otherwise holds none
        longest = 1
        for secret in secrets:
            if not secret:
                continue
            expression, size = pattern(secret)
            if expression not in self.patterns:
                self.patterns.append(expression)
                self.holds.append(hold_pattern(secret))
                self.written = self.written.union(secret)
                longest = max(longest, size)
        self.keep = longest - 1
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        """What of `data` (and the bytes held before it) can go now, masked."""
        if self.held:
            data = self.held + data
        data = mask(data, self.patterns)
        cut = len(data)
        if not cut or data[-1] not in self.written:  # (an SSE event's `\n`: nothing begun)
            self.held = b""
            return data
        start = max(cut - self.keep, 0)
        for hold in self.holds:
            found = hold.search(data, start)
            if found is not None and found.start() < cut:
                cut = found.start()
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
