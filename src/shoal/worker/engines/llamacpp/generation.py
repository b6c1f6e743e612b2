"""One request's generation: it runs on the engine thread and hands its results to the
event loop; and how its failures become OpenAI errors.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from shoal.openai import ApiError

log = logging.getLogger(__name__)

END = object()
"""What a streamed generation hands over last, once llama.cpp's chunks are all sent."""


class Generation:
    """One request's generation: runs on the engine thread, hands results to the loop.

    `logits_guard` is called by llama.cpp before each token is sampled: it counts the
    prompt and sampled tokens, applies `logit_bias`, and once `cancelled` is set it leaves
    only end-of-sequence to sample, which ends even a non-streaming generation at the
    next token.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        eos_token: int,
        logit_bias: dict[int, float] | None = None,
    ) -> None:
        self.loop = loop
        self.eos_token = eos_token
        self.logit_bias = logit_bias or {}
        self.queue: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.prompt_tokens = 0
        self.sampled_tokens = 0

    def logits_guard(self, input_ids: Any, scores: Any) -> Any:
        if self.sampled_tokens == 0:
            self.prompt_tokens = len(input_ids)
        self.sampled_tokens += 1
        for token, bias in self.logit_bias.items():
            scores[token] += bias
        if self.cancelled.is_set():
            scores.fill(float("-inf"))
            scores[self.eos_token] = 0.0
        return scores

    def emit(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening
            self.cancelled.set()

    def usage(self, finish_reason: str | None) -> dict[str, int]:
        # Ending on "stop", the last token sampled was end-of-sequence (or ended a stop
        # string), which is not part of the completion.
        completion = self.sampled_tokens
        if finish_reason == "stop" and completion:
            completion -= 1
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }


def engine_stopping() -> ApiError:
    return ApiError(503, "The engine is stopping.", code="engine_stopping")


def as_openai_error(exc: BaseException) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValueError):
        code = "context_length_exceeded" if "context window" in str(exc) else None
        return ApiError(400, str(exc), code=code)
    log.error("llama.cpp generation failed", exc_info=exc)
    return ApiError(500, f"The generation failed: {exc!r}")
