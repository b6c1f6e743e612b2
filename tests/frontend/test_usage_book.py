"""`UsageBook`: counts per row, keeps batches while the catalog is away, bounded."""

from __future__ import annotations

import asyncio
import json

import pytest

from shoal.discovery.grants import Grant
from shoal.frontend.keys.usage import OTHER_MODELS, UsageBook, status_class
from tests.helpers import free_port

GRANT = Grant(workspace="w", name="team", hash="a" * 64)


def key_number(n: int) -> Grant:
    return Grant(workspace="w", name=f"k{n}", hash="a" * 64)


async def test_a_catalog_that_cannot_be_reached_keeps_a_bounded_backlog() -> None:
    book = UsageBook(f"http://127.0.0.1:{free_port()}", max_rows=3, interval=3600)
    await book.start()
    try:
        book.record(GRANT, "chat", "chat", 200, 1, 3)
        book.record(GRANT, "chat", "chat", 200, 2, 5)  # the same row: added up
        book.record(GRANT, "chat", "chat", 503, 0, 0)
        assert sorted(book.rows.values()) == [[1, 0, 0], [2, 3, 8]]
        await book.flush()
        assert (len(book.pending), book.pending_rows, book.dropped_rows) == (1, 2, 0)
        assert book.describe()["last_error"]
        for model in ("a", "b"):
            book.record(GRANT, model, model, 200, 1, 1)
            await book.flush()  # each flush seals a batch, and fails again
        described = book.describe()
        assert (described["pending_batches"], described["pending_rows"]) == (2, 2)
        assert described["dropped_rows"] == 2  # over 3 rows: the oldest batch went first
        assert [batch["rows"][0]["model"] for batch in book.pending] == ["a", "b"]
    finally:
        await book.stop()


def test_status_classes_are_the_four_the_catalog_knows() -> None:
    assert [status_class(s) for s in (101, 200, 304, 429, 499, 503, 600)] == [
        "2xx", "2xx", "3xx", "4xx", "4xx", "5xx", "5xx",
    ]  # fmt: skip


async def test_an_answer_that_is_no_receipt_of_the_batch_keeps_it_waiting() -> None:
    """A `--catalog-url` that points elsewhere (a login page in front, another service)
    answers 200 too: only an answer naming the batch counts it as sent, else usage would be
    dropped in silence while `/health` said all was flushed."""
    from aiohttp import web

    from tests.helpers import Server

    answers = [web.Response(text="<html>sign in</html>", content_type="text/html"),
               web.json_response({"ok": True})]  # fmt: skip

    async def usage(request: web.Request) -> web.Response:
        body = await request.json()
        if answers:
            return answers.pop(0)
        return web.json_response({"batch_id": body["batch_id"], "counted": True, "rows": 1})

    app = web.Application()
    app.router.add_post("/v1/usage", usage)
    server = Server(app)
    await server.start()
    book = UsageBook(server.url, interval=3600)
    await book.start()
    try:
        book.record(GRANT, "chat", "chat", 200, 1, 1)
        for _ in range(2):
            await book.flush()
            assert len(book.pending) == 1
            assert "receipt" in book.describe()["last_error"]
        await book.flush()
        assert not book.pending and book.describe()["last_error"] is None
    finally:
        await book.stop()
        await server.stop()


async def test_the_catalog_urls_credentials_never_reach_health_or_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG")
    for url in (f"http://user:s3cret@127.0.0.1:{free_port()}", "http://user:s3cret@[::1:80"):
        book = UsageBook(url, interval=3600)
        await book.start()
        try:
            book.record(GRANT, "chat", "chat", 200, 1, 3)
            await book.flush()
            described = book.describe()
        finally:
            await book.stop()
        assert described["last_error"] and described["catalog"].startswith("http://***@")
        assert "s3cret" not in json.dumps(described) + caplog.text, described


async def test_sealing_100000_rows_never_holds_the_loop_20ms() -> None:
    """A flush seals every row counted since the last one (at most `max_rows`, 100,000):
    turning them all into batches in one go held the loop 0.13 s. Rows recorded while it
    seals count in the next batch, none lost."""
    from tests.helpers import StallProbe

    book = UsageBook(f"http://127.0.0.1:{free_port()}", interval=3600)
    await book.start()
    try:
        for n in range(100_000):  # (keys of their own: a key's rows are bounded)
            book.record(key_number(n), f"m{n}", f"m{n}", 200, 1, 1)
        probe = StallProbe()
        flushing = asyncio.ensure_future(book.flush())  # (the catalog is not there)
        await asyncio.sleep(0)
        book.record(GRANT, "late", "late", 200, 1, 1)  # while it seals
        await flushing
        worst = await probe.stop()
        assert book.pending_rows == 100_000 and book.dropped_rows == 0
        assert sum(n for n, _, _ in book.rows.values()) <= 1
        await book.flush()
        assert book.pending_rows + book.dropped_rows == 100_001
        assert worst < 0.02, f"the loop was held {worst * 1000:.0f} ms"
    finally:
        await book.stop()


async def test_a_seal_cancelled_midway_loses_no_row() -> None:
    """The frontend stops (its flush task cancelled) while a seal is between two slices:
    the rows not yet sealed are sealed all the same, for the last flush to send."""
    book = UsageBook(f"http://127.0.0.1:{free_port()}", interval=3600)
    for n in range(10_000):
        book.record(key_number(n), f"m{n}", f"m{n}", 200, 1, 1)
    sealing = asyncio.ensure_future(book.seal())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    sealing.cancel()
    await asyncio.gather(sealing, return_exceptions=True)
    assert sealing.cancelled() and not book.rows
    assert book.pending_rows == 10_000 and book.dropped_rows == 0


async def test_one_keys_flood_of_model_names_leaves_room_for_the_other_keys() -> None:
    """A key with no allow-list may name any model, and a model that does not exist is
    answered 404 and recorded under the name asked for: one key naming 100,000 models
    filled the rows between two flushes, and every other key's usage was dropped."""
    book = UsageBook(f"http://127.0.0.1:{free_port()}", interval=3600)
    flood = Grant(workspace="w", name="flood", hash="b" * 64)
    for n in range(100_000):
        book.record(flood, f"no-such-{n}", "", 404, 0, 0)
    book.record(GRANT, "chat", "chat", 200, 3, 4)
    assert [1, 3, 4] in book.rows.values()  # the other key's usage is counted
    assert len(book.rows) < 1_010 and book.dropped_rows == 0
    # the flood is counted all the same: beyond its rows, under one name
    assert sum(n for (_, key, *_), (n, _, _) in book.rows.items() if key == "flood") == 100_000
    assert any(row[2] == OTHER_MODELS for row in book.rows)
