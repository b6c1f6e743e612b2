"""What the two stages of a disaggregated request send and read, in vLLM's NixlConnector
protocol (disagg.py carries the requests): the prefill's body and the decode's (as top-level
members, `stage_one` and `stage_two`: made of the client's, decoded once), the handle
(`kv_transfer_params`) in a prefill's answer, and a decode's refusal of it."""

from __future__ import annotations

import msgspec

from shoal.bounds import TooDeep, check_json_depth
from shoal.frontend.http.exchange import UpstreamError
from shoal.frontend.proxy.fields import Members
from shoal.openai import ApiError

STAGE_ONE_PARAMS = msgspec.Raw(
    msgspec.json.encode(
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
    )
)
_ONE = msgspec.Raw(b"1")
_FALSE = msgspec.Raw(b"false")


class _Answer(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")  # kept as it came


class _ErrorDetail(msgspec.Struct):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: str | int | None = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode
_decode_error = msgspec.json.Decoder(_ErrorBody).decode


def stage_one(members: Members) -> Members:
    """The prefill's members (a copy): the client's, asking for one token, whole, and a
    remote decode. Its answer is read for the handle alone: what would only make it longer
    (an `echo` of the prompt, 1 MB of it past `MAX_PREFILL_ANSWER`) is left out."""
    members = dict(members)
    members["max_tokens"] = _ONE
    if "max_completion_tokens" in members:
        members["max_completion_tokens"] = _ONE
    members["stream"] = _FALSE
    members.pop("stream_options", None)
    members.pop("min_tokens", None)  # (more than 1 is refused against `max_tokens: 1`)
    members.pop("echo", None)
    members["kv_transfer_params"] = STAGE_ONE_PARAMS
    return members


def stage_two(members: Members, params: msgspec.Raw | None) -> Members:
    """The decode's members: the client's, with the prefill's `kv_transfer_params` (none: the
    prefill gave none, and the decode computes the prompt itself, as vLLM's proxy does);
    `members` themselves when that changes nothing. Params the client sent never reach a
    decode: they would name blocks and a host to fetch them from (another request's KV, or
    any address) that no prefill of this request made."""
    if params is not None:
        return {**members, "kv_transfer_params": params}
    if "kv_transfer_params" not in members:
        return members
    members = dict(members)
    del members["kv_transfer_params"]
    return members


def prefill_handle(answer: bytes, address: str) -> msgspec.Raw | None:
    """The `kv_transfer_params` of a prefill's whole answer (None if it gave none), as they
    came; `UpstreamError` when the answer is no JSON object, nests deeper than `MAX_DEPTH`,
    or its params are no object: nothing else is put into a decode's body."""
    try:
        check_json_depth(answer)
        params = _decode_answer(answer).kv_transfer_params
    except (TooDeep, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise UpstreamError(f"prefill instance {address} answered no usable JSON: {exc}") from None
    raw = bytes(params)
    if raw == b"null":
        return None
    if not raw.startswith(b"{"):
        raise UpstreamError(
            f"prefill instance {address} answered kv_transfer_params that are no object"
        )
    return params


def _error_detail(body: bytes) -> _ErrorDetail | None:
    """The `error` of an instance's error answer, or None when it has no readable one (no
    JSON, another shape, or nested deeper than `MAX_DEPTH`: never a `RecursionError`)."""
    try:
        check_json_depth(body)
        return _decode_error(body).error
    except (TooDeep, msgspec.DecodeError, msgspec.ValidationError):
        return None


def refuses_handle(body: bytes) -> bool:
    """Whether a decode's 400 refuses the KV handle (its `param` names `kv_transfer_params`)."""
    error = _error_detail(body)
    return error is not None and str(error.param or "").startswith("kv_transfer_params")


def api_error(status: int, body: bytes) -> ApiError:
    """A prefill's refusal (4xx), relayed to the client with its message, param and code."""
    detail = _error_detail(body)
    if detail is None:
        return ApiError(status, f"The prefill instance refused the request ({status}).")
    code = None if detail.code is None else str(detail.code)
    return ApiError(status, detail.message, type=detail.type, param=detail.param, code=code)
