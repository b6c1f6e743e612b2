"""A small real OpenAI-compatible server standing in for vLLM behind the `openai` sidecar.

It answers `/health` and `/v1/models`, and streams a chat completion one chunk per release
of a gate, so tests can prove that chunks cross the sidecar one by one. It records every
request and `Authorization` header it gets, and can require an API key.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from tests.helpers import Server

MODEL = "fake/model-7b"


def sse(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def chat_chunk(content: str, finish_reason: str | None = None) -> dict[str, object]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish_reason}],
    }


STREAM = [
    sse(chat_chunk("Hello")),
    sse(chat_chunk(", ")),
    sse(chat_chunk("world", finish_reason="stop")),
    b"data: [DONE]\n\n",
]


class FakeUpstream:
    """A minimal OpenAI-compatible server that records every request it gets."""

    def __init__(self, *, health_status: int = 200, api_key: str | None = None) -> None:
        self.health_status = health_status
        self.api_key = api_key  # when set, every route needs `Authorization: Bearer <api_key>`
        self.model_ids = [MODEL]  # base models listed, besides the adapters
        self.adapter_ids = ["sql-lora"]  # adapters listed on `MODEL`
        self.requests: list[tuple[str, str]] = []
        self.bodies: list[bytes] = []  # the body of each chat request, as received
        self.authorizations: list[str | None] = []
        self.gate = asyncio.Semaphore(0)  # one release per streamed chunk
        self.chunks_sent = 0
        self.hang_after_first_chunk = False
        self.probe_delay = 0.0  # seconds `/health` and `/v1/models` take to answer (a slow server)
        self.stream_cancelled = asyncio.Event()
        self.server = Server(self.app())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.authenticate], client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        authorization = request.headers.get("Authorization")
        self.authorizations.append(authorization)
        if self.api_key is not None and authorization != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    async def health(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path))
        await asyncio.sleep(self.probe_delay)
        return web.Response(status=self.health_status)

    async def models(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path))
        await asyncio.sleep(self.probe_delay)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    *(
                        {"id": name, "object": "model", "max_model_len": 8192, "parent": None}
                        for name in self.model_ids
                    ),
                    *(
                        {"id": name, "object": "model", "parent": MODEL}
                        for name in self.adapter_ids
                    ),
                ],
            }
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        self.bodies.append(await request.read())
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 1,
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "Hello"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
                },
                status=201,  # unusual on purpose: the status must cross unchanged
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for chunk in STREAM:
                await self.gate.acquire()
                self.chunks_sent += 1
                await response.write(chunk)
                if self.hang_after_first_chunk:
                    await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.stream_cancelled.set()
            raise
        await response.write_eof()
        return response
