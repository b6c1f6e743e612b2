"""The providers phase: what each provider serves, as entities, links, statuses and names.

Virtual models are read once per pass, providers once, entities once (the phase's cache).
For each provider, its failure isolated from the others:

1. discover the names it serves, cheaply: `GET {base_url}/models` for a `url` provider, one
   discovery listing per namespace for `fleet` ones; keep those `enabled_models` allows.
   Providers are listed concurrently (`LISTINGS_AT_ONCE`), each within `timeout`, which the
   controller keeps below its loop's `max_silence`: each listing that ends beats, so hung
   providers cost one timeout per pass, not one each, and never make the loop unhealthy;
2. stage an entity per name (created autoprovisioned when missing) linked to the provider,
   and unlink the entities it no longer serves;
3. write its `served_models`, `status` and `status_message` if they differ.

A provider whose listing fails, or that serves more than `SERVED_MODELS_BYTES` of
`served_models` (its PATCH would be over the API's body bound), is marked ERROR with the
reason and keeps its persisted `served_models`
(cleanup below uses them); its links are left as they are. A provider whose row cannot be
read is left as it is, and so is all it serves: its entities are unjudged
(`unreadable_entities`), so their links, passthrough virtual models and routes stay (once,
they were deleted). Links to providers of this workspace that no longer exist are removed.
The cache is flushed in a `finally`.

Then, if the virtual-model listing succeeded: a passthrough virtual model (autoprovisioned)
for each served name no virtual model holds (a user-managed one is never touched), and the
deletion of autoprovisioned virtual models whose entity nobody serves any more. Deletion
works from the pass's snapshot with its version: one created meanwhile is not in the
snapshot, one changed meanwhile answers 409 and is kept, one deleted meanwhile is not an error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from shoal.bounds import MAX_DEPTH, TooDeep, read_at_most
from shoal.catalog.cache import EntityCache
from shoal.catalog.calls import Calls, each
from shoal.catalog.errors import CatalogError, ConflictError, NotFoundError
from shoal.catalog.kinds import PROVIDERS, VIRTUAL_MODELS
from shoal.catalog.resources import NAME_PATTERN, Model, Provider, VirtualModel
from shoal.catalog.routing import SLICE, pause
from shoal.discovery import Discovery, Query
from shoal.slices import decoded_slices

log = logging.getLogger(__name__)

ENTITY_NAME = re.compile(NAME_PATTERN.removeprefix("^").removesuffix("$"))
"""A valid entity name, used with `fullmatch` only: `$` with `re.match` also matches before
a final "\n" (which the API, validating with pydantic's regex, refuses)."""


def entity_name_valid(name: str) -> bool:
    """Whether the API takes `name` for a new entity (and its passthrough virtual model):
    the name pattern, at most 200 characters, and no `.` or `..` segment (an id `a/../b`
    was refused on create every pass, two failed calls and warnings a name a pass)."""
    if len(name) > 200 or not ENTITY_NAME.fullmatch(name):
        return False
    return not any(segment in (".", "..") for segment in name.split("/"))


LISTINGS_AT_ONCE = 16  # providers listed concurrently
SERVED_MODELS_BYTES = 768 << 10
"""A provider's `served_models` as JSON, at most: the controller's PATCH carrying them (with
a `status_message` of at most 4,000 characters) stays under the API's 1 MiB body bound
(`api.MAX_BODY_BYTES`), so it is never refused. About 1,700 names of 200 characters, or
10,000 of 20; a provider serving more is ERROR, naming the bound (`enabled_models` narrows
it)."""
Lister = Callable[[Provider], Awaitable[list[str]]]


class ListingError(Exception):
    """A provider's served models could not be read; the message says why."""


@dataclass
class ProvidersResult:
    """What the pass ends with, for routing: virtual models (None: not read), providers by
    `"workspace/name"`, and the entities as flushed."""

    virtual_models: list[VirtualModel] | None
    providers: dict[str, Provider]
    entities: dict[str, Model] = field(default_factory=dict)
    served: set[str] = field(default_factory=set)
    unreadable: set[str] = field(default_factory=set)  # refs of providers not read: kept as is
    unreadable_entities: set[str] = field(default_factory=set)  # routes over them: kept as is


def secret_value(name: str | None) -> str | None:
    """The value of secret `name` from `SHOAL_SECRET_<NAME>` (never from the catalog)."""
    return os.environ.get(f"SHOAL_SECRET_{name.upper()}") if name else None


LISTING_BYTES = 8 << 20
"""A `GET {base_url}/models` answer, at most (its declared length, else as it comes): a
provider answering more is ERROR, never buffered whole."""
LISTING_MODELS = 100_000
"""The ids a listing may hold (what a provider's `served_models` may); over it, ERROR."""


class UrlLister:
    """`GET {base_url}/models` of an OpenAI-compatible server: the ids it lists, read up to
    `LISTING_BYTES` and `LISTING_MODELS` (over either: `ListingError` naming the bound),
    decoded on the event loop a slice at a time (`listed_ids`)."""

    def __init__(self, session: aiohttp.ClientSession, timeout: float = 10.0) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def __call__(self, provider: Provider) -> list[str]:
        assert provider.base_url is not None
        url = provider.base_url.rstrip("/") + "/models"
        secret = secret_value(provider.auth_secret)
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        try:
            async with self.session.get(url, headers=headers, timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise ListingError(f"GET {url}: HTTP {resp.status}")
                raw = await _bounded_read(resp, url)
        except TimeoutError as exc:
            raise ListingError(f"GET {url}: no answer within {self.timeout.total:g}s") from exc
        except aiohttp.ClientError as exc:
            raise ListingError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        return await listed_ids(raw, url)


async def _bounded_read(resp: aiohttp.ClientResponse, url: str) -> bytes:
    raw = await read_at_most(resp, LISTING_BYTES)
    if raw is None:
        raise ListingError(f"GET {url}: answer over {LISTING_BYTES} bytes (LISTING_BYTES)")
    return raw


class _RawListing(msgspec.Struct):
    data: list[msgspec.Raw] | None = None


class _Entry(msgspec.Struct, gc=False):  # (decoded JSON: no cycles)
    """What the catalog reads of a listing's entry: its `id` (any JSON value), left encoded
    until it is read. The entry's other fields are skipped, never built: a slice decoded
    whole (`list[Any]`) built ~30,000 lists and dicts when they nested densely, enough to set
    off full collections of the catalog's heap (~175 ms each) on the event loop."""

    id: msgspec.Raw = msgspec.Raw(b"null")


_raw_listing = msgspec.json.Decoder(_RawListing)
# (an entry that is no object is skipped, as one without an `id`; an array's items are left
# encoded)
_entries = msgspec.json.Decoder(list[_Entry | list[msgspec.Raw] | str | int | float | bool | None])
_id = msgspec.json.Decoder()


async def listed_ids(raw: bytes, url: str) -> list[str]:
    """The model ids of a `/models` answer, in its order; `ListingError` if it is not one,
    lists more than `LISTING_MODELS`, or holds an entry nesting deeper than `MAX_DEPTH` or
    over `SLICE_BYTES`. Read with its entries left encoded, then decoded on the event loop a
    slice at a time (`shoal.slices`): msgspec and json decode in one C call holding the GIL,
    so in a thread an 8 MiB listing held the loop (the catalog's API beside the controller)
    ~90 ms all the same."""
    try:
        data = _raw_listing.decode(raw).data
    except msgspec.ValidationError:  # not an object, or its `data` not a list
        data = None
    except msgspec.DecodeError as exc:  # not JSON, not UTF-8
        raise ListingError(f"GET {url}: {exc}"[:1000]) from None
    except RecursionError:  # (nested past what the pass skipping the entries follows)
        raise ListingError(f"GET {url}: {TooDeep(MAX_DEPTH)}") from None
    if data is None:
        raise ListingError(f"GET {url}: no `data` list in the answer")
    if len(data) > LISTING_MODELS:
        raise ListingError(
            f"GET {url}: lists {len(data)} models, over {LISTING_MODELS} (LISTING_MODELS)"
        )
    ids: list[str] = []
    try:
        async for entries in decoded_slices(data, _entries, utf8=True):
            for entry in entries:  # (an id that is a value, not a string, as `str` writes it)
                if type(entry) is _Entry and (value := _id.decode(entry.id)):
                    ids.append(str(value))
    except (ValueError, msgspec.DecodeError) as exc:  # too deep, too large, not JSON
        raise ListingError(f"GET {url}: {exc}"[:1000]) from None
    return ids


class FleetLister:
    """The model names announced in a discovery namespace: one listing per namespace per pass,
    shared by the providers listed meanwhile (16 at once each listed the whole namespace when
    the cache was filled only once a listing had ended)."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery
        self._listed: dict[str, asyncio.Future[list[str]]] = {}

    def new_pass(self) -> None:
        for listing in self._listed.values():
            listing.cancel()  # (one still running: its callers all timed out)
        self._listed = {}

    async def __call__(self, provider: Provider) -> list[str]:
        namespace = provider.namespace or "default"
        listing = self._listed.get(namespace)
        if listing is None:
            listing = self._listed[namespace] = asyncio.ensure_future(self._list(namespace))
            listing.add_done_callback(_retrieved)
        return await asyncio.shield(listing)  # a caller's timeout is not the others'

    async def _list(self, namespace: str) -> list[str]:
        models = await self.discovery.list(Query(namespace))
        return sorted({m.card.display_name for m in models})


def _retrieved(listing: asyncio.Future[list[str]]) -> None:
    """Its failure is read by its callers, or by nobody (they all timed out): not logged."""
    if not listing.cancelled():
        listing.exception()


class ProvidersPhase:
    """One pass over one workspace's providers."""

    def __init__(
        self,
        calls: Calls,
        url_lister: Lister,
        fleet_lister: FleetLister,
        *,
        timeout: float = 10.0,
    ) -> None:
        self.calls = calls
        self.listers: dict[str, Lister] = {"url": url_lister, "fleet": fleet_lister}
        self.fleet = fleet_lister
        self.timeout = timeout
        self._invalid_logged: set[tuple[str, str]] = set()  # (provider ref, name) logged

    async def run(self, workspace: str) -> ProvidersResult:
        """One workspace's providers. (The namespaces' listings are the pass's: the
        controller starts a pass of `fleet` before its first workspace.)"""
        cache = EntityCache(self.calls, workspace)
        # The three reads of the pass, at once: none depends on another.
        virtual_models, providers, _ = await asyncio.gather(
            self._virtual_models(workspace),
            self.calls.list_all(PROVIDERS, workspace),
            cache.refresh(),
        )
        result = ProvidersResult(virtual_models, {f"{workspace}/{p.name}": p for p in providers})
        result.unreadable = {f"{workspace}/{name}" for name in providers.invalid}
        listed = await self._list_served(providers)
        try:
            for provider in providers:
                await self._provider(workspace, provider, listed[provider.name], cache, result)
                self.calls.beat()
            self._unlink_gone(workspace, cache, result)
        finally:
            await cache.flush()
        result.entities = {name: e for name in cache.names() if (e := cache.peek(name))}
        # An entity served by a provider whose row cannot be read is not judged either: what
        # that provider serves is unknown, so its routes and passthroughs stay as they are.
        result.unreadable_entities = set(cache.unreadable) | {
            name for name, entity in result.entities.items()
            if not result.unreadable.isdisjoint(entity.providers)
        }  # fmt: skip
        if virtual_models is not None:
            await self._passthrough(workspace, result)
            await self._cleanup(workspace, result)
        return result

    async def _virtual_models(self, workspace: str) -> list[VirtualModel] | None:
        """Every virtual model of the workspace; None (logged) if they cannot be read."""
        try:
            return await self.calls.list_all(VIRTUAL_MODELS, workspace)
        except (CatalogError, aiohttp.ClientError, TimeoutError) as exc:
            log.warning("virtual models of %s not read: no creation or cleanup: %s", workspace, exc)
            return None

    async def _list_served(self, providers: list[Provider]) -> dict[str, list[str] | Exception]:
        """What each provider serves (or why not), listed concurrently, each within `timeout`."""
        listed: dict[str, list[str] | Exception] = {}
        limit = asyncio.Semaphore(LISTINGS_AT_ONCE)

        async def list_one(provider: Provider) -> None:
            async with limit:
                try:
                    async with asyncio.timeout(self.timeout):
                        listed[provider.name] = await self.listers[provider.type](provider)
                except TimeoutError:
                    listed[provider.name] = ListingError(f"no answer within {self.timeout:g}s")
                except Exception as exc:  # isolated: this provider is ERROR, the others go on
                    listed[provider.name] = exc
            self.calls.beat()  # a listing ended: progress, whatever its outcome

        await asyncio.gather(*(list_one(provider) for provider in providers))
        return listed

    async def _provider(
        self,
        workspace: str,
        provider: Provider,
        names: list[str] | Exception,
        cache: EntityCache,
        result: ProvidersResult,
    ) -> None:
        ref = f"{workspace}/{provider.name}"
        if isinstance(names, Exception):  # isolated: this provider is ERROR, the others go on
            exc = names
            message = str(exc) if isinstance(exc, ListingError) else f"{type(exc).__name__}: {exc}"
            result.served |= {s.model_entity for s in provider.served_models or ()}
            await self._write_status(workspace, ref, result, {"status": "ERROR",
                                     "status_message": message[:4000]})  # fmt: skip
            return
        served, valid, served_models, size = await self._judge(ref, provider, names)
        if size > SERVED_MODELS_BYTES:  # its PATCH would be refused: ERROR, saying why
            over = ListingError(
                f"serves {len(valid)} models: their served_models would be {size} bytes of "
                f"JSON, over the bound of {SERVED_MODELS_BYTES} (SERVED_MODELS_BYTES); "
                "narrow it with enabled_models"
            )
            await self._provider(workspace, provider, over, cache, result)
            return
        for count, name in enumerate(valid, 1):
            if count % SLICE == 0:  # (10,000 names staged at once held the loop ~160 ms)
                await pause(self.calls.beat)
            if cache.peek(name) is None:
                cache.stage_create(
                    name, {"autoprovisioned": True, "description": f"served by {ref}"}
                )
            cache.stage_provider_link(name, ref)
        kept = set(valid)
        for name in cache.linked_to(ref):
            if name not in kept:
                cache.stage_provider_unlink(name, ref)
        result.served |= kept
        skipped = served - len(valid)
        message = f"{len(valid)} model(s)" + (f"; {skipped} name(s) not valid entity names"
                                              if skipped else "")  # fmt: skip
        await self._write_status(workspace, ref, result, {
            "status": "READY", "status_message": message,
            "served_models": served_models,
        })  # fmt: skip

    async def _judge(
        self, ref: str, provider: Provider, names: list[str]
    ) -> tuple[int, list[str], list[dict[str, str]], int]:
        """A listing's names as the provider serves them: how many `enabled_models` allows
        (once each), the valid entity names among them (sorted; the others logged), the size
        of their `served_models` as JSON, and those `served_models`, made only when that size
        is within `SERVED_MODELS_BYTES` (else empty): the size is counted as the names are
        judged, not encoded after (a valid name needs no escape in JSON), so an oversized
        listing is never sorted or encoded whole. The loop runs (and the heartbeat beats)
        every `SLICE` names: 100,000 were deduplicated, sorted, checked and encoded in one
        hold of it (~280 ms), only to be found over the bound."""
        allowed = set(provider.enabled_models) if provider.enabled_models is not None else None
        seen: set[str] = set()
        valid: list[str] = []
        invalid: list[str] = []
        served = 0
        size = 1  # [{"model_entity":"N","served_model_name":"N"},...]: 43 bytes, N twice
        for count, name in enumerate(names, 1):
            if count % SLICE == 0:
                await pause(self.calls.beat)
            if name in seen or (allowed is not None and name not in allowed):
                continue
            seen.add(name)
            served += 1
            if entity_name_valid(name):
                valid.append(name)
                size += 43 + 2 * len(name)
            else:
                invalid.append(name)
        await self._report_invalid(ref, invalid)
        if not valid:
            return served, valid, [], 2
        if size > SERVED_MODELS_BYTES:
            return served, valid, [], size
        valid.sort()
        return served, valid, [{"model_entity": n, "served_model_name": n} for n in valid], size

    async def _report_invalid(self, ref: str, invalid: list[str]) -> None:
        """Log the served names that are not valid entity names (once each), each once per
        provider (they are skipped every pass, and counted in its status_message); the first
        ten as examples. A slice at a time, as the names are judged."""
        logged = self._invalid_logged
        new: list[str] = []
        for count, name in enumerate(invalid, 1):
            if count % SLICE == 0:
                await pause(self.calls.beat)
            if (ref, name) not in logged:
                new.append(name)
        if new:
            if len(logged) > 100_000:  # bounded: at worst some are logged again
                logged.clear()
            for count, name in enumerate(new, 1):
                if count % SLICE == 0:
                    await pause(self.calls.beat)
                logged.add((ref, name))
            shown = ", ".join(repr(name[:100]) for name in sorted(new[:10]))
            log.warning("provider %s: %d served name(s) skipped, not valid entity names: %s%s",
                        ref, len(new), shown, ", ..." if len(new) > 10 else "")  # fmt: skip

    async def _write_status(
        self, workspace: str, ref: str, result: ProvidersResult, desired: dict[str, Any]
    ) -> None:
        provider = result.providers[ref]
        current = provider.model_dump(mode="json")
        changes = {k: v for k, v in desired.items() if current.get(k) != v}
        if not changes:
            return
        try:
            updated = await self.calls.update(
                PROVIDERS, workspace, provider.name, changes, provider.version
            )
        except (ConflictError, NotFoundError) as exc:  # changed or deleted meanwhile
            log.info("provider %s not updated (next pass): %s", ref, exc.message)
            return
        except (CatalogError, aiohttp.ClientError, TimeoutError) as exc:  # isolated: go on
            log.warning("provider %s not updated (next pass): %s", ref, exc)
            return
        result.providers[ref] = updated

    def _unlink_gone(self, workspace: str, cache: EntityCache, result: ProvidersResult) -> None:
        """Unlink providers of this workspace that no longer exist."""
        for name in cache.names():
            entity = cache.peek(name)
            for ref in entity.providers if entity is not None else ():
                gone = ref not in result.providers and ref not in result.unreadable
                if ref.startswith(f"{workspace}/") and gone:
                    cache.stage_provider_unlink(name, ref)

    async def _passthrough(self, workspace: str, result: ProvidersResult) -> None:
        """A virtual model for each served name that no virtual model holds."""
        assert result.virtual_models is not None
        made = result.virtual_models
        taken = {vm.name for vm in made}

        async def create(name: str) -> None:
            body = {"name": name, "default_model": name, "autoprovisioned": True,
                    "description": "passthrough: the model under its own name"}  # fmt: skip
            try:
                made.append(await self.calls.create(VIRTUAL_MODELS, workspace, body))
            except ConflictError:  # made meanwhile by someone else: theirs to keep
                return
            except CatalogError as exc:
                log.warning("passthrough virtual model %s/%s: %s", workspace, name, exc.message)

        await each(sorted(result.served - taken), create)

    async def _cleanup(self, workspace: str, result: ProvidersResult) -> None:
        """Delete autoprovisioned virtual models whose entity nobody serves any more."""
        assert result.virtual_models is not None
        kept: list[VirtualModel] = []
        served, unjudged = result.served, result.unreadable_entities
        for count, vm in enumerate(result.virtual_models, 1):
            if count % SLICE == 0:  # (10,000 looked at in one go held the loop ~3 ms and more)
                await pause(self.calls.beat)
            if not vm.autoprovisioned or vm.default_model in served or vm.default_model in unjudged:
                kept.append(vm)
                continue
            try:
                await self.calls.delete(VIRTUAL_MODELS, workspace, vm.name, vm.version)
            except NotFoundError:  # deleted meanwhile: what we wanted
                pass
            except ConflictError:  # changed meanwhile: not ours to judge this pass
                kept.append(vm)
                continue
            log.info("virtual model %s/%s removed: %s is not served", workspace, vm.name,
                     vm.default_model)  # fmt: skip
        result.virtual_models = kept
