"""The built-in engines, imported on demand so a worker loads only the one it runs.

- `mocker`: `MockerEngine`, a simulated LLM with no weights (tests, demos, benchmarks).
- `openai`: `OpenAISidecarEngine`, an existing OpenAI-compatible server (vLLM, SGLang, ...).
- `llamacpp`: `LlamaCppEngine`, a GGUF model run in process by llama.cpp.
"""

from __future__ import annotations

import importlib

from shoal.worker.engine import Engine

ENGINES = {
    "mocker": ("shoal.worker.engines.mocker", "MockerEngine"),
    "openai": ("shoal.worker.engines.openai_sidecar", "OpenAISidecarEngine"),
    "llamacpp": ("shoal.worker.engines.llamacpp", "LlamaCppEngine"),
}


def engine_class(kind: str) -> type[Engine]:
    """The engine class for `kind` (one of `ENGINES`), imported now."""
    try:
        module, name = ENGINES[kind]
    except KeyError:
        raise ValueError(f"unknown engine {kind!r}: choose from {', '.join(ENGINES)}") from None
    cls: type[Engine] = getattr(importlib.import_module(module), name)
    return cls
