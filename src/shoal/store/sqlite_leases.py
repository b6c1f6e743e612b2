"""The leases of the SQLite store: the clock their deadlines are kept on, the SQL that tells
an expired one (`_EXPIRED`; `_LIVE` for the keys under one), and the statements that grant,
renew and look up one, run inside a write transaction in the store thread (see
`shoal.store.sqlite`). Revoking or reaping a lease deletes its keys, each a logged change:
that is done by the statements on keys (`_end_lease`).

Lease clock. Deadlines are not on the wall clock: a step of the wall clock (NTP, a VM
resumed, an operator's `date -s`) in any one process would otherwise expire every lease in
the file at once, or keep dead ones alive. They are on `CLOCK_MONOTONIC`, which POSIX
defines from a fixed point set at system start: every process of the host reads the same
value, and nothing can step it. SQLite's WAL mode already requires every process using the
file to run on one host, so all of them share that clock. It restarts at each boot, so each
lease also records the boot id (`/proc/sys/kernel/random/boot_id`): a lease from another
boot is expired, since no process survives a reboot. (Leases of version-1 processes still
running during an upgrade keep their wall-clock deadlines until they go.) The assumption: every process using
the file runs on this host in the same time namespace (containers that share the file must
not be given a private `CLOCK_MONOTONIC` offset). Where no boot id is available (not
Linux), the monotonic clock alone cannot tell a reboot (it restarts near 0, so a dead
lease would outlive the reboot by the previous uptime): each lease then also gets a
wall-clock bound, its TTL + `WALL_CLOCK_SLACK` (120 s) after its grant or last renewal.
A dead lease outlives a reboot by that much at most; the price is that a forward step of
the wall clock by more than the slack expires the leases of live holders, which re-grant.
A lease granted without a boot id is judged so by every process, one with a boot id too
(it was taken for another boot's and reaped at once).
A monotonic clock does not count time the host is suspended, so (with a boot id) a
suspend neither expires the leases of live holders nor counts towards the TTL of dead ones.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from pathlib import Path

OUT_OF_REACH = 1e300
"""The wall-clock `deadline` of a lease judged on the monotonic clock: never passed."""
WALL_CLOCK_SLACK = 120.0
"""Seconds the wall clock may step forward without costing a lease, where the boot is
unknown (see "Lease clock"): a dead lease outlives a reboot by at most its TTL + this."""


def _boot_id() -> str:
    """This boot of the host (Linux), or "" where the system does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


BOOT_ID = _boot_id()
BOOT = "boot:" + BOOT_ID
"""The `boot` of the leases this process grants: never empty (empty marks version 1);
"boot:" where the boot is unknown."""


def lease_clock() -> float:
    """Now on the host's monotonic clock: the clock lease deadlines are kept on."""
    if hasattr(time, "clock_gettime"):
        return time.clock_gettime(time.CLOCK_MONOTONIC)
    return time.monotonic()


def _wall_deadline(ttl: float) -> float:
    """The wall-clock `deadline` of a lease granted or renewed now: out of reach where the
    boot id tells a reboot, else a generous bound that a reboot always passes."""
    if BOOT != "boot:":
        return OUT_OF_REACH
    return time.time() + ttl + WALL_CLOCK_SLACK


_EXPIRED = (
    "(CASE WHEN boot = '' THEN deadline < :wall"
    " ELSE expires < :now OR deadline < :wall"
    " OR (boot != :boot AND :boot != 'boot:' AND boot != 'boot:') END)"
)
"""SQL: the lease has expired, at `_expired_at(now)`. A lease of another boot has: no
process survives a reboot. Where the boot is unknown (`BOOT` is "boot:", to the judge or
to the holder: a sandbox without /proc beside a process with it), the monotonic clock
counts, and the wall-clock bound `_wall_deadline` gave the lease."""

_LIVE = f"(lease = 0 OR lease NOT IN (SELECT id FROM leases WHERE {_EXPIRED}))"
"""SQL, on `kv`: the key's lease (if any) has not expired, at `_expired_at(now)`."""


def _expired_at(now: float) -> dict[str, object]:
    """The parameters of `_EXPIRED` at `now` on the lease clock."""
    return {"now": now, "boot": BOOT, "wall": time.time()}


def _lease_exists(conn: sqlite3.Connection, lease_id: int) -> bool:
    return conn.execute("SELECT 1 FROM leases WHERE id = ?", (lease_id,)).fetchone() is not None


def _grant(conn: sqlite3.Connection, now: float, ttl: float) -> int:
    while True:
        lease_id = secrets.randbits(62) + 1
        inserted = conn.execute(
            "INSERT INTO leases (id, ttl, deadline, boot, expires) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (id) DO NOTHING",
            (lease_id, ttl, _wall_deadline(ttl), BOOT, now + ttl),
        ).rowcount
        if inserted == 1:
            return lease_id


def _keepalive(conn: sqlite3.Connection, now: float, lease_id: int, ttl: float) -> bool:
    # Expired leases were reaped at the start of this transaction.
    updated = conn.execute(
        "UPDATE leases SET ttl = ?, deadline = ?, boot = ?, expires = ? WHERE id = ?",
        (ttl, _wall_deadline(ttl), BOOT, now + ttl, lease_id),
    ).rowcount
    return bool(updated == 1)
