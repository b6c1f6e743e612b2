"""`FileSource`: namespaces from a JSON file that an operator's tooling rewrites.

The file is `{"version": 1, "sources": [{"namespace": "..."}]}`, validated strictly, with two
optional opaque strings (at most `MAX_REVISION` characters): `revision`, the selection's
revision instead of the content hash, and `connection_revision`, whose change makes a
consumer that connects elsewhere (the KV relay, to NATS) connect again. It is
watched with `watchfiles` (inotify and friends) on its directory, so an atomic replacement
(write a temporary file, rename it over) is seen; a poll every `poll_interval` seconds
catches whatever the notifications miss, or everything when they are unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from shoal.bounds import TooDeep, check_json_depth
from shoal.discovery.keys import check_name, quoted
from shoal.membership.errors import SourceError
from shoal.membership.selection import Selection

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1024 * 1024
MAX_SOURCES = 4096
MAX_REVISION = 256
READ_TIMEOUT_SECONDS = 5.0
"""How long one read of the file is awaited (a file on a hung network mount)."""

_SPACE_OR_SLASH = re.compile(r"[\s/]")


class _Entry(msgspec.Struct, forbid_unknown_fields=True):
    namespace: str


class _SourcesFile(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    sources: list[_Entry]
    revision: str | None = None
    connection_revision: str | None = None


_decoder = msgspec.json.Decoder(_SourcesFile)


def parse_sources(data: bytes, origin: str = "sources file") -> Selection:
    """The selection `data` holds; a `SourceError` naming the problem if it is not valid.
    A message quotes at most the first `QUOTED_CHARS` characters of a value (and its length)."""
    if len(data) > MAX_FILE_BYTES:
        raise SourceError(f"{origin}: {len(data)} bytes, over the {MAX_FILE_BYTES}-byte limit")
    try:
        check_json_depth(data)
        parsed = _decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, TooDeep) as exc:
        raise SourceError(f"{origin}: {exc}") from None
    if parsed.version != 1:
        raise SourceError(f"{origin}: version must be 1, got {parsed.version}")
    if len(parsed.sources) > MAX_SOURCES:
        raise SourceError(
            f"{origin}: {len(parsed.sources)} sources, over the limit of {MAX_SOURCES}"
        )
    for field in ("revision", "connection_revision"):
        value = getattr(parsed, field)
        if value is not None and not 0 < len(value) <= MAX_REVISION:
            raise SourceError(f"{origin}: {field} must be 1 to {MAX_REVISION} characters")
    seen: set[str] = set()
    for i, entry in enumerate(parsed.sources):
        name = entry.namespace
        where = f"{origin}: sources[{i}].namespace"
        if not name:
            raise SourceError(f"{where}: empty namespace")
        try:
            check_name("namespace", name)  # (a bounded check: at most 64 characters looked at)
        except ValueError as exc:
            if _SPACE_OR_SLASH.search(name):
                raise SourceError(f"{where}: {quoted(name)} contains whitespace or '/'") from None
            raise SourceError(f"{where}: {exc}") from None
        if name in seen:
            raise SourceError(f"{where}: duplicate namespace {name!r}")
        seen.add(name)
    return Selection.of(
        seen, revision=parsed.revision, connection_revision=parsed.connection_revision
    )


def read_bytes(path: Path) -> bytes:
    """The bytes of the regular file at `path` (at most one byte over the limit is read).

    Opened without blocking and checked before it is read: a FIFO put in its place (open(2)
    of one with no writer waits for ever), a device or a directory is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SourceError(f"sources file {path}: not found") from None
    except OSError as exc:
        raise SourceError(f"sources file {path}: {exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SourceError(f"sources file {path}: not a regular file")
        if info.st_size > MAX_FILE_BYTES:  # (its size named, not the bytes a read would get)
            raise SourceError(
                f"sources file {path}: {info.st_size} bytes, over the {MAX_FILE_BYTES}-byte limit"
            )
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SourceError(f"sources file {path}: {exc}") from None
    finally:
        os.close(fd)


def read_sources(path: Path) -> Selection:
    """Read and parse the file at `path` (blocking: `FileSource` calls it in a thread)."""
    return parse_sources(read_bytes(path), f"sources file {path}")


class FileSource:
    """Yields the file's selection at start and whenever its content or validity changes.

    The file is read and parsed in a thread, at most one read at a time and each awaited
    at most `read_timeout` seconds (a hung network mount: a `SourceError`, and the read
    still running is awaited again at the next wake-up rather than another one started).
    Bytes identical to the last ones read are not parsed again (4,096 names: 20-70 ms)."""

    def __init__(
        self,
        path: Path | str,
        *,
        poll_interval: float = 1.0,
        read_timeout: float = READ_TIMEOUT_SECONDS,
    ) -> None:
        self.path = Path(path).absolute()
        self.poll_interval = poll_interval
        self.read_timeout = read_timeout
        self.reads = 0  # reads of the file made
        self.timeouts = 0  # waits for a read that ended at `read_timeout`
        self.parses = 0  # contents parsed (not the reads whose bytes had not changed)
        self._reading: asyncio.Future[Selection | str] | None = None
        self._last: tuple[bytes, Selection | str] | None = None  # bytes read, what they hold

    async def selections(self) -> AsyncIterator[Selection | SourceError]:
        changed = asyncio.Event()
        notifier = asyncio.create_task(self._notify(changed), name=f"watch-file:{self.path}")
        last: Selection | str | None = None
        try:
            while True:
                changed.clear()
                current = await self._current()
                if current != last:
                    last = current
                    yield current if isinstance(current, Selection) else SourceError(current)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_interval):
                        await changed.wait()
        finally:
            notifier.cancel()
            with contextlib.suppress(BaseException):
                await notifier

    async def _current(self) -> Selection | str:
        """What the file holds now (a selection, or why it holds none), read in a thread."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(asyncio.to_thread(self._read))
        reading = self._reading
        try:
            async with asyncio.timeout(self.read_timeout):
                current = await asyncio.shield(reading)
        except TimeoutError:
            self.timeouts += 1
            return f"sources file {self.path}: not read within {self.read_timeout:g}s"
        finally:
            if reading.done():
                self._reading = None
        return current

    def _read(self) -> Selection | str:
        self.reads += 1
        try:
            data = read_bytes(self.path)
        except SourceError as exc:
            return str(exc)
        last = self._last
        if last is not None and last[0] == data:
            return last[1]
        self.parses += 1
        try:
            current: Selection | str = parse_sources(data, f"sources file {self.path}")
        except SourceError as exc:
            current = str(exc)
        self._last = (data, current)
        return current

    async def _notify(self, changed: asyncio.Event) -> None:
        """Set `changed` on any change to the file's directory entry (the poll covers gaps)."""
        try:
            import watchfiles
        except ImportError:  # pragma: no cover - a dependency; polling still works
            log.warning("watchfiles is not available; polling %s", self.path)
            return
        name = self.path.name
        try:
            async for changes in watchfiles.awatch(
                self.path.parent,
                watch_filter=lambda _change, p: Path(p).name == name,
                recursive=False,
                debounce=50,
                step=20,
            ):
                if changes:
                    changed.set()
        except (OSError, RuntimeError) as exc:
            log.warning(
                "cannot watch %s (%s); polling every %ss", self.path, exc, self.poll_interval
            )
