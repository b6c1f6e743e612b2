"""`shoal worker`: serve one model on one endpoint, announced in the discovery store.

On start it prints one line to stdout, which scripts and tests parse:

    shoal worker ready: model=NAME url=http://HOST:PORT status=http://HOST:PORT instance=HEX

SIGTERM (or Ctrl-C) drains: models are tainted `draining`, in-flight requests finish (up to
`--drain-timeout`), models are withdrawn and the lease revoked (store calls within a 2 s
budget); then it exits 0. A second signal cuts the requests still in flight but not the
withdrawal. Start-up errors are one `shoal worker: ...` line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

from shoal.cli.common import (
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    SECONDS,
    SECONDS_OR_ZERO,
    add_flag,
    print_ready,
    run_event_loop,
)
from shoal.kv import WIRE_FORMATS, check_zmq_endpoint
from shoal.store import StoreUnavailableError, default_store_url
from shoal.worker.engine import Engine
from shoal.worker.engines import ENGINES, engine_class
from shoal.worker.metadata import MAX_METADATA_FILE

if TYPE_CHECKING:
    from shoal.worker.endpoint import Endpoint

log = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "worker",
        help="serve a model on this machine",
        description="Serve a model over the OpenAI API and announce it in discovery. "
        "Every flag falls back to the environment variable SHOAL_<FLAG>.",
    )
    flag = partial(add_flag, p)
    flag("--model", help="the model name to announce (SHOAL_MODEL)")
    flag("--engine", "mocker", choices=sorted(ENGINES), help="engine (default: mocker)")
    flag("--namespace", "default", help="discovery namespace (default: default)")
    flag("--component", "backend", help="component (default: backend)")
    flag("--endpoint", "generate", help="endpoint (default: generate)")
    flag("--store", None, help="store URL (default: SHOAL_STORE, else the local SQLite file)")
    flag("--host", "127.0.0.1", help="address to serve on (default: 127.0.0.1)")
    flag("--port", "0", type=PORT, help="request port (default: 0, a free port)")
    flag("--status-port", "0", type=PORT, help="status server port (default: 0, a free port)")
    flag("--lease-ttl", "10", type=SECONDS, help="seconds the lease outlives a silent worker")
    flag(
        "--drain-timeout",
        "30",
        type=SECONDS_OR_ZERO,
        help="seconds to let requests finish on SIGTERM",
    )
    flag(
        "--role",
        "aggregated",
        choices=("aggregated", "prefill", "decode"),
        help="mocker and openai engines: the stage this worker serves in disaggregated "
        "serving (prefill, decode), or whole requests (aggregated, the default)",
    )
    flag("--admin-token", None, help="Bearer token required to load/unload adapters")
    flag("--upstream", None, help="openai engine: URL of the OpenAI-compatible server")
    flag("--upstream-api-key", None, help="openai engine: API key the upstream requires")
    flag(
        "--max-body",
        None,
        type=POSITIVE,
        help="openai engine: largest request body forwarded, in bytes (default 16 MiB, "
        "the frontend's default)",
    )
    flag("--model-path", None, help="llamacpp engine: path of the GGUF file")
    flag(
        "--kv-events-endpoint",
        None,
        type=check_zmq_endpoint,
        help="openai engine: the fronted vLLM's KV events PUB socket (tcp://host:port)",
    )
    flag(
        "--kv-replay-endpoint",
        None,
        type=check_zmq_endpoint,
        help="openai engine: the fronted vLLM's replay socket (tcp://host:port)",
    )
    mocker = partial(add_flag, p.add_argument_group("mocker engine"))
    mocker("--ttft-ms", "50", type=NON_NEGATIVE, help="time to first token")
    mocker("--itl-ms", "10", type=NON_NEGATIVE, help="inter-token latency")
    mocker("--max-seqs", "256", type=POSITIVE, help="concurrent sequences (excess requests queue)")
    mocker("--block-size", "16", type=POSITIVE, help="KV block tokens")
    mocker("--kv-blocks", "16384", type=POSITIVE, help="simulated KV cache blocks")
    mocker("--context-length", "8192", type=POSITIVE, help="the model's context, in tokens")
    mocker(
        "--speedup", "1", type=NON_NEGATIVE, help="divide all latencies by this; 0 answers at once"
    )
    mocker(
        "--prefill-us-per-token",
        "0",
        type=NON_NEGATIVE,
        help="prefill time per uncached prompt token, prefills one at a time (0: use --ttft-ms)",
    )
    mocker(
        "--chat-template",
        None,
        help="mocker engine: publish the chat template in this file instead of the mocker's "
        "own (the mocker still renders chats its own way): to see what a frontend does with "
        "a worker's template",
    )
    mocker(
        "--die-after-tokens",
        None,
        type=POSITIVE,
        help="a test hook: the process kills itself (SIGKILL) once a response has streamed "
        "this many tokens; unset: off",
    )
    mocker(
        "--stream-interval",
        "1",
        type=POSITIVE,
        help="tokens per streamed chunk (as vLLM's and SGLang's --stream-interval)",
    )
    mocker(
        "--prefill-stalls-decode",
        action="store_true",
        help="with --prefill-us-per-token: a prefill stalls the worker's decode steps for its "
        "duration (prefill and decode sharing one GPU)",
    )
    mocker(
        "--kv-transfer-us-per-block",
        "0",
        type=NON_NEGATIVE,
        help="decode role: simulated time to fetch each KV block from the prefill mocker",
    )
    mocker(
        "--kv-events-port",
        None,
        type=PORT,
        help="mocker and llamacpp engines: publish KV cache events (vLLM's format) on this "
        "port; 0: a free port; unset: off",
    )
    mocker(
        "--kv-events-format",
        "array",
        choices=WIRE_FORMATS,
        help="mocker and llamacpp engines: how KV events are encoded: array (vLLM's tagged "
        "arrays, what shoal's frontend and relay read; the default) or map (tagged maps, as "
        "vLLM 0.28 on publishes them and vllm-router's kv_aware reads them)",
    )


def read_text(path: str, flag: str, limit: int = MAX_METADATA_FILE) -> str:
    """The text of the regular file at `path`, of at most `limit` bytes; SystemExit naming
    `flag` and the file otherwise (a device such as /dev/zero, a FIFO, a larger file: read
    whole, /dev/zero took the worker to 1.7 GB)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO with no writer: no wait)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SystemExit(f"shoal worker: {flag} {path}: not a regular file")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise SystemExit(f"shoal worker: {flag} {path}: larger than {limit:,} bytes")
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"shoal worker: {flag} {path}: cannot read: {exc}") from None


def make_engine(args: argparse.Namespace) -> Engine:
    """The engine the flags ask for; raises SystemExit with a message when flags are missing."""
    cls: Any = engine_class(args.engine)
    if args.engine == "mocker":
        if not args.model:
            raise SystemExit("shoal worker: --model is required for the mocker engine")
        engine: Engine = cls(
            args.model,
            ttft_ms=args.ttft_ms,
            itl_ms=args.itl_ms,
            max_seqs=args.max_seqs,
            block_size=args.block_size,
            kv_blocks=args.kv_blocks,
            context_length=args.context_length,
            speedup=args.speedup,
            prefill_us_per_token=args.prefill_us_per_token,
            kv_events_port=args.kv_events_port,
            kv_events_host=args.host,
            kv_events_format=args.kv_events_format,
            chat_template=None
            if args.chat_template is None
            else read_text(args.chat_template, "--chat-template"),
            die_after_tokens=args.die_after_tokens,
            role=args.role,
            kv_transfer_us_per_block=args.kv_transfer_us_per_block,
            prefill_stalls_decode=args.prefill_stalls_decode,
            stream_interval=args.stream_interval,
        )
    elif args.engine == "openai":
        if not args.upstream:
            raise SystemExit("shoal worker: --upstream is required for the openai engine")
        engine = cls(
            args.upstream,
            model=args.model,
            api_key=args.upstream_api_key,
            kv_events_endpoint=args.kv_events_endpoint,
            kv_replay_endpoint=args.kv_replay_endpoint,
            role=args.role,
            **({} if args.max_body is None else {"max_body": args.max_body}),
        )
    else:
        if args.role != "aggregated":
            raise SystemExit("shoal worker: --role is for the mocker and openai engines")
        # Without --model-path, the SmolLM2-135M GGUF shipped in the llamacpp extra is served.
        engine = cls(
            args.model_path,
            name=args.model,
            kv_events_port=args.kv_events_port,
            kv_events_host=args.host,
            kv_events_format=args.kv_events_format,
        )
    return engine


async def serve(args: argparse.Namespace) -> int:
    """Start, print the ready line, serve until SIGTERM, SIGINT or SIGHUP, drain. A signal during
    start-up stops it there: no ready line, exit 0."""
    from shoal.worker.runtime import Runtime

    try:
        engine = make_engine(args)
        runtime = Runtime(
            args.store or default_store_url(),
            lease_ttl=args.lease_ttl,
            host=args.host,
            status_port=args.status_port,
            admin_token=args.admin_token,
            drain_timeout=args.drain_timeout,
            freeze_collector=True,  # (the process is the worker's own)
        )
    except ValueError as exc:
        return _fail(exc, 2)
    runtime.install_signal_handlers()  # a SIGTERM from now on stops, even before ready
    try:
        if not await runtime.unless_stopped(runtime.start()):
            await runtime.drain(timeout=0)  # whatever the start got to
            return 0
    except (StoreUnavailableError, OSError) as exc:  # a busy --status-port is an OSError
        return _fail(exc, 1)
    except ValueError as exc:  # a store URL with no or an unknown scheme
        return _fail(exc, 2)
    try:
        endpoint = runtime.endpoint(f"{args.namespace}.{args.component}.{args.endpoint}")
        serving = endpoint.serve(engine, host=args.host, port=args.port, model=args.model)
        started = await runtime.unless_stopped(serving)
    except BaseException as exc:
        await runtime.drain(timeout=0)
        if isinstance(exc, Exception):
            return _fail(f"cannot serve: {exc}", 1)
        raise
    if started:
        print_ready(
            "worker",
            model=await _models_named(endpoint),
            url=endpoint.url,
            status=runtime.status_url,
            instance=f"{runtime.instance_id:x}",
        )
    await runtime.run_until_stopped()
    if runtime.cleanup_cut_short:
        _exit_now(0)
    return 0


async def _models_named(endpoint: Endpoint) -> str:
    """The ready line's `model`: the base model, then the first adapters by name, up to
    `MODELS_SHOWN`, and how many more (a sidecar may announce 65,536)."""
    from shoal.worker.health import MODELS_SHOWN, first_by_name

    models = endpoint.models
    shown = await first_by_name(models, MODELS_SHOWN)
    names = ",".join(models[s].card.display_name for s in shown if s in models) or "-"
    more = len(models) - len(shown)
    return f"{names} (+{more} more)" if more > 0 else names


def _exit_now(code: int) -> None:
    """Exit without joining the thread of a store call the drain gave up on (a SQLite write
    blocked on a lock would hold the exit for its whole busy timeout). The drain is over; a
    write that never got its lock changed nothing."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(message: object, code: int) -> int:
    """Say what stopped the worker in one line on stderr; `code` to exit with."""
    print(f"shoal worker: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    return run_event_loop(serve(args))
