"""What every `shoal` command shares: flags that fall back to the environment, the event
loop, the stop signals, and the ready line that scripts, `shoal up`, the tests and `bench/`
read to learn where a started process serves.

The ready line is one line on stdout, `shoal COMPONENT ready: KEY=VALUE KEY=VALUE ...`,
printed once the process serves; `parse_ready_line` is its one parser.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import re
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from shoal import open_files

T = TypeVar("T")
N = TypeVar("N", int, float)

_TRUE = ("1", "true", "yes")
_READY = re.compile(r"^shoal (?P<component>[\w-]+) ready:(?P<fields>.*)$")
_FIELD = re.compile(r" (\w+)=(.*?)(?= \w+=|$)")  # a value runs to the next ` KEY=`


def env_value(name: str) -> str | None:
    """`SHOAL_<NAME>` (dashes become underscores) when set and not empty, else None."""
    return os.environ.get(f"SHOAL_{name.upper().replace('-', '_')}") or None


MAX_INT = 2**63 - 1
"""The largest integer flag value: what a store or a syscall takes (int64). A longer one
would not even convert to a float (`math.isfinite` raised `OverflowError`, a traceback)."""


def number(
    kind: type[N], *, low: N | None = None, high: N | None = None, above: N | None = None
) -> Callable[[str], N]:
    """The `type` of a numeric flag: `kind` (int or float), finite, at least `low`, at most
    `high`, more than `above`. The one validator of every numeric flag of every command
    (`add_flag` refuses a bare `int` or `float`): a bad value, from the flag or from its
    `SHOAL_*` variable, is a usage error naming the flag, before anything starts."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str) -> N:
        # A value is echoed, never a huge one whole.
        plain = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
        shown = repr(text) if len(text) <= 40 else repr(text[:40]) + f" ({len(text)} characters)"
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown} is not {what}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{shown} is not a finite number")
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise argparse.ArgumentTypeError(f"{shown} is out of range (at most {MAX_INT})")
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {plain}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {plain}")
        if above is not None and value <= above:
            raise argparse.ArgumentTypeError(f"must be more than {above}, got {plain}")
        return value

    parse.__name__ = kind.__name__  # argparse's messages name the type
    return parse


PORT = number(int, low=0, high=65535)
"""A TCP port; 0 lets the system pick a free one."""
POSITIVE = number(int, low=1)
"""A count or size of at least 1."""
COUNT = number(int, low=0)
"""A count that may be 0."""
SECONDS = number(float, above=0)
"""A duration of more than 0 seconds."""
SECONDS_OR_ZERO = number(float, low=0)
"""A duration where 0 means none (or no limit, as the flag says)."""
NON_NEGATIVE = number(float, low=0)
"""A finite number of at least 0 (a weight, a latency, a factor)."""
MAX_PROCESSES = 1024


def processes(text: str) -> int:
    """A number of processes (1 to `MAX_PROCESSES`), or `auto`: the cores this process may
    run on (`os.sched_getaffinity`, which a cgroup's cpuset or taskset narrows), fewer when
    its cgroups' CPU quota allows less (`cpu_quota`: a container's CPU limit)."""
    if text.strip().lower() == "auto":
        cores = len(os.sched_getaffinity(0))
        quota = cpu_quota()
        return max(1, min(cores, quota if quota is not None else cores, MAX_PROCESSES))
    return _PROCESS_COUNT(text)


def cpu_quota(
    cgroup_fs: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """The CPUs the CPU quota of this process's cgroups allows, rounded up: the tightest of
    its cgroup's and its ancestors' (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`); None
    without a quota, or where none can be read."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        files: tuple[str, ...]
        if controllers == "":  # v2: one hierarchy
            base, files = cgroup_fs, ("cpu.max",)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            base, files = cgroup_fs / controllers, ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        group = base / path.strip("/")
        for directory in (group, *group.parents):
            try:
                values = " ".join(directory.joinpath(f).read_text() for f in files).split()
                quota, period = values
                if quota not in ("max", "-1") and float(period) > 0:
                    quotas.append(float(quota) / float(period))
            except (OSError, ValueError):
                pass
            if directory == base:
                break
    return math.ceil(min(quotas)) if quotas else None


_PROCESS_COUNT = number(int, low=1, high=MAX_PROCESSES)
PROCESSES = processes
"""A count of processes, or `auto` (see `processes`)."""


def add_flag(
    parser: argparse._ActionsContainer,
    name: str,
    default: Any = None,
    *,
    env: str | None = None,
    short: str | None = None,
    **kwargs: Any,
) -> None:
    """Add flag `name`, defaulting to `SHOAL_<NAME>` (or `SHOAL_<ENV>`) when set and not
    empty, else to `default`; `short` is its one-letter alias (`-w`).

    A default is kept as a string, so argparse converts it with the flag's `type` when the
    command runs: a bad value is a usage error of that command only. A numeric flag's
    `type` is a `number(...)` (`PORT`, `SECONDS`, ...), never a bare `int` or `float`. With
    `action="store_true"` the variable is a switch (1, true or yes); with `action="append"`
    it is a comma-separated list the flags add to.
    """
    if kwargs.get("type") in (int, float):
        raise TypeError(f"flag {name}: give a numeric flag a `number(...)` type, not a bare one")
    value = env_value(env or name.lstrip("-"))
    action = kwargs.get("action")
    if action == "store_true":
        chosen: Any = value.lower() in _TRUE if value is not None else bool(default)
    elif action == "append":
        chosen = [item for item in value.split(",") if item] if value else list(default or [])
    elif value is not None:
        chosen = value
    else:
        chosen = default if default is None or isinstance(default, str) else str(default)
    names = (short, name) if short else (name,)
    parser.add_argument(*names, default=chosen, **kwargs)


def run_event_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on uvloop, the event loop the request path is tuned for (in every command,
    so each runs on the loop it is tested on), with the open-file limit raised (the one it
    started with given back to the programs it starts: `shoal.open_files`); what it
    returns."""
    import uvloop

    logging.getLogger("asyncio").setLevel(logging.WARNING)
    open_files.raise_limit()
    return uvloop.run(main)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a `shoal` command cleanly (as `shoal.worker.runtime.STOP_SIGNALS` drain a
worker): SIGHUP too, a closed terminal or a lost ssh session, not a kill."""


def on_stop_signals(stop: asyncio.Event) -> None:
    """Set `stop` on SIGINT, SIGTERM or SIGHUP (`STOP_SIGNALS`; replacing any handler set
    before)."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)


def shown(text: str) -> str:
    """`text` on one line of a terminal: a character that is not printable (a newline, an
    escape sequence: names come from engines and the store) is written as `repr` writes it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def ready_line(component: str, **fields: object) -> str:
    """`shoal COMPONENT ready: KEY=VALUE ...`, the line a process prints once it serves; one
    line whatever the values hold (`shown`: a model's name is its engine's)."""
    return f"shoal {component} ready:" + "".join(f" {k}={shown(str(v))}" for k, v in fields.items())


def print_ready(component: str, **fields: object) -> None:
    """Print the ready line on stdout, flushed at once (a pipe would hold it otherwise)."""
    print(ready_line(component, **fields), flush=True)


def parse_ready_line(line: str, component: str | None = None) -> dict[str, str] | None:
    """The fields of a ready line (of `component`, when given); None for any other line."""
    match = _READY.match(line.strip())
    if match is None or (component is not None and match["component"] != component):
        return None
    return dict(_FIELD.findall(match["fields"]))
