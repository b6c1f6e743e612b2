"""A body's `model` is bounded (`fields.MAX_MODEL_NAME`): a longer one is a 400 naming it,
before any lookup, whatever the body's size (decoded on the event loop, or in the decoder
process for a large body), never a 404 quoting it whole."""

from __future__ import annotations

import asyncio

import pytest

from shoal.frontend.proxy.fields import MAX_MODEL_NAME
from tests.frontend.conftest import StartFrontend, StartWorker
from tests.frontend.support import raw_exchange, serving
from tests.helpers import wait_for


def post(body: bytes) -> bytes:
    return b"POST /v1/chat/completions HTTP/1.1\r\nhost: g\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


@pytest.mark.parametrize("length", [MAX_MODEL_NAME + 1, 8 << 20], ids=["small body", "8 MiB"])
async def test_a_model_name_over_the_bound_is_refused_not_quoted(
    start_worker: StartWorker, start_frontend: StartFrontend, length: int
) -> None:
    """A 15 MB `model` was looked up, then quoted whole in its 404: a 15 MB answer to each
    such request (an echo of any size a client likes), the loop held to build it."""
    await start_worker()
    frontend = await start_frontend()
    await wait_for(lambda: serving(frontend), message="served")
    body = b'{"model":"%s","messages":[{"role":"user","content":"hi"}]}' % (b"m" * length)
    answer = await asyncio.wait_for(raw_exchange(frontend.port, post(body)), 20)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert len(answer) < 1000
    assert b"$.model" in answer and b"%d" % MAX_MODEL_NAME in answer
    # A name within the bound is looked up as ever.
    fine = b'{"model":"mock-llm","messages":[{"role":"user","content":"hi"}]}'
    assert (await raw_exchange(frontend.port, post(fine))).startswith(b"HTTP/1.1 200 ")
