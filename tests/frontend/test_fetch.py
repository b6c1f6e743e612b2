"""The metadata files' own HTTP client (`shoal.frontend.http.fetch.Fetcher`): keep-alive
connections reused, a stale one tried once more, bodies bounded, statuses and odd URLs
refused or left to a general client, at most `per_host` connections to one host."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.cards import MetadataFile, ModelCard
from shoal.frontend.http.fetch import Fetcher, FetchError
from shoal.frontend.registry.metadata import MetadataCache, MetadataError

BODY = b'{"vocab": {"a": 0}}'


class RawHost:
    """An HTTP/1.1 server on loopback written on raw sockets, so that the test decides
    exactly when a connection closes. `mode`: "ok" answers `BODY` and keeps the connection;
    "drop-second" answers the first request of a connection, and closes it without answering
    at the second (a server's keep-alive timeout that fell as the request came); "huge" answers a body of 1 MiB; "404" answers 404; "hang" never
    answers."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.delay = 0.01  # before each answer of "ok" (so that requests overlap)
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)

    def url(self, target: str = "/w0/tokenizer.json") -> str:
        return f"http://127.0.0.1:{self.port}{target}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            served = 0
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head)
                if self.mode == "drop-second" and served:
                    break
                served += 1
                if self.mode == "hang":
                    await asyncio.sleep(3600)  # a server that never answers
                if self.mode == "404":
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                elif self.mode == "huge":
                    body = b"x" * (1 << 20)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
                    writer.write(body)
                else:
                    await asyncio.sleep(self.delay)  # a slow server
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY))
                    writer.write(BODY)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            writer.close()


@pytest.fixture
async def raw_host() -> AsyncIterator[RawHost]:
    host = RawHost()
    await host.start()
    yield host
    await host.stop()


async def test_fetches_reuse_one_keep_alive_connection(raw_host: RawHost) -> None:
    fetcher = Fetcher()
    try:
        for _ in range(5):
            assert await fetcher.get(raw_host.url(), 1000, 5) == BODY
    finally:
        fetcher.close()
    assert raw_host.connections == 1
    assert len(raw_host.requests) == 5
    assert raw_host.requests[0].startswith(b"GET /w0/tokenizer.json HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:%d\r\n" % raw_host.port in raw_host.requests[0]


async def test_a_connection_the_server_closed_is_tried_once_more_on_a_new_one(
    raw_host: RawHost,
) -> None:
    raw_host.mode = "drop-second"
    fetcher = Fetcher()
    try:
        for _ in range(3):
            assert await fetcher.get(raw_host.url(), 1000, 5) == BODY
    finally:
        fetcher.close()
    # Each connection answered once and dropped the next request, which went to a new one.
    assert raw_host.connections == 3
    assert len(raw_host.requests) == 5


async def test_a_body_over_its_bound_is_refused_and_its_connection_not_reused(
    raw_host: RawHost,
) -> None:
    raw_host.mode = "huge"
    fetcher = Fetcher()
    try:
        with pytest.raises(FetchError, match="larger than 1000 bytes"):
            await fetcher.get(raw_host.url(), 1000, 5)
        raw_host.mode = "ok"
        assert await fetcher.get(raw_host.url(), 1000, 5) == BODY
    finally:
        fetcher.close()
    assert raw_host.connections == 2


async def test_a_status_other_than_200_is_an_error_naming_it(raw_host: RawHost) -> None:
    raw_host.mode = "404"
    fetcher = Fetcher()
    try:
        with pytest.raises(FetchError, match="answered 404"):
            await fetcher.get(raw_host.url(), 1000, 5)
    finally:
        fetcher.close()


async def test_at_most_per_host_connections_to_one_host(raw_host: RawHost) -> None:
    fetcher = Fetcher(per_host=3)
    try:
        bodies = await asyncio.gather(
            *(fetcher.get(raw_host.url(f"/w{i}/f"), 1000, 5) for i in range(30))
        )
    finally:
        fetcher.close()
    assert bodies == [BODY] * 30
    assert raw_host.most_open == 3


def test_only_plain_http_urls_are_taken() -> None:
    assert Fetcher.handles("http://10.0.0.7:8081/metadata/config.json")
    assert Fetcher.handles("http://worker/metadata/config.json?rev=2")
    assert not Fetcher.handles("https://worker/metadata/config.json")
    assert not Fetcher.handles("http://worker/meta data/config.json")  # a space: encoded elsewhere
    assert not Fetcher.handles("http://worker/x\r\nInjected: 1")
    assert not Fetcher.handles("http://worker/caf\u00e9")
    assert not Fetcher.handles("http://worker:notaport/x")
    assert not Fetcher.handles("ftp://worker/x")
    assert not Fetcher.handles("http://wo rker:80/x")
    assert Fetcher.handles("http://[::1]:8081/x")
    assert Fetcher.handles("http://user:secret@worker:8081/x")


def _card(url: str) -> ModelCard:
    return ModelCard.build(
        display_name="m",
        slug="m",
        source="test/m",
        model_types=["chat"],
        context_length=4096,
        metadata_files={
            "tokenizer.json": {
                "url": url,
                "checksum": "sha256:" + hashlib.sha256(BODY).hexdigest(),
                "size": len(BODY),
            }
        },
    )


async def test_a_cache_download_that_hangs_times_out_naming_the_timeout(
    raw_host: RawHost, tmp_path: Path
) -> None:
    raw_host.mode = "hang"
    cache = MetadataCache(tmp_path, timeout=0.3)
    try:
        with pytest.raises(MetadataError, match=r"timed out after 0\.3s"):
            await cache.fetch(_card(raw_host.url()))
    finally:
        await cache.close()


async def test_the_cache_keeps_a_file_fetched_by_its_own_client(
    raw_host: RawHost, tmp_path: Path
) -> None:
    cache = MetadataCache(tmp_path)
    card = _card(raw_host.url())
    try:
        await cache.fetch(card)
    finally:
        await cache.close()
    file: MetadataFile = card.metadata_files["tokenizer.json"]
    assert cache.path(file.checksum).read_bytes() == BODY
    assert len(raw_host.requests) == 1


async def test_files_verified_together_are_written_in_few_thread_wake_ups(tmp_path: Path) -> None:
    cache = MetadataCache(tmp_path)
    files = {f"sha256:{i:064x}": b"%d" % i for i in range(200)}
    try:
        kept = await asyncio.gather(*(cache._writer.write(c, data) for c, data in files.items()))
    finally:
        await cache.close()
    assert kept == [True] * 200
    assert all(cache.path(c).read_bytes() == data for c, data in files.items())
    assert cache._writer.batches < 20  # (one wake-up per file was the thread hop's way)


async def test_the_timeout_bounds_a_request_not_its_wait_for_a_turn_at_its_host(
    raw_host: RawHost,
) -> None:
    """Twenty files queued for one host two at a time, each answered in 50 ms: the last
    waits ~0.5 s for its turn, and none of them is late by a 0.2 s timeout."""
    raw_host.delay = 0.05
    fetcher = Fetcher(per_host=2)
    try:
        bodies = await asyncio.gather(
            *(fetcher.get(raw_host.url(f"/w{i}/f"), 1000, 0.2) for i in range(20))
        )
    finally:
        fetcher.close()
    assert bodies == [BODY] * 20
    assert raw_host.most_open == 2


async def test_a_failed_download_names_its_url_without_credentials(
    raw_host: RawHost, tmp_path: Path
) -> None:
    raw_host.mode = "404"
    cache = MetadataCache(tmp_path)
    url = f"http://user:hunter2@127.0.0.1:{raw_host.port}/w0/tokenizer.json"
    try:
        with pytest.raises(MetadataError) as failure:
            await cache.fetch(_card(url))
    finally:
        await cache.close()
    assert "answered 404" in str(failure.value)
    assert "hunter2" not in str(failure.value)
    assert b"Authorization: Basic " in raw_host.requests[0]  # (sent, as the URL asked)
