"""The test command's last resort works: a throwaway PostgreSQL cluster on a free port."""

from __future__ import annotations

import glob
import shutil

import pytest

from shoal.catalog.database import current_revision, migrate, open_engine
from tests.catalog.test_migrations import HEAD
from tests.postgres_server import PostgresCluster


@pytest.mark.skipif(
    not (shutil.which("initdb") or glob.glob("/usr/lib/postgresql/*/bin/initdb")),
    reason="no initdb: scripts/ensure-postgres.sh installs it when no server is reachable",
)
async def test_throwaway_cluster_serves_a_migrated_catalog() -> None:
    cluster = PostgresCluster()
    try:
        engine = open_engine(cluster.start())
        try:
            await migrate(engine)
            async with engine.connect() as conn:
                assert await current_revision(conn) == HEAD
        finally:
            await engine.dispose()
    finally:
        cluster.stop()
