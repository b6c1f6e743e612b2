"""API keys at the frontend (`--auth keys`): the grants of the store, checked in memory.

`KeyRing` holds the grants of the frontend's workspaces by the hash of their secret, the one
lookup a request makes: a bearer is hashed with the pepper (`--key-pepper`, as the catalog's)
and found, or not, in one dict. Unknown, disabled or expired → 401 (unknown → 503
`keys_loading`, retry, until every workspace's keys were read once); a model outside the key's
allow-list → 403, answered before the model is looked up, so a key cannot learn whether a model
it may not use exists. `KeyWatcher` keeps the ring equal to `shoal/v1/keys/{workspace}/` of the
store: read, then watch from the read's revision + 1; a `Resync` or a broken watch replaces
the workspace's grants with what the store holds (a delete missed meanwhile is not kept). A
malformed grant is reported in `skipped` and never hides or removes a valid one.

The frontend's own `--api-key`s stay valid beside the keys: they are the operator's, with no
allow-list and no limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, TypeVar

import msgspec

from shoal.bounds import first_listed
from shoal.discovery.grants import Grant, GrantError, decode_grant, grants_prefix
from shoal.frontend.http.request import bearer_token
from shoal.openai import ApiError
from shoal.store import Delete, KeyValue, Put, Store

log = logging.getLogger(__name__)

T = TypeVar("T")
SLICE = 256  # grants decoded between two yields to the loop (~10 µs each)


async def _slices(items: Iterable[T]) -> AsyncIterator[list[T]]:
    """`items` in lists of `SLICE`, the loop given a turn after each."""
    rest = iter(items)
    while chunk := list(itertools.islice(rest, SLICE)):
        yield chunk
        await asyncio.sleep(0)


def invalid_key() -> ApiError:
    return ApiError(
        401,
        "Incorrect API key provided: send `Authorization: Bearer <key>` with a valid key.",
        type="invalid_request_error",
        code="invalid_api_key",
    )


def keys_loading() -> ApiError:
    """503 for a key not (yet) held while the store's keys are first read: a frontend that
    serves before it has read them answered a valid key 401, which clients do not retry."""
    return ApiError(
        503,
        "The gateway is still loading its API keys; retry shortly.",
        code="keys_loading",
        headers=((b"retry-after", b"1"),),
    )


def ended_key(why: str) -> ApiError:
    code = "key_" + why.split()[-1]  # key_disabled, key_expired
    return ApiError(401, f"This API key {why}.", type="invalid_request_error", code=code)


def model_not_allowed(model: str) -> ApiError:
    return ApiError(
        403,
        f"This API key may not use the model `{model}`.",
        type="permission_error",
        code="model_not_allowed",
        param="model",
    )


class KeyRing:
    """The grants of `workspaces`, by secret hash (see the module's docstring)."""

    def __init__(
        self, workspaces: Iterable[str], pepper: str = "", static: Iterable[bytes] = ()
    ) -> None:
        self.workspaces = tuple(workspaces)
        self.pepper = pepper.encode()
        self.static = tuple(static)  # the operator's own `--api-key`s
        self._held: dict[str, Grant] = {}  # store key -> grant
        self.by_hash: dict[str, Grant] = {}
        self.skipped: dict[str, str] = {}  # store key -> why its value was refused
        self.version = 0
        self.loaded = False  # every workspace's keys were read once (`KeyWatcher.start`)

    # -- the request path ----------------------------------------------------------------

    def check(self, authorization: bytes | None, now: float | None = None) -> Grant | None:
        """The grant of the request's bearer; None for an operator's `--api-key`; `ApiError`
        (401) for a missing, unknown, disabled or expired key (503 `keys_loading` for an
        unknown one until the keys are `loaded`)."""
        secret = bearer_token(authorization)
        if secret is None:
            raise invalid_key()
        digest = hashlib.sha256(secret + self.pepper).hexdigest()
        grant = self.by_hash.get(digest)
        if grant is None:
            if any(hmac.compare_digest(secret, s) for s in self.static):
                return None
            raise invalid_key() if self.loaded else keys_loading()
        if grant.disabled:
            raise ended_key("is disabled")
        if grant.expires_at is not None and (now or time.time()) >= grant.expires_at:
            raise ended_key("has expired")
        return grant

    @staticmethod
    def admit(grant: Grant | None, model: str) -> None:
        """403 unless `grant`'s allow-list names `model` (an empty one: every model the key
        reaches, its own workspace's virtual models and the fleet's; the proxy looks the name
        up in the key's workspace, `RouteTable.lookup`)."""
        if grant is not None and grant.models and model not in grant.models:
            raise model_not_allowed(model)

    @staticmethod
    def allows(grant: Grant | None, model: str) -> bool:
        return grant is None or not grant.models or model in grant.models

    # -- following the store ---------------------------------------------------------------

    def put(self, key: str, value: bytes) -> None:
        try:
            grant = decode_grant(key, value)
        except GrantError as exc:
            self.skipped[key] = str(exc)
            log.warning("key grant skipped: %s", exc)
            return  # a valid grant held at this key stays
        self.skipped.pop(key, None)
        old = self._held.get(key)
        if old is not None and self.by_hash.get(old.hash) is old:
            del self.by_hash[old.hash]
        self._held[key] = grant
        self.by_hash[grant.hash] = grant
        self.version += 1

    def delete(self, key: str) -> None:
        self.skipped.pop(key, None)
        old = self._held.pop(key, None)
        if old is not None:
            if self.by_hash.get(old.hash) is old:
                del self.by_hash[old.hash]
            self.version += 1

    async def replace(self, workspace: str, items: Iterable[KeyValue]) -> None:
        """The grants of `workspace` become exactly `items`, `SLICE` of them between two
        yields to the loop (100,000 grants held it 0.9 s in one go). Meanwhile each key keeps
        its old grant until its new value replaces it, and one gone is refused at once."""
        prefix = grants_prefix(workspace)
        fresh: dict[str, bytes] = {}
        async for values in _slices(items):
            fresh.update((kv.key, kv.value) for kv in values if kv.key.startswith(prefix))
        async for keys in _slices(list(self._held)):
            for key in keys:
                if key.startswith(prefix) and key not in fresh:
                    self.delete(key)
        async for keys in _slices(list(self.skipped)):
            for key in keys:
                if key.startswith(prefix) and key not in fresh:
                    self.skipped.pop(key, None)
        async for pairs in _slices(fresh.items()):
            for key, value in pairs:
                self.put(key, value)

    def describe(self) -> dict[str, object]:
        """For `/health`: how many grants are held, how many values are refused, and the
        first `MAX_LISTED` of them by key with why (never a hash)."""
        return {
            "keys": len(self.by_hash),
            "skipped_total": len(self.skipped),
            "skipped": first_listed(self.skipped),
        }


class KeyWatcher:
    """Keeps `ring` equal to the grants of its workspaces in `store`."""

    def __init__(self, store: Store, ring: KeyRing) -> None:
        self.store = store
        self.ring = ring
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Read every workspace (retrying until the store answers), then watch each."""
        for workspace in self.ring.workspaces:
            revision = await self._read(workspace)
            self._tasks.append(
                asyncio.create_task(self._watch(workspace, revision + 1), name=f"keys:{workspace}")
            )
        self.ring.loaded = True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._tasks.clear()

    async def _read(self, workspace: str) -> int:
        backoff = 0.1
        while True:
            try:
                snapshot = await self.store.get_prefix(grants_prefix(workspace))
                # (inside the retry: whatever a value makes it raise must not end the
                # workspace's watch task, nor the frontend's start)
                await self.ring.replace(workspace, snapshot.items)
            except Exception as exc:
                log.warning("reading the keys of %r failed: %s; retrying", workspace, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            return snapshot.revision

    async def _watch(self, workspace: str, start_revision: int) -> None:
        """Watch for ever; after a broken watch, read again and watch from that read. The
        loop turns every `SLICE` events: a store hands a burst over without a wait (a
        workspace's keys published at once: 20,000 grants decoded in one turn)."""
        backoff = 0.1
        while True:
            try:
                events = 0
                async for event in self.store.watch(grants_prefix(workspace), start_revision):
                    if isinstance(event, Put):
                        self.ring.put(event.key, event.value)
                    elif isinstance(event, Delete):
                        self.ring.delete(event.key)
                    else:
                        await self.ring.replace(workspace, event.items)
                    backoff = 0.1
                    events += 1
                    if events >= SLICE:
                        events = 0
                        await asyncio.sleep(0)
                log.warning("key watch of %r ended; restarting", workspace)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("key watch of %r failed: %s", workspace, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
            start_revision = await self._read(workspace) + 1


class ModelListing:
    """The `/v1/models` listing of one version of the registry and routes: its `body`, and
    each model's object by id, so that a key's listing is made by looking up its allow-list
    (at most 1,000 names), never by decoding the body (30,000 models: 20-45 ms of the loop)."""

    __slots__ = ("body", "by_id")

    def __init__(self, data: list[dict[str, Any]]) -> None:
        """`data`: the models' objects, sorted by id."""
        self.body = msgspec.json.encode({"object": "list", "data": data})
        self.by_id = {str(obj["id"]): obj for obj in data}

    @classmethod
    def made(cls, body: bytes, by_id: dict[str, dict[str, Any]]) -> ModelListing:
        """A listing whose body and objects were made a slice at a time (`frontend/listings.py`)."""
        listing = cls.__new__(cls)
        listing.body, listing.by_id = body, by_id
        return listing


def models_for(listing: ModelListing, grant: Grant | None) -> bytes:
    """The `/v1/models` body with only the models `grant` may use (in the listing's order)."""
    if grant is None or not grant.models:
        return listing.body
    by_id = listing.by_id
    names = sorted(name for name in set(grant.models) if name in by_id)
    return msgspec.json.encode({"object": "list", "data": [by_id[name] for name in names]})
