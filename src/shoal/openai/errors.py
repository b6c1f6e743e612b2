"""The OpenAI error: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

One class for the gateway and every engine. The official clients turn these bodies into
their typed exceptions (`NotFoundError`, ...), so status, `type` and `code` follow what
OpenAI itself answers for the same mistake. Raise `ApiError` where the mistake is found;
the HTTP layer that catches it sends `status`, `headers` and `body()`.
"""

from __future__ import annotations

import msgspec

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    501: "not_implemented_error",
    503: "service_unavailable",
}


def error_type(status: int) -> str:
    """The `type` OpenAI gives an error of `status` when nothing more specific applies."""
    return _TYPES.get(status, "server_error" if status >= 500 else "error")


class ApiError(Exception):
    """An error answered with `status` and an OpenAI error body (and `headers`, such as
    Retry-After). `type` defaults to the usual one for the status (`error_type`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type(status)
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)


def model_not_found(model: str) -> ApiError:
    """404 for a model nobody here serves, in the words and code the OpenAI API uses."""
    return ApiError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def missing_parameter(param: str) -> ApiError:
    """The 400 for a request that lacks the required parameter `param`."""
    return ApiError(
        400,
        f"Missing required parameter: '{param}'.",
        param=param,
        code="missing_required_parameter",
    )


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> bytes:
    """The JSON body of an OpenAI error."""
    return _encode({"error": {"message": message, "type": type, "param": param, "code": code}})


_encode = msgspec.json.Encoder().encode
