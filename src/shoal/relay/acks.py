"""`AckInbox`: the acknowledgements of the records one NATS connection publishes to JetStream.

A record is published with the reply subject `{inbox}.{token}`; the stream answers there
(`{"stream", "seq", "duplicate"}` or `{"error": ...}`; a 503 status when no stream takes the
subject). One subscription (`{inbox}.*`) receives every answer and hands it to the record's
`Member`, so publishing does not wait for each answer: the records of a member go out in a
window, in order, and are retired in order (`Member.acknowledged`). A request per record
(nats-py's `JetStreamContext.publish`) cost an inbox, a future and a `wait_for` each, and a
round trip before the next one.

The subscription's queue in nats-py holds at most `answers` answers (the relay's records in
flight, twice: late answers to records sent again) and `answers * ANSWER_BYTES` of them, not
nats-py's defaults (524,288 messages, 128 MiB). An answer nats-py drops past that (a slow
consumer: its error callback) is a failure of its record (`dropped`): the member sends its
records in flight again, same ids, and the stream refuses what it stored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shoal.relay.member import DUPLICATE, FAILED, STORED, Member, Record

log = logging.getLogger(__name__)

NO_RESPONDERS = "503"
TOO_LARGE = 10054  # JetStream's "message size exceeds maximum allowed" (the stream's max_msg_size)
YIELD_EVERY = 256  # answers handled before yielding to the event loop
ANSWER_BYTES = 1024  # bytes an answer may take in nats-py's queue (a `PubAck`: ~60)


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


_decode = msgspec.json.Decoder(_PubAck).decode


class AckInbox:
    """Reply subjects for records sent on `nc`, and the answers routed back to their member."""

    def __init__(
        self, nc: Client, no_stream: Callable[[], None] = lambda: None, answers: int = 8192
    ) -> None:
        self.nc = nc
        self.no_stream = no_stream  # told when no stream takes a record's subject
        self.answers = answers  # queued in nats-py at most (past that: dropped)
        self.subscription: Subscription | None = None
        self.prefix = nc.new_inbox() + "."
        self.waiting: dict[str, tuple[Member, Record]] = {}
        self.refusing: str | None = None  # why the stream refused the last record answered
        self._count = 0
        self._answers = 0

    async def start(self) -> None:
        self.subscription = await self.nc.subscribe(
            self.prefix + "*",
            cb=self._answer,
            pending_msgs_limit=self.answers,
            pending_bytes_limit=self.answers * ANSWER_BYTES,
        )

    def dropped(self, subject: str) -> bool:
        """nats-py dropped the answer sent to `subject` (its queue was full): its record
        failed, to be sent again. False when it was not an answer awaited here."""
        if not subject.startswith(self.prefix):
            return False
        entry = self.waiting.pop(subject[len(self.prefix) :], None)
        if entry is None:
            return False  # (a record sent again since, or not ours)
        member, record = entry
        record.token = ""
        member.acknowledged(record, FAILED, "its acknowledgement was dropped (slow consumer)")
        return True

    def reply(self, member: Member, record: Record) -> str:
        """The reply subject of `record`, now awaited."""
        self._count += 1
        record.token = token = f"{self._count:x}"
        self.waiting[token] = (member, record)
        return self.prefix + token

    def forget(self, record: Record) -> None:
        """`record` is no longer awaited here (it is sent again, or never was)."""
        entry = self.waiting.get(record.token)
        if entry is not None and entry[1] is record:  # (a token of another connection: not)
            del self.waiting[record.token]
        record.token = ""

    async def _answer(self, msg: Msg) -> None:
        self._answers += 1
        if self._answers % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # nats-py hands queued answers over without yielding
        entry = self.waiting.pop(msg.subject[len(self.prefix) :], None)
        if entry is None:
            return  # a record sent again since (its answer came late), or not ours
        member, record = entry
        record.token = ""
        headers = msg.headers
        if headers and headers.get("Status") == NO_RESPONDERS:
            self.refusing = "no stream takes the records"
            member.acknowledged(record, FAILED, self.refusing)
            self.no_stream()
            return
        try:
            ack = _decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.refusing = f"unreadable acknowledgement: {exc}"
            member.acknowledged(record, FAILED, self.refusing)
            return
        if ack.error is not None:
            why = f"{ack.error.description} (code {ack.error.code}/{ack.error.err_code})"
            if ack.error.err_code == TOO_LARGE:  # this record, ever: a resnapshot instead
                log.warning(
                    "kv relay: the stream refuses a record of %s as too large: a resnapshot "
                    "in its place", member.subject,
                )  # fmt: skip
                member.too_large(record, why)
                return
            self.refusing = f"the stream refuses records: {why}"
            member.acknowledged(record, FAILED, why)
            return
        self.refusing = None
        member.acknowledged(record, DUPLICATE if ack.duplicate else STORED)
