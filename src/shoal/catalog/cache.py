"""`EntityCache`: one phase's view of a workspace's model entities, read once, written once.

A phase refreshes the cache (one paginated list), reads entities through it, stages what it
wants changed, and flushes. Invariants, both ways:

- reads see staged changes over the snapshot: a phase that stages a change reads it back;
  a name the snapshot lacks costs one direct get (created by someone else since the refresh);
- `flush()` writes each entity at most once per flush, and only if its desired state differs
  from the snapshot: contributions of several providers merge into that one write, and a
  converged pass writes nothing;
- `refresh()` refuses while changes are staged that no flush has attempted: refresh → work →
  flush is enforced, not a convention. A change whose write failed stays staged (marked
  attempted) and is retried by the next flush, over the next refresh's snapshot;
- a create that meets an existing entity (409) adopts it and applies the change to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from shoal.catalog.calls import Calls, each
from shoal.catalog.errors import ConflictError, NotFoundError
from shoal.catalog.kinds import MODELS
from shoal.catalog.leader import LeadershipLost
from shoal.catalog.resources import Model

log = logging.getLogger(__name__)


class StagedChangesError(RuntimeError):
    """`refresh()` was called while staged changes wait for a flush."""


@dataclass
class _Change:
    """What a phase wants of one entity, relative to the snapshot."""

    create: dict[str, Any] | None = None  # the fields of a new entity
    links: dict[str, bool] = field(default_factory=dict)  # provider ref -> link (True) / unlink
    fields: dict[str, Any] = field(default_factory=dict)
    attempted: bool = False  # a flush tried to write it and failed


@dataclass
class FlushResult:
    written: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # name -> why


class EntityCache:
    """The model entities of `workspace`: a snapshot, and the changes staged over it."""

    def __init__(self, calls: Calls, workspace: str) -> None:
        self.calls = calls
        self.workspace = workspace
        self._snapshot: dict[str, Model] = {}
        self._absent: set[str] = set()  # names a direct get found missing since the refresh
        self._staged: dict[str, _Change] = {}
        self.unreadable: set[str] = set()  # listed names the client could not read
        self.refreshed = False

    # -- reading ------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read every entity of the workspace in one paginated list."""
        pending = [name for name, change in self._staged.items() if not change.attempted]
        if pending:
            raise StagedChangesError(
                f"refresh with {len(pending)} staged change(s) not flushed: {', '.join(pending[:5])}"
            )
        entities = await self.calls.list_all(MODELS, self.workspace)
        self._snapshot = {entity.name: entity for entity in entities}
        self.unreadable = set(entities.invalid)
        self._absent = set()
        self.refreshed = True

    def names(self) -> list[str]:
        """Every entity name known: the snapshot's and the staged creates'."""
        return sorted(self._snapshot.keys() | self._staged.keys())

    def linked_to(self, provider: str) -> list[str]:
        """Names linked to `provider` once the flush is done (no call, no copies)."""
        linked = []
        for name in self.names():
            change = self._staged.get(name)
            staged = change.links.get(provider) if change is not None else None
            base = self._snapshot.get(name)
            if staged or (staged is None and base is not None and provider in base.providers):
                linked.append(name)
        return linked

    def peek(self, name: str) -> Model | None:
        """The entity as it will be after the flush, from the snapshot only (no call)."""
        base = self._snapshot.get(name)
        change = self._staged.get(name)
        if change is None:
            return base
        if base is None:
            if change.create is None:
                return None
            base = Model.model_validate(
                {"name": name, "workspace": self.workspace, "version": 0,
                 "created_at": "1970-01-01T00:00:00Z", "updated_at": "1970-01-01T00:00:00Z",
                 **change.create}
            )  # fmt: skip
        return base.model_copy(update=self._desired(base, change))

    async def get(self, name: str) -> Model | None:
        """The entity with staged changes applied; one direct get for a name the snapshot
        does not know nor stages (absent if that get finds nothing)."""
        if name not in self._snapshot and name not in self._absent and name not in self._staged:
            try:
                self._snapshot[name] = await self.calls.get(MODELS, self.workspace, name)
            except NotFoundError:
                self._absent.add(name)
        return self.peek(name)

    # -- staging ------------------------------------------------------------------------

    def _change(self, name: str) -> _Change:
        change = self._staged.setdefault(name, _Change())
        change.attempted = False
        return change

    def stage_create(self, name: str, fields: dict[str, Any] | None = None) -> None:
        """Create `name` with `fields` unless it exists (then only later stages apply)."""
        if name in self._snapshot:
            return
        change = self._change(name)
        change.create = {**(change.create or {}), **(fields or {})}

    def stage_provider_link(self, name: str, provider: str) -> None:
        """Link `provider` ("workspace/name"); cancels a staged unlink of it."""
        self._stage_link(name, provider, True)

    def stage_provider_unlink(self, name: str, provider: str) -> None:
        """Unlink `provider`; cancels a staged link of it."""
        self._stage_link(name, provider, False)

    def _stage_link(self, name: str, provider: str, link: bool) -> None:
        change = self._change(name)
        if change.links.get(provider) is (not link):
            del change.links[provider]  # the opposite was staged: they cancel
        base = self._snapshot.get(name)
        linked = base is not None and provider in base.providers
        if linked != link:
            change.links[provider] = link
        self._drop_if_empty(name)

    def stage_field_updates(self, name: str, fields: dict[str, Any]) -> None:
        """Set `fields` of `name` (merged with fields staged before)."""
        self._change(name).fields.update(fields)

    def _drop_if_empty(self, name: str) -> None:
        change = self._staged[name]
        if change.create is None and not change.links and not change.fields:
            del self._staged[name]

    @property
    def staged(self) -> list[str]:
        """Names with a staged change (including failed ones kept for the next flush)."""
        return sorted(self._staged)

    # -- writing ------------------------------------------------------------------------

    def _desired(self, base: Model, change: _Change) -> dict[str, Any]:
        """The fields of `base` that `change` sets, as they should end up."""
        desired = dict(change.fields)
        providers = [p for p in base.providers if change.links.get(p, True)]
        providers += sorted(p for p, link in change.links.items() if link and p not in providers)
        if providers != base.providers:
            desired["providers"] = providers
        return desired

    def _differences(self, base: Model, change: _Change) -> dict[str, Any]:
        current = base.model_dump(mode="json")
        return {k: v for k, v in self._desired(base, change).items() if current.get(k) != v}

    async def flush(self) -> FlushResult:
        """Write every staged entity that differs, each at most once; failures stay staged."""
        result = FlushResult()

        async def flush_one(name: str) -> None:
            change = self._staged[name]
            try:
                written = await self._write(name, change)
            except LeadershipLost:  # not this entity's: the pass stops
                raise
            except Exception as exc:  # this entity only (unreadable, refused, the catalog down)
                change.attempted = True
                result.failed[name] = f"{type(exc).__name__}: {exc}"
                log.warning("model %s/%s not written (retried next pass): %s",
                            self.workspace, name, exc)  # fmt: skip
                return
            if self._staged.get(name) is change:  # not staged again while it was written
                del self._staged[name]
            if written:
                result.written.append(name)

        await each(sorted(self._staged), flush_one)
        result.written.sort()
        return result

    async def _write(self, name: str, change: _Change) -> bool:
        """Create or update one entity; True if a write was made."""
        base = self._snapshot.get(name)
        if base is None and change.create is None:
            base = await self.get_fresh(name)
            if base is None:  # nothing to change: the entity is gone
                return False
        if base is None:
            assert change.create is not None
            body = {**change.create, "name": name}
            fresh = Model.model_validate(
                {**body, "workspace": self.workspace, "version": 0,
                 "created_at": "1970-01-01T00:00:00Z", "updated_at": "1970-01-01T00:00:00Z"}
            )  # fmt: skip
            body.update(self._desired(fresh, change))
            try:
                self._snapshot[name] = await self.calls.create(MODELS, self.workspace, body)
                return True
            except ConflictError:  # made meanwhile by someone else: adopt it
                base = await self.get_fresh(name)
                if base is None:
                    raise
        return await self._update(base, change)

    async def _update(self, base: Model, change: _Change) -> bool:
        changes = self._differences(base, change)
        if not changes:
            return False
        try:
            updated = await self.calls.update(
                MODELS, self.workspace, base.name, changes, base.version
            )
        except ConflictError:  # changed since the snapshot: merge into what it is now, once
            fresh = await self.get_fresh(base.name)
            if fresh is None or not (changes := self._differences(fresh, change)):
                return False
            updated = await self.calls.update(
                MODELS, self.workspace, base.name, changes, fresh.version
            )
        self._snapshot[base.name] = updated
        return True

    async def get_fresh(self, name: str) -> Model | None:
        try:
            entity = await self.calls.get(MODELS, self.workspace, name)
        except NotFoundError:
            self._snapshot.pop(name, None)
            return None
        self._snapshot[name] = entity
        return entity
