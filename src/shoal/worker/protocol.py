"""The OpenAI wire format as workers speak it: errors, request bodies, SSE framing.

Shared by the built-in engines so that every worker answers errors the same way:
`{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from typing import Any, TypeVar

import msgspec
from aiohttp import web

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    501: "not_implemented_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error to answer in OpenAI format; raise it from a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "error")

    def body(self) -> bytes:
        return _encoder.encode(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body(), content_type="application/json")


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> web.Response:
    return OpenAIError(status, message, param=param, code=code).response()


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or is not served here.",
        param="model",
        code="model_not_found",
    )


_FIELD_RE = re.compile(r"field `([^`]+)`")
_PATH_RE = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")


def decode_request(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """Decode a JSON request body; raises `OpenAIError` 400 naming the parameter at fault."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        missing = "missing required field" in text
        match = (_FIELD_RE.search(text) if missing else None) or _PATH_RE.search(text)
        param = match.group(1) if match else None
        if missing and param:
            raise OpenAIError(
                400,
                f"Missing required parameter: '{param}'.",
                param=param,
                code="missing_required_parameter",
            ) from None
        raise OpenAIError(400, f"Invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(
            400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json"
        ) from None


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn `OpenAIError` and aiohttp's own 404/405/413 into OpenAI-format error responses."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except OpenAIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason)


class IdMaker:
    """Unique response ids (`chatcmpl-...`) without a uuid per request."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count(1)

    def __call__(self, kind: str) -> str:
        return f"{kind}-{self._prefix}{next(self._counter):08x}"


def now() -> int:
    return int(time.time())


_encoder = msgspec.json.Encoder()
