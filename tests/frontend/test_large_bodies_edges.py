"""Large bodies at their edges, on both event loops: judged as they arrive (pipelined,
chunked, at the meter's boundary, behind an ignored upgrade or `Expect`), a connection giving
the loop a turn, a large body's messages kept as JSON text and read as a small body's are,
and the dashboard's spaced reads and stop."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp
import msgspec
import pytest
from tokenizers import Tokenizer

from shoal.frontend.http import server
from shoal.frontend.http.request import GATHER_FROM, BodyPieces
from shoal.frontend.kv.prompt import PromptTokenizer
from shoal.frontend.kv.router import KvPrompt
from shoal.frontend.proxy import fields
from shoal.worker.engines.mocker.tokenizer import CHAT_TEMPLATE, TOKENIZER
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import count_responses, raw_exchange
from tests.frontend.test_fleet_reports import FIRST_ID, card, join
from tests.frontend.test_proxy import ready
from tests.frontend.test_server import post
from tests.helpers import errors_logged, wait_for

# Every probe on both loops (`shoal frontend` runs on uvloop, which reads a socket up to 32
# times in one go).
BOTH_LOOPS = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])


DEEP = '{"a":' * 80 + "1" + "}" * 80


def chunked(body: bytes, size: int = 5000) -> bytes:
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
        + b"0\r\n\r\n"
    )


def chat(n: int) -> list[dict[str, str]]:
    text = 'a "quoted" \\ [x] {y} words to fill the turn ' * 3
    return [{"role": "user", "content": f"{i}: {text}"} for i in range(n)]


def large_body(*, deep: bool = False, size: int = server.METER_FROM + 50_000) -> bytes:
    messages = json.dumps(chat(size // 150))
    meta = DEEP if deep else '{"a":1}'
    body = f'{{"model":"mock-llm","max_tokens":2,"metadata":{meta},"messages":{messages}}}'
    return body.encode()


def statuses(received: bytes) -> list[int]:
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", received)]


# -- 1/2: the meter on the connection ---------------------------------------------------------


@BOTH_LOOPS
async def test_pipelined_large_bodies_deep_and_not_chunked_or_not_are_each_judged_alone(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, router="prefix")
    ok = large_body()
    deep = large_body(deep=True)
    assert len(ok) > server.METER_FROM and len(deep) > server.METER_FROM
    data = post(deep) + post(ok) + chunked(deep) + chunked(ok) + post(b'{"model":"mock-llm"}')
    received = await raw_exchange(frontend.port, data, responses=5, timeout=20)
    assert statuses(received) == [400, 200, 400, 200, 200]
    assert worker.bodies[:2] == [ok, ok]


@BOTH_LOOPS
async def test_a_body_of_one_byte_chunks_is_gathered_judged_and_forwarded_whole(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """Each chunk of a body is a piece: 10 MB of 1-byte chunks were 10 million objects (900
    MB) joined in one go (a second of the loop). Small pieces are gathered as they come."""
    worker = await start_worker()
    frontend = await ready(start_frontend, worker)
    ok, deep = large_body(), large_body(deep=True)
    data = chunked(ok, size=1) + chunked(deep, size=1)
    received = await raw_exchange(frontend.port, data, responses=2, timeout=30)
    assert statuses(received)[:2] == [200, 400]
    assert worker.bodies[0] == ok


def test_small_pieces_of_a_body_are_gathered_in_order_among_large_ones() -> None:
    body = BodyPieces()
    for i in range(200_000):
        body.add(b"%d" % (i % 10))
        if i % 50_000 == 0:
            body.add(b"L" * 4096)
    assert len(body.pieces) < GATHER_FROM + 20  # (the first pieces as they came)
    expected = b"".join(b"%d" % (i % 10) + (b"L" * 4096 if i % 50_000 == 0 else b"")
                        for i in range(200_000))  # fmt: skip
    assert body.joined() == expected


@pytest.mark.parametrize("extra", [0, 1])
@BOTH_LOOPS
async def test_a_body_ending_at_the_meter_boundary_nested_too_deep_at_its_end_is_400(
    start_worker: StartWorker, start_frontend: StartFrontend, extra: int
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker)
    head = b'{"model":"mock-llm","pad":"'
    tail = b'","deep":' + ("[" * 65 + "]" * 65).encode() + b"}"
    body = head + b"x" * (server.METER_FROM + extra - len(head) - len(tail)) + tail
    assert len(body) == server.METER_FROM + extra
    received = await raw_exchange(frontend.port, post(body), timeout=10)
    assert statuses(received) == [400]
    assert worker.requests == 0


@pytest.mark.parametrize("deep", [True, False])
@BOTH_LOOPS
async def test_an_ignored_h2c_upgrade_with_a_large_body_is_judged_once_and_forwarded_whole(
    start_worker: StartWorker, start_frontend: StartFrontend, deep: bool
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, router="prefix")
    body = large_body(deep=deep)
    upgrade = post(
        body,
        "Connection: Upgrade, HTTP2-Settings",
        "Upgrade: h2c",
        "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
    )
    live = b"GET /live HTTP/1.1\r\nHost: t\r\n\r\n"
    received = await raw_exchange(
        frontend.port, upgrade + post(large_body()) + live, responses=3, timeout=20
    )
    assert statuses(received) == [400 if deep else 200, 200, 200]
    assert worker.bodies == ([] if deep else [body]) + [large_body()]


@BOTH_LOOPS
async def test_many_pipelined_large_bodies_from_a_client_that_reads_late_are_all_answered(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """Turns given, the pipeline full, the client's buffer full: no reason left standing."""
    worker = await start_worker()
    frontend = await ready(start_frontend, worker)
    body = large_body(size=server.TURN_BYTES + 1000)
    count = server.MAX_PIPELINED + 8
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        for _ in range(count):
            writer.write(post(body))
        await writer.drain()
        received = b""
        async with asyncio.timeout(60):
            while count_responses(received) < count:
                chunk = await reader.read(1 << 16)
                assert chunk, "closed"
                received += chunk
    finally:
        writer.close()
    assert statuses(received) == [200] * count
    assert worker.requests == count


@BOTH_LOOPS
async def test_a_large_body_over_max_body_gets_its_413_after_turns_given(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, max_body=server.TURN_BYTES + 10_000)
    body = b'{"model":"mock-llm","pad":"' + b"x" * (4 * server.TURN_BYTES) + b'"}'
    data = chunked(body, 1 << 16)  # (no length up front: refused as it is read)
    received = await raw_exchange(frontend.port, data, timeout=10)
    assert statuses(received) == [413]


# -- 3: a large body's messages -------------------------------------------------------------

ODD = [
    "just a string",
    42,
    None,
    [["nested", ["array"]]],
    {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}, 3]},
    {"role": "user", "content": None},
    {"role": "user", "content": {"weird": [1]}},
    {"content": 7},
    "y" * 100_000,  # a huge message that is not an object
    {"role": "user", "content": [{"type": "text", "text": "z" * 100_000}]},  # huge, parts
]


@pytest.mark.parametrize("router", ["prefix", "kv"])
@pytest.mark.parametrize("large", [False, True])
@BOTH_LOOPS
async def test_odd_messages_are_forwarded_large_body_or_small(
    start_worker: StartWorker, start_frontend: StartFrontend, router: str, large: bool
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker, router=router)
    messages: list[Any] = [*ODD, *chat(3000 if large else 1)]
    body = json.dumps({"model": "mock-llm", "max_tokens": 2, "messages": messages}).encode()
    assert (len(body) >= fields.RAW_MESSAGES_FROM) is large
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            response = await session.post(f"{frontend.url}/v1/chat/completions", data=body)
            assert response.status == 200, await response.text()
    assert worker.bodies == [body, body]


def system_prompt() -> dict[str, str]:
    """A shared system prompt longer than `LARGE_MESSAGE` bytes of JSON (a RAG document)."""
    return {"role": "system", "content": "You answer from this document.\n" + "lorem ipsum " * 8000}


def test_a_chat_hints_the_same_prefix_whether_its_body_is_small_or_large() -> None:
    """A conversation with a long system prompt: turn 1's body is small, a later turn's is
    past `RAW_MESSAGES_FROM`. The routing prefix (the first 8192 characters: all from the
    system prompt) must not change when the body crosses the threshold."""
    first = [system_prompt(), {"role": "user", "content": "question 1"}]
    later = [
        *first,
        {"role": "assistant", "content": "answer " * 30_000},
        {"role": "user", "content": "q2"},
    ]
    small = json.dumps({"model": "m", "messages": first}).encode()
    large = json.dumps({"model": "m", "messages": later}).encode()
    assert len(small) < fields.RAW_MESSAGES_FROM <= len(large)
    hint_small = fields.prompt_text(fields.decode_fields(small, with_prompt=True))
    hint_large = fields.prompt_text(fields.decode_fields(large, with_prompt=True))
    assert hint_small.startswith("system:You answer")
    assert hint_large[:1024] == hint_small[:1024], (hint_small[:60], hint_large[:60])


def test_the_kv_fallback_prefix_is_the_same_whether_the_body_is_small_or_large() -> None:
    first = [system_prompt(), {"role": "user", "content": "question 1"}]
    later = [*first, {"role": "assistant", "content": "answer " * 30_000}]
    small = fields.decode_fields(
        json.dumps({"model": "m", "messages": first}).encode(), with_prompt=True
    )
    large = fields.decode_fields(
        json.dumps({"model": "m", "messages": later}).encode(), with_prompt=True
    )
    assert str(KvPrompt.of(large))[:1024] == str(KvPrompt.of(small))[:1024]


@BOTH_LOOPS
async def test_a_conversation_keeps_its_instance_when_its_body_grows_past_the_threshold(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """End to end with the prefix router: turn 1 (small body) and turn 2 (large body) of the
    same conversation go to the same instance (its KV cache holds the system prompt)."""
    a, b = await start_worker(), await start_worker()
    frontend = await ready(start_frontend, a, b, router="prefix")
    first = [system_prompt(), {"role": "user", "content": "question 1"}]
    later = [
        *first,
        {"role": "assistant", "content": "answer " * 30_000},
        {"role": "user", "content": "q2"},
    ]
    async with aiohttp.ClientSession() as session:
        for messages in (first, later):
            body = json.dumps({"model": "mock-llm", "max_tokens": 2, "messages": messages}).encode()
            response = await session.post(f"{frontend.url}/v1/chat/completions", data=body)
            assert response.status == 200
    assert sorted([a.requests, b.requests]) == [0, 2], (a.requests, b.requests)


@pytest.mark.parametrize("inline", [True, False])
def test_raw_messages_render_as_the_decoded_ones(inline: bool) -> None:
    def tokenizer() -> PromptTokenizer:
        return PromptTokenizer(
            Tokenizer.from_str(TOKENIZER.to_str()), {"chat_template": CHAT_TEMPLATE}
        )

    chat_ = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}],
        },
        {"role": "user", "content": None},
    ]
    raw = [msgspec.Raw(msgspec.json.encode(m)) for m in chat_]
    assert tokenizer().chat_hashes(raw, [16], 64, inline=inline) == tokenizer().chat_hashes(
        chat_, [16], 64, inline=inline
    )


# -- 4: the dashboard -----------------------------------------------------------------------


@BOTH_LOOPS
async def test_a_snapshot_waiting_out_the_spacing_is_answered_503_at_close(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(reconcile_interval=3600, drain_timeout=3.0)
    join(frontend, FIRST_ID, card("m"))
    dash = frontend.dashboard
    await dash.read()
    dash._next_read = time.monotonic() + 30  # spaced: a changed registry waits
    join(frontend, FIRST_ID + 1, card("m"))
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(b"GET /ui/api/snapshot HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        await wait_for(lambda: dash._tasks, 5, message="the snapshot waits")
        started = time.monotonic()
        await dash.close()
        answer = await asyncio.wait_for(reader.read(65536), 2)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:80]
    assert time.monotonic() - started < 1.5


@BOTH_LOOPS
async def test_a_page_opened_after_the_dashboard_stopped_is_refused_503(
    start_frontend: StartFrontend,
) -> None:
    """`close()` ends every event stream so the drain need not wait for them; a page that
    (re)connects on a kept-alive connection during the drain is sent to another replica
    (before: a stream nobody ended, which the drain waited `drain_timeout` for)."""
    frontend = await start_frontend(reconcile_interval=3600, drain_timeout=3.0)
    join(frontend, FIRST_ID, card("m"))
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        writer.write(b"GET /live HTTP/1.1\r\nhost: x\r\n\r\n")  # a kept-alive connection
        await writer.drain()
        await reader.read(65536)
        await frontend.dashboard.close()
        writer.write(b"GET /ui/api/events HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
    assert b"stopping" in answer
    assert not frontend.dashboard.streams


@BOTH_LOOPS
async def test_head_snapshot_while_reads_are_spaced(start_frontend: StartFrontend) -> None:
    frontend = await start_frontend(reconcile_interval=3600)
    join(frontend, FIRST_ID, card("m"))
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            frontend.dashboard._next_read = time.monotonic() + 0.2
            response = await session.head(f"{frontend.url}/ui/api/snapshot")
            assert response.status == 200
            assert await response.read() == b""


@BOTH_LOOPS
async def test_expect_continue_then_a_large_deep_body_then_a_large_good_one(
    start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker)
    deep, ok = large_body(deep=True), large_body()
    reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
    try:
        head, _, _ = post(deep, "Expect: 100-continue").partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(deep + post(ok))
        received = b""
        async with asyncio.timeout(20):
            while count_responses(received) < 2:
                received += await reader.read(1 << 16)
    finally:
        writer.close()
    assert statuses(received) == [400, 200]
    assert worker.bodies == [ok]


@BOTH_LOOPS
async def test_a_client_gone_while_its_connection_gives_way_leaves_the_server_well(
    start_worker: StartWorker, start_frontend: StartFrontend, caplog: pytest.LogCaptureFixture
) -> None:
    worker = await start_worker()
    frontend = await ready(start_frontend, worker)
    body = large_body(size=3 * server.TURN_BYTES)
    for _ in range(5):
        _, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
        writer.write(post(body)[: 2 * server.TURN_BYTES + 17])
        await writer.drain()
        writer.transport.abort()
    await wait_for(lambda: not frontend.server.connections, 5, message="connections gone")  # type: ignore[union-attr]
    received = await raw_exchange(frontend.port, post(large_body()), timeout=10)
    assert statuses(received) == [200]
    assert not errors_logged(caplog.records)
