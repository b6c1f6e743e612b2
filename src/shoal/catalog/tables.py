"""The catalog's database schema: one table per kind, all of one shape, plus workspaces.

A row is its identity (`workspace`, `name`, unique together), its `version` (1 on create,
bumped by every change: the optimistic-concurrency token) and its fields as one JSON `data`
document, so a list or a get is a single query on a single table. Migrations in
`shoal/catalog/migrations` create exactly this; `metadata` here is what they are checked against.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER only

workspaces = sa.Table(
    "workspaces",
    metadata,
    sa.Column("name", sa.String(63), primary_key=True),
    sa.Column("version", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)


def resource_table(name: str) -> sa.Table:
    """A table of one kind of resource."""
    return sa.Table(
        name,
        metadata,
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("workspace", sa.String(63), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
        sa.UniqueConstraint("workspace", "name", name=f"uq_{name}_workspace_name"),
        sa.Index(f"ix_{name}_workspace_updated", "workspace", "updated_at"),
    )


providers = resource_table("providers")
models = resource_table("models")
virtual_models = resource_table("virtual_models")
deployments = resource_table("deployments")
keys = resource_table("keys")

# Usage of API keys, per (workspace, key, model, served model, status class, minute), added to
# by the frontends' batches; a batch id is kept once, so a retried batch is not counted twice.
usage = sa.Table(
    "usage",
    metadata,
    sa.Column("id", Id, primary_key=True, autoincrement=True),
    sa.Column("workspace", sa.String(63), nullable=False),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("model", sa.String(400), nullable=False),
    sa.Column("served_model", sa.String(400), nullable=False),
    sa.Column("status_class", sa.String(3), nullable=False),
    sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
    sa.Column("requests", sa.BigInteger, nullable=False),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False),
    sa.UniqueConstraint(
        "workspace", "key", "model", "served_model", "status_class", "minute",
        name="uq_usage_row",
    ),
    sa.Index("ix_usage_workspace_minute", "workspace", "minute"),
    sa.Index("ix_usage_minute", "minute"),  # (the retention's deletes)
)  # fmt: skip
usage_batches = sa.Table(
    "usage_batches",
    metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
    sa.Index("ix_usage_batches_received_at", "received_at"),
)
