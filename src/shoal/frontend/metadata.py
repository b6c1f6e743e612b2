"""Model metadata files (config, tokenizer, chat template), fetched from workers and cached.

A card lists each file with the URL where its worker hosts it and its checksum. Files are
kept on disk by checksum, so a file is fetched once per frontend cache whatever the number
of workers that serve it, and a cached file needs no verification again. Cards that need a
file whose download is already in flight wait for that download instead of starting theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
from pathlib import Path

import aiohttp
import platformdirs

from shoal.cards import MetadataFile, ModelCard

log = logging.getLogger(__name__)


class MetadataError(Exception):
    """A metadata file could not be fetched, or did not match its checksum or size."""


def default_cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("shoal")) / "metadata"


class MetadataCache:
    """Verified metadata files on disk, named by checksum."""

    def __init__(self, directory: Path | None = None, *, timeout: float = 30.0) -> None:
        self.directory = directory or default_cache_dir()
        self.timeout = timeout
        self._verified: set[str] = set()
        self._downloads: dict[str, asyncio.Task[None]] = {}  # by checksum, in flight
        self._session: aiohttp.ClientSession | None = None

    def path(self, checksum: str) -> Path:
        return self.directory / checksum.replace(":", "-")

    def has(self, file: MetadataFile) -> bool:
        if file.checksum in self._verified:
            return True
        if self.path(file.checksum).is_file():
            self._verified.add(file.checksum)
            return True
        return False

    def missing(self, card: ModelCard) -> dict[str, MetadataFile]:
        return {name: f for name, f in card.metadata_files.items() if not self.has(f)}

    async def fetch(self, card: ModelCard) -> None:
        """Fetch and verify every file of `card` not cached yet; `MetadataError` on any failure."""
        missing = self.missing(card)
        if missing:
            await asyncio.gather(*(self._fetch_one(name, f) for name, f in missing.items()))

    async def _fetch_one(self, name: str, file: MetadataFile) -> None:
        """Download `file`, or wait for the download of its checksum already in flight.

        The download is shielded: a card that goes away does not cancel it for the others.
        If another card's download fails, this card's own URL is tried: one worker's
        failure says nothing of another's copy.
        """
        running = self._downloads.get(file.checksum)
        if running is None:
            running = asyncio.create_task(self._download(name, file), name=f"metadata:{name}")
            self._downloads[file.checksum] = running
            running.add_done_callback(functools.partial(self._download_done, file.checksum))
            await asyncio.shield(running)
            return
        try:
            await asyncio.shield(running)
        except MetadataError:
            await self._download(name, file)

    def _download_done(self, checksum: str, task: asyncio.Task[None]) -> None:
        if self._downloads.get(checksum) is task:
            del self._downloads[checksum]
        if not task.cancelled():
            task.exception()  # retrieved: whoever awaited it has it; nobody else needs it

    async def _download(self, name: str, file: MetadataFile) -> None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        digest = hashlib.sha256()
        chunks: list[bytes] = []
        size = 0
        try:
            async with self._session.get(file.url) as response:
                if response.status != 200:
                    raise MetadataError(f"{name}: GET {file.url} answered {response.status}")
                async for chunk in response.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > file.size:
                        raise MetadataError(f"{name}: {file.url} is larger than {file.size} bytes")
                    digest.update(chunk)
                    chunks.append(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise MetadataError(f"{name}: GET {file.url} failed: {exc or 'timed out'}") from exc
        checksum = f"sha256:{digest.hexdigest()}"
        if checksum != file.checksum or size != file.size:
            raise MetadataError(
                f"{name}: {file.url} has checksum {checksum} ({size} bytes), "
                f"the card says {file.checksum} ({file.size} bytes)"
            )
        await asyncio.to_thread(self._store, file.checksum, b"".join(chunks))
        self._verified.add(file.checksum)

    def _store(self, checksum: str, data: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path(checksum)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{id(data):x}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    async def close(self) -> None:
        downloads = list(self._downloads.values())
        for task in downloads:
            task.cancel()
        for task in downloads:
            with contextlib.suppress(BaseException):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None
