"""The operator's provider key in a provider's answer, in whatever form the provider wrote it:
JSON-escaped (`\\/`, `\\u002f`), URL-encoded (`%2F`, `%2f`), HTML-escaped (`&#x2F;`), mixed,
in the body of an error or in a response header. Only its raw bytes were masked: every other
form reached the client."""

from __future__ import annotations

import asyncio
import gzip
import html
import json
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from shoal.frontend.proxy.routed import Masked
from shoal.frontend.virtual import masking
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
    # (one more level: leading zeros, URL-encoded twice, a JSON string inside a JSON string)
    "html-zeros": _each(lambda c: f"&#x000{ord(c):X};"),
    "html-decimal-zeros": _each(lambda c: f"&#00000{ord(c)};"),
    "url-twice": lambda key: urllib.parse.quote(urllib.parse.quote(key, safe=""), safe=""),
    "json-in-json": lambda key: key.replace("/", "\\\\/"),
    "json-in-json-twice": lambda key: key.replace("/", "\\\\\\\\/"),  # (`\\/` quoted twice)
    "json-in-json-unicode": _each(lambda c: f"\\\\u{ord(c):04x}"),
}


def revealed(text: str) -> str:
    """`text` with every form undone, twice: what a reader of it learns."""
    for _ in range(2):
        text = text.replace("\\\\", "\\")
        text = re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text)
        text = html.unescape(urllib.parse.unquote(text.replace("\\/", "/")))
    return text


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


KEY_HTML = "sk-live&PROVIDER\"SECRET<0123456789>x'y"  # (visible ASCII: a secret may hold & " < > ')


@pytest.mark.parametrize("escape", ["html.escape", "named-upper"])
async def test_a_key_holding_html_specials_written_as_named_entities_reaches_the_client_masked(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any, escape: str
) -> None:
    """`html.escape` writes `&amp;` `&quot;` `&lt;` `&gt;` `&#x27;`: only numeric entities were
    among the forms, so a key holding any of `& " < > '` reached the client readable."""
    monkeypatch.setenv("SHOAL_SECRET_PKEY", KEY_HTML)
    upper = {"&": "&AMP;", '"': "&QUOT;", "<": "&LT;", ">": "&GT;", "'": "&apos;"}
    form = html.escape if escape == "html.escape" else _each(lambda c: upper.get(c, c))
    runner, url = await provider(400, form, in_header=False)
    try:
        frontend = await start_frontend()
        await serve_route(store, frontend, "v", url_target(url, "m", secret="pkey"))
        status, text, _ = await ask(frontend.url)
        assert status == 400
        assert text == '{"error":{"message":"Invalid key: ' + "*" * len(form(KEY_HTML)) + '"}}'
    finally:
        await runner.cleanup()


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


async def test_a_provider_body_of_any_status_quoting_the_key_reaches_the_client_masked(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any
) -> None:
    """Only bodies of a status of 400 or more were masked: a redirect's page and a 200 that
    echoes the `Authorization` it got (a debug field, a streamed event) carried the key
    through. Every provider body is masked now; a stream's events are not held back behind
    the next one (the provider sends its second event only once the client has the first)."""
    monkeypatch.setenv("SHOAL_SECRET_PKEY", KEY)
    got_first = asyncio.Event()

    async def answer(request: web.Request) -> web.StreamResponse:
        given = request.headers["Authorization"][len("Bearer ") :]
        model = (await request.json())["model"]
        if model == "redirect":
            location = f"https://login.example/?key={FORMS['url'](given)}"
            page = f'<a href="{location}">moved</a> {given}'
            return web.Response(status=302, headers={"Location": location}, text=page)
        if model == "echo":
            return web.json_response({"id": "x", "debug": {"auth": f"Bearer {given}"}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f'data: {{"n":1,"auth":"{given}","tail":"sk"}}\n\n'.encode())
        await asyncio.wait_for(got_first.wait(), 10)  # (held back: the client never gets it)
        await response.write(f'data: {{"n":2,"auth":"{FORMS["json-slash"](given)}"}}\n\n'.encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner, url = await serve(app)
    try:
        frontend = await start_frontend()
        for name in ("redirect", "echo", "stream"):
            await serve_route(store, frontend, name, url_target(url, name, secret="pkey"))
        async with aiohttp.ClientSession() as session:
            chat = f"{frontend.url}/v1/chat/completions"
            for name in ("redirect", "echo"):
                body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
                async with session.post(chat, json=body, allow_redirects=False) as response:
                    text = await response.text()
                    assert response.status == (302 if name == "redirect" else 200)
                    assert "0123456789" not in revealed(text), text
                    assert "*" * len(KEY) in text, text
                    location = response.headers.get("Location", "")
                    assert "0123456789" not in revealed(location), location
            body = {"model": "stream", "messages": [{"role": "user", "content": "hi"}]}
            events = []
            async with session.post(chat, json=body) as response:
                assert response.status == 200
                async for line in response.content:
                    if line.startswith(b"data: "):
                        events.append(line.decode())
                        got_first.set()
        assert len(events) == 3, events
        first = json.loads(events[0][len("data: ") :])
        assert first == {"n": 1, "auth": "*" * len(KEY), "tail": "sk"}
        assert "0123456789" not in revealed("".join(events)), events
    finally:
        await runner.cleanup()


async def test_a_compressed_provider_body_is_dropped_for_a_502_naming_the_provider_and_encoding(
    store: Store, start_frontend: StartFrontend, monkeypatch: Any
) -> None:
    """The gateway asks a provider for identity; one that gzips its error anyway had its
    compressed bytes searched for the key (never found there), and the client decompressed
    the key. Now such a body is not relayed: a 502 `provider_encoding` names both."""
    monkeypatch.setenv("SHOAL_SECRET_PKEY", KEY)

    async def answer(request: web.Request) -> web.Response:
        given = request.headers["Authorization"][len("Bearer ") :]
        data = gzip.compress(('{"error":{"message":"bad key ' + given + '"}}').encode())
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        return web.Response(status=400, headers=headers, body=data)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner, url = await serve(app)
    try:
        frontend = await start_frontend()
        await serve_route(store, frontend, "v", url_target(url, "m", secret="pkey"))
        status, text, headers = await ask(frontend.url)
        assert status == 502
        error = json.loads(text)["error"]
        assert error["code"] == "provider_encoding"
        assert "gzip" in error["message"] and "127.0.0.1" in error["message"], error
        assert "0123456789" not in revealed(text)
        assert "content-encoding" not in {name.lower() for name, _ in headers}
    finally:
        await runner.cleanup()


async def raw_provider(head: Callable[[str], bytes]) -> tuple[asyncio.Server, str]:
    """A provider written on sockets (aiohttp would not send a `Transfer-Encoding` of gzip):
    to each request, the bytes `head(bearer)` and a gzipped body quoting the bearer."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        found = re.search(rb"(?i)\r\nauthorization: bearer ([^\r]*)", request)
        given = found.group(1).decode() if found else ""
        length = re.search(rb"(?i)\r\ncontent-length: (\d+)", request)
        await reader.readexactly(int(length.group(1)) if length else 0)
        body = gzip.compress(('{"error":{"message":"bad key ' + given + '"}}').encode())
        writer.write(head(given) + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


CODED_HEADS: dict[str, Callable[[str], bytes]] = {
    # a coding of the transfer, not of the content: the body reached the client gzipped
    "te-gzip": lambda key: (
        b"HTTP/1.1 400 Bad\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: gzip, chunked\r\n\r\n"
    ),
    # a coding that quotes the key: the 502 and the log quoted it unmasked
    "ce-quoting-key": lambda key: (
        b"HTTP/1.1 400 Bad\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: x-" + key.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    ),
}


@pytest.mark.parametrize("head", CODED_HEADS, ids=list(CODED_HEADS))
async def test_a_provider_coding_other_than_chunked_is_refused_and_its_value_masked(
    store: Store,
    start_frontend: StartFrontend,
    monkeypatch: Any,
    caplog: pytest.LogCaptureFixture,
    head: str,
) -> None:
    """Only `Content-Encoding` was checked: a `Transfer-Encoding: gzip, chunked` body went to
    the client compressed, the key inside it unmasked; and a coding quoting the key was
    quoted in the 502 as it came. Now any coding but identity and chunked is refused, and the
    502 names the header with the key masked in its value."""
    monkeypatch.setenv("SHOAL_SECRET_PKEY", KEY)
    caplog.set_level("DEBUG")
    server, url = await raw_provider(CODED_HEADS[head])
    try:
        frontend = await start_frontend()
        await serve_route(store, frontend, "v", url_target(url, "m", secret="pkey"))
        status, text, _ = await ask(frontend.url)
        assert status == 502, text
        error = json.loads(text)["error"]
        assert error["code"] == "provider_encoding", error
        assert "Encoding" in error["message"] and "127.0.0.1" in error["message"], error
        assert "0123456789" not in revealed(text), text
        assert "0123456789" not in revealed(caplog.text), caplog.text
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("piece", [1, 7, 64 << 10])
def test_masking_a_body_full_of_near_matches_searches_each_byte_a_bounded_number_of_times(
    piece: int,
) -> None:
    """A body of the key less its last character, again and again, in every form: each packet
    is searched with at most the bytes held before it (fewer than the longest form), so the
    work grows with the body, never with its square; the body goes out as it came, but for
    the key itself, written in every form at its end."""
    secret = KEY.encode()
    near = [f(KEY[:-1]).encode() for f in FORMS.values()] + [secret[:-1]]
    whole = [f(KEY).encode() for f in FORMS.values()]
    body = b" ".join(near * 40 + whole)
    expected = b" ".join(near * 40 + [b"*" * len(w) for w in whole])
    searched = 0
    real = masking.mask

    def counted(data: bytes, patterns: Any) -> bytes:
        nonlocal searched
        searched += len(data)
        return real(data, patterns)

    masking.mask = counted  # type: ignore[assignment]
    try:
        masked = Masked(secret)
        pieces = [body[i : i + piece] for i in range(0, len(body), piece)]
        out = b"".join(masked.feed(p) for p in pieces) + masked.rest()
    finally:
        masking.mask = real  # type: ignore[assignment]
    assert out == expected
    assert searched <= len(body) + len(pieces) * masked.keep
    assert searched <= 2 * len(body) or piece < masked.keep  # (large packets: about once)
