"""Fixtures for the engine tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.worker.engines.fake_upstream import FakeUpstream


@pytest.fixture
async def fake() -> AsyncIterator[FakeUpstream]:
    """A started fake OpenAI-compatible upstream (stands in for vLLM)."""
    fake = FakeUpstream()
    await fake.server.start()
    try:
        yield fake
    finally:
        await fake.server.stop()
