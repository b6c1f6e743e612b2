"""Alembic environment: runs on the connection `shoal.catalog.database.migrate` passes in."""

from __future__ import annotations

from alembic import context

from shoal.catalog.tables import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
