"""The engine interface: what a worker serves, behind the OpenAI HTTP API.

An engine answers OpenAI requests itself (`app()`), and tells the runtime which models it
serves right now (`served_models()`); the runtime turns each into a `ModelCard`, hosts its
metadata files and announces it in discovery.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import Metric

from shoal.cards import ModelType, WorkerRole
from shoal.kv import KvEndpoint


@dataclass(frozen=True)
class ServedModel:
    """A model an engine serves: the base model (`adapter` None) or a LoRA adapter on it."""

    name: str
    source: str
    model_types: tuple[ModelType, ...] = (ModelType.CHAT, ModelType.COMPLETIONS)
    context_length: int = 4096
    kv_block_size: int = 16
    metadata_dir: Path | None = None
    metadata_files: tuple[str, ...] = ()
    adapter: str | None = None
    base_model: str | None = None
    runtime_config: dict[str, object] = field(default_factory=dict)
    role: WorkerRole = WorkerRole.AGGREGATED  # a stage of disaggregated serving, or both


class EngineUnavailableError(Exception):
    """The engine (or the server it fronts) cannot serve right now; the reason says why."""


class Engine(abc.ABC):
    """An inference engine. Lifecycle: `start()`, serve `app()`, `stop()`."""

    name: str

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load or connect; raise with a clear message if the engine cannot serve."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Release resources; in-flight requests have finished or been cancelled."""

    @abc.abstractmethod
    def app(self) -> web.Application:
        """The OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, ... ."""

    @abc.abstractmethod
    async def served_models(self) -> list[ServedModel]:
        """What to announce now; the runtime announces and withdraws to match."""

    async def check_health(self) -> None:  # noqa: B027 - optional hook
        """Cheap health check (never a paid generation); raises `EngineUnavailableError`."""

    @property
    def in_flight(self) -> int:
        """Requests being served now, for drain and metrics."""
        return 0

    @property
    def kv_events(self) -> KvEndpoint | None:
        """Where the engine publishes its KV cache events (vLLM's format), once started."""
        return None

    def collect_metrics(self) -> Iterable[Metric]:
        """The engine's own metrics (queue depth, KV usage, tokens), read at each scrape.

        The worker's metrics collector adds them to the process's metrics registry, so engines
        keep plain counters on the request path and build metric families only when scraped.
        """
        return ()

    @property
    def unloads_adapters(self) -> bool:
        """Whether this engine can unload an adapter (it overrides `unload_adapter`)."""
        return type(self).unload_adapter is not Engine.unload_adapter

    async def load_adapter(self, name: str, path: str) -> ServedModel:
        raise EngineUnavailableError(f"engine {self.name} does not support LoRA adapters")

    async def unload_adapter(self, name: str) -> None:
        raise EngineUnavailableError(f"engine {self.name} does not support LoRA adapters")
