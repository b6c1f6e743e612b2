"""`Endpoint`: one `namespace.component.endpoint` of a worker, serving an engine over HTTP.

An endpoint instance is registered in discovery under the runtime's lease (its id is the
lease id) with the URL requests go to. Models are attached to it: each gets a card whose
metadata file URLs point at the runtime's status server, its files in the metadata
registry (owned by the model's `ModelKey`), then its key in discovery. Detaching undoes
that in reverse: discovery first, so no frontend fetches a file that is already gone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from shoal.cards import MetadataFile, ModelCard, file_checksum, slugify
from shoal.discovery import EndpointId, InstanceInfo, ModelKey
from shoal.discovery.keys import check_suffix
from shoal.worker.engine import Engine, ServedModel
from shoal.worker.metadata import MetadataKey

if TYPE_CHECKING:
    from shoal.worker.runtime import Runtime

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
MAX_METADATA_FILE = 64 * 1024 * 1024


def metadata_files_in(directory: Path) -> dict[str, Path]:
    """The non-weight files beside a model: config, tokenizer, chat template, generation config."""
    found: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        name = path.name
        if (
            name.startswith(".")
            or not path.is_file()
            or name.endswith(WEIGHT_SUFFIXES)
            or name.endswith(".index.json")
            or not name.endswith(METADATA_SUFFIXES)
            or path.stat().st_size > MAX_METADATA_FILE
        ):
            continue
        found[name] = path
    return found


def suffix_for(model: ServedModel) -> str | None:
    """The discovery suffix of a served model: None for a base model, else from the adapter name."""
    return None if model.adapter is None else check_suffix(slugify(model.adapter))


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
        runtime_config=dict(model.runtime_config),
        lora=lora,
    )
    return card, files


def advertised_host(host: str) -> str:
    """The host others reach a server bound to `host` at (a wildcard becomes this host's name)."""
    if host in ("", "0.0.0.0", "::"):
        return socket.getfqdn()
    return f"[{host}]" if ":" in host else host


@dataclass
class Attached:
    """A model attached to an endpoint: its current registration key, card and hosted files."""

    key: ModelKey
    card: ModelCard
    files: dict[str, Path]
    served: ServedModel | None = None  # set when the model came from the engine


class Endpoint:
    """Serves one engine at `namespace.component.endpoint`; get it with `Runtime.endpoint`."""

    def __init__(self, runtime: Runtime, id: EndpointId) -> None:
        self.runtime = runtime
        self.id = id
        self.engine: Engine | None = None
        self.url: str | None = None
        self.models: dict[str | None, Attached] = {}
        self.in_flight = 0
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()
        self.requests: dict[tuple[str, int], int] = {}
        self.preferred_model: str | None = None
        self.sync_lock = asyncio.Lock()  # engine-driven attach/detach vs adapter calls
        self._runner: web.AppRunner | None = None
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"<Endpoint {self.id} url={self.url}>"

    @property
    def serving(self) -> bool:
        return self._runner is not None

    @property
    def instance_id(self) -> int:
        return self.runtime.instance_id

    def model_key(self, suffix: str | None = None) -> ModelKey:
        return ModelKey(self.id, self.instance_id, suffix)

    def instance_info(self, instance_id: int) -> InstanceInfo:
        assert self.url is not None
        return InstanceInfo(
            namespace=self.id.namespace,
            component=self.id.component,
            endpoint=self.id.endpoint,
            instance_id=instance_id,
            url=self.url,
            status_url=self.runtime.status_url,
            kv_events=None if self.engine is None else self.engine.kv_events,
        )

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
        step by the runtime's models loop. An engine listing several base models gets the
        one named `model` (else the first) announced: one base model per endpoint instance.
        """
        if self.engine is not None:
            raise RuntimeError(f"endpoint {self.id} already serves {self.engine.name}")
        self.engine = engine
        self.preferred_model = model
        await engine.start()
        try:
            app = engine.app()
            app.middlewares.insert(0, self._track)
            runner = web.AppRunner(
                app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
            )
            await runner.setup()
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound = runner.addresses[0][1]
            self._runner = runner
            self.url = f"http://{advertised_host(host)}:{bound}"
            await self.runtime.register_instance(self)
            if attach_models:
                await self.sync_models()
                self.runtime.watch_models(self)
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

        `files` are metadata files to host on the status server: the card's
        `metadata_files` are set to their URLs, checksums and sizes. Returns the card as
        announced. Raises (and leaves nothing attached) if the store refuses it.
        """
        if suffix is not None:
            check_suffix(suffix)
        hosted = dict(files or {})
        if hosted:
            card = await self._with_metadata(card, suffix, hosted)
        await self.runtime.attach(self, card, suffix, hosted)
        return card

    async def detach_model(self, suffix: str | None = None) -> None:
        """Withdraw the model at `suffix` from discovery, then stop hosting its files. Idempotent."""
        await self.runtime.detach(self, suffix)

    async def attach_served(self, model: ServedModel) -> ModelCard:
        """Attach a model an engine serves, hosting the metadata files found beside it."""
        card, files = card_for(model)
        suffix = suffix_for(model)
        attached = await self.attach_model(card, suffix, files=files)
        self.models[suffix].served = model
        return attached

    async def set_taints(self, taints: list[str]) -> None:
        """Replace the taints of every attached model (e.g. `draining`)."""
        await self.runtime.set_taints(self, taints)

    async def sync_models(self) -> None:
        """Attach what the engine serves and is not attached; detach what it no longer serves."""
        if self.engine is None:
            return
        async with self.sync_lock:
            wanted = self._wanted(await self.engine.served_models())
            for suffix, att in list(self.models.items()):
                if att.served is not None and wanted.get(suffix) != att.served:
                    await self.detach_model(suffix)
            for suffix, model in wanted.items():
                if suffix not in self.models:
                    await self.attach_served(model)

    def _wanted(self, served: list[ServedModel]) -> dict[str | None, ServedModel]:
        wanted: dict[str | None, ServedModel] = {}
        bases = [m for m in served if m.adapter is None]
        if len(bases) > 1:
            chosen = next((m for m in bases if m.name == self.preferred_model), bases[0])
            names = ", ".join(sorted(m.name for m in bases if m is not chosen))
            if names not in self._warned:
                self._warned.add(names)
                log.warning(
                    "endpoint %s: engine serves several base models; announcing %r, not %s "
                    "(serve each on its own endpoint)",
                    self.id,
                    chosen.name,
                    names,
                )
            served = [m for m in served if m.adapter is not None or m is chosen]
        for model in served:
            wanted[suffix_for(model)] = model
        return wanted

    async def _with_metadata(
        self, card: ModelCard, suffix: str | None, files: Mapping[str, Path]
    ) -> ModelCard:
        listed: dict[str, MetadataFile] = {}
        base = self.runtime.status_url
        for name, path in files.items():
            checksum, size = await asyncio.to_thread(file_checksum, path)
            url = base + MetadataKey.of(self.id, card.slug, suffix, name).path
            listed[name] = MetadataFile(url=url, checksum=checksum, size=size)
        return msgspec.structs.replace(card, metadata_files=listed)

    async def close(self) -> None:
        """Detach every model, withdraw the instance and stop serving."""
        for suffix in list(self.models):
            try:
                await self.detach_model(suffix)
            except Exception as exc:
                log.warning("endpoint %s: detach of %s failed: %s", self.id, suffix or "_", exc)
        try:
            await self.runtime.unregister_instance(self)
        except Exception as exc:
            log.warning("endpoint %s: unregistering the instance failed: %s", self.id, exc)
        await self._stop_serving()
