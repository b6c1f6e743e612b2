"""`shoal worker` start-up: bad flags and busy ports get one clear line, never a traceback;
the status server's admin routes are never open to the network without a token."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from shoal.discovery import Discovery
from shoal.store import Store
from shoal.worker.engines.mocker import MockerEngine
from shoal.worker.runtime import Runtime
from tests.helpers import Server, free_port
from tests.processes import shoal
from tests.worker.conftest import StartWorker
from tests.worker.support import raw_request


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


async def run_worker(*args: str, timeout: float = 30) -> tuple[int, str, str]:
    proc = await shoal(
        "worker", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


BAD_STARTS = {
    "busy status port": (["--status-port", "{busy}"], "{busy}"),
    "store path without scheme": (["--store", "/x.db"], "/x.db"),
    "unknown store scheme": (["--store", "redis://x"], "redis://x"),
    "upstream not http": (["--engine", "openai", "--upstream", "ftp://x"], "ftp://x"),
    "no sequence slots": (["--max-seqs", "0"], "--max-seqs"),
    "nan drain timeout": (["--drain-timeout", "nan"], "--drain-timeout"),
    "port out of range": (["--port", "75276"], "--port"),
    "zero lease ttl": (["--lease-ttl", "0"], "lease"),
    "non-loopback host without admin token": (["--host", "0.0.0.0"], "--admin-token"),
}


@pytest.mark.parametrize("case", list(BAD_STARTS), ids=list(BAD_STARTS))
async def test_bad_start_up_prints_one_clear_line_and_exits_non_zero(
    case: str, busy_port: int, store_url: str
) -> None:
    flags, named = BAD_STARTS[case]
    args = [f.format(busy=busy_port) for f in flags]
    if "--store" not in args:
        args += ["--store", store_url]
    code, out, err = await run_worker("--model", "m", *args)
    assert code != 0, err
    assert "Traceback" not in err, err
    assert "shoal worker ready" not in out
    lines = [line for line in err.splitlines() if line.startswith("shoal worker:")]
    assert len(lines) == 1, err
    assert named.format(busy=busy_port) in lines[0], lines


async def test_status_server_on_a_network_address_with_a_token_starts(
    start_worker: StartWorker,
) -> None:
    worker = await start_worker("--host", "0.0.0.0", "--admin-token", "t0k")
    assert worker.instance_id > 0


async def test_non_utf8_authorization_is_a_401_in_openai_format(
    start_worker: StartWorker,
) -> None:
    worker = await start_worker("--admin-token", "s3cret")
    body = json.dumps({"name": "x", "path": "/x"}).encode()
    for value in (b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer s3cret\x80"):
        status, head, answer = await raw_request(
            worker.status_url,
            b"POST /v1/loras HTTP/1.1\r\nContent-Type: application/json\r\nAuthorization: " + value,
            body,
        )
        assert status == 401, (value, head, answer)
        assert json.loads(answer)["error"]["code"] == "invalid_api_key"


async def test_a_sidecar_stopped_during_start_up_never_prints_its_ready_line(
    store_url: str, store: Store, tmp_path: Path
) -> None:
    asked = asyncio.Event()
    release = asyncio.Event()

    async def models(request: web.Request) -> web.Response:
        asked.set()
        await release.wait()
        return web.json_response({"object": "list", "data": [{"id": "up", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    upstream = Server(app, port=free_port())
    await upstream.start()
    try:
        proc = await shoal(
            "worker", "--engine", "openai", "--upstream", upstream.url, "--store", store_url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await asyncio.wait_for(asked.wait(), 20)
        proc.send_signal(signal.SIGTERM)
        release.set()
        out, err = await asyncio.wait_for(proc.communicate(), 20)
    finally:
        release.set()
        await upstream.stop()
    assert "shoal worker ready" not in out.decode(), out
    assert "Traceback" not in err.decode(), err
    assert proc.returncode == 0
    assert await Discovery(store).list() == []


async def test_a_sidecar_sigtermed_during_its_first_probe_exits_at_once_and_cleanly(
    store_url: str,
) -> None:
    asked = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        asked.set()
        await asyncio.Event().wait()  # never answers
        raise AssertionError

    app = web.Application()
    app.router.add_get("/health", health)
    upstream = Server(app, port=free_port())
    await upstream.start()
    try:
        proc = await shoal(
            "worker", "--engine", "openai", "--upstream", upstream.url, "--store", store_url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        await asyncio.wait_for(asked.wait(), 20)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 20)
        took = time.monotonic() - signalled
    finally:
        await upstream.stop()
    assert proc.returncode == 0, err
    assert "Unclosed" not in err.decode() and "Traceback" not in err.decode(), err
    assert took < 1.5, f"exit took {took:.1f}s after SIGTERM"


async def test_a_mocker_whose_kv_events_port_is_busy_leaves_no_temp_dir(
    busy_port: int, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    engine = MockerEngine("m", kv_events_port=busy_port)
    async with Runtime(store_url) as runtime:
        with pytest.raises(Exception, match=str(busy_port)):
            await runtime.endpoint("default.backend.generate").serve(engine)
    assert not any(name.startswith("shoal-mocker-") for name in os.listdir(tmp_path))
