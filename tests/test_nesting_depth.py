"""Nested input, generated, fed to every decoder of outside values: store values (cards,
endpoint instances, routes), client bodies (gateway, dashboard login, workers), files (the
membership sources file, `shoal catalog apply` files, a worker's tokenizer config) and KV event batches. Each one decodes, or refuses
with its own documented error; none raises `RecursionError`, at any depth up to 1,500, in a
free-form field or one it skips. Past `shoal.bounds.MAX_DEPTH` the JSON ones refuse."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from shoal.bounds import MAX_DEPTH
from shoal.cards import CardError, ModelCard
from shoal.catalog.apply import ApplyError, parse_documents
from shoal.cli.catalog import apply as cli_apply
from shoal.discovery import RouteError, decode_route, route_key
from shoal.discovery.join import CardsAndInstances
from shoal.discovery.keys import MODELS, EndpointId, ModelKey, instance_key
from shoal.discovery.values import parse_instance
from shoal.frontend.dashboard.dashboard import login_key
from shoal.frontend.kv.prompt import PromptTokenizer
from shoal.frontend.proxy.fields import decode_fields, rewrite_model
from shoal.frontend.registry.registry import Registry
from shoal.frontend.virtual.virtual import RouteTable
from shoal.kv import KVEventBatch, decode_batch
from shoal.membership import parse_sources
from shoal.membership.errors import SourceError
from shoal.openai import ApiError, ChatRequest, decode_request

# A nesting, outermost first: True an object (`{"k": ...}`), False an array (`[...]`).
SHAPES = st.lists(st.booleans(), min_size=1, max_size=1_500)
DEEP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EDGES = [[False] * n for n in (MAX_DEPTH - 2, MAX_DEPTH, MAX_DEPTH + 1, 999, 1_000, 1_500)]

ENDPOINT = EndpointId("ns", "backend", "generate")
CARD = {
    "display_name": "m",
    "slug": "m",
    "source": "test/m",
    "model_types": ["chat"],
    "context_length": 4096,
}
INSTANCE = {
    "namespace": "ns",
    "component": "backend",
    "endpoint": "generate",
    "instance_id": 7,
    "url": "http://127.0.0.1:1/v1",
    "status_url": "http://127.0.0.1:1",
}


def nested(shape: list[bool]) -> bytes:
    """JSON text nested as `shape` says, around a leaf."""
    opens = b"".join(b'{"k":' if obj else b"[" for obj in shape)
    closes = b"".join(b"}" if obj else b"]" for obj in reversed(shape))
    return opens + b"1" + closes


def nested_msgpack(shape: list[bool]) -> bytes:
    opens = b"".join(b"\x81\xa1k" if obj else b"\x91" for obj in shape)  # one-item map/array
    return opens + b"\x01"


def with_field(document: dict[str, Any], field: str, value: bytes) -> bytes:
    """`document` (a JSON object) with `field` set to the raw JSON `value`."""
    return msgspec.json.encode(document)[:-1] + b',"' + field.encode() + b'":' + value + b"}"


def outcome(decode: Callable[[], object], *refusals: type[Exception]) -> Exception | None:
    """Run `decode`: None if it decoded, its error if that is one of `refusals` (anything
    else, `RecursionError` first, fails the test)."""
    try:
        decode()
    except refusals as exc:
        return exc
    return None


def too_deep(shape: list[bool], error: Exception | None) -> None:
    """Past the bound a JSON decoder refuses, saying why; the rest is up to the schema."""
    if len(shape) > MAX_DEPTH:
        assert error is not None and f"nested deeper than {MAX_DEPTH} levels" in str(error)


@DEEP
@given(SHAPES, st.sampled_from(["runtime_config", "unknown"]))
@example(EDGES[4], "runtime_config")
def test_cards(shape: list[bool], field: str) -> None:
    value = b'{"x":' + nested(shape) + b"}" if field == "runtime_config" else nested(shape)
    data = with_field(CARD, field, value)
    too_deep(shape, outcome(lambda: ModelCard.from_json(data), CardError))
    # In the discovery join: skipped and listed, never raised out of the stream.
    join = CardsAndInstances({})
    key = ModelKey(ENDPOINT, 7).key
    held = join.put(key, data, 1, 1)
    assert bool(held) != (key in join.skipped)
    if len(shape) > MAX_DEPTH:
        assert key in join.skipped and key.startswith(MODELS)


@DEEP
@given(SHAPES)
@example(EDGES[4])
def test_endpoint_instances(shape: list[bool]) -> None:
    key = instance_key(ENDPOINT, 7)
    data = with_field(INSTANCE, "extra", nested(shape))
    too_deep(shape, outcome(lambda: parse_instance(key, data), ValueError))
    join = CardsAndInstances({})
    join.put(key, data, 1, 1)
    assert (key in join.skipped) == (len(shape) > MAX_DEPTH)


@DEEP
@given(SHAPES)
@example(EDGES[4])
def test_routes(shape: list[bool]) -> None:
    key = route_key("default", "r")
    data = with_field({"workspace": "default", "name": "r"}, "extra", nested(shape))
    too_deep(shape, outcome(lambda: decode_route(key, data), RouteError))
    table = RouteTable(Registry(), ("default",))
    table.put(key, data)  # never raises: a bad route is skipped
    assert (key in table.skipped) == (len(shape) > MAX_DEPTH)


@DEEP
@given(SHAPES, st.booleans(), st.sampled_from(["content", "metadata"]))
@example(EDGES[3], True, "content")
def test_gateway_bodies(shape: list[bool], with_prompt: bool, where: str) -> None:
    if where == "content":
        body = b'{"model":"m","messages":[{"role":"user","content":' + nested(shape) + b"}]}"
    else:
        body = with_field({"model": "m"}, "metadata", nested(shape))
    error = outcome(lambda: decode_fields(body, with_prompt=with_prompt), ApiError)
    too_deep(shape, error)
    if error is None:
        assert msgspec.json.decode(rewrite_model(body, "served"))["model"] == "served"
    else:
        assert isinstance(error, ApiError) and error.status == 400


@DEEP
@given(SHAPES)
@example(EDGES[4])
def test_dashboard_logins(shape: list[bool]) -> None:
    body = with_field({"key": "k"}, "x", nested(shape))
    error = outcome(lambda: login_key(body), ApiError)
    too_deep(shape, error)
    assert error is None or (isinstance(error, ApiError) and error.status == 400)


@DEEP
@given(SHAPES)
@example(EDGES[4])
def test_worker_request_bodies(shape: list[bool]) -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":' + nested(shape) + b"}]}"
    decoder = msgspec.json.Decoder(ChatRequest)
    error = outcome(lambda: decode_request(body, decoder), ApiError)
    too_deep(shape, error)
    assert error is None or (isinstance(error, ApiError) and error.status == 400)


@DEEP
@given(SHAPES, st.sampled_from(["namespace", "unknown"]))
@example(EDGES[4], "unknown")
def test_membership_sources_files(shape: list[bool], where: str) -> None:
    if where == "namespace":
        data = b'{"version":1,"sources":[{"namespace":' + nested(shape) + b"}]}"
    else:
        data = with_field({"version": 1, "sources": []}, "x", nested(shape))
    error = outcome(lambda: parse_sources(data), SourceError)
    assert error is not None  # (an array is no namespace; unknown fields are refused)
    too_deep(shape, error)


@DEEP
@given(SHAPES, st.booleans())
@example(EDGES[4], True)
@example(EDGES[5], False)
def test_catalog_apply_files(shape: list[bool], json_only: bool) -> None:
    text = with_field({"kind": "provider", "name": "p"}, "x", nested(shape)).decode()
    parse = lambda: parse_documents(text, workspace="default", json_only=json_only)  # noqa: E731
    too_deep(shape, outcome(parse, ApplyError))


@pytest.mark.parametrize("block", [False, True])
async def test_catalog_apply_names_the_file_nested_too_deep(tmp_path: Path, block: bool) -> None:
    """`shoal catalog apply`: the error names the file (YAML block style too, past what the
    parser can take)."""
    if block:
        text = "".join(" " * i + "k:\n" for i in range(1_500)) + " " * 1_500 + "v\n"
    else:
        text = "kind: provider\nname: p\nx: " + "[" * 1_000 + "]" * 1_000 + "\n"
    args = argparse.Namespace(text=text, file="fleet.yaml", workspace="default", prune=False)
    with pytest.raises(ApplyError, match=r"^fleet\.yaml: nested too deep"):
        await cli_apply(None, args)


@DEEP
@given(SHAPES, st.sampled_from(["batch", "event"]))
@example(EDGES[4], "batch")
@example(EDGES[5], "event")
def test_kv_event_batches(shape: list[bool], where: str) -> None:
    """Binary: no bound to count brackets for, but a deep value is still a `DecodeError`."""
    value = nested_msgpack(shape)
    ts = msgspec.msgpack.encode(1.0)
    if where == "batch":  # a trailing field of the batch, which readers skip
        payload = b"\x94" + ts + b"\x90\xc0" + value
    else:  # a trailing field of an event
        stored = msgspec.msgpack.encode(["BlockStored", [1], None, [1], 16, None, None])
        payload = b"\x92" + ts + b"\x91" + bytes([stored[0] + 1]) + stored[1:] + value
    error = outcome(lambda: decode_batch(payload), msgspec.DecodeError)
    if error is None:
        assert isinstance(decode_batch(payload), KVEventBatch)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 1_000, 100_000])
def test_a_card_nested_past_the_bound_is_a_card_error_naming_it(depth: int) -> None:
    data = with_field(CARD, "runtime_config", b'{"x":' + b"[" * depth + b"]" * depth + b"}")
    with pytest.raises(CardError, match=f"nested deeper than {MAX_DEPTH} levels"):
        ModelCard.from_json(data)


@pytest.mark.parametrize("depth", [1, MAX_DEPTH - 1, MAX_DEPTH + 1, 1_000, 1_500])
def test_tokenizer_configs_of_the_kv_router(tmp_path: Path, depth: int) -> None:
    """A worker's `tokenizer_config.json` (downloaded metadata): loads, or `ValueError`."""
    tokenizer = tmp_path / "tokenizer.json"
    Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tokenizer))
    config = tmp_path / "tokenizer_config.json"
    config.write_bytes(with_field({"eos_token": "a"}, "extra", nested([True] * depth)))
    error = outcome(lambda: PromptTokenizer.load(tokenizer, config), ValueError)
    too_deep([True] * depth, error)
