"""Full garbage collections while the frontend's KV stream reader keeps many tiny batches (a
reader catching up the relay's stream for instances it does not follow yet: its 64 MiB bound
holds ~285,000 of them). `KvStreamReader.record` is given `--records` tiny batches of 70
instances not followed, yielding to the loop every 1,000; a `gc.callbacks` timer measures every
full (generation 2) collection. Prints the collections' count and durations, the longest, and
the objects the collector tracks at the end.

    PYTHONPATH=$PWD/src:$PWD .venv/bin/python -m bench.kv_kept_gc [--records 300000] [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time

from shoal.frontend.kv.stream import KvStreamReader
from shoal.kv import KVEventBatch, encode_batch
from shoal.kv import stream as layout

INSTANCES = 70


async def run(records: int) -> dict[str, object]:
    pauses: list[float] = []
    started = [0.0]

    def timer(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            pauses.append((time.perf_counter() - started[0]) * 1000)

    gc.collect()
    gc.callbacks.append(timer)
    try:
        reader = KvStreamReader("nats://127.0.0.1:1")
        payload = bytes(encode_batch(KVEventBatch(1.0, [])))
        begun = time.perf_counter()
        for i in range(records):
            seq = i // INSTANCES
            headers = {layout.KIND: layout.BATCH, layout.SEQ: str(seq), layout.TS: f"{seq}.0"}
            reader.record(layout.subject("other", 1 + i % INSTANCES), headers, payload)
            if i % 1000 == 0:
                await asyncio.sleep(0)
        took = time.perf_counter() - begun
    finally:
        gc.callbacks.remove(timer)
    return {
        "kept": reader.ledger.live,
        "seconds": round(took, 2),
        "full_collections_ms": [round(p, 1) for p in pauses],
        "longest_ms": round(max(pauses, default=0.0), 1),
        "tracked_objects": len(gc.get_objects()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=300_000)
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args()
    for _ in range(args.runs):
        print(asyncio.run(run(args.records)))


if __name__ == "__main__":
    main()
