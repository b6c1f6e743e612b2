"""The `/ui` page in a real browser: Debian's headless Chromium driven by Playwright.

Real `shoal worker` and `shoal frontend` processes on a SQLite store for the fleet test; the
page is only ever looked at, as an operator would. The screenshots in `docs/images/` (shown
in `docs/dashboard.md`) are written by these tests. `scripts/test` installs Chromium
(`scripts/ensure-chromium.sh`); without it these tests are skipped, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from playwright.async_api import Page, async_playwright

from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelKey
from shoal.frontend import Frontend
from shoal.store import Store, open_store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import serving
from tests.helpers import wait_for
from tests.processes import Process, Processes

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# The screenshots shown in docs/dashboard.md are refreshed with
# `SHOAL_SCREENSHOTS_DIR=docs/images pytest tests/frontend/test_dashboard_browser.py`; a plain
# test run writes them to a temporary directory, leaving the checkout as it was.
IMAGES = Path(os.environ.get("SHOAL_SCREENSHOTS_DIR") or tempfile.mkdtemp(prefix="shoal-ui-"))
FAST = ("--lease-ttl", "2", "--ttft-ms", "5", "--itl-ms", "2")
UPDATE_MS = 2000  # the page shows a fleet change within 2 s

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="no /usr/bin/chromium: run scripts/ensure-chromium.sh (scripts/test does)",
)


@pytest.fixture
async def page(tmp_path: Path) -> AsyncIterator[Page]:
    """A page of a fresh headless Chromium profile."""
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 900},
        )
        try:
            yield context.pages[0] if context.pages else await context.new_page()
        finally:
            await context.close()


def row(instance_id: int) -> str:
    return f'#instances tbody tr[data-key$="/{instance_id:x}"]'


async def until(page: Page, expression: str, timeout: float = 10.0) -> None:
    """Wait for a JS expression to be true (polled from here: the page's CSP forbids eval)."""
    await wait_for(lambda: page.evaluate(expression), timeout=timeout, interval=0.1)


async def screenshot(page: Page, name: str, *, height: int | None = None) -> None:
    """Write `IMAGES/NAME`: the whole page, or its top `height` pixels."""
    await asyncio.to_thread(IMAGES.mkdir, parents=True, exist_ok=True)
    path = IMAGES / name
    if height is None:
        await page.screenshot(path=str(path), full_page=True)
    else:
        await page.screenshot(
            path=str(path), clip={"x": 0, "y": 0, "width": 1400, "height": height}
        )
    assert path.stat().st_size > 10_000


async def traffic(url: str, stop: asyncio.Event) -> None:
    """Streamed requests for the charts (TTFT is measured on streams), and a few for a model
    nobody serves (404)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    async with client:
        n = 0
        while not stop.is_set():
            n += 1
            model = "no-such-model" if n % 7 == 0 else "mock-llm"
            with contextlib.suppress(openai.APIError):
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"story {n}"}], stream=True
                )
                async for _ in stream:
                    pass
            await asyncio.sleep(0.05)  # pacing, not synchronisation


async def test_workers_appear_drain_and_vanish_on_the_page_and_a_lost_frontend_is_said(
    page: Page, processes: Processes, tmp_path: Path
) -> None:
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    namespace = f"ui-{uuid.uuid4().hex[:8]}"
    frontend = await processes.start(
        "frontend", "--store", store_url, "--port", "0", "--namespace", namespace,
        ready="frontend",
    )  # fmt: skip
    await page.goto(f"{frontend.url}/ui/")
    await page.wait_for_selector('#conn[data-state="live"]')
    assert await page.locator("#instances tbody tr").count() == 0

    first = await processes.worker(store_url, "--namespace", namespace, *FAST)
    started = time.monotonic()
    await page.wait_for_selector(row(first.instance_id), timeout=UPDATE_MS)
    assert time.monotonic() - started < UPDATE_MS / 1000
    others: list[Process] = list(
        await asyncio.gather(
            processes.worker(store_url, "--namespace", namespace, *FAST),
            processes.worker(store_url, "--namespace", namespace, *FAST),
            processes.worker(store_url, "--namespace", namespace, "--model", "mock-coder", *FAST),
        )
    )
    for worker in others:
        await page.wait_for_selector(row(worker.instance_id), timeout=UPDATE_MS)

    stop = asyncio.Event()
    load = asyncio.create_task(traffic(frontend.url, stop))
    store = await open_store(store_url)
    try:
        drained = others[0]
        await taint(store, namespace, drained.instance_id, "draining")
        started = time.monotonic()
        await page.wait_for_selector(
            f'{row(drained.instance_id)}[data-state="draining"]', timeout=UPDATE_MS
        )
        assert time.monotonic() - started < UPDATE_MS / 1000
        await until(
            page, "Number(document.querySelector('#chart-rps').dataset.points || 0) >= 6", 30
        )
        states = await page.locator("#instances tbody tr").evaluate_all(
            "rows => rows.map(r => r.dataset.state).sort()"
        )
        assert states == ["draining", "ready", "ready", "ready"]
        assert "No routes published" in await page.inner_text("#routes .empty")
        await screenshot(page, "dashboard-fleet.png")
    finally:
        stop.set()
        await load
        await store.close()

    killed = others[1]
    killed.signal(signal.SIGKILL)
    # Gone once its lease (2 s) runs out and the store deletes its keys.
    await page.wait_for_selector(row(killed.instance_id), state="detached", timeout=15_000)
    assert await page.locator(row(first.instance_id)).count() == 1

    frontend.signal(signal.SIGKILL)
    lost = page.locator("#lost")
    await lost.wait_for(state="visible", timeout=UPDATE_MS * 2)
    assert "Lost the frontend" in await lost.inner_text()
    assert await page.get_attribute("#conn", "data-state") == "lost"
    await screenshot(page, "dashboard-lost.png")


async def taint(store: Store, namespace: str, instance_id: int, *taints: str) -> None:
    key = ModelKey(EndpointId(namespace, "backend", "generate"), instance_id)
    await Discovery(store).update_taints(key, taints)


async def test_page_asks_for_the_api_key_and_refuses_without_it(
    page: Page, start_frontend: StartFrontend, start_worker: StartWorker
) -> None:
    worker = await start_worker()
    frontend = await start_frontend(api_keys=("open-sesame",))
    await wait_for(lambda: serving(frontend))
    await page.goto(f"{frontend.url}/ui/")
    await page.wait_for_selector("#login-form", state="visible")
    assert await page.is_hidden("#fleet")
    assert await page.get_attribute("#conn", "data-state") == "locked"
    refused = await page.evaluate("fetch('api/snapshot').then(r => r.status)")
    assert refused == 401
    await screenshot(page, "dashboard-login.png", height=420)

    await page.fill("#key", "not-the-key")
    await page.click("#login-form button")
    await page.wait_for_selector("#login-error:not([hidden])")
    assert "Refused" in await page.inner_text("#login-error")
    assert await page.is_hidden("#fleet")

    await page.fill("#key", "open-sesame")
    await page.click("#login-form button")
    await page.wait_for_selector(row(worker.instance_id), timeout=UPDATE_MS)
    assert await page.is_hidden("#login")
    # The cookie is HttpOnly: the page's scripts never see the key or the session.
    assert await page.evaluate("document.cookie") == ""
    assert await page.is_visible("#routes .empty")
    route = {
        "workspace": "team-a",
        "name": "fast",
        "targets": [
            {"kind": "fleet", "model": "mock-llm", "weight": 3},
            {"kind": "url", "base_url": "https://api.example.com/v1", "model": "big", "weight": 1},
        ],
        "targets_total": 5,  # (the frontend describes the first few)
    }
    frontend.dashboard.reader.routes = lambda: [route]  # what the routes follower will fill
    cell = page.locator('#routes tbody tr[data-key="team-a/fast"] td:nth-child(3)')
    await cell.wait_for(timeout=UPDATE_MS)
    assert "fleet model mock-llm weight 3" in await cell.inner_text()
    assert "https://api.example.com/v1" in await cell.inner_text()
    assert "and 3 more" in await cell.inner_text()
    await page.reload()  # the session survives a reload
    await page.wait_for_selector(row(worker.instance_id), timeout=UPDATE_MS)
    await page.click("#logout")
    await page.wait_for_selector("#login-form", state="visible")


async def test_a_thousand_instances_are_paged_and_filtered(
    page: Page, start_frontend: StartFrontend, start_worker: StartWorker, store: Store
) -> None:
    worker = await start_worker(register=False)
    lease = await store.grant(30)
    discovery = Discovery(store)
    ids = [0x10000 + i for i in range(1000)]
    endpoint = EndpointId("default", "backend", "generate")
    for instance_id in ids:
        info = InstanceInfo(
            "default", "backend", "generate", instance_id, f"{worker.url}/v1", worker.url
        )
        await discovery.register_instance(info, lease=lease.id)
        await discovery.register_model(
            ModelKey(endpoint, instance_id), worker.card(), lease=lease.id
        )
    frontend: Frontend = await start_frontend()
    await wait_for(lambda: serving(frontend, instances=1000), timeout=60)
    await page.goto(f"{frontend.url}/ui/")
    await until(page, "document.querySelector('#summary').textContent.startsWith('1000 instances')")
    assert await page.locator("#instances tbody tr").count() == 50
    assert "page 1 of 20" in await page.inner_text("#instances .pager")
    await page.click("#instances .pager button:has-text('next')")
    await page.wait_for_selector(row(ids[50]))
    await page.fill("#filter", f"{ids[-1]:x}")
    await until(page, "document.querySelectorAll('#instances tbody tr').length === 1")
    assert await page.locator(row(ids[-1])).count() == 1
    assert "1 of 1000 match" in await page.inner_text("#instances .count")
    await page.fill("#filter", "generate/1038")  # ids 0x10380..0x1038f
    await until(page, "document.querySelectorAll('#instances tbody tr').length === 16")
    await screenshot(page, "dashboard-filter.png", height=900)
    await lease.revoke()
    await page.wait_for_selector(row(ids[-1]), state="detached", timeout=10_000)
