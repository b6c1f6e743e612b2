"""Usage in the catalog, on SQLite and PostgreSQL: batches add up per minute, a batch sent
again is not counted twice, and the report groups by key, model or minute."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shoal.catalog import CatalogClient, CatalogConfig, CatalogServer, InvalidError
from tests.catalog.test_api_limits import nested
from tests.helpers import LoopTurns


def row(key: str, model: str, minute: str, requests: int, prompt: int = 0, completion: int = 0,
        status: str = "2xx", workspace: str = "team-a") -> dict[str, Any]:  # fmt: skip
    return {
        "workspace": workspace, "key": key, "model": model, "served_model": model,
        "status_class": status, "minute": minute, "requests": requests,
        "prompt_tokens": prompt, "completion_tokens": completion,
    }  # fmt: skip


async def test_batches_add_up_and_a_retried_batch_counts_once(client: CatalogClient) -> None:
    first = {"batch_id": "batch-0001", "rows": [
        row("a", "chat", "2030-01-01T00:00:10Z", 2, 10, 20),
        row("a", "chat", "2030-01-01T00:00:50Z", 1, 5, 5),  # the same minute: added up
        row("b", "embed", "2030-01-01T00:01:00Z", 4, 40, 0),
        row("a", "chat", "2030-01-01T00:00:00Z", 3, 0, 0, status="4xx"),
    ]}  # fmt: skip
    assert await client.record_usage(first)
    assert not await client.record_usage(first)  # its answer was lost: sent again
    second = {"batch_id": "batch-0002", "rows": [row("a", "chat", "2030-01-01T00:01:00Z", 1, 1, 1)]}
    assert await client.record_usage(second)
    by_key = await client.usage(group_by="key")
    assert [(i["key"], i["requests"], i["total_tokens"]) for i in by_key] == [
        ("a", 7, 42), ("b", 4, 40)
    ]  # fmt: skip
    by_model = await client.usage(group_by="model", key="a")
    assert [(i["model"], i["prompt_tokens"], i["completion_tokens"]) for i in by_model] == [
        ("chat", 16, 26)
    ]
    by_minute = await client.usage(
        group_by="minute", start="2030-01-01T00:01:00Z", end="2030-01-01T00:02:00Z"
    )
    assert [(i["minute"], i["requests"]) for i in by_minute] == [("2030-01-01T00:01:00Z", 5)]
    assert await client.usage(workspace="other") == []


async def test_a_report_query_no_row_can_match_is_refused_naming_it(
    client: CatalogClient,
) -> None:
    """`key`/`model` with NUL, and `from`/`to` out of range once in UTC, reached the database,
    whose failure answered 503 `database_unavailable` (clients retry it as an outage): they
    are 422 naming the parameter now, on SQLite and PostgreSQL."""
    for query, param in (
        ({"key": "a\x00b"}, "key"),
        ({"model": "\x00"}, "model"),
        ({"start": "0001-01-01T00:00:00+01:00"}, "from"),
        ({"end": "9999-12-31T23:59:59-01:00"}, "to"),
    ):
        with pytest.raises(InvalidError) as caught:
            await client.usage(**query)
        assert caught.value.param == param
    assert await client.usage(key="a", start="0001-01-01T00:00:00Z") == []  # in range: read


async def test_a_bad_row_refuses_the_batch_naming_it(client: CatalogClient) -> None:
    bad = {"batch_id": "batch-0003", "rows": [row("a", "chat", "2030-01-01T00:00:00Z", -1)]}
    with pytest.raises(InvalidError) as caught:
        await client.record_usage(bad)
    assert caught.value.param == "rows.0.requests"
    good = {"batch_id": "batch-0003", "rows": [row("a", "chat", "2030-01-01T00:00:00Z", 1)]}
    assert await client.record_usage(good)  # the refused batch did not take its id


async def test_usage_survives_a_catalog_restart(database_url: str) -> None:
    for n in range(2):
        server = CatalogServer(CatalogConfig(database_url, port=0))
        await server.start()
        try:
            async with CatalogClient(server.url, workspace="team-a") as catalog:
                batch = {"batch_id": f"restart-{n:04d}",
                         "rows": [row("a", "chat", "2030-01-01T00:00:00Z", 1, 2, 3)]}  # fmt: skip
                assert await catalog.record_usage(batch)
                assert (await catalog.usage())[0]["requests"] == n + 1
        finally:
            await server.stop()


async def test_catalog_usage_prints_the_sums(catalog: CatalogServer, client: CatalogClient) -> None:
    from tests.catalog.test_cli import catalog_cli

    await client.record_usage(
        {"batch_id": "batch-cli1", "rows": [row("a", "chat", "2030-01-01T00:00:00Z", 2, 3, 4)]}
    )
    code, out, err = await catalog_cli("usage", "--url", catalog.url, "-w", "team-a")
    assert code == 0, err
    assert out.split() == ["KEY", "REQUESTS", "PROMPT_TOKENS", "COMPLETION_TOKENS",
                           "TOTAL_TOKENS", "a", "2", "3", "4", "7"]  # fmt: skip


@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="no /usr/bin/chromium")
async def test_the_usage_page_shows_the_sums_per_key_then_per_minute(
    catalog: CatalogServer, client: CatalogClient, tmp_path: Path
) -> None:
    from playwright.async_api import async_playwright

    from tests.frontend.test_dashboard_browser import CHROMIUM_FLAGS

    await client.record_usage({"batch_id": "batch-page", "rows": [
        row("a", "chat", "2030-01-01T00:00:00Z", 2, 3, 4),
        row("b", "chat", "2030-01-01T00:01:00Z", 1, 1, 1),
    ]})  # fmt: skip
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path="/usr/bin/chromium", headless=True,
            args=CHROMIUM_FLAGS,
        )  # fmt: skip
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            await page.goto(f"{catalog.url}/ui/usage")
            await page.fill("input[name=workspace]", "team-a")
            await page.click("button")
            await page.wait_for_selector("#rows tbody tr:nth-child(2)")
            cells = await page.locator("#rows tbody tr").all_inner_texts()
            assert [c.split() for c in cells] == [
                ["a", "2", "3", "4", "7"],
                ["b", "1", "1", "1", "2"],
            ]
            await page.select_option("select[name=group_by]", "minute")
            await page.click("button")
            await page.wait_for_function("document.querySelector('#group').textContent == 'minute'")
            assert await page.locator("#chart rect").count() == 2
        finally:
            await context.close()


def count_rows_read(monkeypatch: pytest.MonkeyPatch, turns: LoopTurns) -> None:
    """Note in `turns` the rows each partition of a streamed result brings (SQLAlchemy's
    `AsyncResult.partitions`: its rows are made on the loop, in the turn they arrive)."""
    from sqlalchemy.ext.asyncio import AsyncResult

    real = AsyncResult.partitions

    async def partitions(self: AsyncResult[Any], size: int | None = None) -> Any:
        async for part in real(self, size):
            turns.note(len(part))
            yield part

    monkeypatch.setattr(AsyncResult, "partitions", partitions)


async def test_a_usage_report_of_many_minutes_does_not_hold_the_event_loop(
    catalog: CatalogServer, client: CatalogClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A month of one key's minutes is 43,200 items: building and encoding them item by item
    held the catalog's loop (its controller's included) for about a second. Counted, not
    timed: the rows come `PARTITION` at most a turn, the items are made in a thread (Python
    code: the loop takes the GIL back every switch interval), and encoded on the loop
    `ENCODED_PER_SLICE` at most a turn (msgspec encodes in one C call holding the GIL: in a
    thread, 100,000 items held the loop ~20 ms all the same)."""
    from datetime import UTC, datetime, timedelta

    import aiohttp
    import msgspec

    from shoal import slices
    from shoal.catalog import tables, usage

    start = datetime(2030, 1, 1, tzinfo=UTC)
    rows = [
        {"workspace": "team-a", "key": "k", "model": "m", "served_model": "m",
         "status_class": "2xx", "minute": start + timedelta(minutes=i), "requests": 1,
         "prompt_tokens": 2, "completion_tokens": 3}
        for i in range(43_200)
    ]  # fmt: skip
    assert catalog.engine is not None
    async with catalog.engine.begin() as conn:
        await conn.execute(tables.usage.insert(), rows)
    url = f"{client.base_url}/v1/workspaces/team-a/usage"
    async with aiohttp.ClientSession() as session:
        async with session.get(url, params={"group_by": "key"}) as resp:  # warm the pool
            assert resp.status == 200
        read = LoopTurns()  # the catalog serves on this very loop
        count_rows_read(monkeypatch, read)
        made = LoopTurns().wrap(usage, "_items")
        encoded = LoopTurns().wrap(  # (items a call encodes)
            msgspec.json, "encode", lambda value, *_, **__: len(value) * isinstance(value, list)
        )
        try:
            async with session.get(url, params={"group_by": "minute"}) as resp:
                assert resp.status == 200
                body = await resp.read()
        finally:
            for turns in (read, made, encoded):
                await turns.stop()
    items = json.loads(body)["items"]
    assert len(items) == 43_200
    assert items[1] == {"key": None, "model": None, "minute": "2030-01-01T00:01:00Z",
                        "requests": 1, "prompt_tokens": 2, "completion_tokens": 3,
                        "total_tokens": 5}  # fmt: skip
    assert read.on_loop == 43_200
    assert read.most_per_turn <= usage.PARTITION, f"{read.most_per_turn} rows in one turn"
    assert made.on_loop == 0 and made.off_loop == 1
    assert encoded.off_loop == 0 and encoded.on_loop == 43_200
    most = encoded.most_per_turn
    assert most <= slices.ENCODED_PER_SLICE, f"{most} items encoded in one turn"


def big_batch(batch_id: str = "batch-big1") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A batch just under the body bound (~5,000 rows, ~1,000 identities; 2 KiB to spare for
    what a test spoils), and its rows."""
    from shoal.catalog.api import MAX_BODY_BYTES

    one = row("key-00", "model-0", "2030-01-01T00:00:00Z", 1, 10, 20)
    count = (MAX_BODY_BYTES - 2048) // (len(json.dumps(one)) + 2)
    rows = [row(f"key-{i % 50:02}", f"model-{i % 7}",
                f"2030-01-01T{i // 60 % 24:02}:{i % 60:02}:00Z", 1, 10, 20)
            for i in range(count)]  # fmt: skip
    return rows, {"batch_id": batch_id, "rows": rows}


async def test_a_usage_batch_of_a_mebibyte_is_validated_on_the_loop_a_slice_at_a_time(
    catalog: CatalogServer, client: CatalogClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch just under the body bound was decoded and validated on the catalog's loop
    (~70 ms), then in a thread: `json.loads` is one C call holding the GIL, so the loop was
    held ~6-10 ms a batch all the same. Counted, not timed: its rows are decoded and
    validated `body_slices.SLICE_BYTES` at most a turn (never the whole body at once: no
    `_decoded`), merged in a thread (Python code: the loop takes the GIL back every switch
    interval), and bound to statements `WRITE_SLICE` at most a turn."""
    import aiohttp
    from sqlalchemy.ext.asyncio import AsyncConnection

    from shoal.catalog import api, body_slices, usage
    from shoal.catalog.api import MAX_BODY_BYTES

    rows, batch = big_batch()
    body = json.dumps(batch)
    assert MAX_BODY_BYTES * 0.95 < len(body) <= MAX_BODY_BYTES
    url = f"{client.base_url}/v1/usage"
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        async with session.post(url, data=b"{}", headers=headers) as resp:  # warm the pool
            assert resp.status == 422
        decoded = LoopTurns().wrap(api, "_decoded")  # the catalog serves on this very loop
        validated = LoopTurns().wrap(body_slices, "_validated", lambda _, items: len(items))
        merged = LoopTurns().wrap(usage, "_merged")

        def rows_bound(conn: Any, statement: Any, parameters: Any = None, **_: Any) -> int:
            return len(parameters) if isinstance(parameters, list) else 0

        bound = LoopTurns().wrap(AsyncConnection, "execute", rows_bound)
        try:
            async with session.post(url, data=body, headers=headers) as resp:
                answer = await resp.json()
        finally:
            for turns in (decoded, validated, merged, bound):
                await turns.stop()
    assert resp.status == 200, answer
    assert answer == {"batch_id": "batch-big1", "counted": True, "rows": len(rows)}
    assert sum(i["requests"] for i in await client.usage(group_by="key")) == len(rows)
    assert decoded.on_loop == decoded.off_loop == 0
    assert validated.on_loop == len(rows) and validated.off_loop == 0
    most = validated.most_per_turn
    row_bytes = len(json.dumps(rows[0])) + 1
    assert most <= body_slices.SLICE_BYTES // row_bytes, f"{most} rows validated in one turn"
    assert merged.on_loop == 0 and merged.off_loop == 1
    assert bound.on_loop > 4 * usage.WRITE_SLICE  # (distinct rows: ~1,000 in one batch)
    most = bound.most_per_turn
    assert most <= usage.WRITE_SLICE, f"{most} rows bound to statements in one turn"


def bad_row(index: int, **fields: Any) -> Any:
    return lambda batch: batch["rows"][index].update(fields)


@pytest.mark.parametrize(
    "spoil",
    [
        bad_row(3000, requests=-1),
        bad_row(4000, extra=1),
        lambda batch: batch["rows"][10].pop("minute"),
        bad_row(2000, minute="0001-01-01T00:00:00+01:00"),
        lambda batch: (  # a row over a slice's bytes
            batch["rows"][1000].update(key="k" * 70_000), batch["rows"].__delitem__(slice(500))
        ),
        lambda batch: batch.update(batch_id="x"),
        lambda batch: batch.update(junk={"a": 1}),
        lambda batch: batch.update(rows={"a": 1}),
        lambda batch: batch.pop("rows"),
        lambda batch: batch.update(rows=[1] * 100_001),
        lambda text: text.replace('"requests": 1,', '"requests": 1,,', 1),  # not JSON
        lambda text: text.replace('"requests": 1', '"requests": NaN', 1),  # (msgspec refuses)
        lambda text: text.replace('"key-00"', '"key-\\ud800"', 1),  # (msgspec refuses)
        lambda batch: batch["rows"].__setitem__(5, nested(63)),  # 65 levels in the body
        lambda batch: batch.update(spec=nested(64)),
        lambda text: text + "x",
        lambda text: "[" + text + "]",
    ],
    ids=["bad-count", "unknown-row-field", "missing-row-field", "minute-out-of-range",
         "large-row", "bad-batch-id", "unknown-field", "rows-not-a-list", "no-rows",
         "too-many-rows", "not-json", "nan", "lone-surrogate", "too-deep-row", "too-deep-member", "trailing",
         "not-an-object"],
)  # fmt: skip
async def test_a_large_bad_usage_batch_is_answered_as_when_it_was_decoded_whole(
    client: CatalogClient, monkeypatch: pytest.MonkeyPatch, spoil: Any
) -> None:
    """Validated a slice at a time, a bad batch over `api.OFF_LOOP_BYTES` gets the very answer
    it got decoded and validated whole (the same status, message and field), and takes no
    batch id: what the slices cannot tell is decoded whole."""
    import aiohttp

    from shoal.catalog import body_slices

    _, batch = big_batch("batch-bad1")
    text = json.dumps(batch)
    if spoil.__code__.co_varnames[0] == "text":
        text = spoil(text)
    else:
        spoil(batch)
        text = json.dumps(batch)
    url = f"{client.base_url}/v1/usage"
    headers = {"Content-Type": "application/json"}
    answers = []
    async with aiohttp.ClientSession() as session:
        for sliced in (True, False):
            if not sliced:  # as before: the whole body in `_decoded`
                monkeypatch.setattr(body_slices, "validated_in_slices", none_of)
            async with session.post(url, data=text, headers=headers) as resp:
                answers.append((resp.status, await resp.json()))
    assert answers[0][0] in (400, 422), answers[0]
    assert answers[0] == answers[1]
    _, good = big_batch("batch-bad1")
    assert await client.record_usage(good)  # the refused batch did not take its id


async def none_of(*_: Any) -> None:
    return None


async def test_a_batch_validated_in_slices_is_the_batch_validated_whole(tmp_path: Path) -> None:
    """Rows decoded by msgspec a slice at a time, the rest by `json.loads`, give the model
    the whole body's `json.loads` and validation give: escapes, offsets, defaults, a key
    given twice (the last counts), numbers past 64 bits left to refuse."""
    from shoal.catalog import api, body_slices
    from shoal.catalog.database import open_engine

    engine = open_engine(f"sqlite:///{tmp_path / 'catalog.db'}")  # (never connected)
    app = api.create_app(engine, migrate_on_start=False)
    field = next(r for r in app.routes if getattr(r, "path", "") == "/v1/usage").body_field
    minutes = ("2030-01-01T00:00:30", "2030-01-01T02:00:00+02:00", "2030-01-01T00:01Z")
    texts = []
    for i in range(3000):
        one = row(f'k\u00e9y-{i % 9}"\\', f"mod\u00e8le-{i % 4}", minutes[i % 3], i, 10**15, i)
        if i % 5 == 0:
            del one["served_model"], one["completion_tokens"]
        text = json.dumps(one)  # (as ASCII: é is an escape)
        if i % 7 == 0:
            text = text[:-1] + ', "requests": 99}'
        texts.append(text)
    body = ('{"rows": [' + ", ".join(texts) + '], "batch_id": "batch-edge"}').encode()
    whole = api._decoded(body, field)
    sliced = await body_slices.validated_in_slices(body, field, "rows")
    assert sliced is not None
    assert sliced == whole
    assert sliced.model_fields_set == whole.model_fields_set
    assert [r.model_fields_set for r in sliced.rows] == [r.model_fields_set for r in whole.rows]
    assert whole.rows[7].requests == 99 and whole.rows[1].key == 'kéy-1"\\'
    big = body.replace(b'"requests": 99}', b'"requests": 123456789012345678901234567890}', 1)
    assert await body_slices.validated_in_slices(big, field, "rows") is None
    await engine.dispose()


async def test_counters_stay_at_the_bigint_bound_and_the_batch_is_counted(
    client: CatalogClient, database_url: str
) -> None:
    """Sums past 2**63-1 failed the upsert on PostgreSQL ("bigint out of range": a 500, the
    whole batch refused, every other key's rows with it) and turned REAL on SQLite. Now a
    stored counter stays at the bound, and the batch's other rows are counted."""

    from shoal.catalog import tables
    from shoal.catalog.database import open_engine

    top = 2**63 - 1
    minute = "2030-01-01T00:00:00Z"
    assert await client.record_usage(
        {"batch_id": "batch-0100", "rows": [row("a", "chat", minute, 1)]}
    )
    engine = open_engine(database_url)
    try:
        async with engine.begin() as conn:  # a counter close to the bound
            await conn.execute(tables.usage.update().values(requests=top - 10, prompt_tokens=top))
    finally:
        await engine.dispose()
    batch = {"batch_id": "batch-0101", "rows": [
        row("a", "chat", minute, 10**15, 10**15), row("b", "chat", minute, 2, 3),
    ]}  # fmt: skip
    assert await client.record_usage(batch)
    by_key = {i["key"]: i for i in await client.usage(group_by="key")}
    assert (by_key["a"]["requests"], by_key["a"]["prompt_tokens"]) == (top, top)
    assert type(by_key["a"]["requests"]) is int
    assert (by_key["b"]["requests"], by_key["b"]["prompt_tokens"]) == (2, 3)


async def test_a_report_over_counters_at_the_bound_sums_them_whole(
    client: CatalogClient, database_url: str
) -> None:
    """What was wrong: counters stay at the bigint bound (above), and SQLite's sum() of two
    of them raised 'integer overflow': the report of every key, model or span holding both
    answered as a database outage (503, retried for ever) instead of its sums, so a key whose
    upstream reported absurd token counts hid the whole workspace's bill. What holds now:
    the sums are exact on SQLite as on PostgreSQL (past 2**63)."""
    from shoal.catalog import tables
    from shoal.catalog.database import open_engine

    top = 2**63 - 1
    minutes = ["2030-01-01T00:00:00Z", "2030-01-01T00:01:00Z", "2030-01-01T00:02:00Z"]
    rows = [row("a", "chat", minute, 1, 1, 1) for minute in minutes]
    assert await client.record_usage({"batch_id": "batch-0200", "rows": rows})
    engine = open_engine(database_url)
    try:
        async with engine.begin() as conn:  # three minutes at the bound
            await conn.execute(
                tables.usage.update().values(requests=top, prompt_tokens=top, completion_tokens=5)
            )
    finally:
        await engine.dispose()
    (item,) = await client.usage(group_by="key")
    assert (item["requests"], item["prompt_tokens"]) == (3 * top, 3 * top)
    assert (item["completion_tokens"], item["total_tokens"]) == (15, 3 * top + 15)
    by_minute = await client.usage(group_by="minute")
    assert [i["requests"] for i in by_minute] == [top] * 3


def test_a_batch_is_merged_in_the_order_of_its_identities_whatever_their_prefixes() -> None:
    """Rows are written (and locked) in the order of their identities field by field: a
    field that is a prefix of another's comes first, whatever follows it."""
    import random

    from shoal.catalog.usage import UsageRow, _merged

    labels = ["a", "ab", "a-b", "a b", "a~", "é", "A", "0"]
    rows = [row(key, model, f"2030-01-01T00:0{i % 3}:00Z", 1, workspace=space)
            for i, (key, model, space) in enumerate(
                (k, m, w) for k in labels for m in ["", *labels] for w in ["t", "t-a", "ta"])
            ]  # fmt: skip
    random.Random(7).shuffle(rows)
    merged = _merged([UsageRow.model_validate(r) for r in rows])
    fields = ("workspace", "key", "model", "served_model", "status_class", "minute")
    idents = [tuple(str(m[f]) for f in fields) for m in merged]
    assert len(idents) == len(rows) and idents == sorted(idents)


def test_a_batch_repeating_one_row_sums_at_most_the_bound() -> None:
    from shoal.catalog.usage import UsageRow, _merged

    one = UsageRow.model_validate(row("a", "chat", "2030-01-01T00:00:00Z", 10**15, 10**15))
    merged = _merged([one] * 10_000)  # 10**19 requests: over 2**63-1
    assert len(merged) == 1
    assert (merged[0]["requests"], merged[0]["prompt_tokens"]) == (2**63 - 1, 2**63 - 1)
    assert merged[0]["completion_tokens"] == 0


async def test_a_minute_out_of_range_in_utc_refuses_the_batch_naming_it(
    client: CatalogClient,
) -> None:
    """ "0001-01-01T00:00:00+01:00" is before year 1 in UTC: an OverflowError was a 500."""
    for minute in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:00-01:00"):
        bad = {"batch_id": "batch-0200", "rows": [row("a", "chat", minute, 1)]}
        with pytest.raises(InvalidError) as caught:
            await client.record_usage(bad)
        assert caught.value.param == "rows.0.minute"
    good = {"batch_id": "batch-0200", "rows": [row("a", "chat", "2030-01-01T00:00:00Z", 1)]}
    assert await client.record_usage(good)


async def test_a_report_over_its_item_bound_is_refused_not_cut_short(
    client: CatalogClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A report was cut at its 100,000th item in silence (90 days of minutes are 129,600): a
    client summing it (a bill) got a part for the whole, with nothing to say so. Over the
    bound it is 422 naming it; at the bound it is whole."""
    from shoal.catalog import usage

    monkeypatch.setattr(usage, "REPORT_ITEMS", 3)
    rows = [row("a", "chat", f"2030-01-01T00:0{i}:00Z", 1) for i in range(4)]
    assert await client.record_usage({"batch_id": "batch-many", "rows": rows})
    with pytest.raises(InvalidError) as caught:
        await client.usage(group_by="minute")
    assert "over 3" in caught.value.message and caught.value.param == "group_by"
    assert len(await client.usage(group_by="minute", end="2030-01-01T00:03:00Z")) == 3
    assert [i["requests"] for i in await client.usage(group_by="key")] == [4]
