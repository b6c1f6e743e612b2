"""The catalog's REST API: every kind under `/v1/workspaces/{workspace}/{kind}`, on FastAPI.

Routes are made from the kind descriptors, so each kind has the same five operations with
the same rules: the admin token guards writes (and reads unless `public_read`), errors answer
in the OpenAI format with `param` naming the field, and lists are paginated with a total.
No `from __future__ import annotations` here: FastAPI reads the route closures' annotations.
"""

import asyncio
import concurrent.futures
import email.message
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Annotated, Any, Generic, TypeVar

import msgspec
import sqlalchemy.exc
from fastapi import Depends, FastAPI, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import BaseModel, StringConstraints
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.exceptions import HTTPException
from starlette.routing import Match

from shoal.bounds import MAX_DEPTH, json_depth_exceeds
from shoal.catalog import body_slices
from shoal.catalog.database import migrate
from shoal.catalog.errors import (
    CatalogError,
    InvalidError,
    TooLargeError,
    UnauthorizedError,
    UnavailableError,
)
from shoal.catalog.keys import key_routes
from shoal.catalog.kinds import KEYS, KINDS, Kind
from shoal.catalog.repository import MAX_PAGE_SIZE, Page, Repository
from shoal.catalog.resources import (
    FREE_FORM_DEPTH,
    NAME_PATTERN,
    WORKSPACE_PATTERN,
    ErrorBody,
    Meta,
    Patch,
    Workspace,
)
from shoal.catalog.usage import usage_routes

T = TypeVar("T")
log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20  # a request body's bound: several times the largest valid resource
OFF_LOOP_BYTES = 32 << 10  # a JSON body over this is decoded and validated in a thread
# ... this one thread, one body at a time: decoding holds the interpreter, so more threads
# decode no faster and leave the event loop (every other client) a smaller share of it; and
# a flood of bodies does not queue before the usage reports in asyncio's default pool.
_DECODER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="catalog-body")
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in (
        (400, f"the body is not JSON, or nests deeper than {MAX_DEPTH} levels"),
        (401, "the admin token is missing or wrong"),
        (404, "no such workspace or resource"),
        (409, "a stale version, or the name exists"),
        (413, f"the body is over {MAX_BODY_BYTES} bytes"),
        (422, "a field is invalid; `param` names it"),
        (503, "the database failed (a restart, a lost connection): try again"),
    )
}

WorkspaceParam = Annotated[
    str, Path(min_length=1, max_length=63, pattern=WORKSPACE_PATTERN, description="workspace")
]
NameParam = Annotated[str, Path(min_length=1, max_length=200, pattern=NAME_PATTERN)]
PageParam = Annotated[int, Query(ge=1, le=1_000_000, description="1-based page number")]
PageSizeParam = Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE, description="items per page")]
AfterParam = Annotated[
    str | None,
    Query(
        max_length=200,
        description="keyset paging (sort=name): the items named after this one; "
        "ask again with the last name of each page until a page is short",
    ),
]
SortParam = Annotated[
    str,
    Query(
        pattern=r"^-?(name|created_at|updated_at|version)$",
        description="name, created_at, updated_at or version; '-' first for descending",
    ),
]


def filter_param(kind: Kind[Any]) -> Any:
    """`filter=field=value` (repeatable, exact match) on `name` and the kind's string fields."""
    fields = "|".join(sorted({"name", *kind.filterable}))
    item = Annotated[str, StringConstraints(pattern=rf"^({fields})=[^\x00]*$", max_length=500)]
    return Annotated[
        list[item] | None,  # type: ignore[valid-type]
        Query(max_length=20, description=f"`field=value`, exact match, on {fields}"),
    ]


class PageOut(BaseModel, Generic[T]):
    """One page of a list; `next_page` is the page to ask for next, null on the last (and
    on a page ended early at the byte budget); `next_after` (sort=name) the name to ask
    `after=` next while more items may follow."""

    items: list[T]
    total: int
    page: int
    page_size: int
    next_page: int | None
    next_after: str | None = None


def _page(page: Page[Any]) -> dict[str, Any]:
    return {
        "items": page.items,
        "total": page.total,
        "page": page.page,
        "page_size": page.page_size,
        "next_page": page.next_page,
        "next_after": page.next_after,
    }


def _filters(raw: list[str] | None) -> dict[str, str]:
    filters: dict[str, str] = {}
    for item in raw or []:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise InvalidError(f"filter: {item!r} is not field=value", param="filter")
        filters[field] = value
    return filters


def _error(exc: CatalogError) -> JSONResponse:
    body = {
        "error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}
    }
    return JSONResponse(body, status_code=exc.status)


class BoundedRoute(APIRoute):
    """A route that answers 401 before reading a body when the admin token it requires is
    missing, 413 for a body over `MAX_BODY_BYTES` (from its declared length, else as it
    comes, never buffering more), and 400 for one nesting deeper than `MAX_DEPTH`, checked
    on its bytes before FastAPI decodes it: no decoder or serializer ever meets a deeper
    value. A JSON body over `OFF_LOOP_BYTES` is checked, decoded and validated in a thread
    of its own (`_DECODER`; on the loop a usage batch of 1 MiB held it ~70 ms), or, when its
    model names a list `validated_in_slices`, on the loop a slice of that list at a time
    (`body_slices`: `json.loads` holds the GIL, so a thread held the loop ~6-10 ms for that
    batch all the same); FastAPI then meets the model it declared, already valid, so the
    OpenAPI schema is the same either way."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        body_field = self.body_field
        one_body = len(self.dependant.body_params) == 1 and not self._embed_body_fields
        guards = [d.dependency for d in self.dependencies if isinstance(d.dependency, _Guard)]
        sliced = body_slices.sliced_field(body_field.field_info.annotation) if body_field else None

        async def bounded(request: Request) -> Response:
            for guard in guards:  # before the body is read
                guard.check_header(request.headers.get("authorization", ""))
            body = await _bounded_body(request)
            off_loop = one_body and len(body) > OFF_LOOP_BYTES and _is_json(request)
            if body_field is not None and off_loop:
                # what FastAPI's `await request.json()` returns from now on
                valid = None
                if sliced is not None:
                    valid = await body_slices.validated_in_slices(body, body_field, sliced)
                if valid is None:
                    loop = asyncio.get_running_loop()
                    valid = await loop.run_in_executor(_DECODER, _decoded, body, body_field)
                request._json = valid
                return await handle(request)
            if json_depth_exceeds(body):
                raise _too_deep()
            return await handle(request)

        return bounded


def _too_deep() -> CatalogError:
    return CatalogError(
        f"body: arrays or objects are nested deeper than {MAX_DEPTH} levels"
        f" (free-form fields: {FREE_FORM_DEPTH})"
    )


def _is_json(request: Request) -> bool:
    """Whether FastAPI would decode this body as JSON (its content type says so)."""
    message = email.message.Message()
    message["content-type"] = request.headers.get("content-type", "")
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _decoded(body: bytes, field: Any) -> Any:
    """`body` checked for depth, decoded and validated as `field` (in a thread), raising
    what FastAPI would: `RequestValidationError` with `loc` from `body`."""
    if json_depth_exceeds(body):
        raise _too_deep()
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                 "input": {}, "ctx": {"error": exc.msg}}  # fmt: skip
        raise RequestValidationError([error], body=exc.doc) from exc
    except ValueError as exc:  # not UTF-8 (or 16, 32): what FastAPI answers for it on the loop
        raise HTTPException(400, "There was an error parsing the body") from exc
    valid, errors = field.validate(value, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=value)
    return valid


async def _bounded_body(request: Request) -> bytes:
    """The body, read once (FastAPI reuses it), or `TooLargeError` once it passes the bound."""
    too_large = TooLargeError(f"body: over {MAX_BODY_BYTES} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    request._body = body = b"".join(chunks)  # what `Request.body()` returns from now on
    return body


def _not_json(exc: RequestValidationError, error: dict[str, Any]) -> CatalogError:
    """400 for a body that is not JSON, saying where it stops being JSON."""
    doc = exc.body if isinstance(exc.body, str) else ""
    pos = error["loc"][1] if len(error["loc"]) > 1 and isinstance(error["loc"][1], int) else 0
    line, column = doc.count("\n", 0, pos) + 1, pos - doc.rfind("\n", 0, pos)
    reason = error.get("ctx", {}).get("error", "invalid")
    return CatalogError(f"body: not valid JSON: {reason} at line {line} column {column}")


async def _on_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        return _error(_not_json(exc, first))
    loc = [str(part) for part in first.get("loc", ())]
    param = ".".join(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc) or None
    return _error(InvalidError(f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param))


async def _on_catalog_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CatalogError)
    return _error(exc)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    error = CatalogError(str(exc.detail))
    error.status, error.code = exc.status_code, "http_error"
    response = _error(error)
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:  # every route of this path, not only the first one matched
        methods: set[str] = set()
        for route in request.app.router.routes:
            if isinstance(route, APIRoute) and route.matches(request.scope)[0] != Match.NONE:
                methods |= route.methods or set()
        response.headers["Allow"] = ", ".join(sorted(methods))
    return response


# What a failing database raises (a restart resets the pooled connections; a pool times out;
# asyncpg cannot connect): the request is answered 503, never a plain-text 500.
DATABASE_ERRORS: tuple[type[Exception], ...] = (
    sqlalchemy.exc.DBAPIError,  # OperationalError, InterfaceError, ...
    sqlalchemy.exc.TimeoutError,  # the pool's
    sqlalchemy.exc.ResourceClosedError,
    ConnectionError,
    TimeoutError,
)


async def _on_database_error(request: Request, exc: Exception) -> JSONResponse:
    log.warning("%s %s: database error: %s", request.method, request.url.path, exc)
    reason = type(getattr(exc, "orig", None) or exc).__name__
    return _error(UnavailableError(f"the catalog's database failed ({reason}); try again"))


_BEARER = HTTPBearer(auto_error=False, description="the admin token")


class _Guard:
    """A dependency refusing requests without `Authorization: Bearer <token>`. A
    `BoundedRoute` also asks it before reading the body: a client without the token never
    has one read, decoded or validated (in a thread)."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()

    async def __call__(
        self, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]
    ) -> None:
        self.check(credentials.credentials if credentials else "")

    def check(self, given: str) -> None:
        if not hmac.compare_digest(given.encode(), self.token):
            raise UnauthorizedError("an admin token is required: Authorization: Bearer <token>")

    def check_header(self, authorization: str) -> None:
        """`check` on an `Authorization` header, read as `HTTPBearer` reads it."""
        scheme, credentials = get_authorization_scheme_param(authorization)
        self.check(credentials if scheme.lower() == "bearer" else "")


async def _no_guard() -> None:
    return None


def create_app(
    engine: AsyncEngine,
    *,
    admin_token: str | None = None,
    public_read: bool = False,
    migrate_on_start: bool = True,
    key_pepper: str = "",
) -> FastAPI:
    """The catalog API on `engine`; the schema is migrated when the app starts."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if migrate_on_start:
            await migrate(engine)
        yield

    app = FastAPI(
        title="shoal catalog",
        version="1",
        description="The fleet's desired state: providers, models, virtual models, deployments.",
        lifespan=lifespan,
    )
    app.router.route_class = BoundedRoute
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(CatalogError, _on_catalog_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    for database_error in DATABASE_ERRORS:
        app.add_exception_handler(database_error, _on_database_error)
    repo = Repository(engine)
    app.state.repository = repo
    guard: Callable[..., Awaitable[None]] = (
        _Guard(admin_token) if admin_token is not None else _no_guard
    )
    write = [Depends(guard)]
    read = [Depends(_no_guard if public_read else guard)]
    _workspace_routes(app, repo, read)
    key_routes(app, repo, key_pepper, write, ERRORS)  # a key's create answers its secret
    usage_routes(app, engine, read, write, ERRORS)
    for kind in KINDS:
        _kind_routes(app, repo, kind, read, write)
    return app


def _workspace_routes(app: FastAPI, repo: Repository, read: list[Any]) -> None:
    @app.get(
        "/v1/workspaces",
        response_model=PageOut[Workspace],
        responses=ERRORS,
        dependencies=read,
        tags=["workspaces"],
        operation_id="list_workspaces",
    )
    async def list_workspaces(page: PageParam = 1, page_size: PageSizeParam = 100) -> Any:
        return _page(await repo.list_workspaces(page=page, page_size=page_size))

    @app.get(
        "/v1/workspaces/{workspace}",
        response_model=Workspace,
        responses=ERRORS,
        dependencies=read,
        tags=["workspaces"],
        operation_id="get_workspace",
    )
    async def get_workspace(workspace: WorkspaceParam) -> Any:
        return await repo.get_workspace(workspace)


def _kind_routes(
    app: FastAPI, repo: Repository, kind: Kind[Any], read: list[Any], write: list[Any]
) -> None:
    """list, get, create, update (PATCH) and delete for one kind."""
    base = f"/v1/workspaces/{{workspace}}/{kind.plural}"
    op = kind.plural.replace("-", "_")
    common: dict[str, Any] = {"responses": ERRORS, "tags": [kind.plural]}
    Create, PatchBody, Read = kind.create, kind.patch, kind.read
    FilterParam = filter_param(kind)

    page_of_read: Any = PageOut[Read]  # type: ignore[valid-type]

    @app.get(
        base, response_model=page_of_read, dependencies=read, operation_id=f"list_{op}", **common
    )
    async def list_items(
        workspace: WorkspaceParam,
        page: PageParam = 1,
        page_size: PageSizeParam = 100,
        sort: SortParam = "name",
        filter: FilterParam = None,  # type: ignore[valid-type]
        after: AfterParam = None,
    ) -> Any:
        found = await repo.list(
            kind, workspace, page=page, page_size=page_size, sort=sort, filters=_filters(filter),
            after=after,
        )  # fmt: skip
        return Response(msgspec.json.encode(_page(found)), media_type="application/json")

    @app.get(
        f"{base}/{{name:path}}",
        response_model=Read,
        dependencies=read,
        operation_id=f"get_{op}",
        **common,
    )
    async def get_item(workspace: WorkspaceParam, name: NameParam) -> Meta:
        return await repo.get(kind, workspace, name)

    async def create_item(workspace: WorkspaceParam, body: Create) -> Meta:  # type: ignore[valid-type]
        return await repo.create(kind, workspace, body)

    if kind is not KEYS:  # a key's create is `key_routes`': it answers the secret
        app.post(
            base,
            response_model=Read,
            status_code=201,
            dependencies=write,
            operation_id=f"create_{op}",
            **common,
        )(create_item)

    @app.patch(
        f"{base}/{{name:path}}",
        response_model=Read,
        dependencies=write,
        operation_id=f"update_{op}",
        **common,
    )
    async def update_item(workspace: WorkspaceParam, name: NameParam, body: PatchBody) -> Meta:  # type: ignore[valid-type]
        patch: Patch = body
        return await repo.update(kind, workspace, name, patch)

    @app.delete(
        f"{base}/{{name:path}}",
        status_code=204,
        response_class=Response,
        dependencies=write,
        operation_id=f"delete_{op}",
        **common,
    )
    async def delete_item(
        workspace: WorkspaceParam,
        name: NameParam,
        version: Annotated[
            int | None, Query(ge=1, le=2**62, description="409 unless current")
        ] = None,
    ) -> Response:
        await repo.delete(kind, workspace, name, version)
        return Response(status_code=204)
