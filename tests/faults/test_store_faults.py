"""The store fails under a serving fleet: etcd stopped for longer than the lease TTL (a worker
killed meanwhile), and the store's traffic stalled or cut by a proxy. Requests keep being
answered from what the frontend knows; once the store is back, the fleet converges and no
ghost stays routable."""

from __future__ import annotations

import signal
import time

import pytest

from tests.etcd_server import EtcdServer
from tests.faults.conftest import Fleet
from tests.faults.support import (
    LEASE_TTL,
    RECONCILE_INTERVAL,
    Load,
    Row,
    TcpProxy,
    routes_exactly,
    until,
)
from tests.faults.support import instance_ids as routed
from tests.processes import Processes

COMMAND = "pytest tests/faults/test_store_faults.py"
CONVERGE = LEASE_TTL + RECONCILE_INTERVAL + 5  # etcd restarts leases with a full TTL


async def test_etcd_down_longer_than_the_lease_ttl_with_a_worker_killed_meanwhile(
    processes: Processes, own_etcd: EtcdServer, namespace: str, tmp_path: object
) -> None:
    fleet = Fleet(processes, own_etcd.url, namespace, tmp_path)  # type: ignore[arg-type]
    staying, dying = await fleet.worker(), await fleet.worker()
    front = await fleet.frontend()
    both = {staying.instance_id, dying.instance_id}
    await until(lambda: routes_exactly(front.url, both), 15, "both workers routed")
    load = Load([front.url])
    load.start()
    try:
        await load.advance(30)
        own_etcd.stop()
        down = time.monotonic()
        dying.signal(signal.SIGKILL)
        # The outage outlasts the lease TTL while requests keep being answered.
        await until(lambda: time.monotonic() - down > 2 * LEASE_TTL, 10, "outage")
        await load.advance(20)
        own_etcd.start()
        converge = await until(lambda: _only_live(front.url, dying.instance_id), CONVERGE, "ghost")
        await load.advance(30)
    finally:
        await load.finish()
    ghosts = len(await routed(front.url) & {dying.instance_id})
    Row(
        f"etcd stopped {2 * LEASE_TTL:g} s (> lease TTL {LEASE_TTL:g} s), a worker SIGKILLed "
        "while it is down, then restarted",
        "etcd", load.sent, len(load.failed_before_first_byte), len(load.failed_mid_stream),
        round(converge, 2), ghosts, COMMAND,
    ).record()  # fmt: skip
    assert load.failed_before_first_byte == []
    assert ghosts == 0
    assert staying.proc.returncode is None  # the store blinked: nobody died of it


@pytest.mark.parametrize("fault", ["stall", "cut"])
async def test_store_traffic_stalled_or_cut_by_a_proxy(
    processes: Processes, own_etcd: EtcdServer, namespace: str, tmp_path: object, fault: str
) -> None:
    proxy = await TcpProxy("127.0.0.1", own_etcd.client_port).start()
    fleet = Fleet(processes, f"etcd://127.0.0.1:{proxy.port}", namespace, tmp_path)  # type: ignore[arg-type]
    # Leases outlive the fault here: only the traffic is lost, not the registrations.
    workers = [await fleet.worker("--lease-ttl", "8") for _ in range(2)]
    front = await fleet.frontend()
    ids = {w.instance_id for w in workers}
    await until(lambda: routes_exactly(front.url, ids), 15, "both workers routed")
    load = Load([front.url])
    load.start()
    try:
        await load.advance(30)
        proxy.stall() if fault == "stall" else proxy.cut()
        faulted = time.monotonic()
        await until(lambda: time.monotonic() - faulted > 3, 10, "fault lasted")
        await load.advance(20)  # answered from what the frontend knows
        proxy.heal()
        # After the fault, discovery events flow again: a worker that leaves is removed.
        workers[0].signal(signal.SIGTERM)
        converge = await until(
            lambda: routes_exactly(front.url, {workers[1].instance_id}),
            8 + 10,
            "drained worker removed",
        )
        await load.advance(30)
    finally:
        await load.finish()
        await proxy.close()
    Row(
        f"etcd traffic {'stalled' if fault == 'stall' else 'cut'} for 3 s by a TCP proxy, "
        "then a worker drained",
        "etcd", load.sent, len(load.failed_before_first_byte), len(load.failed_mid_stream),
        round(converge, 2), 0, COMMAND,
    ).record()  # fmt: skip
    assert load.failed_before_first_byte == []
    assert load.failed_mid_stream == []


async def _only_live(url: str, dead: int) -> bool:
    ids = await routed(url)
    return bool(ids) and dead not in ids
