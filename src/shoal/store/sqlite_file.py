"""The SQLite store's file: the URL that names it, opening it (in WAL mode, in the current
layout: `shoal.store.sqlite_layout`), and `SQLiteFile`, the store's one connection to it,
used only by the store's own thread, which follows the file at its path.

URL: after `sqlite://` come an empty host and the path. `sqlite:///var/x.db` and
`sqlite:////var/x.db` both mean `/var/x.db`; a path that starts with `./` or `../`
(`sqlite:///./x.db`) is relative to the working directory. `%XX` escapes are decoded
(`%20` is a space). The one parameter is `mode`: `?mode=ro` opens the file read-only (it
must exist in the current layout; every write is refused), `?mode=rw` is the default.
Anything else (another parameter, a `#` fragment, `%00`) is refused in one line. Missing
parent directories are created (read-write only).

Each store instance owns one connection, used only by a dedicated thread; a whole
transaction runs in one hop to that thread (`SQLiteFile._call`).

The file: an instance follows the file at its path, not the one it opened. If that file is
deleted (a state directory wiped) or replaced (a backup moved in place, a new store made
there after a delete), the instance opens the one at the path within `FILE_CHECK_INTERVAL`
(making it if there is none): what it held in the old file is gone, as from an etcd whose
data directory was lost (a lease holder finds its lease not found and re-puts what it owns),
and its watches get a `Resync`; a listing of what changed since a revision read before
(another history's) reads every value, and a watch from such a revision starts with a
`Resync`. Kept on the old file (whose inode lives on while open), a
worker renewed its lease and listed its keys to itself for good, while every process
opening the path saw another store without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Self, TypeVar
from urllib.parse import quote, unquote

from shoal.store.base import Store, StoreUnavailableError
from shoal.store.sqlite_kv import _revision
from shoal.store.sqlite_layout import _check_layout
from shoal.urls import redact_url

log = logging.getLogger("shoal.store.sqlite")  # (the backend's one logger, as it always was)

T = TypeVar("T")

BUSY_TIMEOUT = 5.0
"""Seconds a statement waits for another process's lock before failing."""
FILE_CHECK_INTERVAL = 1.0
"""Seconds between two looks (one `stat`, in the store thread, before a read or a write) at
whether the file at the store's path is still the one this instance has open (see "The
file" above)."""
WAL_AUTOCHECKPOINT_PAGES = 256
JOURNAL_SIZE_LIMIT = 1024 * 1024


_URL_USAGE = "use sqlite:///absolute/path.db or sqlite:///./relative/path.db, optionally ?mode=ro"


def _parse_url(url: str) -> tuple[Path, bool]:
    """The file named by `url`, and whether it is opened read-only (`?mode=ro`).

    After `sqlite://` comes an empty host and the path: `sqlite:///var/x.db` and
    `sqlite:////var/x.db` both mean `/var/x.db`; a path that starts `./` or `../` is
    relative to the working directory. `%XX` escapes are decoded. The only parameter is
    `mode` (`ro`, or `rw`, the default); anything else is refused.
    """
    scheme, sep, rest = url.partition("://")
    if scheme != "sqlite" or not sep:
        raise ValueError(f"store URL {redact_url(url)!r}: {_URL_USAGE}")
    if "#" in rest:
        raise ValueError(
            f"store URL {redact_url(url)!r}: a '#' fragment means nothing here; {_URL_USAGE}"
        )
    rest, _, query = rest.partition("?")
    read_only = False
    for param in query.split("&") if query else ():
        name, _, value = param.partition("=")
        if name != "mode" or value not in ("ro", "rw"):
            raise ValueError(
                f"store URL {redact_url(url)!r}: unsupported parameter {name!r} (only mode=ro or mode=rw)"
            )
        read_only = value == "ro"
    try:
        raw = unquote(rest, errors="strict")
    except UnicodeDecodeError:
        raise ValueError(
            f"store URL {redact_url(url)!r}: an escape in the path is not UTF-8"
        ) from None
    if "\0" in raw:
        raise ValueError(f"store URL {redact_url(url)!r}: the path holds a NUL character (%00)")
    if not raw.startswith("/") or not raw.strip("/"):
        raise ValueError(f"store URL {redact_url(url)!r}: {_URL_USAGE}")
    path = raw[1:]
    if path.startswith(("./", "../")):
        return Path(os.path.abspath(path)), read_only
    return Path("/" + path.lstrip("/")), read_only


def _journal_mode_wal(conn: sqlite3.Connection, deadline: float) -> tuple[str]:
    """Switch to WAL. Two processes opening a new file at once can make this fail with
    "database is locked" at once, without the busy handler: retry until `deadline`."""
    while True:
        try:
            row: tuple[str] = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            return row
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005 + random.random() * 0.02)


def _connect(path: Path, busy_timeout: float, read_only: bool) -> sqlite3.Connection:
    """Open `path` in WAL mode and create the schema if the file is new, or migrate it (in
    the store thread). Read-only: the file must exist in the current layout."""
    if read_only:
        if not path.is_file():
            raise sqlite3.OperationalError(f"no store file {path} (mode=ro opens an existing one)")
        conn = sqlite3.connect(
            f"file:{quote(str(path))}?mode=ro",
            uri=True,
            timeout=busy_timeout,
            isolation_level=None,
            check_same_thread=False,
        )
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        if not read_only:
            (mode,) = _journal_mode_wal(conn, time.monotonic() + busy_timeout)
            if str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"cannot switch to WAL journal mode (got {mode!r})")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}")
            conn.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")
        conn.execute("BEGIN" if read_only else "BEGIN IMMEDIATE")
        try:
            _check_layout(conn, read_only)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT * 1000)}")
    except BaseException:
        conn.close()
        raise
    return conn


def _close_unused(future: Future[tuple[sqlite3.Connection, FileId | None]]) -> None:
    """Close a connection whose open finished after the caller gave up on it."""
    if not future.cancelled() and future.exception() is None:
        future.result()[0].close()


FileId = tuple[int, int]
"""A file's device and inode: which file a path names now."""


def _file_id(path: Path) -> FileId | None:
    """The file at `path` now (None: there is none)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _open_file(
    path: Path, busy_timeout: float, read_only: bool
) -> tuple[sqlite3.Connection, FileId | None]:
    """`_connect`, and the file it opened: the one at the path both before and after it
    (looked at after only, a file moved in place in between was taken for the one open, and
    never followed). If they differ, it opens the one there now."""
    for attempt in range(3):
        before = _file_id(path)
        conn = _connect(path, busy_timeout, read_only)
        after = _file_id(path)
        if (before is not None and before == after) or attempt == 2:
            return conn, after
        conn.close()  # (or made by `_connect`: opened again, it is the one looked at before)
    raise AssertionError("unreachable")


class SQLiteFile(Store):
    """The connection of one store instance to its file, used only by the store thread (one
    transaction per hop to it: `_call`), and the file it has open: the one at `path`,
    followed when it is deleted or replaced (`_follow_file`). Open with `open`."""

    def __init__(
        self,
        url: str,
        path: Path,
        conn: sqlite3.Connection,
        executor: ThreadPoolExecutor,
        read_only: bool = False,
    ) -> None:
        super().__init__()
        self.url = url
        self.path = path
        self.read_only = read_only
        self._conn = conn
        # The file `_conn` has open, and when the store thread last looked that it is still
        # the one at `path` (`_follow_file`).
        self._file: FileId | None = None
        self._file_checked = time.monotonic()
        # The lowest revision a listing of what changed may start from, and a watch from
        # (beyond it): one read before the store followed its path to another file is of
        # another history (`_follow_file`).
        self._since_floor = 0
        # Whether the file has `LISTING_INDEX` (looked up by the first listing that uses it).
        self._listing_index: bool | None = None
        self._executor = executor
        self._closed = False
        self._unreachable = False
        # Bumped when every watch must resync (an outage starts, another file is followed,
        # leases expired that this client cannot reap): watches from before it resync.
        self._epoch = 0
        self._start()

    def _start(self) -> None:
        """Set up what each class of the store adds to an instance, and start its background
        work (`SQLiteWatches`: the watch poller; `SQLiteStore`: the lease reaper). Here,
        nothing: the file's state is set up above."""

    @classmethod
    async def open(cls, url: str, *, connect_timeout: float = 5.0) -> Self:
        """Open (creating if needed) the file named by `url`, failing within `connect_timeout`."""
        path, read_only = _parse_url(url)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-sqlite")
        busy = max(0.05, min(BUSY_TIMEOUT, connect_timeout / 2))
        future = executor.submit(_open_file, path, busy, read_only)
        try:
            conn, file = await asyncio.wait_for(asyncio.wrap_future(future), connect_timeout)
        except TimeoutError:
            future.add_done_callback(_close_unused)
            executor.shutdown(wait=False, cancel_futures=True)
            raise StoreUnavailableError(
                f"store {url} could not be opened within {connect_timeout}s (locked?)"
            ) from None
        except (OSError, sqlite3.Error) as exc:
            executor.shutdown(wait=False)
            raise StoreUnavailableError(f"store {url} cannot be opened: {exc}") from exc
        except BaseException:
            future.add_done_callback(_close_unused)
            executor.shutdown(wait=False)
            raise
        store = cls(url, path, conn, executor, read_only)
        store._file = file
        return store

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailableError(f"store {self.url} is closed")
        if self._unreachable:
            raise StoreUnavailableError(f"store {self.url} is unreachable")

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run `fn` in the store thread."""
        self._check_open()
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn)
        except (sqlite3.Error, OSError) as exc:  # (OSError: the path, looked at or made)
            raise StoreUnavailableError(f"store {self.url}: {exc}") from exc
        except RuntimeError as exc:  # the executor was shut down by close()
            raise StoreUnavailableError(f"store {self.url} is closed") from exc

    def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """One read transaction (in the store thread): a consistent snapshot."""
        self._follow_file()
        conn = self._conn
        conn.execute("BEGIN")
        try:
            result = fn(conn)
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")
        return result

    def _follow_file(self) -> None:
        """(In the store thread.) Every `FILE_CHECK_INTERVAL`: if the file at `path` is not
        the one `_conn` has open (deleted, replaced), open the one there (see "The file")."""
        now = time.monotonic()
        if now - self._file_checked < FILE_CHECK_INTERVAL:
            return
        self._file_checked = now
        file = _file_id(self.path)
        if self._file is None or file == self._file:
            self._file = self._file or file  # (an instance not made by `open`: adopts it)
            return
        conn, file = _open_file(self.path, BUSY_TIMEOUT, self.read_only)
        old, self._conn, self._file = self._conn, conn, file
        with contextlib.suppress(sqlite3.Error):  # (every revision read there is below this)
            self._since_floor = max(self._since_floor, _revision(old) + 1)
        self._listing_index = None
        self._epoch += 1  # (read by the poller between polls: its watches resync)
        old.close()
        log.warning(
            "store %s: the file at %s is not the one open (deleted or replaced): opened the "
            "one there now; what this process held in the old one is gone",
            self.url,
            self.path,
        )
