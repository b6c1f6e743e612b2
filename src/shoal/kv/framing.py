"""Where msgpack values end, found a bounded piece of work at a time: what the sliced KV decode
(`shoal.kv.sliced.decode_batch_in_slices`) walks a large batch with.

msgspec decodes a whole value or nothing, and skipping one costs per value it holds, not per
byte (4 MiB of 1-byte ints: 9-17 ms in one call, 3.5 for ids of 5 bytes). So a large batch is
walked by hand, along its fixed schema: `values_end` has msgspec skip values in a window of at
most so many bytes, and says whether they end in it; `elements_end` finds where a run of an
array's elements ends with a regular expression of the forms they may take (a C loop of `re`,
~15 ns an element), so the ends of arrays of millions of token ids are found a slice at a time.
"""

from __future__ import annotations

import functools
import re

import msgspec

_skip = msgspec.msgpack.Decoder(msgspec.Raw).decode
_TRAILING = re.compile(r"trailing characters \(byte ([0-9]+)\)")
_TRUNCATED = "Input data was truncated"


def values_end(data: memoryview, at: int, count: int, within: int) -> int | None:
    """Where the `count` msgpack values written one after the other from `at` end, if they end
    within `within` bytes of it; None if they do not. msgspec skips them (in C) in a copy of
    those bytes at most: it reads a whole value or nothing, and says where the bytes it did not
    need start. Values that cannot be read there are its `DecodeError`."""
    head = b"\xdd" + count.to_bytes(4, "big")  # (the values as one array, read as one Raw)
    window = head + data[at : at + within]
    try:
        _skip(window)
    except msgspec.DecodeError as exc:
        reason = str(exc)
        if reason == _TRUNCATED:
            return None
        trailing = _TRAILING.search(reason)
        if trailing is None:
            raise
        return at + int(trailing.group(1)) - len(head)
    return at + len(window) - len(head)


def container(data: memoryview, at: int) -> tuple[bool, int, int] | None:
    """(whether it is a map, its items (a map's pairs), where the first starts) of the msgpack
    array or map at `at`; None if there is none there."""
    head = data[at] if at < len(data) else 0
    if 0x80 <= head <= 0x9F:
        return head < 0x90, head & 0x0F, at + 1
    width = {0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}.get(head)
    if width is None or at + 1 + width > len(data):
        return None
    return head >= 0xDE, int.from_bytes(data[at + 1 : at + 1 + width], "big"), at + 1 + width


def elements_end(element: bytes, data: memoryview, at: int, count: int) -> int | None:
    """Where `count` elements matching `element` (a pattern of the forms one may take) end, from
    `at`; None where one does not match. Matched in runs of powers of two (their patterns
    are compiled once)."""
    run = 1 << max(count.bit_length() - 1, 0)
    while count:
        if count >= run:
            match = _run_of(element, run).match(data, at)
            if match is None:
                return None
            at, count = match.end(), count - run
        run >>= 1
    return at


@functools.cache
def _run_of(element: bytes, count: int) -> re.Pattern[bytes]:
    return re.compile(b"(?:%s){%d}+" % (element, count), re.DOTALL)


INT = rb"\xce....|\xcd..|[\x00-\x7f\xe0-\xff]|\xcc.|\xcf.{8}|\xd0.|\xd1..|\xd2.{4}|\xd3.{8}"
"""A msgpack int in any of its forms (the most frequent token ids' first)."""


def bin_of(most: int) -> bytes:
    """A msgpack bin of at most `most` bytes, in any of its forms (32 bytes first: vLLM's)."""
    lengths = [32, *(n for n in range(most + 1) if n != 32)]

    def form(kind: int, width: int) -> bytes:
        each = b"|".join(re.escape(n.to_bytes(width, "big")) + b".{%d}" % n for n in lengths)
        return re.escape(bytes([kind])) + b"(?:" + each + b")"

    return b"|".join([form(0xC4, 1), form(0xC5, 2), form(0xC6, 4)])
