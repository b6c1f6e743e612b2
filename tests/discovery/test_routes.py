"""Virtual-model routes in the store: exact round trip, canonical keys, strict values."""

from __future__ import annotations

import pytest

from shoal.discovery import (
    FleetTarget,
    Route,
    RouteError,
    UrlTarget,
    decode_route,
    delete_route,
    publish_route,
    route_key,
)
from shoal.discovery.grants import GrantError, decode_grant
from shoal.discovery.routes import parse_route_key
from shoal.store import open_store

ROUTE = Route(
    workspace="team-a",
    name="org/chat",
    targets=(
        FleetTarget(model="mock-llm", weight=3),
        UrlTarget(base_url="https://api.example/v1", model="gpt", secret="EXAMPLE", weight=1),
    ),
)


def test_a_route_round_trips_through_its_key_and_value() -> None:
    assert ROUTE.key == "shoal/v1/routes/team-a/org=2Fchat"
    assert parse_route_key(ROUTE.key) == ("team-a", "org/chat")
    assert decode_route(ROUTE.key, ROUTE.to_json()) == ROUTE


@pytest.mark.parametrize(
    "key",
    ["shoal/v1/routes/a", "shoal/v1/routes/a/b/c", "shoal/v1/routes//b", "shoal/v1/routes/a/=62"],
)
def test_a_key_that_is_not_a_canonical_route_key_is_refused(key: str) -> None:
    with pytest.raises(RouteError):
        parse_route_key(key)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (b"{", "invalid route"),
        (b'{"workspace":"team-a","name":"org/chat","targets":[{"kind":"ftp"}]}', "kind"),
        (
            b'{"workspace":"team-a","name":"org/chat","targets":[{"kind":"fleet","model":""}]}',
            "model",
        ),
        (b'{"workspace":"other","name":"org/chat"}', "names 'other'/'org/chat'"),
    ],
)
def test_an_invalid_route_value_is_refused_naming_the_problem(value: bytes, named: str) -> None:
    with pytest.raises(RouteError, match=named):
        decode_route(ROUTE.key, value)


def test_unknown_fields_of_a_newer_controller_are_ignored() -> None:
    value = b'{"workspace":"team-a","name":"org/chat","future":1,"targets":[{"kind":"fleet","model":"m","x":2}]}'
    assert decode_route(ROUTE.key, value).targets == (FleetTarget(model="m"),)


async def test_publishing_an_unchanged_route_writes_nothing() -> None:
    store = await open_store("memory://routes-test")
    try:
        assert await publish_route(store, ROUTE) is True
        written = await store.get(route_key("team-a", "org/chat"))
        assert await publish_route(store, ROUTE) is False
        again = await store.get(route_key("team-a", "org/chat"))
        assert written is not None and again is not None
        assert again.mod_revision == written.mod_revision
        await delete_route(store, "team-a", "org/chat")
        assert await store.get(ROUTE.key) is None
    finally:
        await store.close()


def test_a_route_copied_to_another_key_is_refused_without_carrying_its_names() -> None:
    """Any writer of the store may put a route whose names are ~1 MB long at another route's
    key: the refusal (logged, kept in the frontend's skipped routes) quoted them whole."""
    long = "n" * 500_000
    value = Route(workspace="w" * 400_000, name=long).to_json()
    with pytest.raises(RouteError) as refused:
        decode_route(ROUTE.key, value)
    assert len(str(refused.value)) < 400, len(str(refused.value))
    assert "500,000 characters" in str(refused.value)


@pytest.mark.parametrize("what", ["route", "key grant"])
def test_an_outside_megabyte_route_or_grant_key_is_refused_without_quoting_it(what: str) -> None:
    """etcd takes keys of 1.5 MiB: the error for such a route or grant key, which the frontend
    logs and lists in `/health` (`virtual_models.skipped`, `keys.skipped`), quoted it whole."""
    root = "shoal/v1/routes/" if what == "route" else "shoal/v1/keys/"
    key = root + "w/" + "n" * 2**20
    with pytest.raises(RouteError if what == "route" else GrantError) as refused:
        if what == "route":
            decode_route(key, b"{}")
        else:
            decode_grant(key, b"{}")
    assert "over the store's bound" in str(refused.value)
    assert len(str(refused.value)) < 200
