"""`Scope`: one scope the membership watch follows (a namespace, or every namespace): its
watch's epoch and task, the endpoints its last snapshot read, and the two things done to
those between snapshots: a taint update applied in place (`update_taints`), and the
endpoints two snapshots differ by (`note_changes`)."""

from __future__ import annotations

import asyncio
import dataclasses

from shoal.cards import CardError, ModelCard
from shoal.discovery import ModelInstance, ModelKey, Query
from shoal.discovery.keys import parse_model_key
from shoal.discovery.values import check_size
from shoal.membership.view import EndpointRef
from shoal.store import Put

YIELD_EVERY = 256  # events applied, or endpoints built, between two yields to the loop

Models = dict[ModelKey, ModelInstance]


@dataclasses.dataclass(eq=False)
class Scope:
    """One watched scope (a namespace, or everything when `name` is None)."""

    name: str | None
    query: Query
    epoch: int = 0
    task: asyncio.Task[None] | None = None  # consumes the open watch; None: closed, reopen
    ready: bool = False  # a snapshot was read since the watch opened
    dirty: bool = False
    reading: bool = False
    closed: bool = False
    endpoints: dict[EndpointRef, Models] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return "all namespaces" if self.name is None else f"namespace {self.name!r}"

    def update_taints(self, change: Put) -> EndpointRef | tuple[()] | None:
        """The endpoint whose taints changed; () when nothing changed; None when the change
        is not a taint update of a known card. The card is decoded only for a key known
        (each new card of a burst was decoded here for nothing, then again by the read)."""
        try:
            key = parse_model_key(change.key)
        except ValueError:
            return None
        ref = (key.endpoint, key.instance_id)
        models = self.endpoints.get(ref)
        model = None if models is None else models.get(key)
        if models is None or model is None:
            return None
        try:
            check_size(change.value)
            card = ModelCard.from_json(change.value)
        except (ValueError, CardError):
            return None
        if not model.card.same_except_taints(card):
            return None
        if model.card.taints == card.taints:
            return ()
        models[key] = dataclasses.replace(model, card=card, revision=change.revision)
        return ref


async def note_changes(
    before: dict[EndpointRef, Models], after: dict[EndpointRef, Models], changed: set[EndpointRef]
) -> None:
    """Add to `changed` the endpoints whose models differ between two snapshots of a scope,
    yielding every `YIELD_EVERY` (10,000 endpoints compared at once held the loop 10-150 ms)."""
    for i, (ref, models) in enumerate(list(after.items()), 1):
        if i % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        if before.get(ref) != models:  # identical models compare at once
            changed.add(ref)
    for i, ref in enumerate(before, 1):  # (`before` is no longer changed by anyone)
        if i % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        if ref not in after:
            changed.add(ref)
