"""`UsageBook`: counts per row, keeps batches while the catalog is away, bounded."""

from __future__ import annotations

import asyncio
import json

import pytest

from shoal.discovery.grants import Grant
from shoal.frontend.keys.usage import OTHER_MODELS, UsageBook, status_class
from tests.helpers import free_port, turns_until

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
        # over 3 rows: the batches not sent yet ("a", "b") are folded into one row of the
        # key (the first may have reached the catalog: kept as it is); nothing dropped
        assert (described["pending_batches"], described["pending_rows"]) == (2, 3)
        assert (described["dropped_rows"], described["folded_rows"]) == (0, 1)
        assert [[r["model"] for r in batch["rows"]] for batch in book.pending] == [
            ["chat", "chat"], [OTHER_MODELS]
        ]  # fmt: skip
        assert book.pending[1]["rows"][0]["requests"] == 2
        for model in ("c", "d"):  # more keys than rows: the oldest batch goes after all
            book.record(key_number(ord(model)), model, model, 200, 1, 1)
            await book.flush()
        assert book.describe()["pending_rows"] <= 3 and book.dropped_rows == 2
    finally:
        await book.stop()


@pytest.mark.parametrize(("max_rows", "models_kept"), [(50, True), (30, False)])
async def test_a_backlog_over_its_bound_loses_resolution_never_another_keys_counts(
    max_rows: int, models_kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """During a catalog outage one key naming many models filled the backlog, and the
    oldest batches, every key's usage in them, were dropped. Now the batches not sent yet
    are folded: rows of one hour into one (enough at 50 rows: models kept), then each key's
    models into one (needed at 30); every key's requests and tokens are all still there."""
    from shoal.frontend.keys import usage as usage_module

    clock = [1_800_000_000.0]  # (on the hour)
    monkeypatch.setattr(usage_module.time, "time", lambda: clock[0])
    flood = Grant(workspace="w", name="flood", hash="b" * 64)
    book = UsageBook(f"http://127.0.0.1:{free_port()}", max_rows=max_rows, interval=3600)
    await book.start()
    try:
        for minute in range(6):
            clock[0] = 1_800_000_000.0 + 60 * minute
            for n in range(20):
                book.record(flood, f"m{n}", "", 200, 10, 1)
            book.record(GRANT, "chat", "chat", 200, 3, 4)
            await book.flush()  # fails: sealed, waiting
        rows = [row for batch in book.pending for row in batch["rows"]]
        assert book.pending_rows == len(rows) <= max_rows and book.dropped_rows == 0

        def total(key: str) -> list[int]:
            mine = [r for r in rows if r["key"] == key]
            return [sum(r[c] for r in mine) for c in ("requests", "prompt_tokens",
                                                      "completion_tokens")]  # fmt: skip

        assert total("flood") == [120, 1200, 120] and total("team") == [6, 18, 24]
        assert book.pending[0]["rows"][0]["minute"].endswith(":00:00+00:00")
        assert any(r["model"] == "chat" for r in rows[21:]) is models_kept
        assert book.folded_rows == 105 - (len(rows) - 21)
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


async def test_sealing_100000_rows_makes_a_slice_of_them_per_turn_of_the_loop() -> None:
    """A flush seals every row counted since the last one (at most `max_rows`, 100,000):
    turning them all into batches in one go held the loop 0.13 s. Rows recorded while it
    seals count in the next batch, none lost. Counted, not timed: the rows made into
    batches in one turn of the loop are a `SEAL_SLICE` at most."""
    from shoal.frontend.keys.usage import SEAL_SLICE
    from tests.helpers import LoopTurns

    book = UsageBook(f"http://127.0.0.1:{free_port()}", interval=3600)
    await book.start()
    sealed = LoopTurns().wrap(book, "_batch", lambda rows: len(rows))
    try:
        for n in range(100_000):  # (keys of their own: a key's rows are bounded)
            book.record(key_number(n), f"m{n}", f"m{n}", 200, 1, 1)
        flushing = asyncio.ensure_future(book.flush())  # (the catalog is not there)
        await turns_until(lambda: 0 < book.pending_rows < 100_000)  # (some rows sealed)
        book.record(GRANT, "late", "late", 200, 1, 1)  # while it seals
        await flushing
        assert book.pending_rows == 100_000 and book.dropped_rows == 0
        assert sum(n for n, _, _ in book.rows.values()) <= 1
        assert sealed.on_loop == 100_000
        assert sealed.most_per_turn <= SEAL_SLICE, f"{sealed.most_per_turn} rows in one turn"
        await book.flush()
        assert book.pending_rows + book.dropped_rows == 100_001
    finally:
        await sealed.stop()
        await book.stop()


async def test_a_backlog_folded_lets_go_of_its_rows_a_slice_per_turn_of_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rows of a backlog over its bound are folded in threads (Python code: the loop
    takes the GIL back every switch interval), but the 200,000 rows they replace were freed
    on the loop at once (freeing is one C call: ~15-30 ms held). Counted, not timed: the rows
    freed in one turn of the loop are a `SEAL_SLICE` at most, and none is freed in a thread
    (all at once there, it would hold the GIL as long)."""
    from shoal.frontend.keys import usage as usage_module
    from shoal.frontend.keys.usage import SEAL_SLICE
    from tests.helpers import LoopTurns

    freed = LoopTurns()

    class Noted(dict):  # type: ignore[type-arg]
        """A row that counts its freeing in the turn (or thread) it happens in."""

        def __del__(self) -> None:
            freed.note()

    fold = usage_module._fold
    monkeypatch.setattr(
        usage_module, "_fold", lambda rows, level: [Noted(r) for r in fold(rows, level)]
    )
    book = UsageBook(f"http://127.0.0.1:{free_port()}", max_rows=100_000, interval=3600)
    for b in range(200):  # 200,000 rows, each of its own model: only folding keys fits them
        book._batch([Noted(workspace="w", key=f"k{i % 100}", model=f"m{i}", served_model="",
                           status_class="2xx", minute="2030-01-01T00:01:00+00:00", requests=1,
                           prompt_tokens=2, completion_tokens=3)
                     for i in range(b * 1000, (b + 1) * 1000)])  # fmt: skip
    try:
        await book._fit()
        assert book.pending_rows == 1000 + 100 and book.dropped_rows == 0
        assert book.folded_rows == 199_000 - 100
        assert sum(r["requests"] for b in book.pending for r in b["rows"]) == 200_000
        assert freed.on_loop == 2 * 199_000 and freed.off_loop == 0  # (the originals, hours)
        most = freed.most_per_turn
        assert most <= SEAL_SLICE, f"{most} rows freed in one turn"
    finally:
        await freed.stop()


async def test_a_seal_cancelled_midway_loses_no_row() -> None:
    """The frontend stops (its flush task cancelled) while a seal is between two slices:
    the rows not yet sealed are sealed all the same, for the last flush to send."""
    book = UsageBook(f"http://127.0.0.1:{free_port()}", interval=3600)
    for n in range(10_000):
        book.record(key_number(n), f"m{n}", f"m{n}", 200, 1, 1)
    sealing = asyncio.ensure_future(book.seal())
    await turns_until(lambda: 0 < book.pending_rows < 10_000)  # between two slices
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


async def test_the_catalog_token_quoted_in_an_answer_never_reaches_health_or_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A `--catalog-url` pointing at a service that quotes the request's `Authorization` in
    its refusal (a gateway in front, another API): `last_error`, `last_refused` and the log
    carried the text of the answer with the `--catalog-token` in it."""
    from aiohttp import web

    from tests.helpers import Server

    token = "cat-token-7Hq2x"

    async def usage(request: web.Request) -> web.Response:
        said = f"refused {request.headers['Authorization']}"
        return web.json_response({"error": said}, status=401 if answers.pop(0) else 400)

    answers = [True, False]
    app = web.Application()
    app.router.add_post("/v1/usage", usage)
    server = Server(app)
    await server.start()
    caplog.set_level("DEBUG")
    book = UsageBook(server.url, token=token, interval=3600)
    await book.start()
    try:
        book.record(GRANT, "chat", "chat", 200, 1, 1)
        await book.flush()  # 401: kept, and said
        described = json.dumps(book.describe())
        assert "refused Bearer ***" in book.describe()["last_error"]
        await book.flush()  # 400: dropped, and said
        assert "refused Bearer ***" in book.describe()["last_refused"]
        described += json.dumps(book.describe())
    finally:
        await book.stop()
        await server.stop()
    assert token not in described + caplog.text


async def test_usage_the_catalog_never_took_is_counted_as_lost_when_the_frontend_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A frontend stopped during a catalog outage (a rolling restart) lost its whole backlog,
    and its last word was 'usage not flushed (2 batches wait)': nothing waits once it exits.
    What is lost is now said, as an error: its rows, requests and tokens, and why."""
    book = UsageBook(f"http://127.0.0.1:{free_port()}", interval=3600)
    await book.start()
    book.record(GRANT, "chat", "chat", 200, 10, 30)
    await book.flush()  # a batch waits
    book.record(GRANT, "chat", "chat", 200, 5, 7)
    book.record(key_number(2), "other", "other", 429, 0, 0)  # not sealed yet
    with caplog.at_level("ERROR", logger="shoal.frontend.keys.usage"):
        await book.stop()
    lost = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(lost) == 1, lost
    assert "3 rows (3 requests, 52 tokens) of 2 keys" in lost[0], lost[0]
    assert "127.0.0.1" in lost[0]  # why: the catalog's last error
