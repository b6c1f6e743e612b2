"""API keys: one more table of the resource shape (a key's secrets are kept as hashes in `data`).

Revision ID: 0003_keys
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_keys"
down_revision = "0002"

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "keys",
        sa.Column("id", Id, primary_key=True, autoincrement=True),
        sa.Column("workspace", sa.String(63), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
        sa.UniqueConstraint("workspace", "name", name="uq_keys_workspace_name"),
    )
    op.create_index("ix_keys_workspace_updated", "keys", ["workspace", "updated_at"])


def downgrade() -> None:
    op.drop_table("keys")
