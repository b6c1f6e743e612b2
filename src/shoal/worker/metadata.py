"""The metadata registry: which local file the status server hosts at each metadata URL.

A model card lists its metadata files (config, tokenizer, chat template) by URL on the
worker's status server:

    /v1/metadata/{namespace}/{component}/{endpoint}/{slug}/{suffix}/{filename}

with suffix `_` for the base model. Each entry belongs to the model registration that
put it there, its owner (a `ModelKey`: endpoint, instance id and adapter suffix), so a
detach removes exactly what that model registered and nothing leaks: the base model and
each adapter are separate owners. The registry is process-local and never builds a path
from a URL: a request is an exact lookup of its six segments.

Each entry holds a snapshot of the file's bytes, read once at registration (at most
`MAX_METADATA_FILE`) and checksummed from that very read: the card's checksum always
matches what is served, even if the file is edited, grown or deleted afterwards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

from shoal.discovery import EndpointId, ModelKey

MAX_METADATA_FILE = 64 * 1024 * 1024
"""Bytes a metadata file may have; a larger one is not hosted (weights are never metadata)."""

BASE_SUFFIX = "_"
"""The suffix segment of a base model's metadata URLs."""

Owner = ModelKey
"""Who registered an entry: the model registration (endpoint, instance id, suffix)."""

_BAD_SEGMENT_CHARS = ("/", "\\", "\x00")


def url_segment(part: str) -> bool:
    """Whether `part` can be one segment of a metadata URL: not empty, `.` or `..`, no `/`,
    backslash or NUL, and UTF-8 (a file name that is not decodes with surrogates, which
    neither a URL nor a card's JSON can carry). The status server refuses any other, so a
    file named so is never hosted."""
    if part in ("", ".", "..") or any(c in part for c in _BAD_SEGMENT_CHARS):
        return False
    return part.isascii() or _encodes(part)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class MetadataKey(NamedTuple):
    """The six URL segments that name one hosted file."""

    namespace: str
    component: str
    endpoint: str
    slug: str
    suffix: str
    filename: str

    @classmethod
    def of(cls, endpoint: EndpointId, slug: str, suffix: str | None, filename: str) -> MetadataKey:
        return cls(
            endpoint.namespace,
            endpoint.component,
            endpoint.endpoint,
            slug,
            BASE_SUFFIX if suffix is None else suffix,
            filename,
        )

    @property
    def path(self) -> str:
        """The URL path that serves this file."""
        return "/v1/metadata/" + "/".join(quote(part, safe="") for part in self)


class CollisionError(Exception):
    """A metadata key is already held by another owner; the registry was left unchanged."""


class Snapshot(NamedTuple):
    """A metadata file's bytes as registered, and their checksum (`sha256:<hex>`)."""

    data: bytes
    checksum: str

    @classmethod
    def read(cls, path: Path) -> Snapshot:
        """Read `path` once; `ValueError` naming it if it is over `MAX_METADATA_FILE` bytes."""
        with path.open("rb") as fh:
            data = fh.read(MAX_METADATA_FILE + 1)
        if len(data) > MAX_METADATA_FILE:
            raise ValueError(
                f"metadata file {path} is over the {MAX_METADATA_FILE} byte cap: not hosted"
            )
        return cls(data, f"sha256:{hashlib.sha256(data).hexdigest()}")


class MetadataRegistry:
    """Maps metadata keys to (file bytes, owner). Changes are all-or-nothing.

    An index by owner keeps every call linear in what it touches: detaching, re-attaching
    or re-registering one model costs its own files, not every model's (a worker with
    thousands of adapters detaches or re-registers all of them in linear time).
    """

    def __init__(self) -> None:
        self._entries: dict[MetadataKey, tuple[bytes, Owner]] = {}
        self._by_owner: dict[Owner, set[MetadataKey]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def lookup(self, key: MetadataKey) -> bytes | None:
        """The bytes hosted at `key` (as registered), or None."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def owner_of(self, key: MetadataKey) -> Owner | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def register(self, owner: Owner, files: Iterable[tuple[MetadataKey, bytes]]) -> None:
        """Host `files` for `owner`. The same owner re-registering a key updates its bytes.

        Raises `CollisionError` naming both owners if any key is held by another owner;
        then nothing is registered.
        """
        self._put(owner, self._check(owner, files))

    def replace(self, owner: Owner, files: Iterable[tuple[MetadataKey, bytes]]) -> None:
        """Make `files` exactly what `owner` hosts (a re-attached model); all or nothing."""
        batch = self._check(owner, files)
        self.unregister_for_owner(owner)
        self._put(owner, batch)

    def _put(self, owner: Owner, batch: list[tuple[MetadataKey, bytes]]) -> None:
        if not batch:
            return
        keys = self._by_owner.setdefault(owner, set())
        for key, data in batch:
            self._entries[key] = (data, owner)
            keys.add(key)

    def _check(
        self, owner: Owner, files: Iterable[tuple[MetadataKey, bytes]]
    ) -> list[tuple[MetadataKey, bytes]]:
        batch = list(files)
        for key, _ in batch:
            held = self._entries.get(key)
            if held is not None and held[1] != owner:
                raise CollisionError(
                    f"metadata file {key.path} is held by {held[1]}; refusing to register it "
                    f"for {owner}"
                )
        return batch

    def unregister_for_owner(self, owner: Owner) -> int:
        """Remove every entry of `owner` and no other; returns how many. Idempotent."""
        keys = self._by_owner.pop(owner, ())
        for key in keys:
            del self._entries[key]
        return len(keys)

    def reassign(self, old: Owner, new: Owner) -> int:
        """Hand every entry of `old` to `new` (a re-granted lease renames the instance)."""
        if old == new:
            return 0
        keys = self._by_owner.pop(old, None)
        if not keys:
            return 0
        for key in keys:
            self._entries[key] = (self._entries[key][0], new)
        self._by_owner.setdefault(new, set()).update(keys)
        return len(keys)

    def files_of(self, owner: Owner) -> list[tuple[MetadataKey, bytes]]:
        """What `owner` hosts, as `(key, bytes)` pairs."""
        return [(key, self._entries[key][0]) for key in self._by_owner.get(owner, ())]
