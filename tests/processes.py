"""Real `shoal` processes for the tests: spawn `python -m shoal.cli.main ...`, wait for the
ready line, stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.cli.common import parse_ready_line


async def shoal(*args: str, **kwargs: Any) -> asyncio.subprocess.Process:
    """`python -m shoal.cli.main ARGS` as a child; `kwargs` go to `create_subprocess_exec`."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "shoal.cli.main", *args, **kwargs
    )


@dataclass
class Process:
    """A child `shoal` process, its log, and what its ready line said."""

    proc: asyncio.subprocess.Process
    log: Path
    ready: dict[str, str] = field(default_factory=dict)
    stdout: list[str] = field(default_factory=list)

    @property
    def instance_id(self) -> int:
        return int(self.ready["instance"], 16)

    @property
    def url(self) -> str:
        return self.ready["url"]

    @property
    def status_url(self) -> str:
        return self.ready["status"]

    @property
    def model(self) -> str:
        return self.ready["model"]

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def wait(self, timeout: float = 30.0) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    async def read_until_ready(
        self, ready: str | re.Pattern[str], timeout: float
    ) -> dict[str, str]:
        """Read stdout lines (kept in `stdout`) until the ready line of component `ready` (its
        fields), or a line matching the pattern `ready` (its named groups)."""
        what = f"{ready} ready line" if isinstance(ready, str) else repr(ready.pattern)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {what} in {timeout}s:\n{self.stderr()}")
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), remaining)
            except TimeoutError:
                continue
            if not line:
                await self.proc.wait()
                raise AssertionError(
                    f"exited with {self.proc.returncode} before {what}:\n"
                    f"{''.join(self.stdout)}\n{self.stderr()}"
                )
            text = line.decode(errors="replace")
            self.stdout.append(text)
            if isinstance(ready, str):
                if (fields := parse_ready_line(text, ready)) is not None:
                    return fields
            elif match := ready.match(text.strip()):
                return match.groupdict()


class Processes:
    """Starts `shoal` children with their stderr logged under `directory`; kills whatever is
    left at the end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[Process] = []

    async def start(
        self, *args: str, ready: str | re.Pattern[str], timeout: float = 30.0
    ) -> Process:
        """Start `shoal ARGS`; wait for the ready line of component `ready` ("frontend"), or
        for a line matching `ready` of a command that prints none (`shoal up`)."""
        log = self.directory / f"{args[0]}-{len(self.started)}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SHOAL_STORE", None)
        with log.open("wb") as err:
            proc = await shoal(*args, stdout=asyncio.subprocess.PIPE, stderr=err, env=env)
        process = Process(proc, log)
        self.started.append(process)
        process.ready = await process.read_until_ready(ready, timeout)
        return process

    async def worker(
        self,
        store_url: str,
        *args: str,
        model: str = "mock-llm",
        engine: str = "mocker",
        timeout: float = 30.0,
    ) -> Process:
        return await self.start(
            "worker", "--engine", engine, "--model", model, "--store", store_url, *args,
            ready="worker", timeout=timeout,
        )  # fmt: skip

    async def close(self) -> None:
        for process in self.started:
            if process.proc.returncode is None:
                process.proc.kill()
                with contextlib.suppress(Exception):
                    await process.wait(10)
