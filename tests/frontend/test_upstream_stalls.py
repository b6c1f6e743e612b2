"""Upstreams that stall part-way: in the response head, or between body bytes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import aiohttp
import pytest

from shoal.cli.frontend import config_from_args
from shoal.cli.main import build_parser
from shoal.frontend import Frontend
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.raw_upstream import RawUpstream, StartRaw, start_raw, until_closed
from tests.frontend.support import serving
from tests.helpers import wait_for

__all__ = ["start_raw"]  # the fixture

BODY = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}


async def half_a_head(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
    await until_closed(reader)


async def one_event_then_silence(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    event = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"\r\n%x\r\n%s\r\n" % (len(event), event)
    )
    await until_closed(reader)


async def part_of_a_body_then_silence(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"
    )
    await until_closed(reader)


async def started(start_frontend: StartFrontend, *workers: object, **settings: object) -> Frontend:
    frontend = await start_frontend(**settings)
    await wait_for(lambda: serving(frontend, "mock-llm", len(workers)), message="model served")
    return frontend


async def test_a_head_cut_short_is_timed_out_like_no_head_at_all(
    start_raw: StartRaw, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    stalled = await start_raw(half_a_head)
    frontend = await started(start_frontend, stalled, first_byte_timeout=0.5)
    loop = asyncio.get_running_loop()
    began = loop.time()
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        response = await session.post(f"{frontend.url}/v1/chat/completions", json=BODY)
        assert response.status == 504
        assert (await response.json())["error"]["code"] == "upstream_timeout"
    assert loop.time() - began < 5


async def test_a_head_cut_short_without_a_first_byte_timeout_is_bounded_by_the_idle_timeout(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """`--first-byte-timeout 0` lets an instance think as long as it likes before it answers;
    once its answer began, a pause in it is the idle timeout's (the request hung for good)."""
    stalled = await start_raw(half_a_head)
    frontend = await started(
        start_frontend, stalled, first_byte_timeout=0, upstream_idle_timeout=0.5
    )
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        response = await session.post(f"{frontend.url}/v1/chat/completions", json=BODY)
        assert response.status == 504
        error = (await response.json())["error"]
    assert error["code"] == "upstream_timeout" and "sent nothing for 0.5s" in error["message"]


async def test_a_head_cut_short_is_retried_on_another_instance(
    start_raw: StartRaw, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    stalled = await start_raw(half_a_head)
    good = await start_worker()
    frontend = await started(
        start_frontend, stalled, good, first_byte_timeout=0.5, inhibit_seconds=60
    )
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        for _ in range(2):
            response = await session.post(f"{frontend.url}/v1/chat/completions", json=BODY)
            assert response.status == 200
            assert response.headers["x-shoal-instance"] == f"{good.instance_id:x}"
    assert stalled.requests == 1


@pytest.mark.parametrize("first_byte_timeout", [60.0, 0.3])  # the head re-arms, or not
async def test_a_stream_silent_past_the_idle_timeout_ends_with_the_sse_error_event(
    start_raw: StartRaw, start_frontend: StartFrontend, first_byte_timeout: float
) -> None:
    stalled = await start_raw(one_event_then_silence)
    frontend = await started(
        start_frontend,
        stalled,
        first_byte_timeout=first_byte_timeout,
        upstream_idle_timeout=0.5,
    )
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        response = await session.post(
            f"{frontend.url}/v1/chat/completions", json={**BODY, "stream": True}
        )
        assert response.status == 200
        received = await response.read()  # ends: the gateway closed the stream
    first, error = received.split(b"\n\n")[:2]
    assert first.startswith(b"data: ") and b'"content":"a"' in first
    assert error.startswith(b"data: ")
    assert b'"upstream_error"' in error and b"0.5s" in error
    await wait_for(lambda: stalled.open_connections == 0, message="upstream connection dropped")


async def test_a_body_silent_past_the_idle_timeout_closes_the_client_connection(
    start_raw: StartRaw, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    stalled = await start_raw(part_of_a_body_then_silence)
    frontend = await started(start_frontend, stalled, upstream_idle_timeout=0.5)
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        response = await session.post(f"{frontend.url}/v1/chat/completions", json=BODY)
        assert response.status == 200
        try:
            await response.read()
        except aiohttp.ClientPayloadError:
            pass  # the body was cut short: only closing the connection can say so
        else:
            raise AssertionError("a body shorter than its content-length was accepted")
    await wait_for(lambda: stalled.open_connections == 0, message="upstream connection dropped")


def test_upstream_idle_timeout_comes_from_the_flag_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SHOAL_UPSTREAM_IDLE_TIMEOUT", raising=False)
    parse = build_parser().parse_args
    assert config_from_args(parse(["frontend"])).upstream_idle_timeout == 60.0
    flag = ["frontend", "--upstream-idle-timeout", "2.5"]
    assert config_from_args(parse(flag)).upstream_idle_timeout == 2.5
    monkeypatch.setenv("SHOAL_UPSTREAM_IDLE_TIMEOUT", "0")
    parse = build_parser().parse_args  # (defaults are read when the parser is built)
    assert config_from_args(parse(["frontend"])).upstream_idle_timeout == 0.0


def test_a_negative_upstream_idle_timeout_is_a_one_line_flag_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["frontend", "--upstream-idle-timeout", "-1"])
    assert "--upstream-idle-timeout" in capsys.readouterr().err


async def crash_on_request(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.transport.abort()  # as a worker that dies of this request would


async def test_a_request_that_kills_workers_spends_the_retry_budget(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    crashers = [await start_raw(crash_on_request) for _ in range(4)]
    frontend = await started(start_frontend, *crashers, retries=1)
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        response = await session.post(f"{frontend.url}/v1/chat/completions", json=BODY)
        assert response.status == 502
    # Lost after the request was sent: not free like a refused connect, so one request
    # cannot take down the whole fleet one instance after another.
    assert sum(c.requests for c in crashers) == 2


async def a_head_then_death(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    await writer.drain()
    writer.transport.abort()  # the worker died before its first token


async def test_a_worker_dying_between_its_head_and_its_first_token_is_retried_elsewhere(
    start_raw: StartRaw, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    dying = await start_raw(a_head_then_death)
    good = await start_worker()
    frontend = await started(start_frontend, dying, good, inhibit_seconds=60)
    stream = {**BODY, "stream": True}
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        for _ in range(4):
            response = await session.post(f"{frontend.url}/v1/chat/completions", json=stream)
            assert response.status == 200
            assert response.headers["x-shoal-instance"] == f"{good.instance_id:x}"
            body = await response.read()
            assert b"data: [DONE]" in body and b"error" not in body
    assert dying.requests == 1  # tried once, then inhibited


async def test_a_stuck_instance_is_left_at_the_first_byte_timeout_within_one_sweep(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    # The timeout is swept, not timed per request (deadlines.py): never early, and late by
    # at most one sweep (a tenth of the timeout here), plus this machine's scheduling.
    stalled = await start_raw(half_a_head)
    frontend = await started(start_frontend, stalled, first_byte_timeout=1.0)
    assert frontend.proxy.deadlines is not None and frontend.proxy.deadlines.every == 0.1
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        began = loop.time()
        response = await session.post(f"{frontend.url}/v1/chat/completions", json=BODY)
        waited = loop.time() - began
        assert response.status == 504
    assert 1.0 <= waited < 1.0 + 0.1 + 0.4, waited


async def test_a_silent_stream_is_ended_at_the_idle_timeout_within_two_sweeps(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    # A packet's arrival is dated by the next sweep: late by at most two sweeps, never early.
    stalled = await start_raw(one_event_then_silence)
    frontend = await started(start_frontend, stalled, upstream_idle_timeout=1.0)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        response = await session.post(
            f"{frontend.url}/v1/chat/completions", json={**BODY, "stream": True}
        )
        assert response.status == 200
        await response.content.readuntil(b"\n\n")  # the one event
        began = loop.time()
        rest = await response.read()
        waited = loop.time() - began
    assert b'"upstream_error"' in rest
    assert 0.95 <= waited < 1.0 + 2 * 0.1 + 0.4, waited


async def head_then_silence(
    request: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    )
    await until_closed(reader)


async def test_a_head_then_silence_on_the_last_attempt_is_504_upstream_timeout_naming_the_wait(
    start_raw: StartRaw, start_frontend: StartFrontend
) -> None:
    """The head is held until the first body byte, so nothing reached the client: a wait
    that timed out is a gateway timeout (504), not a failed instance (502)."""
    stalled = await start_raw(head_then_silence)
    frontend = await started(start_frontend, stalled, upstream_idle_timeout=0.5)
    async with aiohttp.ClientSession() as session, asyncio.timeout(10):
        response = await session.post(f"{frontend.url}/v1/chat/completions", json=BODY)
        assert response.status == 504, await response.text()
        error = (await response.json())["error"]
    assert error["code"] == "upstream_timeout"
    assert "sent nothing for 0.5s" in error["message"]
    assert "first-byte" not in error["message"]


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A loopback port whose connects never complete: a listener with a full accept queue
    that accepts nothing (Linux drops the SYNs), as a host that is down drops them."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield port
    finally:
        for sock in (*fillers, listener):
            sock.close()


class Unanswered(RawUpstream):
    """A worker whose announced request URL points at a port no connect completes on."""

    dead_port = 0

    @property
    def raw_port(self) -> int:
        return self.dead_port


async def test_an_instance_whose_connect_times_out_is_a_504_upstream_timeout(
    store: Store, start_frontend: StartFrontend
) -> None:
    """A connect that never completes (the host is down, a firewall drops the SYNs) is a
    wait that ran out, as at the first byte: 504, not 502 (the instance failed)."""
    with unanswered_port() as port:
        down = Unanswered(half_a_head)
        down.dead_port = port
        await down.start()
        await down.register(store)
        try:
            frontend = await started(start_frontend, down, connect_timeout=0.5)
            async with aiohttp.ClientSession() as session, asyncio.timeout(10):
                response = await session.post(f"{frontend.url}/v1/chat/completions", json=BODY)
                assert response.status == 504, await response.text()
                error = (await response.json())["error"]
            assert error["code"] == "upstream_timeout"
            assert "cannot connect" in error["message"] and "timed out" in error["message"]
        finally:
            await down.stop()
