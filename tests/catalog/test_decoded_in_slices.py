"""Large JSON answers the catalog reads (a provider's `GET /models`, a page of the catalog's
own API) are decoded on the event loop a slice of bytes at a time: msgspec and json decode in
one C call holding the GIL, so the decode in a thread they had held the loop as long. Counted
per turn of the loop (`LoopTurns`), not timed; and what they give is what a plain decode of
the whole answer gives: the same ids in the same order, the same items, the same errors."""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from shoal import slices
from shoal.catalog import providers as providers_module
from shoal.catalog.client import read_items, read_items_sliced
from shoal.catalog.errors import CatalogError
from shoal.catalog.providers import ListingError, UrlLister
from shoal.catalog.resources import Model, Provider
from tests.helpers import LoopTurns, serving

MIB = 1 << 20
META = {"workspace": "w", "version": 1, "created_at": "2026-01-01T00:00:00Z",
        "updated_at": "2026-01-01T00:00:00Z"}  # fmt: skip


def listing(entries: list[Any]) -> bytes:
    return json.dumps({"object": "list", "data": entries}).encode()


def vllm_entries(count: int, start: int = 0) -> list[dict[str, Any]]:
    """Entries as vLLM lists them (~200 bytes each)."""
    return [
        {"id": f"org/model-{i:06d}", "object": "model", "created": 1700000000,
         "owned_by": "vllm", "root": f"/models/model-{i:06d}", "parent": None,
         "max_model_len": 8192, "permission": [{"allow_sampling": True}]}
        for i in range(start, start + count)
    ]  # fmt: skip


def plain_ids(body: bytes) -> list[str]:
    """The ids a plain decode of the whole listing gives (as `listed_ids` read them with
    `json.loads`); ValueError for what is not a listing."""
    answer = json.loads(body)
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise ValueError("no `data` list")
    return [str(m["id"]) for m in data if isinstance(m, dict) and m.get("id")]


@asynccontextmanager
async def lister_of(answer: dict[str, bytes]) -> AsyncIterator[tuple[UrlLister, Provider]]:
    """A `UrlLister` and a provider whose `GET /models` answers `answer["body"]`."""

    async def models(request: web.Request) -> web.Response:
        return web.Response(body=answer["body"], content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serving(app) as server, aiohttp.ClientSession() as session:
        provider = Provider.model_validate(
            {"name": "p", "type": "url", "base_url": f"{server.url}/v1", **META}
        )
        yield UrlLister(session), provider


async def test_a_4_mib_provider_listing_is_decoded_on_the_loop_a_slice_of_bytes_a_turn() -> None:
    """A listing over 64 KiB was decoded in a thread with `json.loads`, which held the event
    loop as long (an 8 MiB one ~90 ms). Now its entries are decoded on the loop, at most
    `SLICE_BYTES` of them a turn, and the ids are those a plain decode gives, in order."""
    body = listing(vllm_entries(21_000))
    assert 4 * MIB <= len(body) <= providers_module.LISTING_BYTES
    async with lister_of({"body": body}) as (lister, provider):
        turns = LoopTurns().wrap(slices, "decode_slice", lambda raws, *_: sum(map(len, raws)))
        first = turns.count
        try:
            ids = await lister(provider)
        finally:
            await turns.stop()
    assert ids == plain_ids(body) and len(ids) == 21_000
    assert turns.off_loop == 0 and turns.on_loop > len(body) * 0.9  # every entry, on the loop
    assert turns.most_per_turn <= slices.SLICE_BYTES, f"{turns.most_per_turn} bytes in a turn"
    assert turns.count - first >= len(body) // slices.SLICE_BYTES  # it let the loop run


def padded(entries: list[Any]) -> list[Any]:
    """`entries` among ~400 KB of others (several slices: what is in the middle is decoded
    in a slice of its own, after a turn of the loop)."""
    return vllm_entries(700) + entries + vllm_entries(700, start=700)


ODD_ENTRIES = [
    {"id": "plain"}, {"id": 7}, {"id": 1.5}, {"id": True}, {"id": ["a", 1]}, {"id": {"x": 1}},
    {"id": ""}, {"id": 0}, {"id": None}, {"object": "model"}, "a string", 3, None, ["id"],
    {"id": "ünïcödé/模型", "nested": {"a": [1, {"b": [2]}]}}, {"id": "plain"}, {"id": "last"},
]  # fmt: skip


@pytest.mark.parametrize("entries", [ODD_ENTRIES, padded(ODD_ENTRIES)], ids=["small", "large"])
async def test_a_listing_decoded_in_slices_lists_the_ids_of_a_plain_decode(
    entries: list[Any],
) -> None:
    """Whatever an entry holds, the ids are those a plain decode of the whole listing gives,
    in its order, duplicates and all, for a listing of one slice and of many."""
    body = listing(entries)
    async with lister_of({"body": body}) as (lister, provider):
        assert await lister(provider) == plain_ids(body)


def nests(levels: int) -> Any:
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


DENSE_ENTRIES = [
    # entries within every bound, their bytes nearly all nesting the catalog does not read
    *({"id": f"m{i:05d}", "x": [nests(61)] * 2} for i in range(1500)),
    *({"object": "model", "x": nests(62)} for _ in range(500)),
    *([nests(60), {"id": "inside an array"}] for _ in range(10)),
    {"id": "last", "x": [[] for _ in range(3000)]},
]


async def test_a_listing_dense_in_nesting_builds_nothing_of_what_it_does_not_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A listing within every bound but dense in nesting (vLLM entries carrying arrays 62 deep)
    held the catalog's loop hundreds of ms a slice: each slice was decoded whole, ~30,000
    lists and dicts, enough to set off full collections of the catalog's heap (~175 ms each).
    Only an entry's `id` is decoded now: counted as the objects the collector tracks that a
    slice's decode leaves (`gc.get_count`), not timed. The ids are a plain decode's."""
    body = listing(DENSE_ENTRIES)
    assert len(body) <= providers_module.LISTING_BYTES
    built: list[int] = []
    real = slices.decode_slice

    def counted(*args: Any, **kwargs: Any) -> Any:
        before = gc.get_count()[0]
        decoded = real(*args, **kwargs)
        built.append(gc.get_count()[0] - before)
        return decoded

    monkeypatch.setattr(slices, "decode_slice", counted)
    collecting = gc.isenabled()
    gc.disable()  # (a collection between the two counts would reset them)
    try:
        async with lister_of({"body": body}) as (lister, provider):
            ids = await lister(provider)
    finally:
        if collecting:
            gc.enable()
    assert ids == plain_ids(body) and len(ids) == 1501
    assert len(built) >= len(body) // slices.SLICE_BYTES
    # the list of a slice, and one per entry that is an array (its items left encoded)
    assert max(built) <= 1 + 10, f"{max(built):,} objects tracked after a slice's decode"


def deep(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = {"a": value}
    return value


NOT_LISTINGS = {  # (the answer, made around entries that pad it; what the error says)
    # (None: bad JSON, which each JSON decoder says in its own words)
    "not JSON": (lambda pad: b"<html>" + listing(pad), None),
    "cut short": (lambda pad: listing(pad + vllm_entries(3))[:-5], None),
    "an array": (lambda pad: json.dumps([*pad, {"id": "a"}]).encode(), "no `data` list"),
    "no data": (lambda pad: json.dumps({"models": pad}).encode(), "no `data` list"),
    "data null": (lambda pad: json.dumps({"data": None, "pad": pad}).encode(), "no `data` list"),
    "data an object": (lambda pad: json.dumps({"data": {"pad": pad}}).encode(), "no `data` list"),
    "a bad entry": (
        lambda pad: listing(padded(["BAD"])).replace(b'"BAD"', b'{"id": "b",}'),
        None,
    ),
    "not UTF-8 where not read": (
        lambda pad: listing(padded(["BAD"])).replace(b'"BAD"', b'{"id": "b", "x": "\xff"}'),
        "Invalid UTF-8",
    ),
}


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
@pytest.mark.parametrize("case", list(NOT_LISTINGS))
async def test_an_answer_that_is_not_a_listing_is_refused_as_a_plain_decode_refuses_it(
    case: str, large: bool
) -> None:
    make, why = NOT_LISTINGS[case]
    body = make(vllm_entries(1400) if large else [])
    with pytest.raises(ValueError):
        plain_ids(body)
    async with lister_of({"body": body}) as (lister, provider):
        with pytest.raises(ListingError, match=why) as refused:
            await lister(provider)
    assert str(refused.value).startswith(f"GET {provider.base_url}/models: ")


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
async def test_a_listing_over_its_bounds_is_refused_naming_the_bound(
    large: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Count, depth and the bytes of one entry are bounds, each named when passed, before the
    entries are decoded; the answer's bytes are bounded as it is read (`LISTING_BYTES`)."""
    fill = padded if large else (lambda entries: entries)
    count = len(fill(vllm_entries(10)))
    answer = {"body": listing(fill(vllm_entries(10)))}
    async with lister_of(answer) as (lister, provider):
        monkeypatch.setattr(providers_module, "LISTING_MODELS", count - 1)
        with pytest.raises(ListingError, match=f"lists {count} models, over {count - 1} "):
            await lister(provider)
        monkeypatch.setattr(providers_module, "LISTING_MODELS", 100_000)
        answer["body"] = listing(fill([{"id": "deep", "x": deep(80)}]))
        with pytest.raises(ListingError, match="nested deeper than 64 levels"):
            await lister(provider)
        answer["body"] = listing(fill([{"id": "huge", "x": "y" * (slices.SLICE_BYTES + 1)}]))
        with pytest.raises(ListingError, match=r"an item of 65,5\d\d bytes, over the 65,536"):
            await lister(provider)
        answer["body"] = listing(fill(vllm_entries(10)))
        monkeypatch.setattr(providers_module, "LISTING_BYTES", len(answer["body"]) - 1)
        with pytest.raises(ListingError, match="LISTING_BYTES"):
            await lister(provider)


def page_of(rows: list[Any], total: int | None = None) -> bytes:
    return json.dumps({"items": rows, "total": total or len(rows), "next_after": "x"}).encode()


def model_rows(count: int, spec_bytes: int) -> list[dict[str, Any]]:
    """Rows of models, every seventh not one this client reads (`invalid`)."""
    return [
        {"name": f"m{i:05d}", **(META if i % 7 else {}), "spec": {"text": "x" * spec_bytes}}
        for i in range(count)
    ]


async def test_a_4_mib_catalog_page_is_decoded_on_the_loop_a_slice_of_bytes_a_turn() -> None:
    """A page over 256 KiB was decoded in a thread, which held the event loop as long (msgspec
    holds the GIL): now its items are decoded on the loop, at most `SLICE_BYTES` of them a
    turn, and the page is the one a plain decode reads: items, invalid ones, total, keys."""
    raw = page_of(model_rows(1000, 4300))
    assert len(raw) > 4 * MIB
    turns = LoopTurns().wrap(slices, "decode_slice", lambda raws, *_: sum(map(len, raws)))
    first = turns.count
    try:
        page = await read_items_sliced(Model, raw)
    finally:
        await turns.stop()
    assert turns.off_loop == 0 and turns.on_loop > len(raw) * 0.9
    assert turns.most_per_turn <= slices.SLICE_BYTES, f"{turns.most_per_turn} bytes in a turn"
    assert turns.count - first >= len(raw) // slices.SLICE_BYTES
    whole = read_items(Model, raw)
    assert page.items == whole.items and len(page.items) == 857
    assert page.invalid == whole.invalid and len(page.invalid) == 143
    assert (page.total, page.next_page, page.last, page.next_after) == (
        whole.total, whole.next_page, whole.last, whole.next_after
    )  # fmt: skip
    assert page.last == "m00999" and page.next_after == "x"


NOT_PAGES = [
    b"<html>busy</html>",
    b"[]",
    b'{"total": 1}',
    b'{"items": {"name": "a"}, "total": 1}',
    page_of(model_rows(3, 10))[:-3],
    page_of([*model_rows(300, 1000), 1]),  # an item that is no object, after many slices
    page_of(["DEEP"]).replace(b'"DEEP"', b'{"a":' * 2000 + b"{}" + b"}" * 2000),
]


@pytest.mark.parametrize("raw", NOT_PAGES, ids=range(len(NOT_PAGES)))
async def test_an_answer_that_is_not_a_page_is_refused_as_a_plain_decode_refuses_it(
    raw: bytes,
) -> None:
    with pytest.raises(CatalogError, match="not a page"):
        read_items(Model, raw)
    with pytest.raises(CatalogError, match="not a page"):
        await read_items_sliced(Model, raw)


@pytest.mark.parametrize("count", [0, 1, 999, 1000, 1001, 2500])
async def test_an_array_encoded_in_slices_is_the_bytes_of_one_encode(count: int) -> None:
    """(A usage report's items are encoded `ENCODED_PER_SLICE` a turn: the same bytes.)"""
    items = [{"key": f"k{i}", "minute": None, "requests": i, "name": 'ü\n"'} for i in range(count)]
    turns = LoopTurns()
    first = turns.count
    assert await slices.encode_in_slices(items) == msgspec.json.encode(items)
    assert turns.count - first >= (count - 1) // slices.ENCODED_PER_SLICE
