"""The KV publisher's socket opened anew after stray subscriptions: what its real subscribers
see (`shoal.worker.kv_publisher`, `MAX_STRAY_SUBSCRIPTIONS`)."""

from __future__ import annotations

import zmq.asyncio

from shoal.kv import BlockRemoved, KVEventBatch
from shoal.kv.subscription import KvStats, KvSubscription
from shoal.worker import kv_publisher
from shoal.worker.kv_publisher import KvEventPublisher
from tests.helpers import wait_for
from tests.kv.subscribers import raw_subscriptions, subscribed


async def test_a_batch_published_while_the_socket_is_opened_anew_reaches_an_idle_workers_subscriber() -> (
    None
):
    """After a reopen, a batch published before the subscribers had reconnected was dropped
    by the new socket (no one subscribed yet), and an idle worker sends nothing after it:
    the subscriber learnt of it only with the worker's next batch, if ever (a block removed
    stayed in the frontends' indexes). Now each subscriber coming back after a reopen is
    sent the publisher's next number at once (an empty batch), so it replays what it missed."""
    pub = KvEventPublisher()
    endpoint = await pub.start()
    ctx = zmq.asyncio.Context()
    seen: list[int] = []

    def apply(seq: int, batch: KVEventBatch) -> None:
        if batch.events:
            seen.append(seq)

    sub = KvSubscription(ctx, 7, endpoint, apply, lambda: None, KvStats())
    sub.start()
    try:
        await subscribed(pub)
        pub.record(BlockRemoved(block_hashes=[1]))
        await wait_for(lambda: seen == [0], message="the first batch never came")
        stray = await raw_subscriptions(
            endpoint.publisher,
            [b"stray-%d" % i for i in range(kv_publisher.MAX_STRAY_SUBSCRIPTIONS + 1)],
        )
        await wait_for(lambda: pub.reopened >= 1, message="the socket was never opened anew")
        stray.close()
        pub.record(BlockRemoved(block_hashes=[2]))  # (its subscriber is not back yet)
        pub.flush()
        await wait_for(lambda: seen == [0, 1], timeout=5, message=f"batch 1 never came: {seen}")
    finally:
        await sub.stop()
        ctx.destroy(linger=0)
        await pub.close()
