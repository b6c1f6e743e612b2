"""Test support for the engine tests: a started engine with its app served on a free port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

import openai

from shoal.worker.engine import Engine
from tests.helpers import Server, serving

E = TypeVar("E", bound=Engine)


@asynccontextmanager
async def engine_served(engine: E) -> AsyncIterator[tuple[E, Server]]:
    """`engine` started, its app served on a free port for the block, then stopped."""
    await engine.start()
    try:
        async with serving(engine.app()) as server:
            yield engine, server
    finally:
        await engine.stop()


def client_for(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
