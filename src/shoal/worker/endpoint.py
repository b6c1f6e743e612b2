"""`Endpoint`: one `namespace.component.endpoint` of a worker, serving an engine over HTTP.

An endpoint serves its engine's app on its own port and announces itself and its models
through the process's `Registrations`: its instance under the process lease (its id is the
lease id) with the URL requests go to, then its models, each with a card whose metadata
file URLs point at the process's status server. Detaching undoes that in reverse:
discovery first, so no frontend fetches a file that is already gone.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import operator
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from shoal.cards import MetadataFile, ModelCard, slugify
from shoal.discovery import EndpointId, ModelKey
from shoal.discovery.keys import check_suffix, quoted
from shoal.store import LeaseNotFoundError, StoreUnavailableError
from shoal.worker.engine import Engine, ServedModel
from shoal.worker.http_server import request_port_max_connections, start_server
from shoal.worker.metadata import MAX_METADATA_FILE, MetadataKey, Snapshot, url_segment
from shoal.worker.registrations import PUT_BATCH, Attached, Entry, Registrations

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".gguf",
    ".pt",
    ".pth",
    ".ckpt",
    ".onnx",
    ".h5",
    ".msgpack",
    ".npz",
    ".ot",
)
METADATA_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py")
SHUTDOWN_GRACE = 0.1
"""Seconds a server gives requests still in flight when it stops (twice: to finish, then to
end once cancelled). Drain waits for them before, so this only cuts what outlived it."""
SYNC_BATCH = 256
"""Models a sync of an engine's list handles between two yields to the event loop."""
REFUSED_REASON = 300
REFUSED_RETRY = 30.0
"""Seconds after which a refused model is tried again though the engine lists it the same
(a metadata file unreadable for a moment must not keep a live model unannounced for good)."""
"""Characters of the reason a model was refused that are kept (logs, `/health`)."""
WARNED_KEPT = 64
"""Distinct "several base models" warnings remembered (not repeated) per endpoint."""
CACHED_NAME = 512
"""Characters of the longest adapter name whose suffix is cached (a card's bound)."""
OUTAGES = (StoreUnavailableError, LeaseNotFoundError, TimeoutError, ConnectionError)
"""What an attach raises when the store is out: the whole sync is retried, not one model
refused."""


def metadata_files_in(directory: Path) -> dict[str, Path]:
    """The non-weight files beside a model: config, tokenizer, chat template, generation config
    (not one whose name no metadata URL can carry: `url_segment`)."""
    found: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        name = path.name
        if (
            name.startswith(".")
            or not url_segment(name)
            or not path.is_file()
            or name.endswith(WEIGHT_SUFFIXES)
            or name.endswith(".index.json")
            or not name.endswith(METADATA_SUFFIXES)
            or path.stat().st_size > MAX_METADATA_FILE
        ):
            continue
        found[name] = path
    return found


_HASHED = re.compile(r"-[0-9a-f]{8}$")
"""How a hashed suffix ends: a name that ends so is hashed too, so no name spells another's."""


# A sync computes every adapter's, at each change of the list: as many as a sidecar takes
# (65,536). At 16,384, 20,000 adapters missed every one, in turn (300 ms of CPU a sync).
@functools.lru_cache(maxsize=1 << 16)
def adapter_suffix(name: str) -> str:
    """The discovery suffix of adapter `name`: distinct names get distinct suffixes.

    A name that is its own slug (`my-lora`) is its suffix; any other name (`My-Lora`,
    `org/lora`, `日本語`) gets its slug plus `-` and 8 hex digits of its SHA-256, so names
    that slug alike (`My-Adapter`, `my adapter`) or not at all (every non-Latin name slugs
    to `model`) never share a key. A slug name that ends like a hashed suffix
    (`my-lora-d1ae385f`) is hashed as well: a suffix kept as its name never ends that way,
    so no name can take another's hashed suffix.
    """
    slug = slugify(name)
    if slug == name and not _HASHED.search(name):
        return check_suffix(slug)
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return check_suffix(f"{slug[:119]}-{digest}")


def suffix_for(model: ServedModel) -> str | None:
    """The discovery suffix of a served model: None for a base model, else from the adapter
    name (cached, unless the name is longer than a card allows: it is refused anyway)."""
    name = model.adapter
    if name is None:
        return None
    return adapter_suffix(name) if len(name) <= CACHED_NAME else adapter_suffix.__wrapped__(name)


def card_for(model: ServedModel) -> tuple[ModelCard, dict[str, Path]]:
    """The card announcing `model` (without metadata URLs yet) and the files to host for it."""
    files: dict[str, Path] = {}
    if model.metadata_dir is not None:
        if model.metadata_files:
            files = {name: model.metadata_dir / name for name in model.metadata_files}
        else:
            files = metadata_files_in(model.metadata_dir)
    lora = None
    if model.adapter is not None:
        lora = {"base_model": model.base_model or "", "adapter": model.adapter}
    card = ModelCard.build(
        display_name=model.name,
        slug=slugify(model.name),
        source=model.source,
        model_types=list(model.model_types),
        context_length=model.context_length,
        kv_block_size=model.kv_block_size,
        role=model.role,
        runtime_config=dict(model.runtime_config),
        lora=lora,
        created=int(time.time()),  # frontends show a model's earliest card's
    )
    return card, files


def advertised_host(host: str) -> str:
    """The host others reach a server bound to `host` at (a wildcard becomes this host's name)."""
    if host in ("", "0.0.0.0", "::"):
        return socket.getfqdn()
    return f"[{host}]" if ":" in host else host


class Endpoint:
    """Serves one engine at `namespace.component.endpoint`; get it with `Runtime.endpoint`.

    What it announces is held by `registrations`, never here: `models` is a read-only view
    of this endpoint's models there, so a re-registration under a new lease is seen at once.
    `status_url` is the process's status server, where its models' metadata files are.
    """

    def __init__(self, id: EndpointId, registrations: Registrations, status_url: str) -> None:
        self.id = id
        self.status_url = status_url
        self.engine: Engine | None = None
        self.url: str | None = None
        self.models: Mapping[str | None, Attached] = registrations.models_of(id)
        self.follows_engine = False
        """Set once `serve(attach_models=True)` attached the engine's models: the runtime's
        models loop keeps them in step with the engine from then on, while it serves."""
        self.announced = False
        """Set once `serve` has registered the instance (and, with `attach_models`, once a
        sync announced the engine's models): until then the port is open but no frontend can
        route to it, and `/health` says so."""
        self.in_flight = 0
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()
        self.requests: dict[tuple[str, int], int] = {}
        self.preferred_model: str | None = None
        self.sync_lock = asyncio.Lock()  # engine-driven attach/detach vs adapter calls
        self._registrations = registrations
        self.refused: dict[str, tuple[ServedModel, str]] = {}
        """Models the engine lists that could not be announced (a bad card, a file too
        large), by name: the model as listed and why. Logged once each, shown by `/health`;
        tried again when the engine lists it anew (changed, or dropped and listed again), and
        every `REFUSED_RETRY` seconds."""
        self._retry_at = 0.0  # (monotonic) the refused are tried again from then
        self.refusals = 0
        """Times a model the engine listed was refused."""
        self._runner: web.AppRunner | None = None
        self._warned: set[tuple[str, int, tuple[str, ...]]] = set()
        self._synced: tuple[list[ServedModel], list[Attached]] | None = None

    def __repr__(self) -> str:
        return f"<Endpoint {self.id} url={self.url}>"

    @property
    def serving(self) -> bool:
        return self._runner is not None

    @property
    def instance_id(self) -> int:
        """The id of the process lease held now: this endpoint's instance id."""
        return self._registrations.instance_id

    def model_key(self, suffix: str | None = None) -> ModelKey:
        return ModelKey(self.id, self.instance_id, suffix)

    # -- serving ------------------------------------------------------------------------

    async def serve(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        attach_models: bool = True,
        model: str | None = None,
    ) -> None:
        """Start `engine`, serve its app on host:port (0: a free port) and register the instance.

        With `attach_models`, the engine's `served_models()` are attached now and kept in
        step by the runtime's models loop (`follows_engine`). A store outage meanwhile is not
        raised: the lease loop registers the instance and the models loop announces the models
        once the store answers (`announced` is False until then). An engine listing several base
        models gets the one named `model` announced (else the one announced already, while
        the engine still lists it, else the first): one base model per endpoint instance.
        """
        if self.engine is not None:
            raise RuntimeError(f"endpoint {self.id} already serves {self.engine.name}")
        self.engine = engine
        self.preferred_model = model
        try:  # a start that fails or is cancelled half-way is stopped too
            await engine.start()
            app = engine.app()
            app.middlewares.insert(0, self._track)
            runner = await start_server(
                app,
                host,
                port,
                max_connections=request_port_max_connections(),
                handler_cancellation=True,
                access_log=None,
                shutdown_timeout=SHUTDOWN_GRACE,
            )
            bound = runner.addresses[0][1]
            self._runner = runner
            self.url = f"http://{advertised_host(host)}:{bound}"
            try:
                await self._registrations.register_instance(
                    self.id, self.url, self.status_url, kv_events=engine.kv_events
                )
            except OUTAGES as exc:  # (held: the lease loop puts it in the store)
                log.warning("endpoint %s: instance not registered yet (retried): %s", self.id, exc)
            if not attach_models:
                self.announced = True
                return
            self.follows_engine = True
            try:
                await self.sync_models()
            except OUTAGES as exc:  # (the models loop tries again)
                log.warning("endpoint %s: models not announced yet (retried): %s", self.id, exc)
        except BaseException:
            await self._stop_serving()
            raise

    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Count requests in flight (drain waits for zero) and by route and status."""
        self.in_flight += 1
        self.idle.clear()
        status = 500
        try:
            response: web.StreamResponse = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "unmatched"
            key = (route, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    async def _stop_serving(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        if self.engine is not None:
            try:
                await self.engine.stop()
            except Exception:
                log.exception("engine %s of endpoint %s failed to stop", self.engine.name, self.id)

    # -- models -------------------------------------------------------------------------

    async def attach_model(
        self,
        card: ModelCard,
        suffix: str | None = None,
        *,
        files: Mapping[str, Path] | None = None,
    ) -> ModelCard:
        """Announce `card` on this endpoint instance (`suffix`: a LoRA adapter's key).

        `files` are metadata files to host on the status server, read once now: the card's
        `metadata_files` are set to their URLs, checksums and sizes, and those bytes are
        what is served, whatever happens to the files later. Returns the card as
        announced. Raises (and leaves nothing attached) if the store refuses it, or
        `ValueError` if a file is over `MAX_METADATA_FILE` bytes.
        """
        return await self._attach(card, suffix, files)

    async def detach_model(self, suffix: str | None = None) -> None:
        """Withdraw the model at `suffix` from discovery, then stop hosting its files. Idempotent."""
        await self._registrations.detach(self.id, suffix)

    async def attach_served(self, model: ServedModel) -> ModelCard:
        """Attach a model an engine serves, hosting the metadata files found beside it."""
        card, suffix, snapshots = await self.card_of(model)
        await self._registrations.attach(self.id, card, suffix, snapshots, model)
        return card

    async def card_of(self, model: ServedModel) -> tuple[ModelCard, str | None, dict[str, bytes]]:
        """The card announcing a model an engine serves, its suffix, and the bytes of the
        metadata files found beside it (read once, now). Raises if any is refused."""
        card, files = card_for(model)
        suffix = suffix_for(model)
        card, snapshots = await self._prepared(card, suffix, files)
        return card, suffix, snapshots

    async def _attach(
        self,
        card: ModelCard,
        suffix: str | None,
        files: Mapping[str, Path] | None,
        served: ServedModel | None = None,
    ) -> ModelCard:
        card, snapshots = await self._prepared(card, suffix, files)
        await self._registrations.attach(self.id, card, suffix, snapshots, served)
        return card

    async def _prepared(
        self, card: ModelCard, suffix: str | None, files: Mapping[str, Path] | None
    ) -> tuple[ModelCard, dict[str, bytes]]:
        """The card to announce at `suffix` (checked) and the bytes of its `files`."""
        if suffix is not None:
            check_suffix(suffix)
        snapshots: dict[str, bytes] = {}
        if files:
            card, snapshots = await self._with_metadata(card, suffix, files)
        return card, snapshots

    async def reattach(self, suffix: str | None, att: Attached) -> None:
        """Announce again a model detached from this endpoint, as it was (`att`)."""
        await self._registrations.attach(self.id, att.card, suffix, att.files, att.served)

    async def set_taints(self, taints: list[str]) -> None:
        """Replace the taints of every attached model (e.g. `draining`)."""
        await self._registrations.set_taints(self.id, taints)

    async def sync_models(self) -> None:
        """Attach what the engine serves and is not attached; detach what it no longer serves.

        A model that cannot be announced (its card or files refused) is refused alone, in
        `refused`: the others are announced. A store outage fails the whole sync (retried).
        Nothing is done while the engine lists the very same models as at the last sync and
        nothing was attached or detached since; a sync yields every `SYNC_BATCH` models.
        """
        if self.engine is None:
            return
        async with self.sync_lock:
            served = await self.engine.served_models()
            retry = bool(self.refused) and time.monotonic() >= self._retry_at
            if retry:
                self._retry_at = time.monotonic() + REFUSED_RETRY
            elif self._in_step(served):
                return
            self._synced = None
            wanted = await self._wanted(served)
            gone: list[str | None] = []
            for i, (suffix, att) in enumerate(list(self.models.items()), 1):
                if i % SYNC_BATCH == 0:
                    await asyncio.sleep(0)
                model = wanted.get(suffix)
                if att.served is not None and model is not att.served and model != att.served:
                    gone.append(suffix)
            for start in range(0, len(gone), PUT_BATCH):  # (withdrawn a batch per store call)
                await self._registrations.detach_many(self.id, gone[start : start + PUT_BATCH])
            fresh: list[ServedModel] = []
            for i, (suffix, model) in enumerate(wanted.items(), 1):
                if i % SYNC_BATCH == 0:
                    await asyncio.sleep(0)
                if suffix in self.models:
                    if self.refused:
                        self.refused.pop(model.name, None)
                    continue
                held = self.refused.get(model.name)
                if held is None or retry or (held[0] is not model and held[0] != model):
                    fresh.append(model)
                if len(fresh) == PUT_BATCH:
                    await self._attach_batch(fresh)
                    fresh = []
            if fresh:
                await self._attach_batch(fresh)
            if self.refused:
                listed = {m.name for m in served}
                self.refused = {k: v for k, v in self.refused.items() if k in listed}
            self._synced = (served, list(self.models.values()))
            self.announced = True

    def _in_step(self, served: list[ServedModel]) -> bool:
        """Whether the last sync saw these very model objects and left the models attached
        now (identity only: a few microseconds per thousand models)."""
        if self._synced is None:
            return False
        last_served, last_attached = self._synced
        attached = self.models.values()
        return (
            len(served) == len(last_served)
            and len(attached) == len(last_attached)
            and all(map(operator.is_, served, last_served))
            and all(map(operator.is_, attached, last_attached))
        )

    async def _attach_batch(self, models: list[ServedModel]) -> None:
        """Attach `models` (at most `PUT_BATCH`, with distinct suffixes not attached) with
        one put of their cards (`Registrations.attach_many`). A model that cannot be
        announced (its card or files refused) is refused alone; a store outage raises."""
        entries: list[Entry] = []
        by_suffix: dict[str | None, ServedModel] = {}
        for i, model in enumerate(models, 1):
            if i % SYNC_BATCH == 0:
                await asyncio.sleep(0)
            try:
                card, suffix, snapshots = await self.card_of(model)
            except OUTAGES:
                raise
            except Exception as exc:
                self._refuse(model, exc)
                continue
            entries.append((card, suffix, snapshots, model))
            by_suffix[suffix] = model
        refused, alone = await self._registrations.attach_many(self.id, entries)
        for suffix, model in by_suffix.items():
            if suffix in refused:
                self._refuse(model, refused[suffix])
            elif suffix in alone:
                await self._attach_alone(model)
            elif self.refused:
                self.refused.pop(model.name, None)

    async def _attach_alone(self, model: ServedModel) -> None:
        """Attach `model`; a failure that is its own (not a store outage) refuses it alone."""
        try:
            await self.attach_served(model)
        except OUTAGES:
            raise
        except Exception as exc:
            self._refuse(model, exc)
        else:
            self.refused.pop(model.name, None)

    def _refuse(self, model: ServedModel, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}"[:REFUSED_REASON]
        held = self.refused.get(model.name)
        if held is None or held[1] != reason:
            log.warning(
                "endpoint %s: not announcing %s (the others are): %s",
                self.id,
                quoted(model.name),
                reason,
            )
        if not self.refused:
            self._retry_at = time.monotonic() + REFUSED_RETRY
        self.refused[model.name] = (model, reason)
        self.refusals += 1

    async def _wanted(self, served: list[ServedModel]) -> dict[str | None, ServedModel]:
        wanted: dict[str | None, ServedModel] = {}
        bases = [m for m in served if m.adapter is None]
        chosen = bases[0] if bases else None
        if len(bases) > 1:
            # The model named, else the one announced now while it is still served (an
            # upstream reordering its list must not swap it), else the first.
            held = self.models.get(None)
            current = None if held is None or held.served is None else held.served.name
            chosen = next((m for m in bases if m.name == self.preferred_model), None)
            chosen = chosen or next((m for m in bases if m.name == current), bases[0])
            self._warn_bases(chosen, bases)
        for i, model in enumerate(served, 1):
            if i % SYNC_BATCH == 0:
                await asyncio.sleep(0)
            if model.adapter is None and model is not chosen:
                continue
            try:
                suffix = suffix_for(model)
            except ValueError as exc:
                self._refuse(model, exc)
                continue
            wanted[suffix] = model
        return wanted

    def _warn_bases(self, chosen: ServedModel, bases: list[ServedModel]) -> None:
        """Warn once that only `chosen` of several base models is announced (a count and the
        first few names, however many there are)."""
        first = tuple(m.name for m in bases[:4] if m is not chosen)[:3]
        key = (chosen.name, len(bases) - 1, first)
        if key in self._warned:
            return
        if len(self._warned) >= WARNED_KEPT:
            self._warned.clear()
        self._warned.add(key)
        names = ", ".join(quoted(name) for name in first)
        more = len(bases) - 1 - len(first)
        log.warning(
            "endpoint %s: engine serves %d base models; announcing %s, not %s%s "
            "(serve each on its own endpoint)",
            self.id,
            len(bases),
            quoted(chosen.name),
            names,
            f" and {more} more" if more else "",
        )

    async def _with_metadata(
        self, card: ModelCard, suffix: str | None, files: Mapping[str, Path]
    ) -> tuple[ModelCard, dict[str, bytes]]:
        """The card listing `files` (URL, checksum, size) and their bytes, from one read."""
        listed: dict[str, MetadataFile] = {}
        snapshots: dict[str, bytes] = {}
        base = self.status_url
        for name in files:
            if not url_segment(name):
                raise ValueError(
                    f"metadata file name {name!r} cannot be one segment of a URL (empty, "
                    "'.' or '..', a '/', backslash or NUL, or not UTF-8): not hosted"
                )
        for name, path in files.items():
            snapshot = await asyncio.to_thread(Snapshot.read, path)
            url = base + MetadataKey.of(self.id, card.slug, suffix, name).path
            listed[name] = MetadataFile(
                url=url, checksum=snapshot.checksum, size=len(snapshot.data)
            )
            snapshots[name] = snapshot.data
        return msgspec.structs.replace(card, metadata_files=listed), snapshots

    async def close(self) -> None:
        """Stop serving (cutting what is in flight), then withdraw from discovery."""
        await self.stop_serving()
        await self.withdraw()

    async def stop_serving(self) -> None:
        """Close the request port and stop the engine; requests still in flight are cut
        after `SHUTDOWN_GRACE` (the drain has waited for them already)."""
        await self._stop_serving()

    async def withdraw(self) -> None:
        """Detach every model (discovery first, then metadata) and withdraw the instance."""
        for suffix in list(self.models):
            try:
                await self.detach_model(suffix)
            except Exception as exc:
                log.warning("endpoint %s: detach of %s failed: %s", self.id, suffix or "_", exc)
        try:
            await self._registrations.unregister_instance(self.id)
        except Exception as exc:
            log.warning("endpoint %s: unregistering the instance failed: %s", self.id, exc)
