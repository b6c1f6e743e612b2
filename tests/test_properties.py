"""Bad input, generated: whatever bytes reach a card decoder, a discovery key parser or the
gateway's body decoder, the answer is a value or the one clear error of that layer, never a
crash; and what parses is canonical (it prints back to exactly what was read)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.cards import CardError, ModelCard
from shoal.discovery.keys import INSTANCES, MODELS, parse_instance_key, parse_model_key
from shoal.frontend.proxy.fields import decode_fields, prompt_text
from shoal.openai import ApiError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
CARD_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "display_name": JSON,
        "slug": JSON | st.from_regex(r"[a-z0-9][a-z0-9.-]{0,20}", fullmatch=True),
        "source": JSON,
        "model_types": JSON | st.lists(st.sampled_from(["chat", "completions", "embeddings"])),
        "context_length": JSON,
        "kv_block_size": JSON,
        "role": JSON,
        "runtime_config": JSON,
        "metadata_files": JSON,
        "lora": JSON,
    },
)
SEGMENT = st.text(alphabet=st.characters(codec="utf-8"), max_size=8) | st.sampled_from(
    ["ns", "backend", "generate", "2a", "002A", "0x2a", "-1", "", ".", "a b", "lora"]
)
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(CARD_FIELDS, JSON)
def test_any_card_json_decodes_to_a_card_or_a_card_error(
    fields: dict[str, Any], extra: Any
) -> None:
    for document in (fields, {**fields, "unknown_field": extra}, extra):
        data = json.dumps(document).encode()
        try:
            card = ModelCard.from_json(data)
        except CardError:
            continue
        assert ModelCard.from_json(card.to_json()) == card
        assert card.mdcsum == ModelCard.from_json(card.to_json()).mdcsum


@PROPERTY
@given(st.binary(max_size=200))
def test_any_bytes_as_a_card_decode_to_a_card_or_a_card_error(data: bytes) -> None:
    with contextlib.suppress(CardError):
        ModelCard.from_json(data)


NAME = st.sampled_from(["ns", "backend", "generate", "a-b", "x.y"]) | SEGMENT
INSTANCE_ID = st.text(alphabet="0123456789abcdefABCDEFx+-_ ", min_size=0, max_size=6)


@PROPERTY
@given(
    st.lists(SEGMENT, min_size=0, max_size=6)
    | st.tuples(NAME, NAME, NAME, INSTANCE_ID).map(list)
    | st.tuples(NAME, NAME, NAME, INSTANCE_ID, SEGMENT).map(list)
)
def test_a_discovery_key_that_parses_is_canonical(segments: list[str]) -> None:
    tail = "/".join(segments)
    try:
        key = parse_model_key(MODELS + tail)
    except ValueError:
        pass
    else:
        assert key.key == MODELS + tail  # an alias (002A for 2a) never parses
    try:
        endpoint, instance_id = parse_instance_key(INSTANCES + tail)
    except ValueError:
        pass
    else:
        assert f"{INSTANCES}{endpoint.path}/{instance_id:x}" == INSTANCES + tail


@PROPERTY
@given(JSON, st.booleans())
def test_any_json_body_gives_routing_fields_or_a_400(body: Any, with_prompt: bool) -> None:
    document = body if not isinstance(body, dict) else {"model": "m", **body}
    for data in (
        json.dumps(document).encode(),
        msgspec.json.encode({"model": "m", "messages": body}),
    ):
        try:
            fields = decode_fields(data, with_prompt=with_prompt)
        except ApiError as error:
            assert error.status == 400
            continue
        assert isinstance(prompt_text(fields), str)


@PROPERTY
@given(st.binary(max_size=300))
def test_any_bytes_as_a_body_give_routing_fields_or_a_400(data: bytes) -> None:
    try:
        decode_fields(data, with_prompt=True)
    except ApiError as error:
        assert error.status == 400


@pytest.mark.parametrize("with_prompt", [False, True])
def test_a_body_nested_a_hundred_thousand_deep_is_a_400(with_prompt: bool) -> None:
    data = b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    try:
        decode_fields(data, with_prompt=with_prompt)
    except ApiError as error:
        assert error.status == 400
    else:
        raise AssertionError("a 100,000-deep body was accepted")
