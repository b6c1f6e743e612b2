"""`prefix_message` reads a huge chat message's role and the start of its text from its first
bytes (the usual shape) and reads it as the whole message decoded would."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.frontend.proxy.fields import PROMPT_CHARS
from shoal.frontend.registry import router
from shoal.frontend.registry.router import LARGE_MESSAGE, prefix_message

CHARS = 200


def huge(message: dict[str, Any], separators: tuple[str, str], indent: int | None) -> bytes:
    data = json.dumps(message, separators=separators, indent=indent, ensure_ascii=False)
    return data.encode()


@settings(max_examples=200, deadline=None)
@given(
    role=st.sampled_from(["user", "assistant", "system", "tool", "developer", 'us"er', "ü"]),
    head=st.text(min_size=0, max_size=300),
    separators=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]),
    indent=st.sampled_from([None, 2]),
    extra=st.booleans(),
    size=st.integers(LARGE_MESSAGE, 3 * LARGE_MESSAGE),
    chars=st.sampled_from([CHARS, PROMPT_CHARS]),
)
def test_a_huge_message_reads_as_the_whole_message_decoded(
    role: str,
    head: str,
    separators: tuple[str, str],
    indent: int | None,
    extra: bool,
    size: int,
    chars: int,
) -> None:
    message: dict[str, Any] = {"role": role, "content": head + "x" * size}
    if extra:
        message = {"name": "n", **message} if len(head) % 2 else {**message, "name": "n"}
    raw = msgspec.Raw(huge(message, separators, indent))
    read = prefix_message(raw, chars)
    assert read["role"] == role
    assert read["content"][:chars] == message["content"][:chars]


def test_the_usual_shape_is_read_from_its_first_bytes_and_odd_ones_by_the_decoder(
    monkeypatch: Any,
) -> None:
    decoded: list[bytes] = []
    real = router._decode_head

    def counting(data: Any) -> Any:
        decoded.append(bytes(data)[:20])
        return real(data)

    monkeypatch.setattr(router, "_decode_head", counting)
    text = "y" * LARGE_MESSAGE
    usual = msgspec.Raw(json.dumps({"role": "user", "content": text}).encode())
    read = prefix_message(usual, CHARS)
    assert read["role"] == "user" and read["content"][:CHARS] == text[:CHARS]
    assert decoded == []  # (no scan of the whole message)
    content_first = msgspec.Raw(json.dumps({"content": text, "role": "user"}).encode())
    assert prefix_message(content_first, CHARS)["role"] == "user"
    parts = [{"type": "text", "text": text}]
    parts_message = msgspec.Raw(json.dumps({"role": "user", "content": parts}).encode())
    assert prefix_message(parts_message, CHARS)["content"] == parts
    assert len(decoded) == 2
