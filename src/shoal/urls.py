"""URLs as they may be shown: in logs, error messages, `/health` and reports."""

from __future__ import annotations

import re

# Where a URL's authority starts, however its scheme and slashes are written: `http://`,
# `http:/`, `http:`, `http:///`, `http:\\`, `//` or nothing (the forms a parser refuses
# for want of a host, and an error message then quotes).
_AUTHORITY_START = re.compile(r"[\x00-\x20]*(?:[A-Za-z][A-Za-z0-9+.-]*:)?[/\\]*")


def redact_url(url: str) -> str:
    """`url` without what may hold a secret: its userinfo (`***@`) and its query (`?***`:
    redis-py and libpq take `?password=`); its fragment dropped. Split by hand, as `urlsplit`
    refuses some URLs (`postgresql://u:p@[::1/db`, `http:/u:p@host`) that still carry
    credentials. A password's `/`, `?` or `#` not percent-encoded ends the authority early,
    in a `user:pass` whose "port" is no number (or digits, an `@` after them): the userinfo
    then runs to the last `@`."""
    start = _AUTHORITY_START.match(url)
    head, rest = (url[: start.end()], url[start.end() :]) if start else ("", url)
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, end)
    if at < 0 and _cut_short(rest[:end], rest[end:]):
        at = rest.rfind("@")
    if at >= 0:
        head, rest = head + "***", rest[at:]
    rest, query, _ = rest.partition("#")[0].partition("?")
    return head + rest + ("?***" if query else "")


def _cut_short(authority: str, after: str) -> bool:
    """Whether `authority` (no `@` in it) looks like a `user:pass` cut short: a `:` followed
    by what is no port (an IPv6 host in brackets aside), or by digits alone when an `@` comes
    after it that starts no path segment (`svc:2024/Secret@host`, read as a port and a path;
    `/v1/@team` stays as it is)."""
    _, colon, port = authority.rpartition(":")
    if not colon or (authority.endswith("]") and not port.isdigit()):
        return False
    if not port.isdigit():
        return True
    at = after.rfind("@")
    return at > 0 and after[at - 1] != "/"
