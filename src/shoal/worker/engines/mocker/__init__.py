"""The mocker: a simulated LLM with no weights, for tests, demos and benchmarks.

Text is derived from a hash of the prompt, so the same request always gets the same answer
(`text`); each field that would change a real answer behaves as vLLM's does or is refused
naming it (`conformance`). Prompts are tokenized with a real `tokenizers` model
(`tokenizer`), published with the chat template among the model's files (`metadata`); with
`kv_events_port` set, every block the simulated prefix cache (`prefix_cache`) stores or
evicts is published in vLLM's KV event format. The engine itself and its handlers are in
`engine`, its timing model and KV handoff in `sequences`; the bytes of its answers in
`framing`.
"""

from shoal.worker.engines.mocker.engine import MockerEngine

__all__ = ["MockerEngine"]
