"""Model cards: exact JSON round-trip, strict validation naming the field, a stable mdcsum."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from shoal.cards import CardError, Lora, MetadataFile, ModelCard, file_checksum, slugify
from shoal.cards.card import MAX_ENTRIES, MAX_METADATA_FILES

SHA = "sha256:" + "ab" * 32


def card(**overrides: object) -> ModelCard:
    fields: dict[str, object] = {
        "display_name": "Qwen/Qwen3-0.6B",
        "slug": "qwen--qwen3-0.6b",
        "source": "hf://Qwen/Qwen3-0.6B",
        "model_types": ["chat", "completions"],
        "context_length": 32768,
        "kv_block_size": 16,
        "metadata_files": {
            "config.json": {"url": "http://w/config.json", "checksum": SHA, "size": 3}
        },
    }
    fields.update(overrides)
    return ModelCard.build(**fields)


def test_json_round_trip_is_exact() -> None:
    original = card(runtime_config={"taints": ["draining"], "max_batch": 8}, lora=None)
    data = original.to_json()
    again = ModelCard.from_json(data)
    assert again == original
    assert again.to_json() == data


def test_lora_card_round_trips() -> None:
    c = card(
        display_name="base:sql", slug="base-sql", lora={"base_model": "base", "adapter": "sql"}
    )
    assert ModelCard.from_json(c.to_json()).lora == Lora("base", "sql")


def test_mdcsum_ignores_runtime_config_and_taints() -> None:
    plain = card()
    assert plain.with_taints(["draining"]).mdcsum == plain.mdcsum
    assert card(runtime_config={"anything": 1}).mdcsum == plain.mdcsum


@pytest.mark.parametrize(
    "change",
    [
        {"display_name": "other"},
        {"source": "hf://other"},
        {"context_length": 1024},
        {"kv_block_size": 32},
        {"role": "prefill"},
        {
            "metadata_files": {
                "config.json": {"url": "http://w/c", "checksum": "sha256:" + "cd" * 32, "size": 3}
            }
        },
    ],
)
def test_mdcsum_changes_with_every_identity_field(change: dict[str, object]) -> None:
    assert card(**change).mdcsum != card().mdcsum


def test_mdcsum_ignores_where_metadata_files_are_hosted() -> None:
    moved = card(
        metadata_files={"config.json": {"url": "http://elsewhere/c", "checksum": SHA, "size": 3}}
    )
    assert moved.mdcsum == card().mdcsum


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"context_length": 0}, "context_length"),
        ({"context_length": "big"}, "context_length"),
        ({"model_types": []}, "model_types"),
        ({"model_types": ["vision"]}, "model_types"),
        ({"slug": "Has Space"}, "slug"),
        ({"role": "boss"}, "role"),
        ({"display_name": ""}, "display_name"),
        ({"metadata_files": {"c": {"url": "u", "checksum": "md5:x", "size": 1}}}, "checksum"),
        ({"runtime_config": {"taints": "draining"}}, "taints"),
        ({"role": "encode"}, "role"),
        ({"role": ""}, "role"),
    ],
)
def test_validation_is_strict_and_names_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(CardError, match=field):
        card(**change)


def files(count: int) -> dict[str, object]:
    return {
        f"f{i}.json": {"url": f"http://w/f{i}.json", "checksum": SHA, "size": 1}
        for i in range(count)
    }


@pytest.mark.parametrize(
    ("field", "at_bound", "over"),
    [
        ("metadata_files", files(MAX_METADATA_FILES), files(MAX_METADATA_FILES + 1)),
        ("model_types", ["chat"] * MAX_ENTRIES, ["chat"] * (MAX_ENTRIES + 1)),
        (
            "runtime_config",
            {f"k{i}": i for i in range(MAX_ENTRIES)},
            {f"k{i}": i for i in range(MAX_ENTRIES + 1)},
        ),
        (
            "taints",
            {"taints": [f"t{i}" for i in range(MAX_ENTRIES)]},
            {"taints": [f"t{i}" for i in range(MAX_ENTRIES + 1)]},
        ),
    ],
)
def test_a_card_listing_more_than_its_bound_of_files_kinds_or_settings_is_refused(
    field: str, at_bound: object, over: object
) -> None:
    """A card's mappings and lists had no count bound: a 1 MB card from another writer
    declared 6,300 metadata files (6,300 downloads for every frontend, 31-56 ms of its loop
    to join). Now past its bound a card is refused naming the field (a frontend skips and
    counts it as malformed); at the bound it is read."""
    name = "runtime_config" if field == "taints" else field
    data = msgspec.json.decode(card().to_json())
    data[name] = at_bound
    assert ModelCard.from_json(msgspec.json.encode(data)) == card(**{name: at_bound})
    data[name] = over
    with pytest.raises(CardError, match=field):
        ModelCard.from_json(msgspec.json.encode(data))


def test_malformed_json_is_a_card_error() -> None:
    with pytest.raises(CardError, match="JSON"):
        ModelCard.from_json(b"{not json")


def test_slugify_makes_key_safe_slugs() -> None:
    assert slugify("Qwen/Qwen3-0.6B") == "qwen--qwen3-0.6b"
    assert slugify("  Llama 3 (8B) ") == "llama-3-8b"


def test_file_checksum_matches_metadata_format(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b"{}")
    checksum, size = file_checksum(path)
    assert size == 2
    assert MetadataFile(url="http://x", checksum=checksum, size=size).checksum.startswith("sha256:")


def test_taints_are_normalised_however_the_writer_ordered_them() -> None:
    written = card(runtime_config={"taints": ["zeta", "alpha", "zeta"]})
    assert written.taints == ("alpha", "zeta")
    assert written.taints == card().with_taints(["alpha", "zeta"]).taints


def test_a_newer_workers_card_with_unknown_fields_is_read_and_keeps_its_checksum() -> None:
    known = card(lora={"base_model": "base", "adapter": "a"})
    raw = msgspec.json.decode(known.to_json())
    raw["speculative_decoding"] = {"draft": "small"}  # a field this version does not know
    raw["lora"]["rank"] = 16
    raw["metadata_files"]["config.json"]["mirror"] = "http://elsewhere"
    newer = ModelCard.from_json(msgspec.json.encode(raw))
    assert newer == known
    assert newer.mdcsum == known.mdcsum  # the checksum covers the fields this version knows


def test_building_a_card_in_code_still_refuses_an_unknown_field() -> None:
    with pytest.raises(CardError, match="unknown_field"):
        card(unknown_field=1)
