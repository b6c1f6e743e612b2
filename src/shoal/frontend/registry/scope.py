"""`FollowedScope`: the namespaces a `ModelWatcher` serves when its scope follows a membership.

A new scope is applied by difference, make before break: the namespaces that join (or whose
queries changed) get their event streams first, then those that left are dropped with their
registrations (found by namespace, not by a scan of every registration). At most
`FOLLOW_SLICE` namespaces or dropped keys are handled between two yields to the event loop:
swapping 4,096 namespaces for 4,096 others held the loop 2-3 s in one callback. A scope that
arrives while one is being applied replaces it at the next slice.

`scope_loaded` is set once every namespace in scope has had its first listing applied (each
stream's `on_listed`): until then the frontend is not ready, and `loading()` says how many
namespaces it waits for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

from shoal.discovery import Discovery, ModelKey, Query
from shoal.frontend.registry.registrations import Registrations

log = logging.getLogger(__name__)

FOLLOW_SLICE = 256
"""Namespaces joined or left, or keys dropped, between two yields to the event loop."""

Scopes = Mapping[str, Sequence[Query]]


class FollowedScope(Registrations):
    """The namespaces in scope, their streams, and the application of a new scope. The state
    is `ModelWatcher`'s, declared here."""

    discovery: Discovery
    queries: list[Query]
    _namespaces: dict[str, tuple[tuple[Query, ...], list[asyncio.Task[None]]]]
    _loading: dict[str, set[Query]]  # namespace -> its streams whose listing is not applied
    _joining: int  # namespaces of the scope being applied not joined yet
    _wanted: Scopes | None  # the scope to apply next
    _follower: asyncio.Task[None] | None  # applies `_wanted`, a slice at a time
    scope_loaded: asyncio.Event

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        raise NotImplementedError

    async def _watch(
        self,
        query: Query,
        *,
        after_listing: bool = False,
        on_listed: Callable[[], None] | None = None,
    ) -> None:
        raise NotImplementedError

    def follow(self, scopes: Scopes) -> None:
        """Serve exactly `scopes` (namespace -> its discovery queries): a namespace that left
        is removed, a new one added, one whose queries changed restarted; the rest untouched.
        A small change is applied at once; a larger one by a task, a slice at a time."""
        self.scope_loaded.clear()
        if self._follower is None and len(scopes) + len(self._namespaces) <= FOLLOW_SLICE:
            joining, leaving = self._difference(scopes.items(), self._namespaces.items(), scopes)
            if len(joining) + self._keys_of(leaving) <= FOLLOW_SLICE:
                self._join_all(joining)
                dropped: set[Query] = set()
                for namespace in leaving:
                    for key in self._leave(namespace, dropped):
                        self._drop(key)
                self._forget(dropped)
                self._report(len(joining), len(leaving))
                return
        self._wanted = scopes
        if self._follower is None:
            self._follower = self._spawn(self._follow_wanted(), "scope:follow")

    def loading(self) -> int:
        """Namespaces in scope (or joining it) whose first listing is not applied yet."""
        return self._joining + len(self._loading)

    def _in_scope(self, key: ModelKey) -> bool:
        """`key` is inside a query of a namespace in scope (when the scope follows membership)."""
        entry = self._namespaces.get(key.endpoint.namespace)
        if entry is None:
            return False
        endpoint = key.endpoint
        return any(
            q.component in (None, endpoint.component) and q.endpoint in (None, endpoint.endpoint)
            for q in entry[0]
        )

    # -- applying a scope ---------------------------------------------------------------------

    async def _follow_wanted(self) -> None:
        try:
            while self._wanted is not None:
                scopes, self._wanted = self._wanted, None
                await self._apply_scope(scopes)
        finally:
            self._follower, self._joining = None, 0
            self._report(0, 0)

    async def _apply_scope(self, scopes: Scopes) -> None:
        """Join, then leave, `FOLLOW_SLICE` at a time; a newer scope stops this one between
        two slices (it is applied from wherever this one got to)."""
        items = list(scopes.items())
        namespaces = list(self._namespaces.items())
        joining: list[tuple[str, tuple[Query, ...]]] = []
        leaving: list[str] = []
        step = FOLLOW_SLICE * 4  # (a lookup or two each)
        for start in range(0, max(len(items), len(namespaces)), step):
            more = self._difference(
                items[start : start + step], namespaces[start : start + step], scopes
            )
            joining += more[0]
            leaving += more[1]
            await asyncio.sleep(0)
            if self._wanted is not None:
                return
        self._joining = len(joining)
        for start in range(0, len(joining), FOLLOW_SLICE):
            self._join_all(joining[start : start + FOLLOW_SLICE])
            self._joining -= len(joining[start : start + FOLLOW_SLICE])
            await asyncio.sleep(0)
            if self._wanted is not None:
                return
        work = 0
        dropped: set[Query] = set()
        for namespace in leaving:
            for key in self._leave(namespace, dropped):
                self._drop(key)
                work += 1
                if work % FOLLOW_SLICE == 0:
                    await asyncio.sleep(0)
            work += 1
            if work % FOLLOW_SLICE == 0:
                self._forget(dropped)
                await asyncio.sleep(0)
        self._forget(dropped)
        self._report(len(joining), len(leaving))

    def _difference(
        self,
        wanted: Iterable[tuple[str, Sequence[Query]]],
        current: Iterable[tuple[str, tuple[tuple[Query, ...], list[asyncio.Task[None]]]]],
        scopes: Scopes,
    ) -> tuple[list[tuple[str, tuple[Query, ...]]], list[str]]:
        """The namespaces of `wanted` to (re)start, and those of `current` to leave: not in
        `scopes` (the whole scope `wanted` is part of), or in it with other queries."""
        joining = []
        for namespace, queries in wanted:
            scoped = tuple(queries) if queries else (Query(namespace=namespace),)
            entry = self._namespaces.get(namespace)
            if entry is None or entry[0] != scoped:
                joining.append((namespace, scoped))
        leaving = []
        for namespace, (scoped, _) in current:
            kept = scopes.get(namespace)
            if kept is None or (tuple(kept) or (Query(namespace=namespace),)) != scoped:
                leaving.append(namespace)
        return joining, leaving

    def _keys_of(self, namespaces: list[str]) -> int:
        by_namespace = self._by_namespace or {}
        return sum(1 + len(by_namespace.get(ns, ())) for ns in namespaces)

    def _join_all(self, joining: Sequence[tuple[str, tuple[Query, ...]]]) -> None:
        """Start the streams of each namespace (restarting one whose queries changed)."""
        dropped: set[Query] = set()
        for namespace, _ in joining:  # (one whose queries changed: restarted)
            for key in self._leave(namespace, dropped):
                self._drop(key)
        self._forget(dropped)
        for namespace, scoped in joining:
            self.queries.extend(scoped)
            self._loading[namespace] = set(scoped)
            tasks = [
                self._spawn(
                    self._watch(q, on_listed=self._listed(namespace, scoped, q)),
                    f"watch:{q.models_prefix}",
                )
                for q in scoped
            ]
            self._namespaces[namespace] = (scoped, tasks)

    def _listed(
        self, namespace: str, scoped: tuple[Query, ...], query: Query
    ) -> Callable[[], None]:
        """What a stream calls when its listing is applied (its first one counts)."""

        def listed() -> None:
            entry = self._namespaces.get(namespace)
            waiting = self._loading.get(namespace)
            if entry is None or entry[0] is not scoped or waiting is None:
                return  # (it left, or joined again since)
            waiting.discard(query)
            if not waiting:
                del self._loading[namespace]
                self._report(0, 0)

        return listed

    def _leave(self, namespace: str, dropped: set[Query]) -> list[ModelKey]:
        """Stop the streams of `namespace`; its queries go to `dropped` (taken out of
        `queries` by `_forget`), its keys are returned for `_drop`."""
        entry = self._namespaces.pop(namespace, None)
        self._loading.pop(namespace, None)
        if entry is None:
            return []
        scoped, tasks = entry
        for task in tasks:
            task.cancel()
        dropped.update(scoped)
        return list((self._by_namespace or {}).pop(namespace, ()))

    def _drop(self, key: ModelKey) -> None:
        """Drop the registration of a key whose namespace left: its model stops being served
        at once, and the new generation keeps a listing from before out."""
        self._bump(key)
        self._remove(key)

    def _forget(self, dropped: set[Query]) -> None:
        if not dropped:
            return
        self.queries = [q for q in self.queries if q not in dropped]
        for query in dropped:
            self.discovery.forget(query)  # its listings are not needed any more
        dropped.clear()

    def _report(self, joined: int, left: int) -> None:
        if joined or left:
            log.info(
                "scope: %d namespaces joined, %d left; %d in scope",
                joined,
                left,
                len(self._namespaces),
            )
        if self._follower is None and not self._loading:
            self.scope_loaded.set()
