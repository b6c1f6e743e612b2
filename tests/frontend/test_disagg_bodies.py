"""The two bodies of a disaggregated request, as vLLM's NixlConnector proxy sends them."""

from __future__ import annotations

import json

import msgspec
import pytest

from shoal.frontend.http.exchange import UpstreamError
from shoal.frontend.proxy.stages import prefill_handle, refuses_handle, stage_one, stage_two

_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def stage_one_body(body: bytes) -> bytes:
    """The prefill's body of the client's, as disagg.py makes it (`stage_one`)."""
    return msgspec.json.encode(stage_one(_members(body)))


def stage_two_body(body: bytes, params: msgspec.Raw | None) -> bytes:
    """The decode's body of the client's, as disagg.py makes it: the client's own when
    `stage_two` leaves its members as they are."""
    members = _members(body)
    two = stage_two(members, params)
    return body if two is members else msgspec.json.encode(two)


CLIENT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 300,
    "max_completion_tokens": 200,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
}


def test_stage_one_asks_one_whole_token_and_a_remote_decode_keeping_the_rest() -> None:
    body = json.loads(stage_one_body(json.dumps(CLIENT).encode()))
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert body["stream"] is False and "stream_options" not in body
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert body["messages"] == CLIENT["messages"] and body["temperature"] == 0.5
    without = {k: v for k, v in CLIENT.items() if k != "max_completion_tokens"}
    assert "max_completion_tokens" not in json.loads(stage_one_body(json.dumps(without).encode()))


def test_stage_two_is_the_clients_body_with_the_handle_byte_for_byte() -> None:
    handle = b'{"remote_block_ids":[1,2],"remote_engine_id":"e","remote_port":7,"x":1.50}'
    raw = json.dumps(CLIENT).encode()
    body = stage_two_body(raw, msgspec.Raw(handle))
    assert handle in body  # not re-encoded: unknown fields and number forms pass as they came
    decoded = json.loads(body)
    assert {k: v for k, v in decoded.items() if k != "kv_transfer_params"} == CLIENT
    assert stage_two_body(raw, None) is raw  # no handle: the decode prefills itself


def test_only_a_400_naming_kv_transfer_params_refuses_the_handle() -> None:
    def error(param: str | None) -> bytes:
        return json.dumps({"error": {"message": "x", "param": param}}).encode()

    assert refuses_handle(error("kv_transfer_params.remote_host"))
    assert not refuses_handle(error("max_tokens"))
    assert not refuses_handle(error(None))
    assert not refuses_handle(b"not json")


def test_a_prefill_handle_too_deep_or_no_object_is_a_prefill_failure_never_forwarded() -> None:
    def answer(params: str) -> bytes:
        return b'{"id":"x","choices":[],"kv_transfer_params":' + params.encode() + b"}"

    handle = '{"remote_block_ids":[1,2],"remote_host":"h","remote_port":7}'
    assert bytes(prefill_handle(answer(handle), "p:1") or b"") == handle.encode()
    assert prefill_handle(answer("null"), "p:1") is None
    assert prefill_handle(b'{"id":"x"}', "p:1") is None
    deep = '{"a":' * 100_000 + "1" + "}" * 100_000  # under the 1 MiB answer bound
    for bad in [deep, '"127.0.0.1:22"', "[1,2]", "7", "true"]:
        with pytest.raises(UpstreamError, match="p:1"):
            prefill_handle(answer(bad), "p:1")
    with pytest.raises(UpstreamError):
        prefill_handle(b"[1]", "p:1")


def test_stage_two_never_carries_the_clients_own_kv_transfer_params() -> None:
    # A client's handle would have the decode fetch blocks it names, from a host it names
    # (another request's KV, or any address): only a prefill's answer may give one.
    forged = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "10.0.0.9",
              "remote_port": 22, "remote_block_ids": [1, 2, 3]}  # fmt: skip
    raw = json.dumps({**CLIENT, "kv_transfer_params": forged}).encode()
    assert "kv_transfer_params" not in json.loads(stage_two_body(raw, None))
    twice = raw[:-1] + b', "kv_transfer_params": null}'  # the proxy's check sees the last
    assert b"kv_transfer_params" not in stage_two_body(twice, None)
    escaped = raw.replace(b'"kv_transfer_params"', b'"kv_transfer\\u005fparams"')
    assert "kv_transfer_params" not in json.loads(stage_two_body(escaped, None))
    handle = b'{"remote_engine_id":"p","remote_host":"h","remote_port":7}'
    assert json.loads(stage_two_body(raw, msgspec.Raw(handle)))["kv_transfer_params"] == {
        "remote_engine_id": "p", "remote_host": "h", "remote_port": 7
    }  # fmt: skip


def test_stage_one_leaves_out_min_tokens_which_its_one_token_cannot_meet() -> None:
    """vLLM refuses `min_tokens` over `max_tokens`: a client's `min_tokens: 5` made every
    prefill a 400 naming a limit the client never set. The decode keeps it."""
    client = json.dumps({"model": "m", "prompt": "x", "max_tokens": 20, "min_tokens": 5})
    one = json.loads(stage_one_body(client.encode()))
    assert "min_tokens" not in one and one["max_tokens"] == 1
    assert json.loads(stage_two_body(client.encode(), None))["min_tokens"] == 5


def test_stage_one_leaves_out_echo_whose_prompt_its_answer_need_not_carry() -> None:
    """The prefill's answer is read for its handle alone, within `MAX_PREFILL_ANSWER`: an
    echoed 1 MB prompt made it too long, a 502 for a request the decode serves. The decode
    keeps it."""
    client = json.dumps({"model": "m", "prompt": "x", "max_tokens": 20, "echo": True})
    assert "echo" not in json.loads(stage_one_body(client.encode()))
    assert json.loads(stage_two_body(client.encode(), None))["echo"] is True
