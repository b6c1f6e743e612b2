"""A small typed async client of the catalog API, on aiohttp.

Every call is one HTTP request, except `list_all` and `workspaces` (one per page). Errors
come back as the classes of `shoal.catalog.errors` (`NotFoundError`, `ConflictError`, ...), so
a caller writes `except ConflictError` whether it talks to the API or uses the repository
directly. A listing reads each item on its own: an item this client cannot read (a row an
older or newer catalog wrote) is left out and named in `ListPage.invalid`, never failing
the page. `list_all` pages by key (`after=` the last name), so a row deleted or created
between two pages never shifts an untouched row out of the listing, and follows a page
the server ended early at its byte budget.

    async with CatalogClient("http://127.0.0.1:8100", token=...) as catalog:
        models = await catalog.list_all(MODELS)                # every entity, paged
        entity = await catalog.get(MODELS, "llama-3-8b")       # -> Model
        await catalog.update(MODELS, entity.name, {"providers": [...]}, version=entity.version)
"""

from __future__ import annotations

import asyncio
import builtins
import json as jsonlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import aiohttp
import msgspec
from pydantic import BaseModel, ValidationError

from shoal.catalog.errors import BY_STATUS, CatalogError
from shoal.catalog.kinds import KEYS, Kind
from shoal.catalog.resources import KeyWithSecret, Meta, Workspace
from shoal.slices import decode_slice, decoded_slices

M = TypeVar("M", bound=Meta)


@dataclass
class ListPage(Generic[M]):
    """One page: the items read, and those that could not be read (name → why)."""

    items: list[M]
    total: int
    next_page: int | None
    invalid: dict[str, str] = field(default_factory=dict)
    last: str | None = None  # the name of the page's last row, in the server's order
    next_after: str | None = None  # where the server says the listing goes on (keyset)


class _Envelope(msgspec.Struct):
    items: builtins.list[msgspec.Raw]  # (left encoded: decoded a slice at a time)
    total: int
    next_page: int | None = None
    next_after: str | None = None


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_rows_decoder = msgspec.json.Decoder(builtins.list[dict[str, Any]])


def _segment(text: str) -> str:
    return quote(text, safe="")


VALIDATED_PER_TURN = 100
"""Items of a page validated between two yields to the event loop at most (a 1,000-item page
of entities held the loop of the controller's process 11-60 ms in one piece, a 4 MiB page
~260 ms); fewer when they take over `TURN_SECONDS`."""
TURN_SECONDS = 0.004


def read_items(read: type[M], raw: bytes) -> ListPage[M]:
    """A page from its bytes, each item validated on its own (`invalid` names the others)."""
    page = _envelope(raw)
    try:
        rows = decode_slice(page.items, _rows_decoder, depth=None)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _not_a_page(exc) from exc
    items: builtins.list[M] = []
    invalid: dict[str, str] = {}
    _validate(read, rows, items, invalid)
    return _page(page, rows[-1] if rows else None, items, invalid)


async def read_items_sliced(read: type[M], raw: bytes) -> ListPage[M]:
    """`read_items`, letting the event loop run between slices of its items' bytes
    (`shoal.slices`: msgspec decodes in one C call holding the GIL, so in a thread a 4 MiB page
    held the loop ~20 ms all the same), and while validating them, after
    `VALIDATED_PER_TURN` items or `TURN_SECONDS`, whichever comes first."""
    page = _envelope(raw)  # (a pass that only skips the items: ~1 ms a MiB)
    items: builtins.list[M] = []
    invalid: dict[str, str] = {}
    last: dict[str, Any] | None = None
    try:
        async for rows in decoded_slices(page.items, _rows_decoder, item_bytes=None, depth=None):
            turn, since = time.perf_counter(), 0  # (a slice comes after a turn of the loop)
            for start in range(0, len(rows), 10):
                if since >= VALIDATED_PER_TURN or time.perf_counter() - turn > TURN_SECONDS:
                    await asyncio.sleep(0)
                    turn, since = time.perf_counter(), 0
                _validate(read, rows[start : start + 10], items, invalid)
                since += 10
            last = rows[-1]
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _not_a_page(exc) from exc
    return _page(page, last, items, invalid)


def _envelope(raw: bytes) -> _Envelope:
    try:
        return _envelope_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:  # not a page: the whole answer
        raise _not_a_page(exc) from exc


def _not_a_page(exc: Exception) -> CatalogError:
    return CatalogError(f"the catalog's answer is not a page this client can read: {exc}")


def _validate(
    read: type[M],
    raw_items: builtins.list[dict[str, Any]],
    items: builtins.list[M],
    invalid: dict[str, str],
) -> None:
    for item in raw_items:
        try:
            items.append(read.model_validate(item))
        except (ValidationError, RecursionError) as exc:
            name = item.get("name")
            invalid[name if isinstance(name, str) else f"#{len(invalid)}"] = _why(exc)


def _page(
    page: _Envelope,
    last_row: dict[str, Any] | None,
    items: builtins.list[M],
    invalid: dict[str, str],
) -> ListPage[M]:
    last = last_row.get("name") if last_row else None
    return ListPage(
        items,
        page.total,
        page.next_page,
        invalid,
        last if isinstance(last, str) else None,
        page.next_after,
    )


def _why(exc: Exception) -> str:
    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "item"
        return f"{where}: {first['msg']}"
    return f"{type(exc).__name__}: {exc}"[:500]


def _status_error(status: int, data: bytes) -> CatalogError:
    """The error class of `status`, with the message and param of an OpenAI-format body; a
    body that is not one (a proxy's page, a plain-text 500) still gives the status's class."""
    try:
        body = jsonlib.loads(data)
    except (ValueError, RecursionError):  # not JSON, not UTF-8
        body = None
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    message, param = error.get("message"), error.get("param")
    if not isinstance(message, str) or not message:
        text = data[:200].decode("utf-8", "replace").strip()
        message = f"HTTP {status}" + (f": {text}" if text else "")
    exc = BY_STATUS.get(status, CatalogError)(
        message, param=param if isinstance(param, str) else None
    )
    exc.status = status
    return exc


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
            data = await resp.read()
            if resp.status >= 400:
                raise _status_error(resp.status, data)
            try:
                return jsonlib.loads(data)
            except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8
                raise CatalogError(
                    f"the catalog's answer (HTTP {resp.status}) is not JSON: {exc}"
                ) from exc

    async def list(
        self,
        kind: Kind[M],
        *,
        workspace: str | None = None,
        page: int = 1,
        page_size: int = 1000,
        sort: str = "name",
        filters: dict[str, str] | None = None,
        after: str | None = None,
    ) -> ListPage[M]:
        """One page; with `after`, the first `page_size` items named after it (by name)."""
        params: builtins.list[tuple[str, str]] = [
            ("page", str(page)), ("page_size", str(page_size)), ("sort", sort)
        ]  # fmt: skip
        params += [("filter", f"{k}={v}") for k, v in (filters or {}).items()]
        if after is not None:
            params.append(("after", after))
        raw = await self._call("GET", self._url(kind, workspace), params=params, raw=True)
        return await read_items_sliced(kind.read, raw)

    async def pages(
        self,
        kind: Kind[M],
        *,
        workspace: str | None = None,
        filters: dict[str, str] | None = None,
        page_size: int = 1000,
    ) -> AsyncIterator[ListPage[M]]:
        """Every page of `kind` in name order, each read after the last name of the one
        before (keyset): an untouched row is in exactly one page whatever changes meanwhile.
        A page may end early (the server's byte budget): its `next_after` says so."""
        after: str | None = None
        while True:
            got = await self.list(
                kind, workspace=workspace, page_size=page_size, filters=filters, after=after
            )
            yield got
            full = len(got.items) + len(got.invalid) >= page_size
            if got.last is None or (got.next_after is None and not full):
                return
            after = got.next_after or got.last

    async def list_all(
        self,
        kind: Kind[M],
        *,
        workspace: str | None = None,
        filters: dict[str, str] | None = None,
        page_size: int = 1000,
    ) -> builtins.list[M]:
        """Every item of `kind` this client can read, in name order, page after page."""
        items: builtins.list[M] = []
        async for got in self.pages(
            kind, workspace=workspace, filters=filters, page_size=page_size
        ):
            items += got.items
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

    async def create_key(
        self, name: str, fields: dict[str, Any] | None = None, *, workspace: str | None = None
    ) -> KeyWithSecret:
        """Create key `name`; the answer holds its secret, which is never shown again."""
        body = {"name": name, **(fields or {})}
        return KeyWithSecret.model_validate(
            await self._call("POST", self._url(KEYS, workspace), json=body)
        )

    async def rotate_key(
        self, name: str, *, old_valid_until: str | None = None, workspace: str | None = None
    ) -> KeyWithSecret:
        """A new secret for key `name`; the current ones end at `old_valid_until` (ISO 8601;
        default: at once)."""
        url = self._url(KEYS, workspace, name)
        body = {"old_valid_until": old_valid_until}
        return KeyWithSecret.model_validate(await self._call("POST", url, json=body))

    async def record_usage(self, batch: dict[str, Any]) -> bool:
        """Send one usage batch (`{batch_id, rows}`); False if it was counted before."""
        answer = await self._call("POST", f"{self.base_url}/v1/usage", json=batch)
        return bool(answer["counted"])

    async def usage(
        self,
        *,
        key: str | None = None,
        model: str | None = None,
        start: str | None = None,
        end: str | None = None,
        group_by: str = "key",
        workspace: str | None = None,
    ) -> builtins.list[dict[str, Any]]:
        """The usage sums per `group_by` (key, model or minute), as the API answers them."""
        params = {"group_by": group_by}
        for name, value in (("key", key), ("model", model), ("from", start), ("to", end)):
            if value is not None:
                params[name] = value
        url = f"{self.base_url}/v1/workspaces/{workspace or self.workspace}/usage"
        items: builtins.list[dict[str, Any]] = (await self._call("GET", url, params=params))[
            "items"
        ]
        return items

    async def workspaces(self, *, page_size: int = 1000) -> builtins.list[Workspace]:
        """Every workspace, following `next_page`. Workspaces are only ever added: one
        added meanwhile can repeat a name across two pages (kept once), never hide one."""
        found: dict[str, Workspace] = {}
        page: int | None = 1
        while page is not None:
            params = {"page": str(page), "page_size": str(page_size)}
            body = await self._call("GET", f"{self.base_url}/v1/workspaces", params=params)
            for item in body["items"]:
                workspace = Workspace.model_validate(item)
                found.setdefault(workspace.name, workspace)
            page = body.get("next_page")
        return list(found.values())
