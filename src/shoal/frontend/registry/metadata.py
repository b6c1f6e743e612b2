"""Model metadata files (config, tokenizer, chat template), fetched from workers and cached.

A card lists each file with the URL where its worker hosts it and its checksum. Files are
kept on disk by checksum, so a file is fetched once per frontend cache whatever the number
of workers that serve it, and a cached file needs no verification again. Cards that need a
file whose download is already in flight wait for that download instead of starting theirs;
when it fails, one of them takes over with its own URL while the others keep waiting.

The cache is an optimisation, never a condition: a download streams to a temporary file
while its checksum is computed, and a file that verifies is good even when the disk refused
it (unwritable directory, disk full): the card joins, the trouble is reported by `status()`.
The directory is bounded (`max_bytes`, least recently used out) and temporary files never
outlive a failed download.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import platformdirs

from shoal.cards import MetadataFile, ModelCard
from shoal.frontend.http.fetch import Fetcher, FetchError
from shoal.frontend.registry.cache_io import Writer, resolve_in_slices, sha256_holding_the_gil
from shoal.urls import redact_url

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1 << 30  # the whole cache directory
DEFAULT_MAX_FILE_BYTES = 64 << 20  # one metadata file; a card declaring more is refused
STALE_TMP_SECONDS = 3600.0  # a temporary file this old belongs to a process that died
CHUNK = 1 << 16
SMALL_FILE_BYTES = 1 << 20  # a file up to this size is held in memory and written in one go


def shown(file: MetadataFile) -> str:
    """The URL of `file` as messages and logs show it: without credentials or query."""
    return redact_url(file.url)


def _failed(exc: FetchError) -> str:
    """How a `Fetcher` GET failed, worded as the aiohttp path words it."""
    reason = str(exc)
    return reason if reason.startswith(("answered ", "is larger than")) else f"failed: {reason}"


class MetadataError(Exception):
    """A metadata file could not be fetched, or did not match its checksum or size."""


def default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("shoal")) / "metadata"


@dataclass
class _SharedDownload:
    """The download of one checksum that every card needing it waits on.

    `failed` holds the URLs that already failed in this round (URL -> error), so a waiter
    whose own URL failed does not ask it again; the round ends when nobody waits.
    """

    task: asyncio.Task[None] | None = None
    url: str = ""
    waiters: int = 0
    failed: dict[str, str] = field(default_factory=dict)


MAX_PENDING_BYTES = 64 << 20
"""Verified small files held in memory while the disk is behind, before a download waits
for its own write."""


class MetadataCache:
    """Verified metadata files on disk, named by checksum, bounded in size."""

    def __init__(
        self,
        directory: Path | None = None,
        *,
        timeout: float = 30.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    ) -> None:
        self.directory = directory or default_cache_dir()
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.max_file_bytes = max_file_bytes
        self._files: OrderedDict[str, int] = OrderedDict()  # on disk: checksum -> size, LRU first
        self._bytes = 0
        self._uncached: set[str] = set()  # verified, but the disk refused them
        self._pending: dict[str, asyncio.Future[bool]] = {}  # verified, being written
        self._pending_bytes = 0
        self._shared: dict[str, _SharedDownload] = {}  # by checksum
        self._session: aiohttp.ClientSession | None = None  # HTTPS, odd URLs, large files
        self._fetcher = Fetcher(connect_timeout=timeout)
        self._writer = Writer(self._write_whole)
        # Checksums to look for on disk at the next turn of the loop, and when it is done.
        self._lookup: tuple[list[str], list[asyncio.Future[bool]]] | None = None
        self._lookups: set[asyncio.Task[None]] = set()
        self._last_lookup: asyncio.Task[None] | None = None  # batches answer in order
        self.downloads = 0  # downloads started
        self.errors = 0  # cache writes the disk refused
        self.evictions = 0
        self.problem: str | None = None  # the last cache write error, until a write succeeds
        self.problem_since: float | None = None
        self._load()

    def path(self, checksum: str) -> Path:
        return Path(self._path(checksum))

    def _path(self, checksum: str) -> str:
        # A plain string: `has` runs for every file of every card, and pathlib costs more
        # than the lookup itself.
        return os.path.join(self.directory, checksum.replace(":", "-"))

    def _load(self) -> None:
        """Index the files already on disk (oldest first) and remove stale temporary files."""
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for entry in entries:
            with contextlib.suppress(OSError):
                stat = entry.stat()
                if entry.name.endswith(".tmp"):
                    if now - stat.st_mtime > STALE_TMP_SECONDS:
                        os.unlink(entry.path)
                elif entry.is_file() and entry.name.startswith("sha256-"):
                    found.append((stat.st_mtime, entry.name.replace("-", ":", 1), stat.st_size))
        for _, checksum, size in sorted(found):
            self._files[checksum] = size
            self._bytes += size

    def has(self, file: MetadataFile) -> bool:
        """Whether `file` is cached (or verified and used uncached), as far as this cache
        knows: a file another frontend sharing the directory put there since it was indexed
        is found by `fetch`, which looks on disk off the event loop."""
        checksum = file.checksum
        if checksum in self._files:
            self._files.move_to_end(checksum)
            return True
        return checksum in self._uncached or checksum in self._pending

    def missing(self, card: ModelCard) -> dict[str, MetadataFile]:
        """The files of `card` not cached (`has`)."""
        files = card.metadata_files
        return {name: f for name, f in files.items() if not self.has(f)}

    def status(self) -> dict[str, Any]:
        """What `/health` shows of the cache: its size, and its trouble if any."""
        return {
            "directory": str(self.directory),
            "files": len(self._files),
            "bytes": self._bytes,
            "max_bytes": self.max_bytes,
            "uncached_files": len(self._uncached),
            "unwritten_files": len(self._pending),  # verified, waiting for the disk
            "problem": self.problem,
            "problem_since": self.problem_since,
        }

    async def fetch(self, card: ModelCard) -> None:
        """Fetch and verify every file of `card` not cached yet; `MetadataError` on any failure.

        The downloads start at once and the card waits for them one after the other, with
        no task per file: at a fleet's cold start a hundred thousand cards wait at once."""
        missing = self.missing(card)
        unseen = [f.checksum for f in missing.values() if f.checksum not in self._shared]
        if unseen:  # (put on disk by another frontend sharing the directory, maybe)
            await self._look_on_disk(unseen)
            missing = self.missing(card)
        if len(missing) > 1:
            for name, file in missing.items():
                shared = self._shared.get(file.checksum)
                if file.size <= self.max_file_bytes and (shared is None or shared.task is None):
                    if shared is None:
                        shared = self._shared[file.checksum] = _SharedDownload()
                    if file.url not in shared.failed:
                        self._start(name, file, shared)
        for name, file in missing.items():
            await self._fetch_one(name, file)

    async def _fetch_one(self, name: str, file: MetadataFile) -> None:
        """Download `file`, or wait for the download of its checksum already in flight.

        The download is shielded: a card that goes away does not cancel it for the others.
        When a download fails, the first waiter to notice starts its own (its URL is another
        worker's copy) and the others wait on that one: never N downloads at once.
        """
        if file.size > self.max_file_bytes:
            raise MetadataError(
                f"{name}: {file.size} bytes is over the {self.max_file_bytes}-byte limit "
                "for a metadata file (--metadata-max-file-bytes)"
            )
        shared = self._shared.get(file.checksum)
        if shared is None:
            shared = self._shared[file.checksum] = _SharedDownload()
        shared.waiters += 1
        try:
            while not self.has(file):  # (`fetch` looked on disk)
                task = shared.task
                if task is None:
                    if file.url in shared.failed:
                        raise MetadataError(shared.failed[file.url])
                    task = self._start(name, file, shared)
                mine = shared.url == file.url
                try:
                    await asyncio.shield(task)
                except MetadataError:
                    if mine:
                        raise
                    # another worker's copy failed: loop, and take over if nobody has. Yield
                    # first: a download that failed before this card came is awaited without
                    # a yield, and its done-callback (which clears `shared.task`) must run.
                    await asyncio.sleep(0)
        finally:
            shared.waiters -= 1
            self._end_round(file.checksum, shared)

    async def _look_on_disk(self, checksums: list[str]) -> None:
        """Look for `checksums` on disk, off the event loop, with every other lookup asked
        in the same turn of the loop: one thread hop per batch, its askers woken
        `RESOLVE_SLICE` per turn. At a cold start thousands of fetches begin together, and
        a `stat` each on the loop (slow while the cache writer creates files in the same
        directory) held it 30-60 ms at a time."""
        loop = asyncio.get_running_loop()
        if self._lookup is None:
            self._lookup = ([], [])
            loop.call_soon(self._start_lookup)
        wanted, askers = self._lookup
        wanted.extend(checksums)
        askers.append(answer := loop.create_future())
        await answer

    def _start_lookup(self) -> None:
        if self._lookup is not None:
            wanted, askers = self._lookup
            self._lookup = None
            batch = self._lookup_batch(wanted, askers, self._last_lookup)
            self._lookups.add(task := asyncio.create_task(batch))
            task.add_done_callback(self._lookups.discard)
            self._last_lookup = task

    async def _lookup_batch(
        self,
        wanted: list[str],
        askers: list[asyncio.Future[bool]],
        previous: asyncio.Task[None] | None,
    ) -> None:
        try:
            try:
                found = await asyncio.to_thread(self._sizes_on_disk, wanted)
                for checksum, size in found.items():
                    if checksum not in self._files:
                        self._remember(checksum, size)
            except Exception:  # (an executor shut down at close: not found, downloaded instead)
                log.debug("metadata cache: looking on disk failed", exc_info=True)
            if previous is not None and not previous.done():
                # Answered in the order asked (two thread hops may end the other way round):
                # a card that came first is not overtaken by one that came a turn later.
                await asyncio.wait((previous,))
        finally:
            resolve_in_slices([(asker, True) for asker in askers])

    def _sizes_on_disk(self, checksums: list[str]) -> dict[str, int]:
        """In a thread: the size of each of `checksums` found on disk."""
        found: dict[str, int] = {}
        for checksum in dict.fromkeys(checksums):  # (two fetches may ask for one file)
            with contextlib.suppress(OSError):
                found[checksum] = os.stat(self._path(checksum)).st_size
        return found

    def _start(self, name: str, file: MetadataFile, shared: _SharedDownload) -> asyncio.Task[None]:
        """Start the download of `file` from its URL, shared by its checksum's waiters."""
        task = asyncio.create_task(self._download(name, file), name=f"metadata:{name}")
        shared.task, shared.url = task, file.url
        task.add_done_callback(functools.partial(self._download_done, file, shared))
        self.downloads += 1
        return task

    def _download_done(
        self, file: MetadataFile, shared: _SharedDownload, task: asyncio.Task[None]
    ) -> None:
        if shared.task is task:
            shared.task = None
            if not task.cancelled() and task.exception() is not None:
                shared.failed[shared.url] = str(task.exception())
        if not task.cancelled():
            task.exception()  # retrieved: whoever awaited it has it; nobody else needs it
        self._end_round(file.checksum, shared)

    def _end_round(self, checksum: str, shared: _SharedDownload) -> None:
        if shared.waiters == 0 and shared.task is None and self._shared.get(checksum) is shared:
            del self._shared[checksum]

    async def _download(self, name: str, file: MetadataFile) -> None:
        """Download `file` while hashing it; keep it if it verifies.

        A small file (most are: configs, templates) comes whole through the gateway's own
        HTTP client when its URL is plain `http://` (`Fetcher`: a quarter of a general
        client's CPU, which counts when a cold start downloads 20,000 of them), else through
        aiohttp, and is written to the cache with one thread hop; a larger one streams to a
        temporary file, chunk by chunk.
        """
        if file.size <= SMALL_FILE_BYTES and Fetcher.handles(file.url):
            try:
                data = await self._fetcher.get(file.url, file.size, self.timeout)
            except FetchError as exc:
                raise MetadataError(f"{name}: GET {shown(file)} {_failed(exc)}") from None
            self._verify(name, file, sha256_holding_the_gil(data), len(data))
            await self._keep_small(file.checksum, data)
            return
        import aiohttp  # (imported when first needed: most fleets never need it here)

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        digest = hashlib.sha256()
        size = 0
        small = file.size <= SMALL_FILE_BYTES
        chunks: list[bytes] = []
        tmp, out = (None, None) if small else await asyncio.to_thread(self._open_tmp, file.checksum)
        try:
            try:
                async with self._session.get(file.url, allow_redirects=False) as response:
                    if response.status != 200:
                        raise MetadataError(f"{name}: GET {shown(file)} answered {response.status}")
                    async for chunk in response.content.iter_chunked(CHUNK):
                        size += len(chunk)
                        if size > file.size:
                            raise MetadataError(
                                f"{name}: {shown(file)} is larger than {file.size} bytes"
                            )
                        digest.update(chunk)
                        if small:
                            chunks.append(chunk)
                        elif out is not None and tmp is not None:
                            out = await asyncio.to_thread(self._write, out, tmp, chunk)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # (an exception is always true: its text is what may be empty, as a timeout's is)
                reason = str(exc) or (
                    f"timed out after {self.timeout:g}s"
                    if isinstance(exc, TimeoutError)
                    else type(exc).__name__
                )
                raise MetadataError(f"{name}: GET {shown(file)} failed: {reason}") from exc
            self._verify(name, file, digest.hexdigest(), size)
            if small:
                await self._keep_small(file.checksum, b"".join(chunks))
                return
            kept = (
                out is not None
                and tmp is not None
                and await asyncio.to_thread(self._keep, out, tmp, file.checksum)
            )
            self._kept(file.checksum, size, kept)
        finally:
            if out is not None and tmp is not None and not out.closed:
                await asyncio.to_thread(self._discard, out, tmp)

    @staticmethod
    def _verify(name: str, file: MetadataFile, sha256: str, size: int) -> None:
        checksum = f"sha256:{sha256}"
        if checksum != file.checksum or size != file.size:
            raise MetadataError(
                f"{name}: {shown(file)} has checksum {checksum} ({size} bytes), "
                f"the card says {file.checksum} ({file.size} bytes)"
            )

    async def _keep_small(self, checksum: str, data: bytes) -> None:
        """A verified small file is usable at once: held in memory (`has` is true, `written`
        waits for it) while the writer thread puts it on disk. Its card does not wait for
        the disk, whose latency is not the fleet's: on this machine a file's creation took
        20 µs or 700 µs by the minute, and 20,000 of them, one after the other, held a
        cold start's every join. Over `MAX_PENDING_BYTES` held, the download waits for its
        own write: a disk that hangs holds a bounded amount of memory."""
        written = self._writer.submit(checksum, data)
        if self._pending_bytes + len(data) > MAX_PENDING_BYTES:
            self._kept(checksum, len(data), await written)
            return
        self._pending[checksum] = written
        self._pending_bytes += len(data)
        written.add_done_callback(functools.partial(self._written, checksum, len(data)))

    def _written(self, checksum: str, size: int, written: asyncio.Future[bool]) -> None:
        if self._pending.get(checksum) is written:
            del self._pending[checksum]
            self._pending_bytes -= size
        self._kept(checksum, size, not written.cancelled() and written.result())

    async def written(self, *checksums: str) -> None:
        """Wait until the files of `checksums` held in memory are on disk (or refused by
        it): for a reader of the file itself, as the KV router's tokenizer is."""
        pending = [self._pending[c] for c in checksums if c in self._pending]
        if pending:
            await asyncio.wait(pending)

    async def flush(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout` seconds) until every file held in memory is written."""
        if self._pending:
            await asyncio.wait(list(self._pending.values()), timeout=timeout)

    def _kept(self, checksum: str, size: int, on_disk: bool) -> None:
        """A verified file: on disk (bounded by `max_bytes`), or used without caching."""
        if on_disk:
            self._remember(checksum, size)
            self._evict()
        else:
            self._uncached.add(checksum)

    # -- disk: every call below runs in a thread; none raises, trouble is recorded ----------

    def _create_tmp(self, checksum: str) -> tuple[str, int | None]:
        """A new temporary file beside the one `checksum` is kept in: its path and an open
        descriptor (None, the trouble recorded, if the disk refused). Plain `os` calls: a cold
        start writes 20,000 files, and pathlib's objects and a `mkdir` each held the GIL
        longer than the writes."""
        target = self._path(checksum)
        head, name = os.path.split(target)
        tmp = os.path.join(head, f".{name}.{os.getpid()}.{time.monotonic_ns():x}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            try:
                return tmp, os.open(tmp, flags, 0o644)
            except FileNotFoundError:  # (no directory yet: made once, not per file)
                os.makedirs(self.directory, exist_ok=True)
                return tmp, os.open(tmp, flags, 0o644)
        except OSError as exc:
            self._trouble(f"cannot write to {self.directory}: {exc}")
            return tmp, None

    def _open_tmp(self, checksum: str) -> tuple[Path, IO[bytes] | None]:
        tmp, fd = self._create_tmp(checksum)
        return Path(tmp), None if fd is None else os.fdopen(fd, "wb")  # closed by _keep or _discard

    def _write_whole(self, checksum: str, data: bytes) -> bool:
        """Write a verified small file to the cache (through a temporary file); False if the
        disk refused it."""
        tmp, fd = self._create_tmp(checksum)
        if fd is None:
            return False
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, self._path(checksum))
        except OSError as exc:
            self._trouble(f"cannot write to {self.directory}: {exc}")
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        self.problem = self.problem_since = None
        return True

    def _write(self, out: IO[bytes], tmp: Path, chunk: bytes) -> IO[bytes] | None:
        try:
            out.write(chunk)
            out.flush()  # a full disk shows here, not later at close
            return out
        except OSError as exc:
            self._trouble(f"cannot write to {self.directory}: {exc}")
            self._discard(out, tmp)
            return None

    def _keep(self, out: IO[bytes], tmp: Path, checksum: str) -> bool:
        try:
            out.close()
            os.replace(tmp, self._path(checksum))
        except OSError as exc:
            self._trouble(f"cannot write to {self.directory}: {exc}")
            self._discard(out, tmp)
            return False
        self.problem = self.problem_since = None
        return True

    @staticmethod
    def _discard(out: IO[bytes], tmp: Path) -> None:
        with contextlib.suppress(OSError):
            out.close()
        with contextlib.suppress(OSError):
            tmp.unlink()

    def _trouble(self, message: str) -> None:
        self.errors += 1
        if self.problem is None:
            self.problem_since = time.time()
            log.warning("metadata cache: %s (files are verified and used without caching)", message)
        self.problem = message

    def _remember(self, checksum: str, size: int) -> None:
        old = self._files.pop(checksum, None)
        if old is not None:
            self._bytes -= old
        self._files[checksum] = size
        self._bytes += size
        self._uncached.discard(checksum)

    def _evict(self) -> None:
        """Remove the least recently used files until the cache fits `max_bytes`."""
        while self._bytes > self.max_bytes and len(self._files) > 1:
            checksum, size = self._files.popitem(last=False)
            self._bytes -= size
            self.evictions += 1
            with contextlib.suppress(OSError):
                os.unlink(self._path(checksum))

    async def close(self) -> None:
        await self.flush(timeout=5.0)  # (verified files kept for the next start, if it can)
        for lookup in list(self._lookups):
            lookup.cancel()
        downloads = [s.task for s in self._shared.values() if s.task is not None]
        for task in downloads:
            task.cancel()
        for task in downloads:
            with contextlib.suppress(BaseException):
                await task
        self._fetcher.close()
        if self._session is not None:
            await self._session.close()
            self._session = None
