"""The catalog's first schema: workspaces and one table per kind of resource.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None

KINDS = ("providers", "models", "virtual_models", "deployments")
Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "workspaces",
        sa.Column("name", sa.String(63), primary_key=True),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    for name in KINDS:
        op.create_table(
            name,
            sa.Column("id", Id, primary_key=True, autoincrement=True),
            sa.Column("workspace", sa.String(63), nullable=False),
            sa.Column("name", sa.String(200), nullable=False),
            sa.Column("version", sa.BigInteger, nullable=False),
            sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
            sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
            sa.Column("data", sa.JSON, nullable=False),
            sa.UniqueConstraint("workspace", "name", name=f"uq_{name}_workspace_name"),
        )
        op.create_index(f"ix_{name}_workspace_updated", name, ["workspace", "updated_at"])


def downgrade() -> None:
    for name in KINDS:
        op.drop_table(name)
    op.drop_table("workspaces")
