"""Workers that die, hang, fail or publish bad metadata, under load: no request that had not
started streaming fails, and no ghost stays routable after the lease TTL."""

from __future__ import annotations

import asyncio
import hashlib
import signal

import aiohttp
import openai

from shoal.cards import ModelCard
from shoal.discovery import EndpointId
from shoal.store import Store
from tests.faults.conftest import Fleet
from tests.faults.support import (
    LEASE_TTL,
    RECONCILE_INTERVAL,
    Load,
    Row,
    copy_card,
    instance_ids,
    register_card,
    routes_exactly,
    until,
)

COMMAND = "pytest tests/faults/test_worker_faults.py"


async def test_workers_killed_and_drained_under_load_fail_no_unstarted_request(
    fleet: Fleet, backend: str
) -> None:
    workers = [await fleet.worker() for _ in range(3)]
    front = await fleet.frontend()
    ids = {w.instance_id for w in workers}
    await until(lambda: routes_exactly(front.url, ids), 15, "all three workers routed")
    load = Load([front.url])
    load.start()
    try:
        await load.advance(30)
        killed, drained = workers[0], workers[1]
        killed.signal(signal.SIGKILL)
        drained.signal(signal.SIGTERM)
        survivors = {workers[2].instance_id}
        converge = await until(
            lambda: routes_exactly(front.url, survivors),
            LEASE_TTL + RECONCILE_INTERVAL + 3,
            "ghosts gone",
        )
        assert await drained.wait(20) == 0
        await load.advance(30)
    finally:
        await load.finish()
    ghosts = len(await instance_ids(front.url) - survivors)
    Row(
        "SIGKILL one worker and SIGTERM another of 3, under streaming and non-streaming load",
        backend, load.sent, len(load.failed_before_first_byte), len(load.failed_mid_stream),
        round(converge, 2), ghosts, COMMAND,
    ).record()  # fmt: skip
    assert load.failed_before_first_byte == []
    assert ghosts == 0


async def test_hung_and_failing_instances_cost_no_request(
    fleet: Fleet, store: Store, backend: str, namespace: str
) -> None:
    worker = await fleet.worker()
    front = await fleet.frontend()
    await until(lambda: routes_exactly(front.url, {worker.instance_id}), 15, "worker routed")
    hung = await asyncio.start_server(_never_answer, "127.0.0.1", 0)
    failing = await asyncio.start_server(_answer_500, "127.0.0.1", 0)
    hung_key, hung_lease = await copy_card(store, namespace, _url(hung))
    failing_key, failing_lease = await copy_card(store, namespace, _url(failing))
    expected = {worker.instance_id, hung_key.instance_id, failing_key.instance_id}
    await until(lambda: routes_exactly(front.url, expected), 15, "the bad instances joined")
    load = Load([front.url])
    load.start()
    try:
        await load.advance(100, timeout=30)
    finally:
        await load.finish()
        hung.close()
        failing.close()
        await hung_lease.revoke()
        await failing_lease.revoke()
    Row(
        "an instance that accepts and never answers, one that answers 500, one healthy",
        backend, load.sent, len(load.failed_before_first_byte), len(load.failed_mid_stream),
        0.0, 0, COMMAND,
    ).record()  # fmt: skip
    assert load.failed_before_first_byte == []
    assert load.failed_mid_stream == []


async def test_bad_or_slow_metadata_never_joins_and_blocks_no_other_model(
    fleet: Fleet, store: Store, backend: str, namespace: str
) -> None:
    front = await fleet.frontend()
    files = await asyncio.start_server(_metadata_files, "127.0.0.1", 0)
    endpoint = EndpointId(namespace, "backend", "generate")
    target = await asyncio.start_server(_answer_500, "127.0.0.1", 0)  # never reached
    bad_key, bad_lease = await register_card(
        store, endpoint, _card("mock-bad", f"{_url(files)}/wrong"), _url(target)
    )
    slow_key, slow_lease = await register_card(
        store, endpoint, _card("mock-slow", f"{_url(files)}/slow"), _url(target)
    )
    try:
        worker = await fleet.worker()  # joins while the slow download hangs
        converge = await until(
            lambda: routes_exactly(front.url, {worker.instance_id}), 15, "the healthy worker joined"
        )
        client = openai.AsyncOpenAI(base_url=f"{front.url}/v1", api_key="-", max_retries=0)
        reply = await client.chat.completions.create(
            model="mock-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.choices[0].message.content
        for model in ("mock-bad", "mock-slow"):
            try:
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                raise AssertionError(f"{model} was served")
            except openai.NotFoundError:
                pass
        await client.close()
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{front.url}/health") as response,
        ):
            health = await response.json()
        incomplete = {entry["key"]: entry for entry in health["incomplete"]}
        assert str(bad_key) in incomplete and str(slow_key) in incomplete
        assert "checksum" in (incomplete[str(bad_key)]["error"] or "")
    finally:
        files.close()
        target.close()
        await bad_lease.revoke()
        await slow_lease.revoke()
    Row(
        "a card whose metadata fails its checksum, one whose metadata never arrives",
        backend, 3, 0, 0, round(converge, 2), 0, COMMAND,
    ).record()  # fmt: skip


# -- misbehaving servers -------------------------------------------------------------------

CONFIG = b'{"model": "bad"}'


def _card(name: str, base: str) -> ModelCard:
    return ModelCard.build(
        display_name=name,
        slug=name,
        source=f"test/{name}",
        model_types=["chat"],
        context_length=4096,
        metadata_files={
            "config.json": {
                "url": f"{base}/config.json",
                "checksum": "sha256:" + hashlib.sha256(CONFIG).hexdigest(),
                "size": len(CONFIG),
            }
        },
    )


async def _never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accepts, reads everything, answers nothing."""
    while await reader.read(1 << 16):
        pass
    writer.close()


async def _answer_500(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers every request with a 500 (and keeps the connection)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            body = b'{"error": {"message": "injected", "type": "server_error"}}'
            writer.write(
                b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        writer.close()


async def _metadata_files(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """`/wrong/...` answers bytes that do not match the card; `/slow/...` never answers."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
        return
    if b" /slow/" in head.split(b"\r\n")[0]:
        while await reader.read(1 << 16):
            pass
    else:
        body = b'{"model": "BAD"}'  # same size, other bytes
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
    writer.close()


def _url(server: asyncio.Server) -> str:
    port = server.sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}"
