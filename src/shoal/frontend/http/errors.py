"""The gateway's errors, each one `ApiError` (`shoal.openai`) built for one mistake.

The status, `type` and `code` follow what OpenAI itself answers for the same mistake, so
the official clients raise the matching typed exception (`NotFoundError`, ...).
"""

from __future__ import annotations

from shoal.openai import ApiError
from shoal.openai import (
    model_not_found as model_not_found,  # the gateway's 404 is the wire format's
)

RETRY_AFTER = (b"retry-after", b"5")
"""Sent with a 503 for a model that exists but whose instances all drain or are tainted."""


def no_ready_instance(model: str, why: str | None = None) -> ApiError:
    """`why`: what the model waits for (an incomplete disaggregated model says which stage)."""
    because = f" ({why})" if why else ""
    return ApiError(
        503,
        f"The model `{model}` has no ready instance right now{because}; retry shortly.",
        type="service_unavailable_error",
        code="no_ready_instance",
        param="model",
        headers=(RETRY_AFTER,),
    )


def discovery_loading(model: str) -> ApiError:
    """503 for a model not (yet) held while the first discovery listing loads: a request or
    a lookup then answers 'retry', not a 404 saying a live model does not exist."""
    return ApiError(
        503,
        f"The gateway is still loading its fleet from discovery; the model `{model}` may be "
        "served once it has: retry shortly.",
        code="discovery_loading",
        headers=((b"retry-after", b"1"),),
    )


def upstream_failed(model: str, reason: str) -> ApiError:
    return ApiError(
        502,
        f"No instance of `{model}` could serve the request: {reason or 'the instance failed'}",
        type="server_error",
        code="upstream_error",
    )


def provider_refused(model: str, provider: str, status: int) -> ApiError:
    """A provider answered 401/403 to the gateway's own credentials for it: the operator's
    secret, never the client's key (a 401 would have the client's SDK say its key is bad)."""
    return ApiError(
        502,
        f"The provider {provider} of `{model}` refused the gateway's credentials for it "
        f"(HTTP {status}); the operator's secret for it is missing, wrong or not allowed.",
        type="server_error",
        code="provider_auth_failed",
    )


def provider_encoded(model: str, provider: str, encoding: str) -> ApiError:
    """A provider answered under a coding the gateway did not ask for (it asks for identity):
    `encoding` is the header, as `Header 'value'`. Its body is dropped, not relayed, as the key
    it may quote could not be masked."""
    return ApiError(
        502,
        f"The provider {provider} of `{model}` answered with {encoding}, "
        "though the gateway asked for none; its answer was dropped.",
        type="server_error",
        code="provider_encoding",
    )


def upstream_timeout(model: str, reason: str) -> ApiError:
    """No instance answered in time; `reason` says which wait ran out."""
    return ApiError(
        504,
        f"No instance of `{model}` answered in time: {reason}",
        type="server_error",
        code="upstream_timeout",
    )


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def client_kv_transfer_params() -> ApiError:
    return bad_request(
        "`kv_transfer_params` are set by the gateway for disaggregated serving, never by "
        "clients: they make a worker fetch KV blocks from the host they name.",
        param="kv_transfer_params",
    )


def unauthorized() -> ApiError:
    return ApiError(
        401,
        "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
        type="invalid_request_error",
        code="invalid_api_key",
    )


def body_too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"The request body is larger than the {limit}-byte limit of this server.",
        code="request_too_large",
    )


def not_found(path: str) -> ApiError:
    return ApiError(404, f"Unknown path {path!r}.", code="unknown_url")


def method_not_allowed(method: str, path: str, allowed: tuple[bytes, ...]) -> ApiError:
    """405, with the `Allow` header naming the methods `path` takes (RFC 9110 §15.5.6)."""
    return ApiError(
        405,
        f"Method {method} is not allowed on {path!r}.",
        code="method_not_allowed",
        headers=((b"allow", b", ".join(allowed)),),
    )


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="service_unavailable_error", code="unavailable")


def headers_too_large(what: str) -> ApiError:
    return ApiError(
        431,
        f"The request head is too large: {what}.",
        code="request_header_fields_too_large",
    )


def request_timeout(what: str, seconds: float) -> ApiError:
    return ApiError(
        408,
        f"The {what} did not arrive within {seconds:g}s.",
        code="request_timeout",
    )


def not_implemented(message: str) -> ApiError:
    return ApiError(501, message, type="invalid_request_error", code="not_implemented")


def too_many_connections(limit: int) -> ApiError:
    return ApiError(
        503,
        f"The server already holds its limit of {limit} client connections; retry shortly.",
        type="service_unavailable_error",
        code="too_many_connections",
    )


def bodies_held(limit: int) -> ApiError:
    return ApiError(
        503,
        f"The server already holds its limit of {limit} bytes of request bodies being "
        "received; retry shortly.",
        type="service_unavailable_error",
        code="server_busy",
    )


def out_of_files(reason: str) -> ApiError:
    return ApiError(
        503,
        f"The gateway holds its limit of open files and could reach no instance ({reason}); "
        "retry shortly.",
        type="service_unavailable_error",
        code="gateway_overloaded",
    )


def origin_not_allowed(origin: str) -> ApiError:
    return ApiError(
        403,
        f"Cross-origin requests from {origin!r} are not allowed.",
        type="invalid_request_error",
        code="cors",
    )


def loop_detected(gateway: str, hops: int) -> ApiError:
    return ApiError(
        508,
        f"Request loop: the request came back to the gateway that already forwarded it "
        f"({gateway}, {hops} gateway hop(s) in `Via`); a virtual model's url target leads back "
        "to a gateway on its own path.",
        type="server_error",
        code="loop_detected",
    )


def too_many_hops(hops: int, limit: int) -> ApiError:
    return ApiError(
        508,
        f"Request loop: the request already passed through {hops} shoal gateways (`Via`), the "
        f"limit is {limit}; virtual models' url targets chain gateways into a loop or too long "
        "a path.",
        type="server_error",
        code="loop_detected",
    )


def unsupported_coding(value: bytes) -> ApiError:
    coding = value.decode("latin-1")
    return not_implemented(
        f"Transfer-Encoding {coding!r} is not supported: send the body with Content-Length "
        "or `Transfer-Encoding: chunked` alone."
    )


def internal_error() -> ApiError:
    return ApiError(500, "Internal error in the gateway.", type="server_error")
