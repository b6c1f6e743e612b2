"""What a template's operation would build, foreseen before it is built (`BoundedSandbox`
checks them against its size limits): a format's width, a sequence's printed characters,
an integer's bits."""

from __future__ import annotations

import itertools
import re
import string
from collections.abc import Iterable
from typing import Any

from shoal.bounds import MAX_DEPTH

_WIDE = re.compile(r"[%:.<>^=]\s*[-+ #0]*\d{7,}")  # a format field a million wide
_STAR = re.compile(r"%%|%(?:\([^)]*\))?[-+ #0]*(?:\*|\d*\.\*)")  # `%*s`: width from arguments


def wide(form: str, style: str) -> bool:
    """Whether format string `form` (`style` "%" or "{") asks for a field a million wide or
    one whose width or precision comes from the arguments (`%*s`, `{0:{1}}`): refused, as
    the size of what it builds is not known before it is built."""
    if _WIDE.search(form):
        return True
    if style == "%":
        return any(m.group() != "%%" for m in _STAR.finditer(form))
    try:
        return any(spec and "{" in spec for _, _, spec, _ in string.Formatter().parse(form))
    except ValueError:
        return False  # (`format` raises it)


def chars(value: Any, budget: int, depth: int = 0, extra: int = 4) -> int:
    """About how many characters `value` makes printed, joined or encoded (its strings'
    lengths, `extra` more per item and a dict's keys too unless `extra` is 0, through lists,
    tuples and dicts), counted up to `budget` (past it, or 32 containers deep, more)."""
    if depth > 32:
        return budget + 1
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, list | tuple | dict):
        if isinstance(value, int) and extra:  # (its digits, about: ~0.3 a bit)
            return value.bit_length() // 3 + 1
        return 1 if extra else 0
    items: Iterable[Any] = value if not isinstance(value, dict) else (
        itertools.chain(value.keys(), value.values()) if extra else value.values()
    )  # fmt: skip
    total = 0
    for item in items:
        total += extra + chars(item, budget - total, depth + 1, extra)
        if total > budget:
            break
    return total


def text_size(value: Any, depth: int = 0) -> int:
    """How many characters the strings in `value` hold, through lists, tuples and dicts
    (keys too): a message's text, its tool calls' arguments included. (An outside value
    nests at most `MAX_DEPTH` levels; past them nothing is counted.)"""
    if isinstance(value, str):
        return len(value)
    if depth > MAX_DEPTH or not isinstance(value, list | tuple | dict):
        return 0
    if isinstance(value, dict):
        return sum(text_size(k, depth + 1) + text_size(v, depth + 1) for k, v in value.items())
    return sum(text_size(item, depth + 1) for item in value)


def int_bits(operator: str, left: Any, right: Any) -> int:
    """About how many bits the largest integer in `left operator right` holds, its result
    (foreseen: `*` adds its operands' bits, `**` multiplies them by the power, `+` and `-`
    one more) or an operand (a number that is no integer counts 0)."""
    a = left.bit_length() if isinstance(left, int) else 0
    b = right.bit_length() if isinstance(right, int) else 0
    if operator == "*" and a and b:
        return a + b
    if operator in ("+", "-") and a and b:
        return max(a, b) + 1
    if operator == "**" and a and isinstance(right, int) and right > 0:
        return max(a * right, b)
    return max(a, b)


def built(operator: str, left: Any, right: Any, budget: int) -> int:
    """About how many characters `left operator right` (`*`, `+`) holds, counted up to
    `budget`: a list by the characters of its items (`[s] * n` prints, joins, encodes n
    times `s`), not by their count."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and type(times) is int and times > 0:
                return chars(seq, budget // times + 1) * times
    if operator == "+" and isinstance(left, list | tuple) and isinstance(right, list | tuple):
        # (the text its items hold, as the render's limit counts a chat's: `[system] +
        # messages` of a long chat is within it; a list doubled again and again is not)
        return chars(left, budget, extra=0) + chars(right, budget, extra=0)
    return 0
