"""Layer 5: the worker runtime, its status server, the metadata registry and the engines.

Write your own engine against `Engine`, then serve it::

    async with Runtime("sqlite:///tmp/shoal.db") as runtime:
        await runtime.endpoint("default.backend.generate").serve(MyEngine())
        await runtime.run_until_stopped()

See docs/runtime.md.
"""

from shoal.worker.endpoint import Endpoint, card_for
from shoal.worker.engine import Engine, EngineUnavailableError, ServedModel
from shoal.worker.metadata import CollisionError, MetadataKey, MetadataRegistry
from shoal.worker.runtime import DRAINING, Runtime

__all__ = [
    "DRAINING",
    "CollisionError",
    "Endpoint",
    "Engine",
    "EngineUnavailableError",
    "MetadataKey",
    "MetadataRegistry",
    "Runtime",
    "ServedModel",
    "card_for",
]
