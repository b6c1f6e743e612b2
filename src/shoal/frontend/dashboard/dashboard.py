"""`/ui`: the fleet dashboard: its static page, a JSON snapshot, and server-sent events of changes.

Routes (all under `/ui`, served by the frontend's own server):

- `GET /ui/` and `GET /ui/<file>`: the page, shipped in the package (`static/`, read once
  with `importlib.resources`). Public even with API keys: it holds no fleet data.
- `GET /ui/api/snapshot`: everything the page shows, as JSON.
- `GET /ui/api/events`: `text/event-stream`; a `snapshot` event, then a `change` event with
  only what changed (at most every `TICK_SECONDS`), and a `ping` when nothing did for a while.
- `POST /ui/api/login` (`{"key": "..."}`) and `POST /ui/api/logout`.

Access: with API keys configured, the data routes want `Authorization: Bearer KEY` (curl;
the scheme in any case) or the `shoal_ui` cookie (a browser, whose EventSource cannot send
headers). Login checks the key and sets that cookie to a new random session id (`Sessions`):
HttpOnly, SameSite=Strict, Secure when the frontend serves HTTPS (or says a proxy in front
does, `X-Forwarded-Proto: https`). The session lives on this frontend only, for
`SESSION_SECONDS` at most, until log out; the browser never holds the key nor anything
derived from it, so a stolen cookie tells nothing about the key.

One timer per frontend reads the fleet every `TICK_SECONDS` while a page is open, or less
often when a read takes long (`BUSY_SHARE`), and samples the request history every period
regardless: nothing here is on the request path. Reads asked at once (the timer, a new
page, `/ui/api/snapshot`) share one, and however often they are asked, a read that took
the loop `SPACED_FROM` or more is followed by none for `BUSY_SHARE` times its time (until
then an unchanged registry's last read is the answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.resources
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from shoal.bounds import TooDeep, check_json_depth
from shoal.frontend.dashboard.snapshot import (
    Fleet,
    FleetReader,
    RequestHistory,
    Sections,
    diff,
    full,
)
from shoal.frontend.http import errors
from shoal.frontend.http.request import Request, bearer_token, status_line
from shoal.frontend.http.server import HttpConnection
from shoal.openai import ApiError

log = logging.getLogger(__name__)

TICK_SECONDS = 0.5  # how often open pages are sent what changed (at most)
BUSY_SHARE = 20  # between two reads, the timer waits at least this many times the last's time
SPACED_FROM = 0.005  # (s) reads that took the loop this long are spaced by BUSY_SHARE for all
PING_SECONDS = 5.0  # an event at least this often, so a page can tell a dead frontend
COOKIE = b"shoal_ui"
SESSION_SECONDS = 12 * 3600  # a dashboard session ends this long after its login
MAX_SESSIONS = 10_000  # sessions held per frontend; a new login beyond ends the oldest
_TYPES = {
    ".html": b"text/html; charset=utf-8",
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".svg": b"image/svg+xml",
}
_PAGE_HEADERS = (
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
)
_encode = msgspec.json.encode
_API_METHODS = {
    b"snapshot": (b"GET", b"HEAD"),
    b"events": (b"GET",),  # a stream: HEAD would have nothing to say
    b"login": (b"POST",),
    b"logout": (b"POST",),
}


class StaticFiles:
    """The page's files, read once from the installed package (a few kB: kept in memory)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[bytes, bytes]] = {}  # name -> (body, content type)
        root = importlib.resources.files("shoal.frontend.dashboard").joinpath("static")
        for entry in root.iterdir():
            suffix = "." + entry.name.rpartition(".")[2]
            if entry.is_file() and suffix in _TYPES:
                self.files[entry.name] = (entry.read_bytes(), _TYPES[suffix])

    def serve(self, name: str, conn: HttpConnection) -> None:
        found = self.files.get(name)
        if found is None:
            raise errors.not_found(f"/ui/{name}")
        body, content_type = found
        conn.send(200, body, content_type, _PAGE_HEADERS)


class EventStream:
    """One open `/ui/api/events` response. `stale` means it missed a change: resend everything."""

    def __init__(self, dashboard: Dashboard, conn: HttpConnection) -> None:
        self.dashboard = dashboard
        self.conn = conn
        self.stale = False
        self.last_sent = time.monotonic()

    def send(self, event: bytes, data: bytes) -> bool:
        """Write one event; False (and `stale`) when the client is not reading its events."""
        if self.conn.writing_paused:
            self.stale = True
            return False
        self.conn.write(b"event: " + event + b"\ndata: " + data + b"\n\n")
        self.last_sent = time.monotonic()
        return True

    def cancel(self) -> None:  # the client went away (`InFlight`)
        self.dashboard.streams.discard(self)

    def end(self) -> None:
        """End the response and close its connection (the page reconnects to another frontend)."""
        self.dashboard.streams.discard(self)
        self.conn.keep_alive = False
        try:
            self.conn.end()
        except OSError:  # the client is gone; its `connection_lost` has not arrived yet
            if self.conn.transport is not None:
                self.conn.transport.abort()


class Dashboard:
    """The `/ui` routes of one frontend and the timer that feeds their event streams."""

    def __init__(self, frontend: Fleet) -> None:
        self.frontend = frontend
        self.reader = FleetReader(frontend)
        self.history = RequestHistory(frontend.metrics)
        self.streams: set[EventStream] = set()
        self.static: StaticFiles | None = None
        self._keys = tuple(key.encode() for key in frontend.config.api_keys)
        # With `--auth keys`, team keys are for the API, not for the fleet's page: the page
        # takes only an `--api-key` (an operator's key), and without one it stays shut.
        self._closed = not self._keys and frontend.config.auth == "keys"
        self.sessions = Sessions()
        self._tls = frontend.config.tls_certfile is not None  # cookies are `Secure`
        self._sent: Sections | None = None  # what open streams were last sent
        self._task: asyncio.Task[None] | None = None
        self._reading: asyncio.Future[Sections] | None = None  # the read in flight
        self._last: tuple[int, Sections] | None = None  # the last read, registry version
        self._next_read = 0.0  # (monotonic) no read starts before
        self._ticking = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()  # new pages' reads, snapshot answers
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the timer: request history samples, and changes for open pages."""
        self.history.sample()
        self._task = asyncio.create_task(self._run(), name="dashboard")

    async def close(self) -> None:
        """End every event stream (so the server's drain does not wait for them), stop the
        timer and the read in flight; a snapshot waiting on it is answered 503."""
        self._stopping = True
        for stream in list(self.streams):
            stream.end()
        for task in (self._task, self._reading, *self._tasks):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A task of this dashboard: cancelled by `close`, its failure logged."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None and not isinstance(error, ApiError):  # (503: stopping)
            log.error("dashboard: %s failed", task.get_name(), exc_info=error)

    async def _run(self) -> None:
        next_sample = time.monotonic() + self.history.period
        while True:
            # A large fleet's read takes longer: the timer waits `BUSY_SHARE` times as long
            # (a page open costs the event loop 1/BUSY_SHARE of its time at most).
            await asyncio.sleep(max(TICK_SECONDS, BUSY_SHARE * self.reader.busy))
            try:
                point = None
                now = time.monotonic()
                if now >= next_sample:
                    next_sample = max(next_sample + self.history.period, now)
                    point = self.history.sample()
                await self.tick(point)
            except ApiError:  # stopping
                return
            except Exception:
                log.exception("dashboard: reading the fleet failed (the page shows the last read)")

    async def read(self) -> Sections:
        """A read of the fleet; callers at the same time share one (reads never overlap), and
        a read starts `BUSY_SHARE` times the last one's time after it at the earliest (until
        then the last one answers if the registry did not change since, else the caller
        waits): asked back to back, reads take 1/`BUSY_SHARE` of the event loop at most."""
        while True:
            if self._stopping:
                raise errors.unavailable("The frontend is stopping: ask another replica.")
            reading = self._reading
            if reading is not None and not reading.done():
                return await asyncio.shield(reading)
            wait = self._next_read - time.monotonic()
            if wait <= 0 or self._last is None:
                break
            if self._last[0] == self.frontend.registry.version:
                return self._last[1]
            await asyncio.sleep(wait)
        reading = self._reading = asyncio.ensure_future(self._read_now())
        return await asyncio.shield(reading)

    async def _read_now(self) -> Sections:
        version = self.frontend.registry.version
        sections = await self.reader.read()
        self._last = (version, sections)
        busy = self.reader.busy  # (a shorter read costs about what the request asking it does)
        self._next_read = time.monotonic() + BUSY_SHARE * busy if busy >= SPACED_FROM else 0.0
        return sections

    async def tick(self, point: dict[str, Any] | None = None) -> None:
        """Send open streams what changed since the last tick (and `point`, a new chart sample)."""
        async with self._ticking:
            if not self.streams:
                self._sent = None  # the next page starts from a fresh read
                return
            before = self._sent
            after = await self.read()
            if not self.streams:
                return
            self._sent = after
            change = diff(before, after) if before is not None else {}
            if point is not None:
                change["series"] = [point]
            data = _encode({"server_time": time.time(), **change}) if change else None
            now = time.monotonic()
            snapshot = None  # (encoded once, for every stream that missed a change)
            for stream in list(self.streams):
                if stream.stale:
                    if not stream.conn.writing_paused:
                        stream.stale = False
                        snapshot = snapshot or self._snapshot_body(after)
                        stream.send(b"snapshot", snapshot)
                elif data is not None:
                    stream.send(b"change", data)
                elif now - stream.last_sent >= PING_SECONDS:
                    stream.send(b"ping", b"{}")

    def _snapshot_body(self, sections: Sections) -> bytes:
        history = {"period": self.history.period, "points": list(self.history.points)}
        return _encode({"server_time": time.time(), **full(sections), "series": history})

    # -- routes ------------------------------------------------------------------------------

    def handle(self, request: Request, conn: HttpConnection) -> None:
        """Answer a request whose path is `/ui` or under `/ui/`."""
        path, method = request.path, request.method
        if path.startswith(b"/ui/api/"):
            self._api(path[len(b"/ui/api/") :], request, conn)
            return
        if method not in (b"GET", b"HEAD"):
            raise errors.method_not_allowed(method.decode(), path.decode(), (b"GET", b"HEAD"))
        if path == b"/ui":
            conn.send(308, b"", b"text/plain", ((b"location", b"/ui/"),))
            return
        if self.static is None:
            self.static = StaticFiles()
        name = path[len(b"/ui/") :].decode() or "index.html"
        self.static.serve(name, conn)

    def _api(self, route: bytes, request: Request, conn: HttpConnection) -> None:
        methods = _API_METHODS.get(route)
        if methods is None:
            raise errors.not_found(request.path.decode())
        if request.method not in methods:
            method, path = request.method.decode(), request.path.decode()
            raise errors.method_not_allowed(method, path, methods)
        if route == b"login":
            self._login(request, conn)
        elif route == b"logout":
            session = _cookie(request.header(b"cookie"), COOKIE)
            if session is not None:
                self.sessions.close(session)
            conn.send(200, b"{}", headers=(self._cookie_header(request, b"", max_age=0),))
        else:
            self._authorize(request)
            if route == b"snapshot":
                _SnapshotLater(self, conn)
            else:
                self._open_stream(conn)

    @property
    def protected(self) -> bool:
        return bool(self._keys) or self._closed

    def _authorize(self, request: Request) -> None:
        if not self._keys and not self._closed:
            return
        token = bearer_token(request.header(b"authorization"))
        if token is not None and any(hmac.compare_digest(token, key) for key in self._keys):
            return
        session = _cookie(request.header(b"cookie"), COOKIE)
        if session is not None and self.sessions.valid(session):
            return
        raise errors.unauthorized()

    def _login(self, request: Request, conn: HttpConnection) -> None:
        key = login_key(request.body).encode()
        if not self._keys and not self._closed:
            conn.send(200, b"{}")
            return
        if not any(hmac.compare_digest(key, known) for known in self._keys):
            raise errors.unauthorized()
        session = self.sessions.open().encode()
        conn.send(200, b"{}", headers=(self._cookie_header(request, session),))

    def _cookie_header(
        self, request: Request, value: bytes, max_age: int | None = None
    ) -> tuple[bytes, bytes]:
        attributes = [COOKIE + b"=" + value, b"Path=/ui/api", b"HttpOnly", b"SameSite=Strict"]
        attributes.append(b"Max-Age=%d" % (SESSION_SECONDS if max_age is None else max_age))
        # (The client's scheme comes first: proxies in a chain add theirs after it.)
        proto = (request.header(b"x-forwarded-proto") or b"").partition(b",")[0]
        if self._tls or proto.strip().lower() == b"https":
            attributes.append(b"Secure")
        return b"set-cookie", b"; ".join(attributes)

    def _open_stream(self, conn: HttpConnection) -> None:
        if self._stopping:  # (a page reconnecting while the frontend drains: to another)
            raise errors.unavailable("The frontend is stopping: ask another replica.")
        stream = EventStream(self, conn)
        conn.keep_alive = False  # the stream ends with the connection
        conn.current = stream
        conn.write(
            status_line(200) + b"content-type: text/event-stream\r\n"
            b"cache-control: no-store\r\nx-accel-buffering: no\r\nconnection: close\r\n\r\n"
            b"retry: 1000\n\n"
        )
        if self._sent is not None and self.streams:
            # The base of the next diff, so this page and the others stay in step.
            stream.send(b"snapshot", self._snapshot_body(self._sent))
        else:
            stream.stale = True  # its snapshot comes with a read started now
            self._spawn(self.tick(), "a new page's first read")
        self.streams.add(stream)


class _SnapshotLater:
    """A `/ui/api/snapshot` answer, written once a read of the fleet is done (a large fleet's
    read takes several turns of the event loop); cancelled if the client goes away."""

    def __init__(self, dashboard: Dashboard, conn: HttpConnection) -> None:
        self.gone = False  # the client went away
        self.task = dashboard._spawn(self._answer(dashboard, conn), "a snapshot's answer")
        conn.produce_later(self)

    async def _answer(self, dashboard: Dashboard, conn: HttpConnection) -> None:
        try:
            body = dashboard._snapshot_body(await dashboard.read())
        except ApiError as error:
            conn.send_error(error)
        except asyncio.CancelledError:  # the read was stopped, or the client went away
            if not self.gone:
                conn.send_error(
                    errors.unavailable("The frontend is stopping: ask another replica.")
                )
            raise
        except Exception:
            log.exception("dashboard: reading the fleet failed")
            conn.send_error(errors.internal_error())
        else:
            conn.send(200, body, headers=((b"cache-control", b"no-store"),))

    def cancel(self) -> None:
        self.gone = True
        self.task.cancel()


class Sessions:
    """The dashboard sessions of one frontend: random ids, each valid for `ttl` seconds after
    its login or until its log out; at most `limit` (a login beyond ends the oldest)."""

    def __init__(
        self,
        ttl: float = SESSION_SECONDS,
        limit: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.limit = limit
        self.clock = clock
        self._expires: dict[bytes, float] = {}  # in login order, so in expiry order

    def __len__(self) -> int:
        return len(self._expires)

    def open(self) -> str:
        """A new session; its id (URL- and cookie-safe)."""
        self._expire()
        while len(self._expires) >= self.limit:
            del self._expires[next(iter(self._expires))]
        session = secrets.token_urlsafe(32)
        self._expires[session.encode()] = self.clock() + self.ttl
        return session

    def valid(self, session: bytes) -> bool:
        expires = self._expires.get(session)
        if expires is None:
            return False
        if expires <= self.clock():
            self._expire()
            return False
        return True

    def close(self, session: bytes) -> None:
        self._expires.pop(session, None)

    def _expire(self) -> None:
        now = self.clock()
        while self._expires:
            oldest = next(iter(self._expires))
            if self._expires[oldest] > now:
                break
            del self._expires[oldest]


class _Login(msgspec.Struct):
    key: str


def login_key(body: bytes) -> str:
    """The key of a login body `{"key": "..."}`; `ApiError` 400 naming what is wrong."""
    try:
        check_json_depth(body)
        return msgspec.json.decode(body, type=_Login).key
    except (msgspec.DecodeError, TooDeep) as exc:
        raise errors.bad_request(f'Login body: expected {{"key": "..."}}: {exc}') from None


def _cookie(header: bytes | None, name: bytes) -> bytes | None:
    if not header:
        return None
    for part in header.split(b";"):
        key, _, value = part.strip().partition(b"=")
        if key == name:
            return value
    return None
