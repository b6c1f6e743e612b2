"""The OpenAI wire format in the worker's aiohttp servers: error responses, ids, times.

The format itself (the error type, SSE framing, request schemas) lives in `shoal.openai`;
this module sends it with aiohttp, so that every worker answers errors the same way:
`{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

from aiohttp import web

from shoal.openai import ApiError


def error_response(error: ApiError) -> web.Response:
    """`error` as an aiohttp response."""
    return web.Response(
        status=error.status,
        body=error.body(),
        content_type="application/json",
        headers={k.decode("latin-1"): v.decode("latin-1") for k, v in error.headers},
    )


@web.middleware
async def openai_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turn `ApiError` and aiohttp's own 404/405/413 into OpenAI-format error responses."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, exc.reason))


class IdMaker:
    """Unique response ids (`chatcmpl-...`) without a uuid per request."""

    def __init__(self) -> None:
        self._prefix = os.urandom(6).hex()
        self._counter = itertools.count(1)

    def __call__(self, kind: str) -> str:
        return f"{kind}-{self._prefix}{next(self._counter):08x}"


def now() -> int:
    return int(time.time())
