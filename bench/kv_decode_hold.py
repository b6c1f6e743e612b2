"""How long a large KV batch holds the event loop while the frontend's stream reader decodes
and applies it: a 1 ms ticker on the loop, `KvStreamReader` given 5 batches just under
`MAX_BATCH_BYTES` (50 `BlockStored` events each). Prints the longest wall-clock gap between
two ticks and the most CPU the process used between two ticks (robust on a loaded machine,
where a gap also counts the time the process was not scheduled; two steps of the loop can
fall between two ticks), and the CPU of the longest step (one callback: one hold of the loop). The applied batches are
counted, not kept. Runs on trees that decode in a thread (before) and in slices (after).

    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.kv_decode_hold [--small-ids] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from shoal.frontend.kv.stream import KvStreamReader
from shoal.kv import BlockStored, KVEventBatch, encode_batch
from shoal.kv.subscription import MAX_BATCH_BYTES


def payload(small_ids: bool) -> bytes:
    """~3.9 MB (ids over 65,535: 5 bytes each) or ~4.1 MB (ids under: 3 bytes, 1.16 M ids)."""
    base, count = (1_000, 23_200) if small_ids else (100_000, 14_000)
    rnd = random.Random(1)
    events = []
    for _ in range(50):
        ids = [base + rnd.randrange(50_000) for _ in range(count)]
        hashes = [rnd.getrandbits(63) for _ in range(len(ids) // 16)]
        events.append(BlockStored(hashes, None, ids, 16))
    data = encode_batch(KVEventBatch(time.time(), events))
    assert len(data) <= MAX_BATCH_BYTES
    return data


def longest_callbacks() -> list[float]:
    """The CPU of the longest callback the loop runs (one step of a task: one hold of the
    loop), measured from now on: `Handle._run` timed."""
    longest = [0.0]
    run = asyncio.events.Handle._run

    def timed(handle: asyncio.events.Handle) -> None:
        start = time.process_time()
        run(handle)
        longest[0] = max(longest[0], time.process_time() - start)

    asyncio.events.Handle._run = timed  # type: ignore[method-assign]
    return longest


async def run(data: bytes) -> tuple[float, float, float]:
    gaps: list[tuple[float, float]] = []
    stop = False

    async def ticker() -> None:
        last, last_cpu = time.perf_counter(), time.process_time()
        while not stop:
            await asyncio.sleep(0.001)
            now, cpu = time.perf_counter(), time.process_time()
            gaps.append((now - last, cpu - last_cpu))
            last, last_cpu = now, cpu

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    reader = KvStreamReader("nats://127.0.0.1:1")
    applied = 0

    def apply(batch: KVEventBatch) -> None:
        nonlocal applied
        applied += len(batch.events)

    key = ("default", 0x1234)
    reader.follow(key, apply, lambda: None)
    gaps.clear()
    longest = longest_callbacks()
    for _ in range(5):
        reader._deliver(reader.instances[key], data)  # (what a record read from the stream does)
        flushing = reader.instances[key].flushing
        if flushing is not None:
            await flushing
    stop = True
    await tick
    assert applied >= 5 * 50 and reader.stats.decode_errors == 0
    return max(g for g, _ in gaps), max(c for _, c in gaps), longest[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small-ids", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    data = payload(args.small_ids)
    for _ in range(args.runs):
        gap, cpu, step = asyncio.run(run(data))
        print(f"{len(data):,} bytes x5: longest loop gap {gap * 1e3:.1f} ms, "
              f"most process CPU between two ticks {cpu * 1e3:.1f} ms, "
              f"longest step {step * 1e3:.1f} ms of CPU")  # fmt: skip


if __name__ == "__main__":
    main()
