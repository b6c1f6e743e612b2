"""`KvRelay`: the KV events of a membership view's workers, republished to NATS JetStream.

The loop, per member (an instance in the view that advertises a KV publisher): its
`KvSubscription` hands over batches in sequence order (replay on connect and on gap,
resnapshot when history is gone, publisher restarts seen); `Member` turns them into records
(`shoal.kv.stream`) in a bounded queue; one `Sender` task sends every member's queue to
JetStream in order, up to `WINDOW` records ahead of their acknowledgements (`AckInbox`),
sending again from the first one that failed or was not acknowledged in time (the same
message ids); the members take turns, one record each, within the relay's budget of
records in flight (`inflight_bytes`, `inflight_records`), so a quiet member's batch waits
one round of the others' at most, however many flood.

The invariants, both ways:
- Nothing blocks the subscription: a member's queue holds at most `buffer` records (and
  `WINDOW` in flight); past that its batches are dropped and a `resnapshot` record (from the
  batch that follows) takes their place, so a consumer forgets the instance's blocks rather
  than keep evicted ones.
- Per subject, the stream stores records in the order of the worker's batches: they are sent
  in order on one connection, and after a failure sent again from the first one not
  acknowledged (what the stream stored meanwhile it refuses as duplicates); what nats-py
  holds unwritten when its socket breaks is dropped, not written on its next connection
  before the records lost with the socket (`drop_unsent`).
- Every batch has the message id `{namespace}:{instance}:{seq}:{ts}` (`batch_id`): the
  worker's own number and timestamp of it, the same from every relay that publishes it,
  whenever each started following the worker, so the stream keeps one copy when two run.
- A member that leaves the view is unsubscribed at once and its `left` record published
  once (after what it had queued). An instance back under the same id (a worker restarted)
  is a new member whose records wait until the one before has published its `left`: the
  runs never mix on their subject.
- The relay never deletes or alters a stream: it creates `stream` when it is missing (after
  every reconnection too: a server restarted without its storage; and when no stream takes
  a record: one deleted under a connected relay).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext, api

from shoal.discovery import ModelInstance
from shoal.kv import KvEndpoint
from shoal.kv import stream as layout
from shoal.kv.subscription import KvSubscription, zmq_context
from shoal.membership import Membership
from shoal.relay.acks import AckInbox
from shoal.relay.member import BUFFER_BYTES, Member, MemberKey, Record, RelayStats
from shoal.relay.sender import INFLIGHT_BYTES, INFLIGHT_RECORDS, Sender

log = logging.getLogger(__name__)

BUFFER = 10_000  # records queued per member while NATS does not take them
BACKOFF_MAX = 5.0  # seconds between two tries to reach NATS, at most
YIELD_SECONDS = 0.005  # applying a view yields to the event loop after this long
CHANGES_PER_TURN = 16  # members joined or left before yielding (their sockets made or closed next)
DROPS_TOLD_EVERY = 10.0  # seconds between two warnings of acknowledgements dropped


@dataclass
class RelayConfig:
    """Where to publish and what the stream keeps."""

    nats_urls: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    stream: str = layout.DEFAULT_STREAM
    max_age: float = 600.0  # seconds a record is kept
    max_bytes: int = 1 << 30  # bytes the stream keeps at most (-1: no bound)
    duplicate_window: float = 120.0  # seconds the stream remembers message ids (`window`)
    buffer: int = BUFFER
    buffer_bytes: int = BUFFER_BYTES
    publish_timeout: float = 2.0
    linger: float = 0.002  # seconds records gather before they are sent (one write for all)
    inflight_bytes: int = INFLIGHT_BYTES  # payload of all members' records in flight, at most
    inflight_records: int = INFLIGHT_RECORDS  # and records (`Turns`)
    creds: Path | None = None  # a NATS credentials file, read at every connection

    @property
    def window(self) -> float:
        """The duplicate window asked of the stream: at most `max_age` (JetStream refuses a
        longer one; a record is sent again within seconds)."""
        if self.max_age > 0:
            return min(self.duplicate_window, self.max_age)
        return self.duplicate_window


def drop_unsent(nc: Client) -> None:
    """Forget what nats-py holds to write on `nc`, whose socket broke (its disconnect
    callback runs before it connects again): it wrote that first on its next connection,
    before the relay sent again the records lost with the socket, so the stream stored a
    member's later records before its earlier ones (`16..19, joined, 0..15`). The relay sends
    every record not acknowledged again itself, in order; subscriptions nats-py makes again
    on its own. (nats-py has no public call for this: its buffer, `_pending`.)"""
    nc._pending = []
    nc._pending_data_size = 0


STATUS_MEMBERS = 1000  # members on a page of the status (and the most a page may ask for)


def member_cursor(key: MemberKey) -> str:
    """A member as the status's cursor names it: `namespace/instance id in hex`."""
    return f"{key[0]}/{key[1]:x}"


def parse_member_cursor(text: str) -> MemberKey:
    """The member a cursor names; `ValueError` for one that names none."""
    namespace, _, instance = text.rpartition("/")
    # (any id keys may hold, up to 256 bits: more than 16 digits is no 64-bit lease id, but
    # a member's all the same, and the cursor after it must be taken)
    if not namespace or not instance or len(instance) > 64 or instance.strip("0123456789abcdef"):
        raise ValueError(f"after: {text[:100]!r} is not namespace/instance_id (in hex)")
    return namespace, int(instance, 16)


class KvRelay:
    """Follows membership views (`on_view`) and relays each member's KV events."""

    def __init__(self, config: RelayConfig | None = None) -> None:
        self.config = config or RelayConfig()
        self.stats = RelayStats()
        self.members: dict[MemberKey, Member] = {}
        self.connected = asyncio.Event()
        self.nats_state = "connecting"
        self.nats_error: str | None = None
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._acks: AckInbox | None = None
        self._ctx = zmq_context()
        self._connector: asyncio.Task[None] | None = None
        self._leaving: set[asyncio.Task[None]] = set()
        self._departing: set[Member] = set()  # left the view; their `left` not acknowledged
        self._last_left: dict[MemberKey, Member] = {}  # of those, the last one of each key
        self.sender = Sender(
            self.stats,
            self.connected,
            lambda: (self._nc, self._acks),
            lambda: (*self.members.values(), *self._departing),
            self._departed,
            linger=self.config.linger,
            publish_timeout=self.config.publish_timeout,
            inflight_bytes=self.config.inflight_bytes,
            inflight_records=self.config.inflight_records,
        )
        self.connections = 0  # connections made to NATS (a new connection_revision: one more)
        self._connection_revision: str | None = None
        self._seen_view = False
        self._view: Membership | None = None  # the newest view, not applied yet
        self._applying: asyncio.Task[None] | None = None
        self._checking: asyncio.Task[None] | None = None  # the stream, after one went missing
        self.stream_differs: dict[str, dict[str, float | None]] = {}  # its settings, not ours
        self._drops_told = -DROPS_TOLD_EVERY  # when dropped acknowledgements were last logged

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start reaching NATS (in the background: the relay follows its workers meanwhile)."""
        self._connector = asyncio.create_task(self._connect(), name="kv-relay-nats")
        self.sender.start()

    async def stop(self) -> None:
        if self._applying is not None:  # (no member joins while the others stop)
            self._applying.cancel()
            with contextlib.suppress(BaseException):
                await self._applying
        tasks = [t for t in (self._connector, self.sender.stop(), self._checking) if t is not None]
        for member in self.members.values():
            if member.subscription is not None:
                await member.subscription.stop()
        tasks += list(self._leaving)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self.members.clear()
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
        self._ctx.destroy(linger=0)

    # -- the view ----------------------------------------------------------------------------

    def on_view(self, view: Membership) -> None:
        """Follow every instance of `view` that publishes KV events; leave the others; connect
        to NATS again when its `connection_revision` changed. The members change in a task
        that yields every `YIELD_SECONDS` (a view of 10,000 instances is not applied in one
        turn of the event loop); a newer view arriving meanwhile is applied instead."""
        if self._seen_view and view.connection_revision != self._connection_revision:
            log.info(
                "kv relay: connection revision %s: connecting to NATS again",
                view.connection_revision,
            )
            task = asyncio.create_task(self._reconnect(), name="kv-relay-reconnect")
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
        self._seen_view, self._connection_revision = True, view.connection_revision
        self._view = view
        if self._applying is None or self._applying.done():
            self._applying = asyncio.create_task(self._apply_views(), name="kv-relay-view")

    async def _apply_views(self) -> None:
        while self._view is not None:
            view, self._view = self._view, None
            try:
                await self._apply(view)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug: the next view is applied all the same
                log.exception("kv relay: applying a membership view failed")

    async def _apply(self, view: Membership) -> None:
        """Leave the members `view` no longer has, join its new ones; given up for a newer
        view as soon as there is one (the members are the truth either way)."""
        loop = asyncio.get_running_loop()
        started, changes = loop.time(), 0

        async def turn(changed: bool = False) -> bool:
            """Whether to go on (after yielding, when this turn has run long enough or changed
            `CHANGES_PER_TURN` members: their subscriptions' sockets are made or closed next)."""
            nonlocal started, changes
            changes += changed
            if changes >= CHANGES_PER_TURN or loop.time() - started > YIELD_SECONDS:
                await asyncio.sleep(0)
                started, changes = loop.time(), 0
            return self._view is None

        wanted: dict[MemberKey, tuple[KvEndpoint, ModelInstance]] = {}
        for endpoint in view.endpoints.values():
            for model in endpoint.models:
                kv = model.instance.kv_events
                if kv is not None and model.card.lora is None:
                    wanted.setdefault((endpoint.namespace, endpoint.instance_id), (kv, model))
            if not await turn():
                return
        for key in [k for k, m in self.members.items() if wanted.get(k, (None,))[0] != m.endpoint]:
            member = self.members.pop(key, None)
            if member is not None:
                self._leave(member)
            if not await turn(member is not None):
                return
        for key, (kv, model) in wanted.items():
            joining = key not in self.members
            if joining:
                self._join(key, kv, model)
            if not await turn(joining):
                return

    def _join(self, key: MemberKey, kv: KvEndpoint, model: ModelInstance) -> None:
        card, instance = model.card, model.instance
        joined = layout.Joined(
            block_size=card.kv_block_size,
            model=card.display_name,
            namespace=instance.namespace,
            component=instance.component,
            endpoint=instance.endpoint,
            role=str(card.role),
            mdcsum=card.mdcsum,
        )
        member = Member(
            key,
            layout.subject(*key),
            kv,
            joined,
            self.stats,
            max(4, self.config.buffer),
            self.config.buffer_bytes,
        )
        member.notify = self.sender.notify
        revision = getattr(model, "revision", 0)  # (of the card in the store; 0: not known)
        if revision:  # the same for every relay: its `joined` stored once
            member.run = f"r{revision:x}"
        member.follows = self._last_left.get(key)
        member.push(Record(layout.JOINED, payload=msgspec.json.encode(joined)))
        member.subscription = KvSubscription(
            self._ctx,
            key[1],
            kv,
            member.apply,
            member.resnapshot,
            self.stats.subscriptions,
            whole_batches=True,
            room=member.room,
        )
        self.members[key] = member
        member.subscription.start()
        log.info("kv relay: following instance %x of namespace %s", key[1], key[0])

    def _leave(self, member: Member) -> None:
        """Unsubscribe now; `left` goes out after what was queued."""
        log.info("kv relay: instance %x left", member.instance_id)
        if member.subscription is not None:
            stopping = asyncio.ensure_future(member.subscription.stop())
            self._leaving.add(stopping)
            stopping.add_done_callback(self._leaving.discard)
        self._departing.add(member)
        self._last_left[member.key] = member
        member.leave()

    def _departed(self, member: Member) -> None:
        """`member`'s `left` is acknowledged: the run of the same instance after it sends."""
        self._departing.discard(member)
        if self._last_left.get(member.key) is member:
            del self._last_left[member.key]
        for after in (*self._departing, self.members.get(member.key)):
            if after is not None and after.follows is member:
                after.follows = None
                self.sender.notify(after)

    # -- NATS --------------------------------------------------------------------------------

    async def _reconnect(self) -> None:
        """Make a new connection (new credentials are read then) and use it once it is made:
        the one in use goes on meanwhile, and for as long as the new one cannot be made
        (make before break); records not acknowledged are then sent again, same ids."""
        if self._connector is not None:
            self._connector.cancel()  # (an attempt with the configuration before)
            with contextlib.suppress(BaseException):
                await self._connector
        self._connector = asyncio.create_task(self._connect(), name="kv-relay-nats")

    async def _connect(self) -> None:
        """Connect (retrying with backoff), then make sure the stream exists; nats-py
        reconnects by itself after that, and the stream is checked again each time. A
        connection in use is closed once the new one is made, not before."""
        delay = 0.1
        while True:
            try:
                nc, acks = await self._open()
                break
            except Exception as exc:
                self._cannot_connect(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
        old, self._nc, self._acks = self._nc, nc, acks
        self._js = nc.jetstream(timeout=self.config.publish_timeout)
        self.connections += 1
        if old is not None:  # (its callbacks are not heard any more: not the one in use)
            with contextlib.suppress(Exception):
                await old.close()
        self.sender.resend("a new connection")  # what was in flight on the last one: again
        await self._reconnected()

    def _cannot_connect(self, exc: BaseException, told: set[str] | None = None) -> None:
        """Why a connection cannot be made, logged once a change or once in `told` (one
        connection's attempts: a server refusing the token alternates two reasons)."""
        why = f"cannot connect: {exc or type(exc).__name__}"
        said = self.nats_error == why or why in (told or ())
        if told is not None and len(told) < 16:
            told.add(why)
        if self._nc is not None and self.connected.is_set():  # the one in use goes on
            if not said:
                log.warning("kv relay: NATS %s (the connection in use is kept)", why)
            self.nats_error = why
        else:
            if not said:
                log.warning("kv relay: NATS %s", why)
            self.nats_state, self.nats_error = "disconnected", why

    async def _open(self) -> tuple[Client, AckInbox]:
        """A new connection and its acknowledgements' subscription; its callbacks act only
        while it is the connection in use."""
        made: list[Client] = []
        told: set[str] = set()  # why its attempts failed (each logged once)

        def current() -> bool:
            return bool(made) and made[0] is self._nc

        async def disconnected() -> None:
            if made:
                drop_unsent(made[0])
            if current():
                await self._disconnected()

        async def reconnected() -> None:
            if current():
                await self._reconnected()

        async def error(exc: Exception) -> None:
            if current():
                await self._error(exc)
            elif not made:  # (nats-py retries a first connection for ever, telling only us)
                self._cannot_connect(exc, told)

        creds = self.config.creds
        nc = await nats.connect(
            list(self.config.nats_urls),
            user_credentials=str(creds) if creds is not None else None,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]
            connect_timeout=2,
            skip_subject_validation=True,  # subjects built here, tokens checked
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=error,
        )
        made.append(nc)
        try:
            acks = AckInbox(nc, self._no_stream, 2 * self.config.inflight_records + 256)
            await acks.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await nc.close()
            raise
        return nc, acks

    async def _disconnected(self) -> None:
        """(After `drop_unsent`: every record in flight is sent again, in order.)"""
        self.connected.clear()
        self._note_down("disconnected; reconnecting")
        self.sender.resend("the connection was lost")

    async def _reconnected(self) -> None:
        delay = 0.1
        while self._nc is not None and self._nc.is_connected:
            try:
                await self._ensure_stream()
            except Exception as exc:
                self._note_down(f"stream {self.config.stream} not ready: {exc}")
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            self.nats_state, self.nats_error = "connected", None
            self.connected.set()
            log.info("kv relay: connected to NATS, stream %s ready", self.config.stream)
            return

    def _no_stream(self) -> None:
        """No stream took a record (deleted under the relay?): made again, once at a time
        (the records are sent again meanwhile, with backoff)."""
        if self._checking is None or self._checking.done():
            self._checking = asyncio.create_task(self._check_stream(), name="kv-relay-stream")

    async def _check_stream(self) -> None:
        try:
            await self._ensure_stream()
        except Exception as exc:
            why = f"stream {self.config.stream} not ready: {exc}"
            if self.nats_error != why:  # (once, not at every record's retry)
                log.warning("kv relay: %s", why)
            self.nats_error = why

    async def _error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):  # an answer dropped: sent again
            self.stats.answers_dropped += 1
            if self._acks is not None:
                self._acks.dropped(exc.subject)
            now = asyncio.get_running_loop().time()
            if now - self._drops_told >= DROPS_TOLD_EVERY:
                self._drops_told = now
                log.warning(
                    "kv relay: nats-py dropped acknowledgements (slow consumer; %d so far): "
                    "their records are sent again", self.stats.answers_dropped,
                )  # fmt: skip
            return
        self.nats_error = str(exc) or type(exc).__name__

    def _note_down(self, why: str) -> None:
        if self.nats_error != why:
            log.warning("kv relay: NATS %s", why)
        self.nats_state, self.nats_error = "disconnected", why

    async def _ensure_stream(self) -> None:
        assert self._js is not None
        config = self.config
        try:
            info = await self._js.stream_info(config.stream)
        except nats.js.errors.NotFoundError:
            pass
        else:  # it exists: used as it is, never altered (said when it is not as asked)
            self._compare(info.config)
            return
        try:
            await self._js.add_stream(
                name=config.stream,
                subjects=[f"{layout.SUBJECT_PREFIX}.>"],
                storage=api.StorageType.FILE,
                max_age=config.max_age,
                max_bytes=config.max_bytes,
                duplicate_window=config.window,
                num_replicas=1,
            )
            log.info("kv relay: created stream %s", config.stream)
            self.stream_differs = {}
        except nats.js.errors.BadRequestError as refused:
            try:  # another relay created it meanwhile?
                info = await self._js.stream_info(config.stream)
            except nats.js.errors.NotFoundError:
                raise refused from None  # no: NATS's reason (another stream's subjects...)
            self._compare(info.config)

    def _compare(self, found: api.StreamConfig) -> None:
        """Note (`stream_differs`, logged once a change) the stream's retention settings
        that are not this relay's flags: another relay, or an operator, made it so."""
        config = self.config
        differs: dict[str, dict[str, float | None]] = {}
        for name, flag, value in (
            ("max_age", config.max_age, found.max_age),
            ("max_bytes", config.max_bytes, found.max_bytes),
            ("duplicate_window", config.window, found.duplicate_window),
        ):
            if value != flag:
                differs[name] = {"stream": value, "flag": flag}
        if differs and differs != self.stream_differs:
            log.warning(
                "kv relay: stream %s is used as it is: %s", config.stream,
                ", ".join(f"{k} {v['stream']} (not {v['flag']})" for k, v in differs.items()),
            )  # fmt: skip
        self.stream_differs = differs

    # -- status ------------------------------------------------------------------------------

    @property
    def refusing(self) -> str | None:
        """Why the stream refused the last record answered (connected, yet it stores
        nothing: full with `discard: new`, gone...); None while it takes them."""
        acks = self._acks
        return None if acks is None else acks.refusing

    @property
    def taking(self) -> bool:
        """Whether NATS takes records: connected, and the stream stores them."""
        return self.connected.is_set() and self.refusing is None

    def status(self, limit: int = STATUS_MEMBERS, after: MemberKey | None = None) -> dict[str, Any]:
        """The relay's state, and its members in order, `limit` of them after `after`: a page
        (`members_next` the cursor of the next, None at the end), so that 20,000 members are
        not listed on the loop at each request (sorting them and their statuses took 28 ms)."""
        keys = self.members if after is None else (k for k in self.members if k > after)
        page = heapq.nsmallest(limit + 1, keys)
        more = len(page) > limit
        page = page[:limit]
        return {
            "nats": {
                "state": self.nats_state,
                "error": self.nats_error,
                "refusing": self.refusing,
                "connections": self.connections,
            },
            "stream": self.config.stream,
            "stream_differs": self.stream_differs,
            "members": [self.members[key].status() for key in page],
            "members_total": len(self.members),
            "members_next": member_cursor(page[-1]) if more else None,
        }

    def lag(self) -> Mapping[MemberKey, float]:
        return {k: m.lag_ms for k, m in self.members.items() if m.lag_ms is not None}
