"""What discovery reads and reports: endpoint instances (`InstanceInfo`), routable models
(`ModelInstance`: a card served by a live instance), and the events of a watch."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from shoal.cards import ModelCard
from shoal.discovery.keys import EndpointId, ModelKey
from shoal.kv import KvEndpoint


class InstanceInfo(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """An endpoint instance: where requests go (`url`) and where its status server is.

    Unknown fields are ignored and unset optional ones are not written, so a newer worker's
    record stays readable by an older frontend, as cards do."""

    namespace: str
    component: str
    endpoint: str
    instance_id: int
    url: str
    status_url: str
    kv_events: KvEndpoint | None = None  # where it publishes KV cache events, if it does

    @property
    def endpoint_id(self) -> EndpointId:
        return EndpointId(self.namespace, self.component, self.endpoint)


@dataclass(frozen=True, slots=True)
class ModelInstance:
    """A routable model: its card, served by a live endpoint instance.

    `revision` is the store revision that last wrote the card (its mod_revision; 0 when not
    known): every reader of the store sees the same one, so it can order cards everywhere.
    `mdcsum` is the card's (`ModelCard.mdcsum`), carried here so that the hundred thousand
    cards a frontend holds need not each cache it: discovery computes it once per model.
    """

    key: ModelKey
    card: ModelCard
    instance: InstanceInfo
    revision: int = 0
    mdcsum: str = field(default="", compare=False)  # (derived from `card`)

    def __post_init__(self) -> None:
        if not self.mdcsum:
            object.__setattr__(self, "mdcsum", self.card.mdcsum)

    @property
    def instance_id(self) -> int:
        return self.key.instance_id

    @property
    def url(self) -> str:
        return self.instance.url


@dataclass(frozen=True, slots=True)
class Added:
    model: ModelInstance


@dataclass(frozen=True, slots=True)
class Removed:
    key: ModelKey


@dataclass(frozen=True, slots=True)
class TaintsUpdated:
    """The card at `key` was written again (at `revision`) with these taints."""

    key: ModelKey
    taints: tuple[str, ...]
    revision: int = field(default=0, compare=False)  # an event's content is key and taints


DiscoveryEvent = Added | Removed | TaintsUpdated
