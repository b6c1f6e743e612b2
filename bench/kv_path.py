"""The kv router's own work per request, in one process (not a test): where its CPU goes.

    .venv/bin/python -m bench.kv_path                 # CPU per request, by step
    .venv/bin/python -m bench.kv_path --profile 25    # one pass under cProfile: top 25
    .venv/bin/python -m bench.kv_path --repeat 9      # the least of 9 passes (default 5)
    .venv/bin/python -m bench.kv_path --record T      # one pass, its requests and events kept in T
    PYTHONHASHSEED=0 valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \
        .venv/bin/python -m bench.kv_path --replay T [--null | --upto STEP]

`--replay` runs only the kv steps over a recorded pass (each batch of events applied to the
instance it came from then), so that two source trees do the same work; `--null` reads the
recording and does none of them. Under valgrind, the difference of the two counts of
instructions (divided by the requests) is the kv path's work per request, whatever the load
of the machine: timings on a shared machine move with it, instruction counts do not.

Replays `bench/kv_routing.py`'s workload (the same options and seed) through the steps the
frontend takes for a chat request under `--router kv`, without sockets: decode the request's
fields, read its prompt (`KvPrompt.of`), tokenize and hash it (`prepare`, with the mocker's
published tokenizer and chat template), pick an instance, and apply the KV events that the
picked worker publishes for it (each worker simulated by the mocker's own `PrefixCache`,
its batches encoded and decoded as on the wire). Conversations are taken `--concurrency`
at a time, turn by turn, as the benchmark's clients interleave them. CPU time is process
time per step; the proxying of the request itself is not counted (`bench/gateway.py` is).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bench.kv_routing import conversations, parse_args
from shoal.frontend.kv.index import KvIndex
from shoal.frontend.kv.prompt import PromptTokenizer
from shoal.frontend.kv.router import KvPrompt, KvRouter
from shoal.frontend.kv.tracker import KvSet
from shoal.frontend.proxy.proxy import decode_fields
from shoal.kv import KVEventBatch, decode_batch, encode_batch
from shoal.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from shoal.openai import ChatMessage
from shoal.worker.engines.mocker.metadata import write_model_files
from shoal.worker.engines.mocker.prefix_cache import PrefixCache
from shoal.worker.engines.mocker.tokenizer import encode, render_chat

STEPS = ("decode", "prompt", "prepare", "pick", "events")


@dataclass
class Target:
    """What `KvRouter.pick` reads of an upstream."""

    instance_id: int
    inhibited: bool = False
    in_flight: int = 0


@dataclass
class Set:
    """What `KvRouter.pick` reads of a worker set."""

    id: str
    routable: tuple[Target, ...]
    cursor: int = 0


@dataclass
class Worker:
    cache: PrefixCache
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = field(default_factory=list)


def requests(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """The benchmark's requests in the order its clients send them (roughly)."""
    convs = conversations(args)
    ordered = []
    for start in range(0, len(convs), args.concurrency):
        group = convs[start : start + args.concurrency]
        for turn in range(args.turns):
            ordered += [conv[turn] for conv in group]
    return ordered


def run(
    args: argparse.Namespace, model_dir: Path, profile: cProfile.Profile | None
) -> tuple[dict[str, float], float]:
    """One pass over the workload, from empty caches: CPU seconds per step, and the
    (simulated) workers' hit rate."""
    write_model_files(model_dir, context_length=1 << 16, hidden_size=64, kv_block_size=16)
    tokenizer = PromptTokenizer.load(
        model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    )
    router = KvRouter()
    state = KvSet(KvIndex(args.block_size), tokenizer, "")
    ws = Set("set", tuple(Target(i + 1) for i in range(args.workers)))
    router.tracker.sets[ws.id] = state  # type: ignore[index]
    workers = {}
    for target in ws.routable:
        worker = Worker(PrefixCache(args.kv_blocks, args.block_size))
        worker.cache.on_event = worker.events.append
        workers[target.instance_id] = worker
    spent = dict.fromkeys(STEPS, 0.0)
    hits = queries = 0
    reqs = requests(args)
    trace: list[tuple[bytes, int, bytes]] = []
    clock = time.process_time
    for messages in reqs:
        body = json.dumps(
            {"model": "m", "messages": messages, "max_tokens": args.max_tokens, "stream": True}
        ).encode()
        if profile is not None:
            profile.enable()
        t0 = clock()
        fields = decode_fields(body, with_prompt=True)
        t1 = clock()
        prompt = KvPrompt.of(fields)
        t2 = clock()
        prompt.prepare(tokenizer, (args.block_size,), router.max_blocks)
        t3 = clock()
        picked = router.pick(ws, prompt)  # type: ignore[arg-type]
        t4 = clock()
        if profile is not None:
            profile.disable()
        assert picked is not None, prompt.failure
        # The worker computes the prompt (its own tokenizer) and publishes its events.
        worker = workers[picked.instance_id]
        tokens = encode(render_chat(ChatMessage(**m) for m in messages))  # type: ignore[arg-type]
        before = worker.cache.hit_tokens
        worker.cache.admit(worker.cache.block_hashes(tokens), tokens)
        hits += worker.cache.hit_tokens - before
        queries += len(tokens)
        payload = encode_batch(KVEventBatch(time.time(), list(worker.events)))
        worker.events.clear()
        trace.append((body, picked.instance_id, payload))
        if profile is not None:
            profile.enable()
        t5 = clock()
        batch = decode_batch(payload)
        for event in batch.events:
            state.index.apply(picked.instance_id, event)
        t6 = clock()
        if profile is not None:
            profile.disable()
        for step, seconds in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5), strict=True):
            spent[step] += seconds
    tokenizer.close()
    if args.record is not None:
        args.record.write_bytes(msgspec.msgpack.encode(trace))
    return {step: seconds / len(reqs) for step, seconds in spent.items()}, hits / queries


def replay(args: argparse.Namespace, model_dir: Path, trace: Path, null: bool) -> int:
    """The kv steps of a recorded pass (none of them with `null`); the requests replayed."""
    gc.disable()  # (its passes fall where allocations cross a threshold: counts would move)
    recorded = msgspec.msgpack.decode(trace.read_bytes(), type=list[tuple[bytes, int, bytes]])
    write_model_files(model_dir, context_length=1 << 16, hidden_size=64, kv_block_size=16)
    tokenizer = PromptTokenizer.load(
        model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
    )
    router = KvRouter()
    state = KvSet(KvIndex(args.block_size), tokenizer, "")
    ws = Set("set", tuple(Target(i + 1) for i in range(args.workers)))
    router.tracker.sets[ws.id] = state  # type: ignore[index]
    steps = STEPS[: args.upto + 1] if args.upto is not None else STEPS
    for body, instance_id, payload in recorded:
        if null:
            continue
        fields = decode_fields(body, with_prompt=True)
        if "prompt" in steps:
            prompt = KvPrompt.of(fields)
        if "prepare" in steps:
            prompt.prepare(tokenizer, (args.block_size,), router.max_blocks)
        if "pick" in steps:
            assert router.pick(ws, prompt) is not None, prompt.failure  # type: ignore[arg-type]
        if "events" in steps:
            for event in decode_batch(payload).events:
                state.index.apply(instance_id, event)
    tokenizer.close()
    return len(recorded)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = 0
    if "--profile" in argv:
        at = argv.index("--profile")
        top = int(argv[at + 1])
        del argv[at : at + 2]
    repeat = 5
    if "--repeat" in argv:
        at = argv.index("--repeat")
        repeat = int(argv[at + 1])
        del argv[at : at + 2]
    flags = {}
    for flag in ("--record", "--replay"):
        if flag in argv:
            at = argv.index(flag)
            flags[flag] = Path(argv[at + 1])
            del argv[at : at + 2]
    upto = None
    if "--upto" in argv:  # replay the steps up to this one only
        at = argv.index("--upto")
        upto = STEPS.index(argv[at + 1])
        del argv[at : at + 2]
    null = "--null" in argv
    if null:
        argv.remove("--null")
    args: Any = parse_args(argv)
    args.record = flags.get("--record")
    args.upto = upto
    if "--replay" in flags:
        with tempfile.TemporaryDirectory(prefix="shoal-kv-path-") as tmp:
            n = replay(args, Path(tmp), flags["--replay"], null)
        print(f"{n} requests replayed{' (null)' if null else ''}")
        return 0
    if args.record is not None:
        repeat = 1
    profile = cProfile.Profile() if top else None
    passes = []
    for i in range(1 if top else repeat):
        with tempfile.TemporaryDirectory(prefix="shoal-kv-path-") as tmp:
            passes.append(run(args, Path(tmp) / str(i), profile))
    print(f"{len(requests(args))} requests; hit rate (simulated workers) {passes[0][1]:.1%}")
    print(f"CPU us per request, the least of {len(passes)} passes:")
    for step in STEPS:
        print(f"  {step:8} {min(p[0][step] for p in passes) * 1e6:8.1f}")
    print(f"  {'total':8} {min(sum(p[0].values()) for p in passes) * 1e6:8.1f}")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
