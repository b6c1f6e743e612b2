"""schemathesis against `/openapi.json` of a running `shoal catalog serve`, on each backend:
generated requests (coverage, fuzzing, and stateful sequences over the inferred links) get no
5xx and no response that breaks the documented schema, status codes or headers.

Excluded: `positive_data_acceptance`, because some rules span fields and cannot be written in
the schema (a `url` provider needs `base_url`; a PATCH is validated merged with the row), and
NUL characters, which the catalog refuses by design (422 naming the field).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.helpers import free_port
from tests.processes import Processes

SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")


async def test_schemathesis_finds_no_server_error_or_schema_violation(
    processes: Processes, database_url: str, tmp_path: Path
) -> None:
    served = await processes.start(
        "catalog", "serve", "--db", database_url, "--port", str(free_port()),
        "--admin-token", "tok", ready="catalog",
    )  # fmt: skip
    # A body over the catalog's byte bound is refused with 413 (documented), which
    # schemathesis does not count as a rejection by default.
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        "[checks.negative_data_rejection]\nexpected-statuses = "
        '["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]\n'
    )
    proc = await asyncio.create_subprocess_exec(
        SCHEMATHESIS, "--config-file", str(config), "run", f"{served.url}/openapi.json",
        "-H", "Authorization: Bearer tok",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--generation-allow-x00", "false", "--generation-deterministic",
        "--max-examples", "20", "--continue-on-failure",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        cwd=tmp_path,  # its example database and cache stay out of the work tree
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 110)
    report = out.decode(errors="replace")
    assert proc.returncode == 0, report[-6000:]
    assert "No issues found" in report and "Stateful" in report, report[-3000:]
