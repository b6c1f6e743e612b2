"""Usage of API keys per minute, and the ids of the batches already counted.

Revision ID: 0004_usage
Revises: 0003_keys
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_usage"
down_revision = "0003_keys"

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "usage",
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
    )  # fmt: skip
    op.create_index("ix_usage_workspace_minute", "usage", ["workspace", "minute"])
    op.create_table(
        "usage_batches",
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("usage_batches")
    op.drop_table("usage")
