"""`shoal_frontend_event_loop_lag_seconds`: how late the event loop runs a timer, on `/metrics`."""

from __future__ import annotations

import time

import aiohttp

from shoal.frontend import Frontend
from tests.frontend.conftest import StartFrontend
from tests.helpers import wait_for


def samples_over(frontend: Frontend, bound: float) -> float:
    """Samples of the loop's lag over `bound` seconds (a bucket's bound)."""
    (family,) = frontend.metrics.loop_lag.collect()
    count = next(s.value for s in family.samples if s.name.endswith("_count"))
    within = next(
        s.value
        for s in family.samples
        if s.name.endswith("_bucket") and float(s.labels["le"]) == bound
    )
    return count - within


def hold(seconds: float) -> None:
    """Hold the event loop (a callback that does not yield), as a slow step would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_callback_that_holds_the_loop_shows_in_the_lag_histogram(
    start_frontend: StartFrontend,
) -> None:
    frontend = await start_frontend()
    before = samples_over(frontend, 0.1)
    hold(0.15)  # longer than a sample's wait: always seen
    await wait_for(lambda: samples_over(frontend, 0.1) > before, message="the hold was seen")
    async with aiohttp.ClientSession() as session, session.get(f"{frontend.url}/metrics") as got:
        text = await got.text()
    assert 'shoal_frontend_event_loop_lag_seconds_bucket{le="0.1"}' in text
    assert "shoal_frontend_event_loop_lag_seconds_count" in text
