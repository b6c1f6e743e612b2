"""The operator's provider key in a provider's answer, in whatever form the provider wrote it:
JSON-escaped (`\\/`, `\\u002f`), URL-encoded (`%2F`, `%2f`), HTML-escaped (`&#x2F;`), mixed,
in the body of an error or in a response header. Only its raw bytes were masked: every other
form reached the client."""

from __future__ import annotations

import asyncio
import html
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from shoal.frontend.proxy.routed import Masked
from shoal.store import Store
from tests.frontend.conftest import StartFrontend
from tests.frontend.test_providers import serve_route, url_target

KEY = "sk-live/PROVIDER+SECRET=0123456789~x"


def _each(special: Callable[[str], str]) -> Callable[[str], str]:
    """The key with each character that is not a letter, digit or `-._` written by `special`."""
    return lambda key: "".join(c if c.isalnum() or c in "-._" else special(c) for c in key)


FORMS: dict[str, Callable[[str], str]] = {
    "json-slash": lambda key: key.replace("/", "\\/"),  # PHP's json_encode, Jackson's option
    "json-unicode": _each(lambda c: f"\\u{ord(c):04x}"),
    "json-unicode-upper": _each(lambda c: f"\\u{ord(c):04X}"),  # .NET's `\u002B`
    "url": lambda key: urllib.parse.quote(key, safe=""),
    "url-lower": lambda key: re.sub(
        "%..", lambda m: m.group().lower(), urllib.parse.quote(key, safe="")
    ),
    "html-hex": _each(lambda c: f"&#x{ord(c):X};"),
    "html-decimal": _each(lambda c: f"&#{ord(c)};"),
    "mixed": lambda key: key.replace("/", "\\/").replace("+", "%2b").replace("=", "\\u003D"),
}


def revealed(text: str) -> str:
    """`text` with every form undone: what a reader of it learns."""
    text = re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text)
    return html.unescape(urllib.parse.unquote(text.replace("\\/", "/")))


async def provider(
    status: int, form: Callable[[str], str], in_header: bool
) -> tuple[web.AppRunner, str]:
    """A provider answering `status` that quotes the bearer it was given in `form`: in its
    body, or (`in_header`) in a debug header, beside a URL quoting it."""

    async def answer(request: web.Request) -> web.Response:
        given = form(request.headers.get("Authorization", "")[len("Bearer ") :])
        if in_header:
            headers = {"X-Debug-Authorization": f"Bearer {given}",
                       "X-Debug-Url": f"https://x/?key={given}"}  # fmt: skip
            return web.json_response(
                {"error": {"message": "quota"}}, status=status, headers=headers
            )
        text = '{"error":{"message":"Invalid key: ' + given + '"}}'
        return web.Response(status=status, text=text, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def ask(url: str) -> tuple[int, str, list[tuple[str, str]]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/v1/chat/completions",
            json={"model": "v", "messages": [{"role": "user", "content": "hi"}]},
        ) as response,
    ):
        return response.status, await response.text(), list(response.headers.items())


@pytest.mark.parametrize("form", FORMS, ids=list(FORMS))
async def test_a_provider_error_body_quoting_the_key_in_any_form_reaches_the_client_masked(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any, form: str
) -> None:
    monkeypatch.setenv("SHOAL_SECRET_PKEY", KEY)
    runner, url = await provider(400, FORMS[form], in_header=False)
    try:
        frontend = await start_frontend()
        await serve_route(store, frontend, "v", url_target(url, "m", secret="pkey"))
        status, text, _ = await ask(frontend.url)  # (read whole: its length held)
        assert status == 400
        written = FORMS[form](KEY)
        assert text == '{"error":{"message":"Invalid key: ' + "*" * len(written) + '"}}'
        assert "0123456789" not in revealed(text)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("status", [429, 200])
@pytest.mark.parametrize("form", ["raw", "url", "json-slash"])
async def test_a_provider_header_quoting_the_key_in_any_form_reaches_the_client_masked(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any, form: str, status: int
) -> None:
    monkeypatch.setenv("SHOAL_SECRET_PKEY", KEY)
    runner, url = await provider(status, FORMS.get(form, lambda key: key), in_header=True)
    try:
        frontend = await start_frontend()
        await serve_route(store, frontend, "v", url_target(url, "m", secret="pkey"))
        answered, _, headers = await ask(frontend.url)
        assert answered == status
        for name, value in headers:
            assert "0123456789" not in revealed(value), (name, value)
        debug = dict(headers)["X-Debug-Authorization"]
        assert debug.startswith("Bearer ***") and set(debug[len("Bearer ") :]) == {"*"}
    finally:
        await runner.cleanup()


def test_every_form_of_the_key_is_masked_wherever_the_packets_cut_it() -> None:
    """Held back: as many bytes as the longest form of the key, less one; the body keeps its
    length (a `Content-Length` still holds)."""
    secret = KEY.encode()
    forms = [f(KEY).encode() for f in FORMS.values()]
    body = b'{"error":"key ' + b" and ".join(forms) + b" end" + secret + b'"}'
    expected = body
    for written in [secret, *forms]:
        expected = expected.replace(written, b"*" * len(written))
    for first in range(0, len(body) + 1, 3):
        for second in range(first, len(body) + 1, 7):
            masked = Masked(secret)
            pieces = (body[:first], body[first:second], body[second:])
            out = b"".join(masked.feed(p) for p in pieces) + masked.rest()
            assert out == expected, (first, second)


async def test_the_key_a_request_was_sent_with_is_masked_after_the_secret_rotated(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any
) -> None:
    """The secret rotated (`refresh_secrets`) while a request was at the provider: its answer
    quotes the key it was sent with, the old one (still valid at the provider during the
    overlap), and only the key in force when the answer came, the new one, was masked."""
    old, new = "sk-OLD-PROVIDER-SECRET-0123456789", "sk-NEW-PROVIDER-SECRET-9876543210"
    monkeypatch.setenv("SHOAL_SECRET_PKEY", old)
    arrived, release = asyncio.Event(), asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        given = request.headers.get("Authorization", "")[len("Bearer ") :]
        arrived.set()
        await release.wait()
        error = {"message": f"Bad request with key {given} ({FORMS['url'](given)})"}
        return web.json_response({"error": error}, status=400, headers={"X-Key": given})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        frontend = await start_frontend()
        await serve_route(store, frontend, "v", url_target(url, "m", secret="pkey"))
        asked = asyncio.create_task(ask(frontend.url))
        await asyncio.wait_for(arrived.wait(), 10)
        monkeypatch.setenv("SHOAL_SECRET_PKEY", new)  # the operator rotates the key
        await frontend.routes.refresh_secrets()
        (choice,) = frontend.routes.models["v"].choices
        assert choice.upstream.authorization == b"Bearer " + new.encode()  # type: ignore[union-attr]
        release.set()
        status, text, headers = await asyncio.wait_for(asked, 10)
        assert status == 400
        assert "0123456789" not in revealed(text), text
        assert dict(headers)["X-Key"] == "*" * len(old)
    finally:
        await runner.cleanup()
