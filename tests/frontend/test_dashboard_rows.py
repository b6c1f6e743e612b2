"""The `/ui` dashboard's rows are bounded in bytes, whatever the store holds behind them.

A card is at most 1 MiB and its 64 taints may fill it; an instance may serve any number of
adapters, a model any number of worker sets (one per namespace, component and role), a
route target's strings are the catalog's. A row carried them whole: 20 instances with 1 MiB
of taints made a 20 MB snapshot, sent again to every page at each change."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import msgspec
import pytest
from playwright.async_api import Page

from shoal.cards import Lora, ModelCard, slugify
from shoal.discovery import Discovery, InstanceInfo, ModelKey
from shoal.frontend import Frontend
from shoal.frontend.dashboard import snapshot
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.test_dashboard_browser import CHROMIUM, page  # noqa: F401 (a fixture)
from tests.helpers import wait_for

TAINTED = 20  # instances, each in its own component (a worker set of its own) with big taints
ADAPTERS = 40  # adapters of one more instance, each with a long name
HOSTILE = "<img src=x onerror=alert(1)>"


async def get_snapshot(url: str) -> tuple[dict[str, Any], int]:
    async with aiohttp.ClientSession() as session:
        response = await session.get(f"{url}/ui/api/snapshot")
        assert response.status == 200
        body = await response.read()
        return json.loads(body), len(body)


async def hostile_fleet(
    start_frontend: StartFrontend, start_worker: StartWorker, store: Store
) -> tuple[Frontend, ModelCard]:
    """`TAINTED` instances with a card's worth of taints each, in a component each, and one
    serving `ADAPTERS` adapters of long names; a frontend once it has them all."""
    worker = await start_worker(register=False)
    base = msgspec.structs.replace(worker.card(), metadata_files={})
    taints = [f"t{j:02}-" + HOSTILE * 540 for j in range(64)]  # a card of ~1 MB
    discovery = Discovery(store)
    for i in range(TAINTED + 1):
        info = InstanceInfo("default", f"c{i}", "generate", 0x1000 + i, f"{worker.url}/v1", "")
        await discovery.register_instance(info, lease=0)
        card = base.with_taints(taints) if i < TAINTED else base
        await discovery.register_model(ModelKey(info.endpoint_id, 0x1000 + i), card, lease=0)
    served = ModelKey(info.endpoint_id, 0x1000 + TAINTED)
    for j in range(ADAPTERS):
        name = f"adapter-{j:02}-" + "x" * 400
        adapter = msgspec.structs.replace(
            base, display_name=name, slug=slugify(name)[:100], lora=Lora(base.display_name, name)
        )
        key = ModelKey(served.endpoint, served.instance_id, f"a{j}")
        await discovery.register_model(key, adapter, lease=0)
    frontend = await start_frontend(reconcile_interval=3600)
    await wait_for(lambda: len(frontend.registry.models) == 1 + ADAPTERS, timeout=30)
    await wait_for(lambda: frontend.registry.models[base.display_name].live_instances == 1)
    return frontend, base


async def test_a_row_is_bounded_in_bytes_whatever_the_cards_behind_it_hold(
    start_frontend: StartFrontend, start_worker: StartWorker, store: Store
) -> None:
    frontend, base = await hostile_fleet(start_frontend, start_worker, store)
    snap, size = await get_snapshot(frontend.url)
    items, chars = snapshot.ROW_ITEMS, snapshot.ROW_CHARS
    rows = {row["key"]: row for row in snap["instances"]}
    tainted = rows["default/c0/generate/1000"]
    assert tainted["state"] == "tainted" and tainted["taints_total"] == 64
    assert len(tainted["taints"]) == items
    assert all(len(t) <= chars and t.endswith("…") for t in tainted["taints"])
    assert tainted["taints"][0].startswith("t00-" + HOSTILE)  # (the first ones, in order)
    many = rows[f"default/c{TAINTED}/generate/{0x1000 + TAINTED:x}"]
    assert many["models_total"] == 1 + ADAPTERS and len(many["models"]) == items
    (model,) = [m for m in snap["models"] if m["name"] == base.display_name]
    assert model["sets_total"] == TAINTED + 1 and len(model["sets"]) == items
    # 20 MB before: every taint of every row, whole.
    assert size < (TAINTED + 1 + ADAPTERS) * 8_000, size


async def test_a_route_row_is_bounded_whatever_its_targets_hold(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend(reconcile_interval=3600)
    target = {"kind": "url", "model": "m" * 100_000, "base_url": "http://p/" + "v" * 100_000}
    route = {"workspace": "w", "name": "vm", "targets": [target] * 16, "targets_total": 200}
    frontend.dashboard.reader.routes = lambda: [route]
    snap, size = await get_snapshot(frontend.url)
    (row,) = snap["routes"]
    assert row["targets_total"] == 200 and len(row["targets"]) == snapshot.ROW_ITEMS
    assert all(len(t["model"]) <= snapshot.ROW_CHARS for t in row["targets"])
    assert size < 20_000, size  # 3.2 MB before


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")
async def test_the_page_shows_a_cut_row_as_text_and_says_how_much_more_there_is(
    page: Page,  # noqa: F811 (the fixture imported above)
    start_frontend: StartFrontend,
    start_worker: StartWorker,
    store: Store,
) -> None:
    frontend, _ = await hostile_fleet(start_frontend, start_worker, store)
    await page.goto(f"{frontend.url}/ui/")
    tainted = '#instances tbody tr[data-key="default/c0/generate/1000"]'
    await page.wait_for_selector(tainted)
    text = await page.inner_text(tainted)
    assert HOSTILE in text and "and 56 more" in text  # 64 taints, 8 shown: as text
    assert await page.locator("#fleet img").count() == 0
    text = await page.inner_text(f'#instances tbody tr[data-key$="/{0x1000 + TAINTED:x}"]')
    assert f"and {1 + ADAPTERS - 8} more" in text
    assert "and 13 more worker sets" in await page.inner_text("#models tbody")


async def test_the_cookie_is_secure_whenever_the_proxy_in_front_says_https(
    start_frontend: StartFrontend,
) -> None:
    """The scheme is case-insensitive, and proxies in a chain add theirs after the client's
    (`https, http`): only a lower-case `https` alone made the cookie `Secure`, so a browser
    behind such a proxy could send it over plain HTTP."""
    frontend = await start_frontend(api_keys=("k",))
    async with aiohttp.ClientSession() as session:
        for proto, secure in [
            ("https", True), ("HTTPS", True), ("https, http", True), (" Https ", True),
            ("http", False), ("http, https", False), ("", False),
        ]:  # fmt: skip
            login = await session.post(
                f"{frontend.url}/ui/api/login",
                json={"key": "k"},
                headers={"X-Forwarded-Proto": proto},
            )
            assert login.status == 200
            assert ("; Secure" in login.headers["set-cookie"]) is secure, proto
