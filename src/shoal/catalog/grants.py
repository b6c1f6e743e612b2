"""The keys phase of the models controller: each key's live secrets published as grants.

For one workspace: list its keys (one list), turn each live secret of each key into a `Grant`
(its hash, the key's allow-list and limits, and when it ends), and make
`shoal/v1/keys/{workspace}/` hold exactly those (`publish_grants` writes only what differs).
A secret whose rotation already ended it is not published, so it is deleted. One key that
cannot be turned into grants, or whose row cannot be read (left out of the listing), is
reported and its grants in the store are kept as they are; it never stops the others (nor
does a grant the store refuses, one over its value bound: that key's failure). Secrets
never reach this phase: the catalog keeps only hashes. The loop runs (and the controller's
heartbeat beats) every `routing.SLICE` keys turned into grants and grants compared: 10,000
keys held it ~50 ms in one go. `guard` (the controller's leadership check, a clock read) is
called before each write and each delete: it raises to stop the phase.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from shoal.catalog.calls import Calls
from shoal.catalog.kinds import KEYS
from shoal.catalog.resources import Key
from shoal.catalog.routing import SLICE, Waiting, pause, unwatched
from shoal.discovery.grants import Grant, decode_grant, grants_prefix
from shoal.discovery.keys import quoted
from shoal.store import InvalidKeyError, Store

log = logging.getLogger(__name__)


@dataclass
class KeysResult:
    written: int = 0
    deleted: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # key name -> why


def grants_of(key: Key, now: datetime) -> list[Grant]:
    """A grant per secret of `key` that has not ended by `now`."""
    grants: list[Grant] = []
    for credential in key.credentials:
        ends = [t for t in (key.expires_at, credential.expires_at) if t is not None]
        end = min(ends) if ends else None
        if credential.expires_at is not None and credential.expires_at <= now:
            continue  # retired by a rotation: gone from the store
        grants.append(
            Grant(
                workspace=key.workspace,
                name=key.name,
                hash=credential.hash,
                models=tuple(key.models),
                rpm=key.rpm,
                tpm=key.tpm,
                max_parallel=key.max_parallel,
                expires_at=end.timestamp() if end is not None else None,
                disabled=key.disabled,
            )
        )
    return grants


class KeysPhase:
    """Publishes the grants of one workspace's keys (see the module's docstring)."""

    def __init__(self, calls: Calls, store: Store, waiting_on: Waiting = unwatched) -> None:
        self.calls = calls
        self.store = store
        self.waiting_on = waiting_on  # each store call is a wait on the store

    async def run(self, workspace: str, guard: Callable[[], None] = lambda: None) -> KeysResult:
        keys = await self.calls.list_all(KEYS, workspace)
        result = KeysResult()
        for name, why in keys.invalid.items():  # a row not read: its grants left as they are
            result.failed[name] = f"cannot be read: {why}"
        now = datetime.now(UTC)
        wanted: dict[str, Grant] = {}
        beat = self.calls.beat
        for count, key in enumerate(keys, 1):
            if count % SLICE == 0:
                await pause(beat)
            try:
                for grant in grants_of(key, now):
                    wanted[grant.key] = grant
            except Exception as exc:  # one bad key: reported, its grants left as they are
                result.failed[key.name] = f"{type(exc).__name__}: {exc}"
                log.warning("key %s/%s: not published: %s", workspace, key.name, exc)
        with self.waiting_on("the store"):
            listed = await self.store.get_prefix(grants_prefix(workspace))
        held = {kv.key: kv.value for kv in listed.items}
        guard()  # (the listings took their time: still the leader?)
        for count, (name, grant) in enumerate(wanted.items(), 1):
            if count % SLICE == 0:
                await pause(beat)
                guard()
            if held.get(name) != (data := grant.to_json()):
                guard()  # (a clock read: a replica frozen mid-slice writes nothing after)
                try:
                    with self.waiting_on("the store"):
                        await self.store.put(name, data)
                except ValueError as exc:  # refused for this grant alone (over the value bound)
                    result.failed[grant.name] = f"{type(exc).__name__}: {exc}"
                    log.warning("key %s/%s: not published: %s", workspace, grant.name, exc)
                    continue
                result.written += 1
        for count, name in enumerate(sorted(held.keys() - wanted.keys()), 1):
            if count % SLICE == 0:
                await pause(beat)
                guard()
            if result.failed and _held_by(name, held[name], result.failed):
                continue
            guard()
            try:
                with self.waiting_on("the store"):
                    await self.store.delete(name)
            except InvalidKeyError as exc:  # another writer's key: reported, the others go on
                result.failed[quoted(name)] = f"not deleted: {exc}"
                log.warning("key grants of %s: %s not deleted: %s", workspace, quoted(name), exc)
                continue
            result.deleted += 1
        return result


def _held_by(key: str, value: bytes, names: dict[str, str]) -> bool:
    """True when the grant at `key` belongs to one of the keys named (or is unreadable)."""
    try:
        return decode_grant(key, value).name in names
    except ValueError:
        return False
