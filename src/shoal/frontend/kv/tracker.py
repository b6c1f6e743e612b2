"""`KvTracker`: whose KV events the frontend follows, and each worker set's index and tokenizer.

The narrow interface is `track(instance, ws)` / `untrack(endpoint, instance_id, ws)`: an
instance is tracked for a worker set while it is a member of it; `retain(selected)` drops
every instance outside a selection (a membership view) at once. Today the registry drives
it (`joined`/`left`, as a `RegistryObserver`), so the tracker follows exactly the instances
the frontend routes to, which the frontend's scope (and, with it, the membership view)
decides. An instance that leaves is purged from the set's index.

The events come from each instance's own publisher (one `KvSubscription` per instance), or,
with `use_stream(reader)`, from the relay's JetStream stream (`KvStreamReader`), which the
tracker tells which instances to follow.

Everything here runs off the request path: subscriptions apply events in their own tasks,
tokenizers load in a thread; the policy only reads `sets`.

Sets whose cards name the same tokenizer and config files (by checksum: models fine-tuned
from one base, one model in many namespaces) share one loaded `tokenizers.Tokenizer`, read
once and let go with the last set that uses it: a load holds the GIL for ~100 ms
(`tokenizers` parses the file without letting it go) and the tables are the bulk of a
tokenizer's memory. They share its cache of tokenized chat segments too (`prompt_chain`, a
function of the tokenizer alone: one `CHAIN_CACHE_BYTES` for all of them, its probe of the
vocabulary made once). Each set still has its own `PromptTokenizer` around them (its
template, its render thread while it has work): a chat that makes one set's template overrun disables that
set's template only, as before the sharing. Loads run one at a time, so that many new
tokenizers hold the loop for one load at a time, not for a pile of threads each waiting for
the GIL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq.asyncio
from tokenizers import Tokenizer

from shoal.cards import ModelCard
from shoal.discovery import EndpointId, InstanceInfo, ModelInstance, ModelKey
from shoal.frontend.kv.chain import PromptChain
from shoal.frontend.kv.index import KvIndex
from shoal.frontend.kv.kept import StreamKey
from shoal.frontend.kv.prompt import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    PromptTokenizer,
    prompt_chain,
    read_files,
)
from shoal.frontend.kv.stream import KvStreamReader
from shoal.frontend.registry.metadata import MetadataCache
from shoal.frontend.registry.registry import SetId, WorkerSet
from shoal.kv import KvEndpoint, KVEventBatch
from shoal.kv.subscription import KvStats, KvSubscription, zmq_context

log = logging.getLogger(__name__)


@dataclass(eq=False)
class KvSet:
    """What the kv policy knows about one worker set."""

    index: KvIndex
    tokenizer: PromptTokenizer | None = None
    no_tokenizer: str = "loading"  # why `tokenizer` is None
    fallback_logged: bool = False
    avg_uncached_blocks: float = 1.0  # a moving average: the load term's unit


TokenizerKey = tuple[str, str | None]  # the checksums of the tokenizer and config files
# What they hold, read (`read_files`), and the segment cache of chats tokenized with them
# (`prompt_chain`): shared by the sets that use them, within one bound.
Files = tuple[Tokenizer, dict[str, Any], PromptChain | None]


@dataclass(eq=False)
class _SharedTokenizer:
    """One tokenizer loaded for every set whose files are the same, and who uses it."""

    load: asyncio.Task[Files]
    users: set[SetId] = field(default_factory=set)


@dataclass(eq=False)
class _Tracked:
    """One instance's subscription and the sets its events feed."""

    subscription: KvSubscription | None  # None: its events come from the stream
    endpoint: KvEndpoint
    sets: set[SetId] = field(default_factory=set)


class KvTracker:
    """Subscriptions to the tracked instances' KV events, feeding per-set `KvIndex`es."""

    def __init__(self, cache: MetadataCache | None = None) -> None:
        self.cache = cache
        self.sets: dict[SetId, KvSet] = {}
        self.stats = KvStats()
        self._tracked: dict[tuple[EndpointId, int], _Tracked] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._loads: set[asyncio.Task[None]] = set()
        self._tokenizers: dict[TokenizerKey, _SharedTokenizer] = {}
        self._set_tokenizer: dict[SetId, TokenizerKey] = {}
        self._one_load = asyncio.Lock()
        self.stream: KvStreamReader | None = None
        self._by_key: dict[StreamKey, set[tuple[EndpointId, int]]] = {}

    def use_stream(self, reader: KvStreamReader) -> None:
        """Read every instance's events from `reader` instead of its own publisher."""
        self.stream = reader
        reader.stats = self.stats
        reader.start()

    async def close(self) -> None:
        loads = [shared.load for shared in self._tokenizers.values()]
        for state in self.sets.values():
            if state.tokenizer is not None:
                state.tokenizer.close()
        for set_id in list(self._set_tokenizer):
            self._release(set_id)
        await asyncio.gather(*loads, return_exceptions=True)
        for tracked in list(self._tracked.values()):
            if tracked.subscription is not None:
                await tracked.subscription.stop()
        self._tracked.clear()
        if self.stream is not None:
            await self.stream.close()
        for task in list(self._loads):
            task.cancel()
        await asyncio.gather(*self._loads, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # closes any socket a cancelled task left open
            self._ctx = None

    def index_size(self) -> int:
        return sum(len(s.index) for s in self.sets.values())

    @property
    def over_cap(self) -> dict[str, int]:
        """Instances (hex id) purged for holding more blocks than the cap, and how often."""
        return {f"{i:x}": n for s in self.sets.values() for i, n in s.index.over_cap.items()}

    # -- the registry's changes -----------------------------------------------------------

    def joined(self, model: ModelInstance, ws: WorkerSet) -> None:
        if model.card.lora is not None:
            return  # adapters' blocks are told apart by `lora_id`: not indexed yet
        self._ensure_set(ws, model.card)
        self.track(model.instance, ws)

    def left(self, key: ModelKey, ws: WorkerSet) -> None:
        self.untrack(key.endpoint, key.instance_id, ws)
        if not ws.members and (state := self.sets.pop(ws.id, None)) is not None:
            if state.tokenizer is not None:
                state.tokenizer.close()
            self._release(ws.id)

    # -- tracking -----------------------------------------------------------------------------

    def track(self, instance: InstanceInfo, ws: WorkerSet) -> None:
        """Follow `instance`'s events for `ws` (nothing to follow if it publishes none)."""
        endpoint = instance.kv_events
        ident = (instance.endpoint_id, instance.instance_id)
        tracked = self._tracked.get(ident)
        if tracked is not None and tracked.endpoint != endpoint:
            self._drop(ident)  # it moved: its old stream says nothing about the new one
            tracked = None
        if endpoint is None or ws.id not in self.sets:
            return
        if tracked is None:
            tracked = self._tracked[ident] = _Tracked(self._subscribe(ident, endpoint), endpoint)
        tracked.sets.add(ws.id)

    def _subscribe(
        self, ident: tuple[EndpointId, int], endpoint: KvEndpoint
    ) -> KvSubscription | None:
        """Start following `ident`'s events: its own publisher, or its records in the stream."""
        if self.stream is not None:
            key = (ident[0].namespace, ident[1])
            idents = self._by_key.setdefault(key, set())
            idents.add(ident)
            if len(idents) == 1:

                def apply(batch: KVEventBatch) -> None:
                    for one in list(idents):
                        self._apply(one, batch)

                def purge() -> None:
                    for one in list(idents):
                        self._purge(one)

                self.stream.follow(key, apply, purge)
            return None
        if self._ctx is None:
            self._ctx = zmq_context()
        subscription = KvSubscription(
            self._ctx,
            ident[1],
            endpoint,
            lambda seq, batch: self._apply(ident, batch),
            lambda: self._purge(ident),
            self.stats,
        )
        subscription.start()
        return subscription

    def untrack(self, endpoint: EndpointId, instance_id: int, ws: WorkerSet) -> None:
        """Stop following `instance_id` for `ws`, and forget its blocks there."""
        ident = (endpoint, instance_id)
        state = self.sets.get(ws.id)
        if state is not None:
            state.index.purge(instance_id)
            state.index.over_cap.pop(instance_id, None)
        tracked = self._tracked.get(ident)
        if tracked is None:
            return
        tracked.sets.discard(ws.id)
        if not tracked.sets:
            self._drop(ident)

    def retain(self, selected: Callable[[EndpointId], bool]) -> None:
        """Stop following, and purge, every instance whose endpoint `selected` refuses: how a
        membership view that stopped selecting a namespace is applied at once."""
        for ident in [i for i in self._tracked if not selected(i[0])]:
            self._drop(ident)

    def _drop(self, ident: tuple[EndpointId, int]) -> None:
        tracked = self._tracked.pop(ident, None)
        if tracked is None:
            return
        self._purge_sets(ident[1], tracked.sets)
        if tracked.subscription is None:
            key = (ident[0].namespace, ident[1])
            idents = self._by_key.get(key, set())
            idents.discard(ident)
            if not idents and self.stream is not None:
                self._by_key.pop(key, None)
                self.stream.unfollow(key)
            return
        task = asyncio.ensure_future(tracked.subscription.stop())
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    def _apply(self, ident: tuple[EndpointId, int], batch: KVEventBatch) -> None:
        tracked = self._tracked.get(ident)
        if tracked is None:
            return
        instance_id = ident[1]
        for set_id in tracked.sets:
            state = self.sets.get(set_id)
            if state is not None:
                for event in batch.events:
                    state.index.apply(instance_id, event)

    def _purge(self, ident: tuple[EndpointId, int]) -> None:
        tracked = self._tracked.get(ident)
        if tracked is not None:
            self._purge_sets(ident[1], tracked.sets)

    def _purge_sets(self, instance_id: int, sets: set[SetId]) -> None:
        for set_id in sets:
            state = self.sets.get(set_id)
            if state is not None:
                state.index.purge(instance_id)

    # -- tokenizers ---------------------------------------------------------------------------

    def _ensure_set(self, ws: WorkerSet, card: ModelCard) -> None:
        if ws.id in self.sets:
            return
        state = self.sets[ws.id] = KvSet(KvIndex(card.kv_block_size))
        tokenizer = card.metadata_files.get(TOKENIZER_FILE)
        if tokenizer is None:
            state.no_tokenizer = f"its metadata has no {TOKENIZER_FILE}"
            return
        if self.cache is None:
            state.no_tokenizer = "no metadata cache"
            return
        config = card.metadata_files.get(CONFIG_FILE)
        key: TokenizerKey = (tokenizer.checksum, None if config is None else config.checksum)
        shared = self._tokenizers.get(key)
        if shared is None or _failed(shared.load):
            path = self.cache.path(tokenizer.checksum)
            config_path = None if config is None else self.cache.path(config.checksum)
            load = asyncio.ensure_future(self._load(path, config_path, key))
            if shared is None:
                shared = self._tokenizers[key] = _SharedTokenizer(load)
            else:  # (one that failed is loaded anew, for the sets that use it too)
                shared.load = load
                for user in shared.users:
                    if (other := self.sets.get(user)) is not None:
                        self._start_use(other, user, load)
        shared.users.add(ws.id)
        self._set_tokenizer[ws.id] = key
        self._start_use(state, ws.id, shared.load)

    def _start_use(self, state: KvSet, set_id: SetId, load: asyncio.Task[Files]) -> None:
        task = asyncio.ensure_future(self._use(state, set_id, load))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _load(self, path: Path, config: Path | None, key: TokenizerKey) -> Files:
        async with self._one_load:
            if self.cache is not None:
                await self.cache.written(*(c for c in key if c is not None))
            # (a card joins before its files are on disk)
            return await asyncio.to_thread(_read, path, config)

    async def _use(self, state: KvSet, set_id: SetId, load: asyncio.Task[Files]) -> None:
        try:
            files = await asyncio.shield(load)
            tokenizer = await asyncio.to_thread(PromptTokenizer, *files)  # (this set's own)
        except asyncio.CancelledError:
            raise  # (the set left, or the tracker closes)
        except Exception as exc:  # any unusable file: the set routes by prefix instead
            state.no_tokenizer = f"its tokenizer could not be loaded: {exc}"
            log.warning("kv router: %s/%s: %s", set_id.model, set_id.namespace, state.no_tokenizer)
            return
        if self.sets.get(set_id) is not state or state.tokenizer is not None:
            tokenizer.close()  # (the set left meanwhile, or a load made anew served it first)
            return
        state.tokenizer, state.no_tokenizer = tokenizer, ""

    def _release(self, set_id: SetId) -> None:
        """`set_id` no longer uses its tokenizer: close it with its last user."""
        key = self._set_tokenizer.pop(set_id, None)
        shared = None if key is None else self._tokenizers.get(key)
        if key is None or shared is None:
            return
        shared.users.discard(set_id)
        if shared.users:
            return
        del self._tokenizers[key]
        if not shared.load.done():
            shared.load.cancel()


def _read(path: Path, config: Path | None) -> Files:
    """(In a thread.) The files, and the cache of chats tokenized with them."""
    tokenizer, settings = read_files(path, config)
    return tokenizer, settings, prompt_chain(tokenizer)


def _failed(load: asyncio.Task[Files]) -> bool:
    """Whether `load` failed to read its files (an `OSError`: not on disk, evicted, the disk
    refused them): a set that joins then loads it anew. Files read and refused for their
    content stay refused: their checksums name that content, so a new parse would only
    hold the GIL as long again (a 22 MB file refused at its end: 280-400 ms each)."""
    if not load.done() or load.cancelled():
        return False
    return isinstance(load.exception(), OSError)
