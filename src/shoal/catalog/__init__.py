"""Layer 6: the catalog, the fleet's desired state.

What belongs here: the resources users and controllers declare (providers, model entities,
virtual models, deployments, in workspaces), their database (SQLAlchemy on SQLite or
PostgreSQL, Alembic migrations), the REST API over it (FastAPI), the typed client of that API,
and `apply` (a file of resources made true). The models controller that reconciles all this
belongs here too: `controller` (the pass, in one file), its phases `deployments` and
`providers`, the entity `cache` they write through, `calls` (the client, beating), the
deployment `backends`, `routing` (virtual models to published routes), `leader` and `collector`
(full garbage collections kept out of the passes).
Nothing imports the catalog except `shoal.cli`.
"""

from __future__ import annotations

from shoal.catalog.client import CatalogClient, ListPage
from shoal.catalog.database import default_database_url, migrate, open_engine
from shoal.catalog.errors import (
    CatalogError,
    ConflictError,
    InvalidError,
    NotFoundError,
    UnauthorizedError,
    UnavailableError,
)
from shoal.catalog.kinds import (
    DEPLOYMENTS,
    KEYS,
    KINDS,
    MODELS,
    PROVIDERS,
    VIRTUAL_MODELS,
    Kind,
    kind_named,
)
from shoal.catalog.server import CatalogConfig, CatalogServer

__all__ = [
    "DEPLOYMENTS",
    "KEYS",
    "KINDS",
    "MODELS",
    "PROVIDERS",
    "VIRTUAL_MODELS",
    "CatalogClient",
    "CatalogConfig",
    "CatalogError",
    "CatalogServer",
    "ConflictError",
    "InvalidError",
    "Kind",
    "ListPage",
    "NotFoundError",
    "UnauthorizedError",
    "UnavailableError",
    "default_database_url",
    "kind_named",
    "migrate",
    "open_engine",
]
