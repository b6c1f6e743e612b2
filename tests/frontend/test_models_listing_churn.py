"""`/v1/models` under constant change: callers that come while a listing is being made wait
for it or for the one next after it, never each for their own; and none is answered a listing
older than what it asked after."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from shoal.discovery import FleetTarget
from shoal.store import Store
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import serving
from tests.frontend.test_virtual_models import route
from tests.helpers import wait_for


async def test_models_listings_under_constant_change_are_made_one_at_a_time_and_fresh(
    store: Store, start_worker: StartWorker, start_frontend: StartFrontend
) -> None:
    """A route changed every millisecond: each caller of `/v1/models` saw another version,
    and each made its own listing of every model, at the same time (20 callers a millisecond
    apart: 4 listings of 10,000 models in flight at once, their memory and CPU with them). Now one is made at a time; a
    caller that comes while an older one is made waits for the next, started after it came."""
    from shoal.frontend import listings

    await start_worker("mock-llm")
    frontend = await start_frontend()
    count = 10 * listings.LISTING_SLICE
    await store.put_many([(r.key, r.to_json()) for r in (route(f"vm{i:05d}", FleetTarget("mock-llm")) for i in range(count))])  # fmt: skip
    await wait_for(lambda: serving(frontend) and len(frontend.routes.models) == count)
    real = listings.Listings._make
    making = [0, 0]  # (now, most at once)

    async def counted(self: listings.Listings, view: str | None, version: tuple[int, int]) -> Any:
        making[0] += 1
        making[1] = max(making)
        try:
            return await real(self, view, version)
        finally:
            making[0] -= 1

    listings.Listings._make = counted  # type: ignore[method-assign]
    stop = asyncio.Event()

    async def churn() -> None:
        n = 0
        while not stop.is_set():
            changed = route(f"churn{n:06d}", FleetTarget("mock-llm"))
            await store.put(changed.key, changed.to_json())
            n += 1
            await asyncio.sleep(0.001)

    async def ask(session: aiohttp.ClientSession) -> None:
        known = {n for n in frontend.routes.models if n.startswith("churn")}
        async with session.get(f"{frontend.url}/v1/models") as answer:
            listed = {m["id"] for m in (await answer.json())["data"]}
        assert known <= listed, f"{len(known - listed)} routes known before the call not listed"

    changer = asyncio.create_task(churn())
    try:
        async with aiohttp.ClientSession() as session:
            callers = []
            for _ in range(20):
                callers.append(asyncio.create_task(ask(session)))
                await asyncio.sleep(0.001)  # (callers come over time: each at another version)
            async with asyncio.timeout(60):
                await asyncio.gather(*callers)
    finally:
        stop.set()
        await changer
        listings.Listings._make = real  # type: ignore[method-assign]
    assert making[1] == 1, f"{making[1]} listings made at once"
