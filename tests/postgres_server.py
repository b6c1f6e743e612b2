"""A PostgreSQL server for tests, found or started the way `scripts/ensure-postgres.sh` expects.

In order: `SHOAL_TEST_POSTGRES_URL` when set; else a server listening on 127.0.0.1:5432
(trust auth, user postgres); else a throwaway cluster (`initdb` + `pg_ctl`, Debian's
`postgresql` package) on a free port, removed at the end. Each test session gets its own
database, dropped afterwards.
"""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor

import asyncpg

from tests.helpers import free_port


def _listening(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _binary(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))), None
    )
    if not found:
        raise RuntimeError(f"{name} not found: run scripts/ensure-postgres.sh (Debian postgresql)")
    return found


class PostgresCluster:
    """A throwaway cluster in a temporary directory, on a free loopback port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="shoal-pg-")
        self.data = os.path.join(self.dir, "data")
        self._as_user: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root: run the cluster as `postgres`
            shutil.chown(self.dir, "postgres")
            self._as_user = ["runuser", "-u", "postgres", "--"]

    def start(self) -> str:
        run = self._as_user
        subprocess.run(
            [*run, _binary("initdb"), "-D", self.data, "-U", "postgres", "-A", "trust"],
            check=True, capture_output=True,
        )  # fmt: skip
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            [*run, _binary("pg_ctl"), "-D", self.data, "-o", options, "-w", "-l",
             os.path.join(self.dir, "log"), "start"],
            check=True, capture_output=True,
        )  # fmt: skip
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        subprocess.run(
            [*self._as_user, _binary("pg_ctl"), "-D", self.data, "-m", "immediate", "stop"],
            capture_output=True,
        )
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresDatabase:
    """One database of its own on a PostgreSQL server, for one test session."""

    def __init__(self) -> None:
        self.cluster: PostgresCluster | None = None
        if url := os.environ.get("SHOAL_TEST_POSTGRES_URL"):
            self.server_url = url
        elif _listening("127.0.0.1", 5432):
            self.server_url = "postgresql://postgres@127.0.0.1:5432/postgres"
        else:
            self.cluster = PostgresCluster()
            self.server_url = self.cluster.start()
        self.name = f"shoal_test_{uuid.uuid4().hex[:12]}"
        base, _, _ = self.server_url.rpartition("/")
        self.url = f"{base}/{self.name}"
        self._admin(f'CREATE DATABASE "{self.name}"')

    def _admin(self, statement: str) -> None:
        """Run `statement` on the server's own database, on a thread (a loop may be running)."""

        async def execute() -> None:
            conn = await asyncpg.connect(self.server_url)
            try:
                await conn.execute(statement)
            finally:
                await conn.close()

        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, execute()).result()

    def close(self) -> None:
        try:
            self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        finally:
            if self.cluster is not None:
                self.cluster.stop()
