"""Layer 5: the worker runtime, its status server, the metadata registry and the engines.

`Runtime` owns a process's hold on the fleet and starts everything; `Endpoint` serves one
engine; `Registrations` holds what the process announces, under its one lease; `Health`,
`WorkerCollector` (`metrics`) and `AdapterRoutes` (`adapters`) are what the `StatusServer`
serves; `MetadataRegistry` holds the hosted metadata files. Engines implement `Engine`.

Write your own engine against `Engine`, then serve it::

    async with Runtime("sqlite:///tmp/shoal.db") as runtime:
        await runtime.endpoint("default.backend.generate").serve(MyEngine())
        await runtime.run_until_stopped()

See docs/runtime.md.
"""

from shoal.worker.endpoint import Endpoint, card_for
from shoal.worker.engine import Engine, EngineUnavailableError, ServedModel
from shoal.worker.metadata import CollisionError, MetadataKey, MetadataRegistry
from shoal.worker.registrations import DRAINING, Registrations
from shoal.worker.runtime import Runtime

__all__ = [
    "DRAINING",
    "CollisionError",
    "Endpoint",
    "Engine",
    "EngineUnavailableError",
    "MetadataKey",
    "MetadataRegistry",
    "Registrations",
    "Runtime",
    "ServedModel",
    "card_for",
]
