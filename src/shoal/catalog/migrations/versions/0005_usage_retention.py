"""Indexes for the usage retention: rows by minute, batch ids by when they were received.

Revision ID: 0005_usage_retention
Revises: 0004_usage
"""

from __future__ import annotations

from alembic import op

revision = "0005_usage_retention"
down_revision = "0004_usage"


def upgrade() -> None:
    op.create_index("ix_usage_minute", "usage", ["minute"])
    op.create_index("ix_usage_batches_received_at", "usage_batches", ["received_at"])


def downgrade() -> None:
    op.drop_index("ix_usage_batches_received_at", table_name="usage_batches")
    op.drop_index("ix_usage_minute", table_name="usage")
