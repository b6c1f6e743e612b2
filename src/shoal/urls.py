"""URLs as they may be shown: in logs, error messages, `/health` and reports."""

from __future__ import annotations


def redact_url(url: str) -> str:
    """`url` without what may hold a secret: its userinfo (`***@`) and its query (`?***`:
    redis-py and libpq take `?password=`); its fragment dropped. Split by hand, as `urlsplit`
    refuses some URLs (`postgresql://u:p@[::1/db`) that still carry credentials."""
    scheme, sep, rest = url.partition("://")
    rest = rest.partition("#")[0]
    rest, query, _ = rest.partition("?")
    end = rest.find("/") if "/" in rest else len(rest)
    if sep and "@" in rest[:end]:
        rest = "***@" + rest[:end].rpartition("@")[2] + rest[end:]
    return f"{scheme}{sep}{rest}" + ("?***" if query else "")
