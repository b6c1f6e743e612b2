"""`KvRelay`: the KV events of a membership view's workers, republished to NATS JetStream.

The loop, per member (an instance in the view that advertises a KV publisher): its
`KvSubscription` hands over batches in sequence order (replay on connect and on gap,
resnapshot when history is gone, publisher restarts seen); `Member` turns them into records
(`shoal.kv.stream`) in a bounded queue; one publish task per member sends the queue to
JetStream in order, waiting for each acknowledgement, retrying (the same message id) after
an error.

The invariants, both ways:
- Nothing blocks the subscription: a member's queue holds at most `buffer` records, and all
  members' queues at most `buffer_bytes` of payload (plus one batch each); past that the
  member's batches are dropped and a `resnapshot` record (from the batch that follows) takes
  their place, so a consumer forgets the instance's blocks rather than keep evicted ones.
- Every batch has the message id `{instance}:{epoch}:{seq}`, the same from every relay that
  publishes it: the stream keeps one copy when two relays run. The epoch of a run is named
  after the worker's timestamp of its batch 0; a relay that joins a run later takes the
  epoch of the stream's last record of that instance when it belongs to the same run (its
  sequence number and timestamp agree), else names the run after the first batch it saw.
- A member that leaves the view is unsubscribed at once and its `left` record published
  once (after what it had queued).
- The relay never deletes or alters a stream: it creates `stream` when it is missing (after
  every reconnection too: a server restarted without its storage).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import zmq.asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext, api

from shoal.discovery import ModelInstance
from shoal.kv import KvEndpoint, KVEventBatch, encode_batch
from shoal.kv import stream as layout
from shoal.kv.subscription import KvStats, KvSubscription
from shoal.membership import Membership

log = logging.getLogger(__name__)

BUFFER = 10_000  # records queued per member while NATS does not take them
BUFFER_BYTES = 256 << 20  # payload bytes queued by all members at once (batches: <= 4 MiB)
BACKOFF_MAX = 5.0  # seconds between two tries to reach NATS, at most
MemberKey = tuple[str, int]  # (namespace, instance id): one subject


@dataclass
class RelayConfig:
    """Where to publish and what the stream keeps."""

    nats_urls: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    stream: str = layout.DEFAULT_STREAM
    max_age: float = 600.0  # seconds a record is kept
    max_bytes: int = 1 << 30  # bytes the stream keeps at most (-1: no bound)
    duplicate_window: float = 120.0  # seconds the stream remembers message ids
    buffer: int = BUFFER
    buffer_bytes: int = BUFFER_BYTES
    publish_timeout: float = 2.0
    creds: Path | None = None  # a NATS credentials file, read at every connection


class RelayStats:
    """Counters shown on `/metrics` (the subscriptions' own in `subscriptions`)."""

    def __init__(self) -> None:
        self.relayed = 0  # batches the stream stored
        self.duplicates = 0  # records the stream refused as already stored (by id)
        self.dropped = 0  # batches dropped from a full queue (a resnapshot replaced them)
        self.resnapshots = 0  # resnapshot records queued
        self.publish_errors = 0
        self.queued_bytes = 0  # payload bytes of every member's queue
        self.subscriptions = KvStats()


@dataclass(eq=False)
class Record:
    kind: str
    seq: int = -1
    epoch: str | None = None
    payload: bytes = b""
    ts: float = 0.0

    def headers(self, instance_id: int) -> dict[str, str]:
        headers = {layout.KIND: self.kind}
        if self.kind == layout.BATCH or self.kind == layout.RESNAPSHOT:
            headers[layout.SEQ] = str(self.seq)
            headers[layout.EPOCH] = self.epoch or ""
            headers[layout.TS] = repr(self.ts)
        if self.kind == layout.BATCH:
            headers[layout.MSG_ID] = layout.batch_id(instance_id, self.epoch or "", self.seq)
        elif self.kind == layout.RESNAPSHOT:
            headers[layout.MSG_ID] = f"{instance_id:x}:{self.epoch}:resnapshot:{self.seq}"
        else:
            headers[layout.MSG_ID] = f"{instance_id:x}:{self.kind}"
        return headers


@dataclass(eq=False)
class Member:
    """One followed instance: its subscription's batches as records, queued for JetStream."""

    key: MemberKey
    subject: str
    endpoint: KvEndpoint
    joined: layout.Joined
    stats: RelayStats
    buffer: int
    buffer_bytes: int = BUFFER_BYTES  # of all members' queues (`stats.queued_bytes`)
    pending: deque[Record] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    epoch: str | None = None
    last_seq: int = -1
    owed: bool = False  # a resnapshot goes before the next batch
    hint: tuple[str, int, float] | None = None  # the stream's last (epoch, seq, ts) seen
    hint_read: bool = False
    lag_ms: float | None = None
    leaving: bool = False
    subscription: KvSubscription | None = None
    task: asyncio.Task[None] | None = None

    @property
    def instance_id(self) -> int:
        return self.key[1]

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        if seq <= self.last_seq:  # the publisher restarted: a new run, a new epoch
            self.epoch = None
        if seq == 0:
            self.epoch = layout.epoch_of(batch.ts)
        if self.owed:
            self.owed = False
            self._push(Record(layout.RESNAPSHOT, seq, self.epoch, b"", batch.ts))
        self._push(Record(layout.BATCH, seq, self.epoch, encode_batch(batch), batch.ts))
        self.last_seq = seq

    def resnapshot(self) -> None:
        self.owed = True

    def leave(self) -> None:
        self.leaving = True
        self.pending.append(Record(layout.LEFT))
        self.wake.set()

    def sent(self, record: Record) -> None:
        """`record`, the first queued, is in the stream: off the queue."""
        if self.pending and self.pending[0] is record:
            self.pending.popleft()
            self.stats.queued_bytes -= len(record.payload)

    def _push(self, record: Record) -> None:
        stats = self.stats
        if len(self.pending) >= self.buffer or (
            stats.queued_bytes + len(record.payload) > self.buffer_bytes and self.pending
        ):
            kept = [r for r in self.pending if r.kind == layout.JOINED]
            stats.dropped += sum(1 for r in self.pending if r.kind == layout.BATCH)
            stats.queued_bytes -= sum(len(r.payload) for r in self.pending)
            stats.queued_bytes += sum(len(r.payload) for r in kept)
            self.pending = deque(kept)
            if record.kind == layout.BATCH:
                self.stats.resnapshots += 1
                self.pending.append(
                    Record(layout.RESNAPSHOT, record.seq, record.epoch, b"", record.ts)
                )
        if record.kind == layout.RESNAPSHOT:
            stats.resnapshots += 1
        self.pending.append(record)
        stats.queued_bytes += len(record.payload)
        self.wake.set()

    def resolve_epoch(self, first: Record) -> None:
        """Name the run of `first` (its epoch unknown: the relay joined the run after batch
        0), then every queued record of that run."""
        hint = self.hint
        same_run = hint is not None and (
            (hint[1] < first.seq and hint[2] <= first.ts)
            or (hint[1] >= first.seq and hint[2] >= first.ts)
        )
        epoch = hint[0] if same_run and hint is not None else layout.epoch_of(first.ts)
        for record in self.pending:
            if record.epoch is None and record.kind in (layout.BATCH, layout.RESNAPSHOT):
                record.epoch = epoch
        if self.epoch is None:
            self.epoch = epoch

    def status(self) -> dict[str, Any]:
        return {
            "namespace": self.key[0],
            "instance_id": f"{self.instance_id:x}",
            "subject": self.subject,
            "epoch": self.epoch,
            "last_seq": self.last_seq,
            "pending": len(self.pending),
            "lag_ms": self.lag_ms,
        }


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
        self._ctx = zmq.asyncio.Context()
        self._connector: asyncio.Task[None] | None = None
        self._leaving: set[asyncio.Task[None]] = set()
        self.connections = 0  # connections made to NATS (a new connection_revision: one more)
        self._connection_revision: str | None = None
        self._seen_view = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start reaching NATS (in the background: the relay follows its workers meanwhile)."""
        self._connector = asyncio.create_task(self._connect(), name="kv-relay-nats")

    async def stop(self) -> None:
        tasks = [t for t in (self._connector,) if t is not None]
        for member in self.members.values():
            if member.subscription is not None:
                await member.subscription.stop()
            if member.task is not None:
                tasks.append(member.task)
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
        to NATS again when its `connection_revision` changed."""
        if self._seen_view and view.connection_revision != self._connection_revision:
            log.info(
                "kv relay: connection revision %s: connecting to NATS again",
                view.connection_revision,
            )
            task = asyncio.create_task(self._reconnect(), name="kv-relay-reconnect")
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
        self._seen_view, self._connection_revision = True, view.connection_revision
        wanted: dict[MemberKey, tuple[KvEndpoint, ModelInstance]] = {}
        for endpoint in view.endpoints.values():
            for model in endpoint.models:
                kv = model.instance.kv_events
                if kv is not None and model.card.lora is None:
                    wanted.setdefault((endpoint.namespace, endpoint.instance_id), (kv, model))
        for key in [k for k, m in self.members.items() if wanted.get(k, (None,))[0] != m.endpoint]:
            self._leave(self.members.pop(key))
        for key, (kv, model) in wanted.items():
            if key not in self.members:
                self._join(key, kv, model)

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
            key, layout.subject(*key), kv, joined, self.stats, max(2, self.config.buffer),
            self.config.buffer_bytes,
        )  # fmt: skip
        member.pending.append(Record(layout.JOINED, payload=msgspec.json.encode(joined)))
        self.stats.queued_bytes += len(member.pending[0].payload)
        member.wake.set()
        member.subscription = KvSubscription(
            self._ctx,
            key[1],
            kv,
            member.apply,
            member.resnapshot,
            self.stats.subscriptions,
            whole_batches=True,
        )
        self.members[key] = member
        member.task = asyncio.create_task(self._publish(member), name=f"kv-relay-{key[1]:x}")
        member.subscription.start()
        log.info("kv relay: following instance %x of namespace %s", key[1], key[0])

    def _leave(self, member: Member) -> None:
        """Unsubscribe now; `left` goes out after what was queued (its task ends then)."""
        log.info("kv relay: instance %x left", member.instance_id)
        if member.subscription is not None:
            stopping = asyncio.ensure_future(member.subscription.stop())
            self._leaving.add(stopping)
            stopping.add_done_callback(self._leaving.discard)
        member.leave()
        if member.task is not None:
            self._leaving.add(member.task)
            member.task.add_done_callback(self._leaving.discard)

    # -- NATS --------------------------------------------------------------------------------

    async def _reconnect(self) -> None:
        """Drop the connection and make a new one (new credentials are read then); records
        not acknowledged are sent again, with the same ids."""
        self.connected.clear()
        if self._connector is not None:
            self._connector.cancel()
            with contextlib.suppress(BaseException):
                await self._connector
        nc, self._nc = self._nc, None
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        self._connector = asyncio.create_task(self._connect(), name="kv-relay-nats")

    async def _connect(self) -> None:
        """Connect (retrying with backoff), then make sure the stream exists; nats-py
        reconnects by itself after that, and the stream is checked again each time."""
        delay = 0.1
        while True:
            try:
                creds = self.config.creds
                self._nc = await nats.connect(
                    list(self.config.nats_urls),
                    user_credentials=str(creds) if creds is not None else None,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,  # type: ignore[arg-type]
                    connect_timeout=2,
                    disconnected_cb=self._disconnected,
                    reconnected_cb=self._reconnected,
                    error_cb=self._error,
                )
                self.connections += 1
                break
            except Exception as exc:
                self._note_down(f"cannot connect: {exc or type(exc).__name__}")
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
        self._js = self._nc.jetstream(timeout=self.config.publish_timeout)
        await self._reconnected()

    async def _disconnected(self) -> None:
        self.connected.clear()
        self._note_down("disconnected; reconnecting")

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

    async def _error(self, exc: Exception) -> None:
        self.nats_error = str(exc) or type(exc).__name__

    def _note_down(self, why: str) -> None:
        if self.nats_error != why:
            log.warning("kv relay: NATS %s", why)
        self.nats_state, self.nats_error = "disconnected", why

    async def _ensure_stream(self) -> None:
        assert self._js is not None
        config = self.config
        try:
            await self._js.stream_info(config.stream)
            return  # it exists: used as it is, never altered
        except nats.js.errors.NotFoundError:
            pass
        try:
            await self._js.add_stream(
                name=config.stream,
                subjects=[f"{layout.SUBJECT_PREFIX}.>"],
                storage=api.StorageType.FILE,
                max_age=config.max_age,
                max_bytes=config.max_bytes,
                duplicate_window=config.duplicate_window,
                num_replicas=1,
            )
            log.info("kv relay: created stream %s", config.stream)
        except nats.js.errors.BadRequestError:
            await self._js.stream_info(config.stream)  # another relay created it meanwhile

    # -- publishing --------------------------------------------------------------------------

    async def _publish(self, member: Member) -> None:
        """Send the member's queue in order; each record until the stream acknowledges it."""
        delay = 0.1
        while True:
            if not member.pending:
                if member.leaving:
                    return
                member.wake.clear()
                await member.wake.wait()
                continue
            await self.connected.wait()
            js = self._js
            assert js is not None
            record = member.pending[0]
            try:
                if not member.hint_read:
                    member.hint = await self._last_record(js, member.subject)
                    member.hint_read = True
                if record.epoch is None and record.kind in (layout.BATCH, layout.RESNAPSHOT):
                    member.resolve_epoch(record)
                ack = await js.publish(
                    member.subject,
                    record.payload,
                    stream=self.config.stream,
                    headers=record.headers(member.instance_id),
                )
            except asyncio.CancelledError:
                raise
            except nats.errors.MaxPayloadError:
                # Larger than the server takes, ever: a loss, told as one.
                self.stats.publish_errors += 1
                self.stats.dropped += 1
                self.stats.resnapshots += 1
                log.warning(
                    "kv relay: batch %d of instance %x is over NATS's max payload: "
                    "published as a resnapshot", record.seq, member.instance_id,
                )  # fmt: skip
                if member.pending and member.pending[0] is record:
                    member.pending[0] = Record(
                        layout.RESNAPSHOT, record.seq + 1, record.epoch, b"", record.ts
                    )
                    self.stats.queued_bytes -= len(record.payload)
                continue
            except Exception as exc:
                self.stats.publish_errors += 1
                log.debug("kv relay: publish to %s failed: %r", member.subject, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            delay = 0.1
            member.sent(record)
            if ack.duplicate:
                self.stats.duplicates += 1
            elif record.kind == layout.BATCH:
                self.stats.relayed += 1
            if record.kind == layout.BATCH:
                member.lag_ms = max(0.0, (time.time() - record.ts) * 1000)

    async def _last_record(
        self, js: JetStreamContext, subject: str
    ) -> tuple[str, int, float] | None:
        """(epoch, seq, ts) of the stream's last record of `subject` that has them."""
        try:
            msg = await js.get_last_msg(self.config.stream, subject)
        except nats.js.errors.NotFoundError:
            return None
        headers = msg.headers or {}
        try:
            return headers[layout.EPOCH], int(headers[layout.SEQ]), float(headers[layout.TS])
        except (KeyError, ValueError):
            return None

    # -- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "nats": {
                "state": self.nats_state,
                "error": self.nats_error,
                "connections": self.connections,
            },
            "stream": self.config.stream,
            "members": [m.status() for _, m in sorted(self.members.items())],
        }

    def lag(self) -> Mapping[MemberKey, float]:
        return {k: m.lag_ms for k, m in self.members.items() if m.lag_ms is not None}
