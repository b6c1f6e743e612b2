"""Helpers for the membership tests: endpoints written straight into discovery, a counting
feed, and a source the test drives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from shoal.cards import ModelCard
from shoal.discovery import Discovery, EndpointId, InstanceInfo, ModelInstance, ModelKey, Query
from shoal.membership import DiscoveryFeed, Selection, SourceError
from shoal.membership.feed import ScopeWatch


def card(name: str, taints: tuple[str, ...] = ()) -> ModelCard:
    return ModelCard.build(
        display_name=name,
        slug=name,
        source=f"test/{name}",
        model_types=["chat"],
        context_length=4096,
        runtime_config={"taints": list(taints)},
    )


async def add_endpoint(
    discovery: Discovery,
    namespace: str,
    instance_id: int,
    *,
    component: str = "backend",
    model: str = "m",
) -> ModelKey:
    """Register an endpoint instance and its base model card (no lease)."""
    endpoint = EndpointId(namespace, component, "generate")
    info = InstanceInfo(
        namespace, component, "generate", instance_id, "http://127.0.0.1:1/v1", "http://x"
    )
    await discovery.register_instance(info, lease=0)
    key = ModelKey(endpoint, instance_id)
    await discovery.register_model(key, card(model), lease=0)
    return key


async def remove_endpoint(discovery: Discovery, key: ModelKey) -> None:
    await discovery.unregister_model(key)
    await discovery.unregister_instance(key.endpoint, key.instance_id)


class CountingFeed(DiscoveryFeed):
    """Counts the watches opened and the snapshot reads made."""

    def __init__(self, discovery: Discovery) -> None:
        super().__init__(discovery)
        self.opened: list[Query] = []
        self.reads: list[Query] = []
        self.read_at: list[float] = []  # time.monotonic() of each read

    async def open(self, query: Query, revision: int | None = None) -> ScopeWatch:
        self.opened.append(query)
        return await super().open(query, revision)

    async def read(self, query: Query) -> list[ModelInstance]:
        self.reads.append(query)
        self.read_at.append(time.monotonic())
        return await super().read(query)


class DrivenSource:
    """A source whose selections and errors the test pushes."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Selection | SourceError] = asyncio.Queue()

    def push(self, item: Selection | SourceError) -> None:
        self._queue.put_nowait(item)

    async def selections(self) -> AsyncIterator[Selection | SourceError]:
        while True:
            yield await self._queue.get()
