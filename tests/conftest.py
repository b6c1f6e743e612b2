from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path

import pytest
import uvloop

# tests/ is importable as a package for the shared helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.etcd_server import EtcdServer
from tests.nats_server import NatsServer
from tests.processes import Processes

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,  # as `shoal frontend` and `shoal worker` run
}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, object]:
    """The standard library's loop for every async test, unless it asks for others by name
    (`@pytest.mark.asyncio(loop_factories=["uvloop"])`): those run once on each."""
    marker = item.get_closest_marker("asyncio")
    if marker is not None and marker.kwargs.get("loop_factories"):
        return LOOPS
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[Processes]:
    """Real `shoal` child processes of the test; any still running at its end are killed."""
    procs = Processes(tmp_path)
    yield procs
    await procs.close()


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """The session's one shared etcd. Tests keep to keys of their own (a prefix, a namespace)
    and never stop it; a test that needs an outage takes `own_etcd`."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def own_etcd() -> Iterator[EtcdServer]:
    """An etcd of the test's own, which the test may stop and start (an outage)."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    """A `nats-server -js` of the test's own (it may stop and start it: an outage)."""
    with NatsServer() as server:
        yield server
