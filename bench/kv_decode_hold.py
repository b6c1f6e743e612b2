"""How long a large KV batch holds the event loop while the frontend's stream reader decodes
and applies it: a 1 ms ticker on the loop, `KvStreamReader` given 5 batches just under
`MAX_BATCH_BYTES` (50 `BlockStored` events each). Prints the longest wall-clock gap between
two ticks and the most CPU the process used between two ticks (robust on a loaded machine,
where a gap also counts the time the process was not scheduled; two steps of the loop can
fall between two ticks), and the CPU of the longest step (one callback: one hold of the loop). The applied batches are
counted, not kept. Runs on trees that decode in a thread (before) and in slices (after).
`--single-mb N`: batches of one `BlockStored` of N MB instead (a long prefill's; a tree that
refuses it counts it unreadable); `--tiny`: batches of 8,192 removals of one block each.
`--decode-only`: the decoding alone, the garbage collector off (its passes are the process's,
not the decoder's): the CPU of one `decode_batch` call, and the steps and longest step of
`decode_batch_in_slices` (best of the runs). `--hostile SHAPE`: a batch of ~4 MiB written to
cost msgspec the most per byte (`HOSTILE`: one value a byte), with `--decode-only`.

    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.kv_decode_hold [--small-ids] [--runs 3]
    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.kv_decode_hold --single-mb 4 | --tiny
    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.kv_decode_hold --decode-only --hostile ids
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from collections.abc import Callable

from shoal.frontend.kv.stream import KvStreamReader
from shoal.kv import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
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


def single(megabytes: float) -> bytes:
    """One `BlockStored` of `megabytes` MB: ids over 65,535 (5 bytes each), blocks of 16."""
    rnd = random.Random(1)
    ids = [100_000 + rnd.randrange(50_000) for _ in range(int(megabytes * 1e6 / 5.6))]
    hashes = [rnd.getrandbits(63) for _ in range(len(ids) // 16)]
    data = encode_batch(KVEventBatch(time.time(), [BlockStored(hashes, None, ids, 16)]))
    assert len(data) <= MAX_BATCH_BYTES
    return data


def tiny() -> bytes:
    """8,192 removals of one block each (~170 KB): the most events a batch may hold."""
    rnd = random.Random(1)
    events = [BlockRemoved([rnd.getrandbits(20)]) for _ in range(8_192)]
    return encode_batch(KVEventBatch(time.time(), events))


def _fill(unit: bytes) -> bytes:
    """An array of as many `unit`s as fill a batch."""
    count = (MAX_BATCH_BYTES - 4096) // len(unit)
    return b"\xdd" + count.to_bytes(4, "big") + unit * count


_HEAD = b"\x93\xcb" + bytes(8) + b"\x91"  # ([ts, [one event], ...)
_STORED = b"\xabBlockStored\x90\xc0"  # (its tag, no blocks, no parent)
HOSTILE = {
    "ids": _HEAD + b"\x95" + _STORED + _fill(b"\x01") + b"\x10\xc0",
    "hashes-64": _HEAD + b"\x92\xacBlockRemoved" + _fill(b"\xc4\x40" + bytes(64)) + b"\xc0",
    "ignored-empty-arrays": _HEAD + b"\x98" + _STORED + b"\x90\x10\xc0\xc0" + _fill(b"\x90")
    + b"\xc0",
    "batch-field-of-[[]]": b"\x94\xcb" + bytes(8) + b"\x91\x92\xacBlockRemoved\x91\x07\xc0"
    + _fill(b"\x91\x90"),
}  # fmt: skip
"""Shapes of a batch that cost msgspec the most per byte: one event of 1-byte token ids, or of
64-byte hashes; 4 MiB of empty arrays in an event's field no reader knows, or in the batch's."""


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


async def run(data: bytes, blocks: int) -> tuple[float, float, float, int]:
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
        applied += sum(len(e.block_hashes) for e in batch.events)

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
    unreadable = reader.stats.decode_errors
    assert applied == blocks * (5 - unreadable)  # (every block of each batch read)
    return max(g for g, _ in gaps), max(c for _, c in gaps), longest[0], unreadable


async def decode_only(data: bytes, runs: int) -> str:
    from shoal.kv.sliced import decode_batch_in_slices

    held: list[float] = []
    run = asyncio.events.Handle._run

    def timed(handle: asyncio.events.Handle) -> None:
        held.append(_cpu(lambda: run(handle)))

    gc.disable()
    try:
        one = min(_cpu(lambda: decode_batch(data)) for _ in range(runs))
        longest, steps, total, refused = 1e9, 0, 1e9, ""
        for _ in range(runs):
            held.clear()
            asyncio.events.Handle._run = timed  # type: ignore[method-assign]
            try:
                await asyncio.create_task(decode_batch_in_slices(data))
            except ValueError as exc:  # (msgspec's errors are ValueErrors)
                refused = f", refused: {exc}"
            finally:
                asyncio.events.Handle._run = run  # type: ignore[method-assign]
            longest, steps, total = min(longest, max(held)), len(held), min(total, sum(held))
    finally:
        gc.enable()
    return (
        f"{len(data):,} bytes: one decode_batch call {one * 1e3:.1f} ms of CPU; sliced: "
        f"{steps} steps, {total * 1e3:.1f} ms in all, the longest {longest * 1e3:.2f} ms{refused}"
    )


def _cpu(work: Callable[[], object]) -> float:
    start = time.process_time()
    work()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small-ids", action="store_true")
    parser.add_argument("--single-mb", type=float, default=0.0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--decode-only", action="store_true")
    parser.add_argument("--hostile", choices=HOSTILE)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.hostile:
        data = HOSTILE[args.hostile]
    elif args.tiny:
        data = tiny()
    else:
        data = single(args.single_mb) if args.single_mb else payload(args.small_ids)
    if args.decode_only:
        print(asyncio.run(decode_only(data, args.runs)))
        return
    blocks = sum(len(e.block_hashes) for e in decode_batch(data).events)  # (each batch's)
    for _ in range(args.runs):
        gap, cpu, step, unreadable = asyncio.run(run(data, blocks))
        print(f"{len(data):,} bytes x5: longest loop gap {gap * 1e3:.1f} ms, "
              f"most process CPU between two ticks {cpu * 1e3:.1f} ms, "
              f"longest step {step * 1e3:.1f} ms of CPU, unreadable {unreadable}")  # fmt: skip


if __name__ == "__main__":
    main()
