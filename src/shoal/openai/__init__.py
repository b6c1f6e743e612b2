"""Layer 2: the OpenAI wire format. Pure data, no I/O.

What belongs here is what a request or response looks like on the wire, the same for the
gateway and every engine: the error type and its JSON body (`errors`), Server-Sent Events
framing (`sse`), and the request schemas with their decoding (`schemas`). What does not:
anything that serves, routes or generates; how an HTTP framework sends these bytes stays
with the layer that uses the framework.
"""

from shoal.openai.errors import (
    ApiError,
    error_body,
    error_type,
    missing_parameter,
    model_not_found,
)
from shoal.openai.schemas import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    SamplingRequest,
    StreamOptions,
    decode_request,
)
from shoal.openai.sse import SSE_DONE, SSE_EVENT_END, SSE_EVENT_START, SSE_HEADERS, sse_event

__all__ = [
    "SSE_DONE",
    "SSE_EVENT_END",
    "SSE_EVENT_START",
    "SSE_HEADERS",
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "SamplingRequest",
    "StreamOptions",
    "decode_request",
    "error_body",
    "error_type",
    "missing_parameter",
    "model_not_found",
    "sse_event",
]
