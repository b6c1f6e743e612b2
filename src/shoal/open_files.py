"""This process's limit of open files: raised to the hard limit for itself (`raise_limit`),
the soft limit it started with given back to the programs it starts (`with_start_limit`), as
Go's runtime does. A frontend holds a socket per client and per upstream connection; a
program it starts has no use for that limit, and one that calls `select()` breaks past 1,024
descriptors (a `fd_set` holds no more).

The limit is set in the child, before the program runs, by `/bin/sh` (`ulimit -S -n`, then
`exec`: the same process, ~1 ms more): a `prlimit` on the child's pid after it started
races with the program (and with what it starts first), and a `preexec_fn` runs Python
between fork and exec, which is not safe in a process with threads (every shoal process
has the event loop's executor). A shoal command started so raises its own limit again, and
gives back the same start limit to what it starts in turn.
"""

from __future__ import annotations

import logging
import os
import resource
from collections.abc import Sequence

log = logging.getLogger(__name__)

SHELL = "/bin/sh"

_start_soft: int | None = None  # the soft limit `raise_limit` raised from (None: not raised)


def raise_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit, noting the one it
    had (distributions start processes at a soft 1,024 under a hard limit of hundreds of
    thousands: past the soft one, accepts fail and clients are refused)."""
    global _start_soft
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # (a hard limit past the kernel's nr_open)
        log.debug("open-file limit left at %d: %s", soft, exc)
        return
    _start_soft = soft


RESERVED = 256  # descriptors a server keeps beside its connections (store, files, logs, pipes)


def connections_within(wanted: int) -> int:
    """The client connections a proxy may hold within this process's limit of open files: each
    may hold one to an instance too, and `RESERVED` stay for the rest. Past it, accepts fail
    (libuv closes the connection at once, unanswered: a probe sees a reset) and so do connects
    to instances (a 503 then); within it, the connection over the limit is answered 503."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (soft - RESERVED) // 2))


def with_start_limit(command: Sequence[str]) -> list[str]:
    """`command` to start a program with the soft limit of open files this process started
    with (itself, when the limit was never raised, or there is no `/bin/sh`)."""
    if _start_soft is None or not os.path.exists(SHELL):
        return list(command)
    return [SHELL, "-c", f'ulimit -S -n {_start_soft} && exec "$@"', "sh", *command]
