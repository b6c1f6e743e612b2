"""The models controller's pass on a real catalog API (SQLite and PostgreSQL): call budgets,
the providers phase, the deployments phase with a fake backend, and published routes."""

from __future__ import annotations

import asyncio

import pytest

from shoal.catalog import DEPLOYMENTS, MODELS, PROVIDERS, VIRTUAL_MODELS, CatalogServer
from shoal.catalog.controller import PassError
from shoal.catalog.routing import routes_prefix
from shoal.discovery import FleetTarget, UrlTarget, decode_route, route_key
from tests.catalog.controller_fixtures import (
    WS,
    FakeBackend,
    announce,
    controller_on,
    insert_rows,
    openai_servers,
    seed_converged,
)
from tests.helpers import wait_for

REF = f"{WS}/p0"


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-model-{i:03d}" for i in range(n)]


async def versions(client: object, kind: object) -> dict[str, int]:
    return {item.name: item.version for item in await client.list_all(kind)}  # type: ignore[attr-defined]


async def test_steady_pass_of_4_providers_by_102_models_makes_at_most_12_calls(
    catalog: CatalogServer, database_url: str
) -> None:
    served = {f"p{i}": names(f"p{i}", 102) for i in range(4)}
    await seed_converged(database_url, served)
    async with (
        openai_servers(*served.values()) as servers,
        controller_on(catalog.url) as (ctl, client, store),
    ):
        for i, server in enumerate(servers):  # the seed's providers, pointed at the servers
            await client.update(PROVIDERS, f"p{i}", {"base_url": server.base_url})
        before = {k: await versions(client, k) for k in (MODELS, PROVIDERS, VIRTUAL_MODELS)}
        await ctl.step()  # publishes the 408 routes; writes nothing to the catalog
        assert ctl.last is not None and ctl.last.routes_written == 408
        for _ in range(2):
            client.calls.clear()
            await ctl.step()
            assert ctl.last.calls <= 12, client.calls
            assert all(call.startswith("GET ") for call in client.calls), client.calls
            assert ctl.last.routes_written == ctl.last.routes_deleted == 0
        after = {k: await versions(client, k) for k in (MODELS, PROVIDERS, VIRTUAL_MODELS)}
        assert after == before  # converged: nothing written
        assert len((await store.get_prefix(routes_prefix(WS))).items) == 408


async def test_a_cold_pass_grows_only_with_what_it_writes(catalog: CatalogServer) -> None:
    reads: list[int] = []
    for n in (5, 30):
        async with (
            openai_servers(names(f"n{n}", n)) as [server],
            controller_on(catalog.url, workspaces=[f"cold-{n}"]) as (ctl, client, _),
        ):
            await client.create(PROVIDERS, {"name": "p", "type": "url",
                                            "base_url": server.base_url}, workspace=f"cold-{n}")  # fmt: skip
            client.calls.clear()
            await ctl.step()
            assert client.made("POST ") == 2 * n  # an entity and a name per served model
            assert client.made("PATCH ") == 1  # the provider's served_models and status
            reads.append(client.made("GET "))
            client.calls.clear()
            await ctl.step()
            assert client.made("GET ") <= 12 and len(client.calls) == client.made("GET ")
    assert reads[0] == reads[1] <= 12, reads


async def test_virtual_models_are_read_once_per_pass(catalog: CatalogServer) -> None:
    async with (
        openai_servers(["a", "b"], ["b", "c"]) as servers,
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _),
    ):
        for i, server in enumerate(servers):
            await client.create(PROVIDERS, {"name": f"p{i}", "type": "url",
                                            "base_url": server.base_url})  # fmt: skip
        for _ in range(2):
            client.calls.clear()
            await ctl.step()
            assert client.made(f"GET /v1/workspaces/{WS}/virtual-models") == 1
            assert client.made(f"GET /v1/workspaces/{WS}/models") == 1
        # the last pass: no deployment and no provider of one left, so one providers list
        assert client.made(f"GET /v1/workspaces/{WS}/providers") == 1
        b = await client.get(MODELS, "b")
        assert b.providers == [f"{WS}/p0", f"{WS}/p1"] and b.version == 1  # one write


async def test_existing_and_user_managed_names_are_not_recreated(catalog: CatalogServer) -> None:
    async with (
        openai_servers(["mine", "auto", "new"]) as [server],
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _),
    ):
        await client.create(VIRTUAL_MODELS, {"name": "mine", "default_model": "elsewhere"})
        await client.create(VIRTUAL_MODELS, {"name": "auto", "default_model": "auto",
                                             "autoprovisioned": True})  # fmt: skip
        await client.create(PROVIDERS, {"name": "p0", "type": "url", "base_url": server.base_url})
        client.calls.clear()
        await ctl.step()
        assert client.calls.count(f"POST /v1/workspaces/{WS}/virtual-models") == 1  # `new` only
        vms = {vm.name: vm for vm in await client.list_all(VIRTUAL_MODELS)}
        assert (vms["mine"].version, vms["mine"].default_model) == (1, "elsewhere")
        assert vms["auto"].version == 1 and vms["new"].autoprovisioned


async def test_a_virtual_model_created_mid_pass_is_never_deleted(catalog: CatalogServer) -> None:
    async with (
        openai_servers(["served"]) as [server],
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _),
    ):
        await client.create(PROVIDERS, {"name": "p0", "type": "url", "base_url": server.base_url})

        async def create_mid_pass() -> None:
            server.before = None
            await client.create(VIRTUAL_MODELS, {"name": "mid", "default_model": "unserved",
                                                 "autoprovisioned": True})  # fmt: skip

        server.before = create_mid_pass
        await ctl.step()
        assert (await client.get(VIRTUAL_MODELS, "mid")).version == 1
        assert server.requests == 1


async def test_a_virtual_model_deleted_by_someone_else_mid_pass_is_not_an_error(
    catalog: CatalogServer,
) -> None:
    async with (
        openai_servers(["served"]) as [server],
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _),
    ):
        await client.create(PROVIDERS, {"name": "p0", "type": "url", "base_url": server.base_url})
        for name in ("gone", "stale"):
            await client.create(VIRTUAL_MODELS, {"name": name, "default_model": "unserved",
                                                 "autoprovisioned": True})  # fmt: skip

        async def delete_mid_pass() -> None:
            server.before = None
            await client.delete(VIRTUAL_MODELS, "gone")

        server.before = delete_mid_pass
        await ctl.step()  # raises nothing
        assert sorted(vm.name for vm in await client.list_all(VIRTUAL_MODELS)) == ["served"]
        assert ctl.last is not None


async def test_an_unresolved_provider_keeps_served_models_and_cleanup_uses_them(
    catalog: CatalogServer,
) -> None:
    async with (
        openai_servers(["a", "b"]) as [server],
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _),
    ):
        await client.create(PROVIDERS, {"name": "p0", "type": "url", "base_url": server.base_url})
        await ctl.step()
        server.status = 503
        await ctl.step()
        provider = await client.get(PROVIDERS, "p0")
        assert provider.status == "ERROR" and "503" in provider.status_message
        assert [s.model_entity for s in provider.served_models or []] == ["a", "b"]
        assert sorted(vm.name for vm in await client.list_all(VIRTUAL_MODELS)) == ["a", "b"]
        assert (await client.get(MODELS, "a")).providers == [REF]  # links left as they were
        server.status, server.names = 200, ["a"]
        await ctl.step()
        assert [vm.name for vm in await client.list_all(VIRTUAL_MODELS)] == ["a"]
        assert (await client.get(MODELS, "b")).providers == []
        assert (await client.get(PROVIDERS, "p0")).status == "READY"


async def test_a_failed_virtual_model_listing_skips_names_but_updates_statuses_and_links(
    catalog: CatalogServer,
) -> None:
    async with (
        openai_servers(["a"]) as [server],
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, store),
    ):
        await client.create(PROVIDERS, {"name": "p0", "type": "url", "base_url": server.base_url})
        await client.create(VIRTUAL_MODELS, {"name": "old", "default_model": "unserved",
                                             "autoprovisioned": True})  # fmt: skip
        client.fail = lambda call: call.startswith(f"GET /v1/workspaces/{WS}/virtual-models")
        await ctl.step()
        client.fail = lambda call: False
        assert (await client.get(PROVIDERS, "p0")).status == "READY"
        assert (await client.get(MODELS, "a")).providers == [REF]
        assert [vm.name for vm in await client.list_all(VIRTUAL_MODELS)] == ["old"]
        assert (await store.get_prefix(routes_prefix(WS))).items == []  # routes untouched
        await ctl.step()
        assert [vm.name for vm in await client.list_all(VIRTUAL_MODELS)] == ["a"]


async def test_routes_resolve_targets_and_are_written_only_when_they_change(
    catalog: CatalogServer,
) -> None:
    async with (
        openai_servers(["hosted-llm"]) as [server],
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, store),
    ):
        await announce(store, "fleet-ns", "fleet-llm", 7)
        await client.create(PROVIDERS, {"name": "p0", "type": "url", "base_url": server.base_url,
                                        "auth_secret": "HOSTED_KEY"})  # fmt: skip
        await client.create(PROVIDERS, {"name": "f", "type": "fleet", "namespace": "fleet-ns"})
        await client.create(VIRTUAL_MODELS, {"name": "chat", "default_model": "fleet-llm",
            "targets": [{"model_entity": "fleet-llm", "weight": 3},
                        {"model_entity": "hosted-llm", "weight": 1}]})  # fmt: skip
        await ctl.step()
        held = {kv.key: kv for kv in (await store.get_prefix(routes_prefix(WS))).items}
        assert sorted(held) == sorted(route_key(WS, n) for n in ("chat", "fleet-llm", "hosted-llm"))
        chat = decode_route(route_key(WS, "chat"), held[route_key(WS, "chat")].value)
        assert chat.targets == (
            FleetTarget("fleet-llm", 3),
            UrlTarget(server.base_url, "hosted-llm", 1, "HOSTED_KEY", REF),
        )
        assert ctl.last is not None and ctl.last.routes_written == 3
        await ctl.step()
        assert ctl.last.routes_written == 0
        again = {
            kv.key: kv.mod_revision for kv in (await store.get_prefix(routes_prefix(WS))).items
        }
        assert again == {key: kv.mod_revision for key, kv in held.items()}
        await client.delete(VIRTUAL_MODELS, "chat")
        await ctl.step()
        assert ctl.last.routes_deleted == 1
        assert await store.get(route_key(WS, "chat")) is None


async def test_deployments_go_created_pending_ready_and_deleting_deleted(
    catalog: CatalogServer,
) -> None:
    backend = FakeBackend()
    async with controller_on(catalog.url, workspaces=[WS], backend=backend) as (ctl, client, store):
        await announce(store, "default", "mock-llm", 1)
        await client.create(DEPLOYMENTS, {"name": "d", "model": "mock-llm", "engine": "mocker",
                                          "replicas": 2})  # fmt: skip
        await ctl.step()
        assert (await client.get(DEPLOYMENTS, "d")).status == "PENDING"
        assert backend.started == ["d"]
        await ctl.step()
        assert (await client.get(DEPLOYMENTS, "d")).status == "READY"
        provider = await client.get(PROVIDERS, "deployment-d")
        assert (provider.type, provider.enabled_models, provider.autoprovisioned) == (
            "fleet", ["mock-llm"], True)  # fmt: skip
        assert (await client.get(MODELS, "mock-llm")).providers == [f"{WS}/deployment-d"]
        route = await store.get(route_key(WS, "mock-llm"))
        assert route is not None
        assert decode_route(route.key, route.value).targets == (FleetTarget("mock-llm", 1),)
        await client.update(DEPLOYMENTS, "d", {"status": "DELETING"})
        await ctl.step()
        assert backend.stopped == ["d"]
        assert (await client.get(DEPLOYMENTS, "d")).status == "DELETED"
        # the deployment phase unlinked it, and the providers phase did not put it back
        assert (await client.get(MODELS, "mock-llm")).providers == []
        assert [p.name for p in await client.list_all(PROVIDERS)] == []
        assert await store.get(route_key(WS, "mock-llm")) is None


async def test_deleted_and_failed_deployments_are_collected_after_the_ttl(
    catalog: CatalogServer,
) -> None:
    backend = FakeBackend()
    backend.failing.add("bad")
    async with controller_on(catalog.url, workspaces=[WS], backend=backend) as (ctl, client, _):
        for name in ("bad", "done"):
            await client.create(DEPLOYMENTS, {"name": name, "model": "m", "engine": "mocker",
                                              "status": "PENDING"})  # fmt: skip
        await client.update(DEPLOYMENTS, "done", {"status": "DELETED"})
        await ctl.step()
        bad = await client.get(DEPLOYMENTS, "bad")
        assert bad.status == "ERROR" and "failing" in bad.status_message
        assert "bad" in backend.stopped
        assert len(await client.list_all(DEPLOYMENTS)) == 2  # within the TTL: kept
        ctl.deployments.ttl = 0.0
        await ctl.step()
        assert await client.list_all(DEPLOYMENTS) == []


async def test_staged_links_land_when_the_pass_is_cancelled(catalog: CatalogServer) -> None:
    async with (
        openai_servers(["a"], ["b"]) as servers,
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _),
    ):
        for i, server in enumerate(servers):
            await client.create(PROVIDERS, {"name": f"p{i}", "type": "url",
                                            "base_url": server.base_url})  # fmt: skip
        client.hold = lambda call: call == f"PATCH /v1/workspaces/{WS}/providers/p1"
        step = asyncio.create_task(ctl.step())
        await wait_for(client.held.is_set, timeout=30)
        client.hold = lambda call: False
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        # the flush in `finally` wrote both providers' entities and links
        assert (await client.get(MODELS, "a")).providers == [f"{WS}/p0"]
        assert (await client.get(MODELS, "b")).providers == [f"{WS}/p1"]


async def test_one_provider_whose_status_cannot_be_written_does_not_stop_the_others(
    catalog: CatalogServer,
) -> None:
    async with (
        openai_servers(["a"], ["b"]) as servers,
        controller_on(catalog.url, workspaces=[WS]) as (ctl, client, _),
    ):
        for i, server in enumerate(servers):
            await client.create(PROVIDERS, {"name": f"p{i}", "type": "url",
                                            "base_url": server.base_url})  # fmt: skip
        client.fail = lambda call: call == f"PATCH /v1/workspaces/{WS}/providers/p0"
        await ctl.step()
        client.fail = lambda call: False
        assert (await client.get(PROVIDERS, "p0")).status == "CREATED"
        assert (await client.get(PROVIDERS, "p1")).status == "READY"
        assert sorted(vm.name for vm in await client.list_all(VIRTUAL_MODELS)) == ["a", "b"]
        await ctl.step()
        assert (await client.get(PROVIDERS, "p0")).status == "READY"


async def test_a_deleted_deployment_row_stops_its_workers_and_removes_its_provider(
    catalog: CatalogServer,
) -> None:
    backend = FakeBackend()
    async with controller_on(catalog.url, workspaces=[WS], backend=backend) as (ctl, client, store):
        await announce(store, "default", "mock-llm", 1)
        await client.create(DEPLOYMENTS, {"name": "d", "model": "mock-llm", "engine": "mocker",
                                          "status": "PENDING"})  # fmt: skip
        await ctl.step()  # READY, its provider made
        await ctl.step()  # the entity linked to it
        assert (await client.get(MODELS, "mock-llm")).providers == [f"{WS}/deployment-d"]
        await client.delete(DEPLOYMENTS, "d")  # the last deployment of the workspace
        await ctl.step()
        assert backend.stopped == ["d"]
        assert await client.list_all(PROVIDERS) == []
        assert (await client.get(MODELS, "mock-llm")).providers == []


async def test_a_failing_workspace_does_not_stop_the_others_nor_fail_the_pass(
    catalog: CatalogServer,
) -> None:
    async with openai_servers(["a"]) as [server], controller_on(catalog.url) as (ctl, client, _):
        for workspace in ("broken", WS):
            await client.create(PROVIDERS, {"name": "p", "type": "url",
                                            "base_url": server.base_url}, workspace=workspace)  # fmt: skip
        client.fail = lambda call: call.startswith("GET /v1/workspaces/broken/providers")
        await ctl.step()  # one workspace failed, the other was reconciled: the pass holds
        assert ctl.last is not None and list(ctl.last.failed) == ["broken"]
        client.fail = lambda call: False
        assert (await client.get(PROVIDERS, "p")).status == "READY"  # team-a reconciled
        assert (await client.get(PROVIDERS, "p", workspace="broken")).status == "CREATED"
        client.fail = lambda call: call.startswith("GET /v1/workspaces/") and "/providers" in call
        with pytest.raises(PassError, match="2 workspace"):  # every workspace failed: it fails
            await ctl.step()


async def test_fleet_providers_of_one_namespace_cost_one_discovery_listing_per_pass(
    catalog: CatalogServer,
) -> None:
    """40 fleet providers (a deployment each) in one namespace, listed 16 at once: each of
    the first 16 listed the whole namespace before any had cached it (16 listings of every
    card of the fleet per pass, for one). Concurrent listings of a namespace share one."""
    async with controller_on(catalog.url, workspaces=[WS]) as (ctl, client, store):
        await announce(store, "prod", "m", 1)
        for i in range(40):
            await client.create(PROVIDERS, {"name": f"f{i:02d}", "type": "fleet",
                                            "namespace": "prod"})  # fmt: skip
        discovery = ctl.providers.fleet.discovery
        listings: list[str] = []
        real_list = discovery.list

        async def listing(query: object) -> object:
            listings.append(str(query))
            await asyncio.sleep(0.01)  # a listing takes its time (a turn is not enough)
            return await real_list(query)  # type: ignore[arg-type]

        discovery.list = listing  # type: ignore[method-assign]
        await ctl.step()
        assert len(listings) == 1, listings
        assert {p.status for p in await client.list_all(PROVIDERS)} == {"READY"}
        await ctl.step()
        assert len(listings) == 2


async def test_fleet_providers_of_one_namespace_in_many_workspaces_cost_one_listing_per_pass(
    catalog: CatalogServer,
) -> None:
    """The namespace's listing was made anew for each workspace of a pass: 1,001 workspaces
    with a fleet provider on one namespace listed every card of it 1,001 times a pass. One
    listing per namespace per pass, as `FleetLister` says."""
    others = [f"{WS}-{i}" for i in range(3)]
    async with controller_on(catalog.url, workspaces=[WS, *others]) as (ctl, client, store):
        await announce(store, "prod", "m", 1)
        for workspace in [WS, *others]:
            await client.create(PROVIDERS, {"name": "f", "type": "fleet", "namespace": "prod"},
                                workspace=workspace)  # fmt: skip
        discovery = ctl.providers.fleet.discovery
        listings: list[str] = []
        real_list = discovery.list

        async def listing(query: object) -> object:
            listings.append(str(query))
            return await real_list(query)  # type: ignore[arg-type]

        discovery.list = listing  # type: ignore[method-assign]
        await ctl.step()
        assert len(listings) == 1, listings
        for workspace in [WS, *others]:
            statuses = {p.status for p in await client.list_all(PROVIDERS, workspace=workspace)}
            assert statuses == {"READY"}, (workspace, statuses)
        await ctl.step()
        assert len(listings) == 2


async def test_a_deployment_whose_status_no_listing_names_keeps_its_workers_and_provider(
    catalog: CatalogServer, database_url: str
) -> None:
    """Deployments were listed once per known status (filter=status=...): a row whose status
    none names (a newer catalog's `PAUSED`) was in no listing, not even as unreadable, so its
    workers were stopped and its provider deleted as if the row were gone (and a row whose
    status changed between two of the six listings was missed the same way). One listing of
    every deployment: such a row is unreadable, left as it is."""
    backend = FakeBackend()
    await insert_rows(database_url, DEPLOYMENTS, WS, [
        {"name": "odd", "model": "m", "engine": "mocker", "replicas": 1, "status": "PAUSED"},
    ])  # fmt: skip
    async with controller_on(catalog.url, workspaces=[WS], backend=backend) as (ctl, client, _):
        backend.runs.add((WS, "odd"))  # its workers, started while it was READY
        await client.create(PROVIDERS, {"name": "deployment-odd", "type": "fleet",
                                        "autoprovisioned": True})  # fmt: skip
        await client.create(DEPLOYMENTS, {"name": "d", "model": "m", "engine": "mocker"})
        await ctl.step()
        assert ctl.last is not None and ctl.last.failed == {}
        assert (await client.get(DEPLOYMENTS, "d")).status == "PENDING"  # the others go on
        assert (WS, "odd") in backend.runs and "odd" not in backend.stopped
        assert [p.name for p in await client.list_all(PROVIDERS)] == ["deployment-odd"]


async def test_a_ready_deployment_whose_status_write_fails_keeps_its_provider_and_route(
    catalog: CatalogServer,
) -> None:
    """A READY deployment whose step failed on the catalog (its status write answered 500,
    or timed out) is left as it is for the next pass, its workers too; but it was left out
    of the READY ones, so its fleet provider was taken for stale: its entity links undone,
    the provider deleted and the route published without its target, until a later pass
    made it again. What holds now: its provider, links and route stay."""
    from shoal.catalog.backends import Observed

    backend = FakeBackend()
    async with controller_on(catalog.url, workspaces=[WS], backend=backend) as (ctl, client, store):
        await announce(store, "default", "mock-llm", 1)
        await client.create(DEPLOYMENTS, {"name": "d", "model": "mock-llm", "engine": "mocker",
                                          "replicas": 2, "status": "PENDING"})  # fmt: skip
        await ctl.step()  # READY, its provider made
        await ctl.step()  # the entity linked to it, the route published
        assert (await client.get(MODELS, "mock-llm")).providers == [f"{WS}/deployment-d"]

        async def one_of_two(deployment: object) -> Observed:  # its status message changes
            return Observed(1, 2, False, "1 of 2 ready")

        backend.poll = one_of_two  # type: ignore[method-assign]
        client.fail = lambda call: call == f"PATCH /v1/workspaces/{WS}/deployments/d"
        await ctl.step()
        assert (await client.get(DEPLOYMENTS, "d")).status == "READY"
        assert "d" not in backend.stopped
        assert [p.name for p in await client.list_all(PROVIDERS)] == ["deployment-d"]
        assert (await client.get(MODELS, "mock-llm")).providers == [f"{WS}/deployment-d"]
        route = await store.get(route_key(WS, "mock-llm"))
        assert route is not None
        assert decode_route(route.key, route.value).targets == (FleetTarget("mock-llm", 1),)
