"""`Store.put_many` on SQLite (not a test): the time to put N leased keys, what a watch in
another process received meanwhile, and the file's size.

    .venv/bin/python -m bench.put_many --keys 20000                      # put per key, put_many
    .venv/bin/python -m bench.put_many --keys 10000 --writers 3          # 3 processes at once
    .venv/bin/python -m bench.put_many --keys 10000 --writers 3 --frontend   # + a frontend probed

A worker re-putting its cards after a lost lease (300-byte values here). With `--writers 1`
this process puts the keys, first one `put` per key, then with one `put_many`; with more,
each writer is a child process that grants a lease, then puts `--keys` keys with one
`put_many` at the same moment as the others (several workers that lost their leases at
once). The watcher, a child process, lists the prefix, watches from the next revision and
counts the `Put`s and `Resync`s it gets until it holds every key. `--cards`: each writer
child registers an endpoint instance under its lease and puts model cards (LoRA adapters,
~300 bytes) under it, as a worker does. `--frontend` also runs a
`shoal frontend` on the file and `../shared/tools/stall_probe.py` against its `/live` while the
keys are written: it does not watch `bench/`, but its watch poller reads every change of the
file; with `--cards` it watches the cards and joins them. The file's size (main file + WAL) is taken when the watcher has every key.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.processes import Processes

from shoal.store import open_store

PROBE = Path(__file__).resolve().parents[2] / "shared" / "tools" / "stall_probe.py"
PROBE_LINE = re.compile(r"max (?P<max>[\d.]+) ms\s+longest gap (?P<gap>[\d.]+) ms")

WATCHER = """
import asyncio, sys
from shoal.store import Put, Resync, open_store

async def main(url, keys, prefix):
    store = await open_store(url)
    snap = await store.get_prefix(prefix)
    print("ready", flush=True)
    held, puts, resyncs = set(), 0, 0
    async for event in store.watch(prefix, snap.revision + 1):
        if isinstance(event, Resync):
            resyncs += 1
            held = {kv.key for kv in event.items}
        elif isinstance(event, Put):
            puts += 1
            held.add(event.key)
        if len(held) == keys:
            break
    await store.close()
    print(puts, resyncs, flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
"""

WRITER = """
import asyncio, sys, time
import msgspec
from shoal.cards import ModelCard
from shoal.discovery import EndpointId, InstanceInfo, ModelKey
from shoal.store import open_store

async def main(url, prefix, keys):
    store = await open_store(url)
    lease = await store.grant(60)
    if prefix == "cards":  # a worker's instance and the cards of its adapters
        endpoint = EndpointId("bench", "backend", "generate")
        info = InstanceInfo("bench", "backend", "generate", lease.id, "http://127.0.0.1:9", "http://127.0.0.1:9")
        await store.put(ModelKey(endpoint, lease.id).instance_key, msgspec.json.encode(info), lease=lease.id)
        items = [
            (ModelKey(endpoint, lease.id, f"lora-{i:06d}").key, ModelCard.build(
                display_name=f"org/lora-{i:06d}", slug=f"org--lora-{i:06d}", source="hf://org/x",
                model_types=["chat"], context_length=4096,
                lora={"base_model": "fake/base-7b", "adapter": f"org/lora-{i:06d}"},
            ).to_json())
            for i in range(keys)
        ]
    else:
        items = [(f"{prefix}{i:06d}", b"x" * 300) for i in range(keys)]
    print("ready", len(items[0][1]), flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    started = time.perf_counter()
    await store.put_many(items, lease=lease.id)
    print(f"{time.perf_counter() - started:.2f}", flush=True)
    await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


async def _probe(url: str, seconds: float) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(PROBE), url, "--seconds", str(seconds),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    match = PROBE_LINE.search(out.decode())
    return f"probe max {match['max']} ms, gap {match['gap']} ms" if match else out.decode()


async def run(keys: int, writers: int, mode: str, frontend: bool, cards: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="shoal-put-many-") as tmp:
        path = Path(tmp) / "store.db"
        url = f"sqlite://{path}"
        store = await open_store(url)
        total = keys * writers
        children = Processes(Path(tmp))
        probe: asyncio.Task[str] | None = None
        if frontend:
            front = await children.start(
                "frontend", "--store", url, "--port", "0", ready="frontend"
            )
            probe = asyncio.create_task(_probe(front.url + "/live", 8))
            await asyncio.sleep(1)  # (the probe's first answers, before the writes)
        watcher = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WATCHER, url, str(total),
            "shoal/v1/models/bench/" if cards else "bench/", stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        procs = []
        for n in range(writers if mode == "children" else 0):
            prefix = "cards" if cards else f"bench/w{n}/"
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", WRITER, url, prefix, str(keys),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            procs.append(proc)
        try:
            assert watcher.stdout is not None
            await watcher.stdout.readline()
            value_bytes = "300"
            for proc in procs:
                assert proc.stdout is not None
                value_bytes = (await proc.stdout.readline()).decode().split()[1]
            started = time.perf_counter()
            if mode == "children":
                for proc in procs:
                    assert proc.stdin is not None
                    proc.stdin.write(b"go\n")
                    await proc.stdin.drain()
                times = [(await p.stdout.readline()).decode().strip() for p in procs]  # type: ignore[union-attr]
            else:
                lease = await store.grant(60)
                items = [(f"bench/w0/{i:06d}", b"x" * 300) for i in range(keys)]
                if mode == "put":
                    for key, value in items:
                        await store.put(key, value, lease=lease.id)
                else:
                    await store.put_many(items, lease=lease.id)
                times = [f"{time.perf_counter() - started:.2f}"]
            out, _ = await asyncio.wait_for(watcher.communicate(), 120)
            watched = time.perf_counter() - started
            puts, resyncs = map(int, out.split())
            size = _size(path)
            print(
                f"{mode:8} {writers} x {keys:,} keys: writers took {' / '.join(times)} s,"
                f" the watch had all in {watched:.2f} s with {puts:,} Puts, {resyncs} Resyncs;"
                f" file {size / 2**20:.1f} MiB ({value_bytes}-byte values)"
                + (f"; frontend {await probe}" if probe else ""),
                flush=True,
            )
        finally:
            for proc in [watcher, *procs]:
                if proc.returncode is None:
                    proc.kill()
            await children.close()
            await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=20_000, help="keys per writer")
    ap.add_argument("--writers", type=int, default=1)
    ap.add_argument("--frontend", action="store_true")
    ap.add_argument(
        "--cards", action="store_true", help="children write an instance and model cards"
    )
    args = ap.parse_args()
    modes = ("put", "put_many") if args.writers == 1 and not args.cards else ("children",)
    for mode in modes:
        asyncio.run(run(args.keys, args.writers, mode, args.frontend, args.cards))


if __name__ == "__main__":
    main()
