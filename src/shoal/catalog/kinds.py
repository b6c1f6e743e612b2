"""The kinds of resource the catalog holds, each tied to its models, table and URL segment.

One descriptor per kind lets the repository, the API routes, the client and `catalog apply`
treat every kind the same way; what differs between kinds is only data here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import sqlalchemy as sa
from pydantic import BaseModel

from shoal.catalog import resources as r
from shoal.catalog import tables

R = TypeVar("R", bound=r.Meta)


@dataclass(frozen=True)
class Kind(Generic[R]):
    plural: str  # the URL segment: /v1/workspaces/{workspace}/{plural}
    singular: str  # `kind:` in an apply file
    spec: type[BaseModel]
    create: type[BaseModel]
    patch: type[r.Patch]
    read: type[R]
    table: sa.Table
    filterable: frozenset[str]  # string fields a list may filter on (besides name)
    managed: frozenset[str] = frozenset()  # fields the controller writes; apply leaves them


PROVIDERS: Kind[r.Provider] = Kind(
    "providers", "Provider", r.ProviderSpec, r.ProviderCreate, r.ProviderPatch, r.Provider,
    tables.providers, frozenset({"type", "namespace", "status", "auth_secret"}),
    frozenset({"status", "status_message", "served_models"}),
)  # fmt: skip
MODELS: Kind[r.Model] = Kind(
    "models", "Model", r.ModelSpec, r.ModelCreate, r.ModelPatch, r.Model,
    tables.models, frozenset({"base_model", "format"}), frozenset({"providers"}),
)  # fmt: skip
VIRTUAL_MODELS: Kind[r.VirtualModel] = Kind(
    "virtual-models", "VirtualModel", r.VirtualModelSpec, r.VirtualModelCreate,
    r.VirtualModelPatch, r.VirtualModel, tables.virtual_models, frozenset({"default_model"}),
    frozenset({"status_message"}),
)  # fmt: skip
DEPLOYMENTS: Kind[r.Deployment] = Kind(
    "deployments", "Deployment", r.DeploymentSpec, r.DeploymentCreate, r.DeploymentPatch,
    r.Deployment, tables.deployments, frozenset({"model", "engine", "namespace", "status"}),
    frozenset({"status", "status_message"}),
)  # fmt: skip

KEYS: Kind[r.Key] = Kind(
    "keys", "Key", r.KeySpec, r.KeyCreate, r.KeyPatch, r.Key, tables.keys, frozenset()
)

KINDS: tuple[Kind[Any], ...] = (PROVIDERS, MODELS, VIRTUAL_MODELS, DEPLOYMENTS, KEYS)
BY_NAME: dict[str, Kind[Any]] = {
    alias: kind
    for kind in KINDS
    for alias in (kind.plural, kind.singular.lower(), kind.plural.rstrip("s"), kind.singular)
}


def kind_named(name: str) -> Kind[Any]:
    """The kind called `name` (plural, singular, any case); `KeyError` naming the choices."""
    kind = BY_NAME.get(name) or BY_NAME.get(name.lower())
    if kind is None:
        raise KeyError(f"unknown kind {name!r}: one of {', '.join(k.plural for k in KINDS)}")
    return kind
