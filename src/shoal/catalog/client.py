"""A small typed async client of the catalog API, on aiohttp.

Every call is one HTTP request, except `list_all` (one per page). Errors come back as the
classes of `shoal.catalog.errors` (`NotFoundError`, `ConflictError`, ...), so a caller writes
`except ConflictError` whether it talks to the API or uses the repository directly.

    async with CatalogClient("http://127.0.0.1:8100", token=...) as catalog:
        models = await catalog.list_all(MODELS)                # every entity, paged
        entity = await catalog.get(MODELS, "llama-3-8b")       # -> Model
        await catalog.update(MODELS, entity.name, {"providers": [...]}, version=entity.version)
"""

from __future__ import annotations

import builtins
import functools
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel

from shoal.catalog.errors import BY_STATUS, CatalogError
from shoal.catalog.kinds import Kind
from shoal.catalog.resources import Meta, Workspace

M = TypeVar("M", bound=Meta)


@dataclass
class ListPage(Generic[M]):
    items: list[M]
    total: int
    next_page: int | None


class _Page(BaseModel, Generic[M]):
    items: builtins.list[M]
    total: int
    next_page: int | None


def _segment(text: str) -> str:
    return quote(text, safe="")


@functools.cache
def _page_of(read: type[M]) -> type[_Page[M]]:
    """The page model of one kind, built once: a page is parsed in one pass from its bytes."""
    return _Page[read]  # type: ignore[valid-type]


class CatalogClient:
    """Talks to one catalog at `base_url`, in `workspace` unless a call names another."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        workspace: str = "default",
        timeout: float = 30.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.workspace = workspace
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session = session
        self._owns_session = session is None
        self.requests = 0  # HTTP requests made: what a controller's call budget is counted in

    async def __aenter__(self) -> CatalogClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None

    def _url(self, kind: Kind[Any], workspace: str | None, name: str | None = None) -> str:
        """The URL of `kind` (and `name`) in `workspace`: every segment percent-encoded, `/`
        of a name included, so no name (`a/../b`, `a%2Fb`, `a?b`) can address another."""
        url = f"{self.base_url}/v1/workspaces/{_segment(workspace or self.workspace)}/{kind.plural}"
        return f"{url}/{_segment(name)}" if name is not None else url

    async def _call(
        self, method: str, url: str, *, json: Any = None, params: Any = None, raw: bool = False
    ) -> Any:
        """The decoded JSON answer (`raw`: its bytes), or the error class of its status."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        self.requests += 1
        async with self._session.request(
            method, url, json=json, params=params, headers=self._headers
        ) as resp:
            if resp.status == 204:
                return None
            if raw and resp.status < 400:
                return await resp.read()
            body = await resp.json(content_type=None)
            if resp.status >= 400:
                error = (body or {}).get("error", {}) if isinstance(body, dict) else {}
                cls = BY_STATUS.get(resp.status, CatalogError)
                exc = cls(error.get("message") or f"HTTP {resp.status}", param=error.get("param"))
                exc.status = resp.status
                raise exc
            return body

    async def list(
        self,
        kind: Kind[M],
        *,
        workspace: str | None = None,
        page: int = 1,
        page_size: int = 1000,
        sort: str = "name",
        filters: dict[str, str] | None = None,
    ) -> ListPage[M]:
        params: builtins.list[tuple[str, str]] = [
            ("page", str(page)), ("page_size", str(page_size)), ("sort", sort)
        ]  # fmt: skip
        params += [("filter", f"{k}={v}") for k, v in (filters or {}).items()]
        raw = await self._call("GET", self._url(kind, workspace), params=params, raw=True)
        found = _page_of(kind.read).model_validate_json(raw)
        return ListPage(found.items, found.total, found.next_page)

    async def list_all(
        self,
        kind: Kind[M],
        *,
        workspace: str | None = None,
        filters: dict[str, str] | None = None,
        page_size: int = 1000,
    ) -> builtins.list[M]:
        """Every item of `kind`, in name order, reading page after page."""
        items: builtins.list[M] = []
        page: int | None = 1
        while page is not None:
            got = await self.list(
                kind, workspace=workspace, page=page, page_size=page_size, filters=filters
            )
            items += got.items
            page = got.next_page
        return items

    async def get(self, kind: Kind[M], name: str, *, workspace: str | None = None) -> M:
        return kind.read.model_validate(await self._call("GET", self._url(kind, workspace, name)))

    async def create(
        self, kind: Kind[M], body: BaseModel | dict[str, Any], *, workspace: str | None = None
    ) -> M:
        """Create; `ConflictError` (param `name`) when the name is taken."""
        data = (
            body.model_dump(mode="json", exclude_unset=True)
            if isinstance(body, BaseModel)
            else body
        )
        return kind.read.model_validate(
            await self._call("POST", self._url(kind, workspace), json=data)
        )

    async def update(
        self,
        kind: Kind[M],
        name: str,
        changes: dict[str, Any],
        *,
        version: int | None = None,
        workspace: str | None = None,
    ) -> M:
        """PATCH the fields in `changes`; with `version`, `ConflictError` unless it is current."""
        data = {**changes, "version": version} if version is not None else changes
        url = self._url(kind, workspace, name)
        return kind.read.model_validate(await self._call("PATCH", url, json=data))

    async def delete(
        self,
        kind: Kind[Any],
        name: str,
        *,
        version: int | None = None,
        workspace: str | None = None,
    ) -> None:
        params = {"version": str(version)} if version is not None else None
        await self._call("DELETE", self._url(kind, workspace, name), params=params)

    async def workspaces(self) -> builtins.list[Workspace]:
        body = await self._call(
            "GET", f"{self.base_url}/v1/workspaces", params={"page_size": "1000"}
        )
        return [Workspace.model_validate(item) for item in body["items"]]
