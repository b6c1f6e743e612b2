"""Catalog errors, one per answer the API gives:

    CatalogError              anything the catalog refuses (status 400)
    ├── UnauthorizedError     401: the admin token is missing or wrong
    ├── NotFoundError         404: no such workspace or resource
    ├── ConflictError         409: a stale version, or a create of a name that exists
    ├── TooLargeError         413: the request body is over the API's byte bound
    ├── InvalidError          422: a field failed validation; `param` names it
    └── UnavailableError      503: the catalog's database failed (retry later)

The repository raises them, the API answers them in the OpenAI error format, and the client
raises the same classes from those answers, so callers handle one hierarchy everywhere.
"""

from __future__ import annotations


class CatalogError(Exception):
    """A request the catalog refused; `status` is the HTTP status it answers with."""

    status = 400
    type = "invalid_request_error"
    code = "bad_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class UnauthorizedError(CatalogError):
    status = 401
    type = "authentication_error"
    code = "invalid_admin_token"


class NotFoundError(CatalogError):
    status = 404
    code = "not_found"


class ConflictError(CatalogError):
    status = 409
    code = "conflict"


class TooLargeError(CatalogError):
    status = 413
    code = "body_too_large"


class InvalidError(CatalogError):
    status = 422
    code = "invalid_value"


class UnavailableError(CatalogError):
    """The catalog cannot answer now (its database failed): nothing was refused, try again."""

    status = 503
    type = "server_error"
    code = "database_unavailable"


BY_STATUS: dict[int, type[CatalogError]] = {
    cls.status: cls
    for cls in (
        UnauthorizedError, NotFoundError, ConflictError, TooLargeError, InvalidError,
        UnavailableError,
    )
}  # fmt: skip
