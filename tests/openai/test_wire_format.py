"""The OpenAI wire format shared by the gateway and the engines (`shoal.openai`)."""

from __future__ import annotations

import json

import msgspec
import pytest

from shoal.openai import (
    SSE_DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    decode_request,
    error_body,
    sse_event,
)

_chat = msgspec.json.Decoder(ChatRequest)
_completion = msgspec.json.Decoder(CompletionRequest)


@pytest.mark.parametrize(
    ("status", "expected"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (503, "service_unavailable"),
     (502, "server_error"), (418, "error")],
)  # fmt: skip
def test_error_type_follows_the_status_unless_given(status: int, expected: str) -> None:
    assert ApiError(status, "m").type == expected
    assert ApiError(status, "m", type="custom").type == "custom"


def test_error_body_is_the_openai_error_object() -> None:
    error = ApiError(404, "no such model", code="model_not_found", param="model")
    assert json.loads(error.body()) == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert error.body() == error_body(
        "no such model", type="invalid_request_error", code="model_not_found", param="model"
    )


def test_a_missing_required_field_is_named_as_the_parameter() -> None:
    with pytest.raises(ApiError) as caught:
        decode_request(b'{"model": "m"}', _chat)
    assert caught.value.status == 400
    assert caught.value.param == "messages"
    assert caught.value.code == "missing_required_parameter"


def test_an_out_of_range_value_names_its_parameter() -> None:
    with pytest.raises(ApiError) as caught:
        decode_request(b'{"prompt": "hi", "temperature": 3}', _completion)
    assert caught.value.status == 400 and caught.value.param == "temperature"


def test_invalid_json_is_refused_as_such() -> None:
    with pytest.raises(ApiError) as caught:
        decode_request(b"{not json", _chat)
    assert caught.value.status == 400 and caught.value.code == "invalid_json"


def test_a_parameter_not_given_is_none_so_engines_apply_their_defaults() -> None:
    req = decode_request(b'{"messages": [{"role": "user", "content": "hi"}]}', _chat)
    assert req.temperature is None and req.top_p is None and req.max_tokens is None
    assert not req.include_usage
    streamed = decode_request(
        b'{"prompt": "hi", "stream": true, "stream_options": {"include_usage": true}}',
        _completion,
    )
    assert streamed.include_usage


def test_sse_events_are_one_data_line_each() -> None:
    assert sse_event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"
