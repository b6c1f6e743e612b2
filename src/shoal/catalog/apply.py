"""`catalog apply`: make the resources a file declares true, and say what changed.

A file (YAML, several documents, or JSON) holds resources, each a mapping with `kind`, `name`,
an optional `workspace` and its fields. Applying is idempotent: a resource that already
matches is left alone (no write, same version), so a second apply of the same file reports
every resource `unchanged`, and concurrent applies of one file all succeed (a write that
loses a race reads the resource again and adopts it). Fields the controller owns (statuses, served models) are left as
they are unless the file names them. With `prune`, resources of the file's workspaces that the
file no longer names are deleted, except those the controller made (`autoprovisioned`), and
except API keys when the file declares no key of that workspace: a key's secret is never
applied, so a key pruned by a file of models could not be put back, and every client of it
would be locked out for good.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from shoal.bounds import MAX_DEPTH, TooDeep, check_json_depth
from shoal.catalog.client import CatalogClient
from shoal.catalog.errors import ConflictError, NotFoundError
from shoal.catalog.kinds import KEYS, KINDS, Kind, kind_named
from shoal.catalog.resources import WorkspaceName

READ_ONLY = frozenset(
    {"version", "created_at", "updated_at", "status_history", "credentials", "secret"}
)  # a key's secrets are never applied: `shoal catalog key create` / `rotate` make them
MAX_FILE_BYTES = 16 << 20
"""An apply file's bytes, at most (read no further): any valid file is far smaller."""


class NoAliasLoader(yaml.SafeLoader):
    """YAML's safe loader refusing aliases (`*name`): an alias copies a node, and nested
    aliases expand exponentially (a 497-byte file became millions of nodes, MemoryError).
    Anchors alone are harmless; a file that needs a value twice writes it twice."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(
                None, None, f"alias *{event.anchor} refused: write the value out instead",
                event.start_mark,
            )  # fmt: skip
        return super().compose_node(parent, index)


_WORKSPACE: TypeAdapter[str] = TypeAdapter(WorkspaceName)
"""A document's workspace, as the API checks it."""

ATTEMPTS = 5  # reads and writes of one resource before a race it keeps losing is an error


class ApplyError(ValueError):
    """A file that cannot be applied; the message names the document and the field."""


@dataclass(frozen=True)
class Document:
    kind: Kind[Any]
    workspace: str
    name: str
    fields: dict[str, Any]  # as written, without kind, workspace and read-only metadata
    where: str  # "document 3" for messages

    @property
    def label(self) -> str:
        return f"{self.kind.plural.rstrip('s')} {self.workspace}/{self.name}"


@dataclass(frozen=True)
class Change:
    action: str  # created, updated, unchanged, deleted
    label: str

    def __str__(self) -> str:
        return f"{self.label} {self.action}"


def parse_documents(text: str, *, workspace: str, json_only: bool = False) -> list[Document]:
    """The resources in `text`, checked against their kind's schema; a file nesting deeper
    than `MAX_DEPTH` is refused before it is parsed (YAML's block style: while it is), one
    over `MAX_FILE_BYTES` before anything, and YAML aliases as they are met."""
    if len(text) > MAX_FILE_BYTES or len(text.encode("utf-8", "replace")) > MAX_FILE_BYTES:
        raise ApplyError(f"the file is over {MAX_FILE_BYTES} bytes")
    try:
        check_json_depth(text)  # JSON, and YAML's flow style: [..] and {..}
        raw: list[Any] = (
            [json.loads(text)] if json_only else list(yaml.load_all(text, Loader=NoAliasLoader))
        )
    except TooDeep as exc:
        raise ApplyError(f"nested too deep: {exc}") from exc
    except RecursionError as exc:
        raise ApplyError(f"nested too deep to parse (the bound is {MAX_DEPTH} levels)") from exc
    except (ValueError, yaml.YAMLError) as exc:
        raise ApplyError(f"not valid {'JSON' if json_only else 'YAML'}: {exc}") from exc
    items: list[Any] = []
    for doc in raw:
        if isinstance(doc, dict) and "items" in doc and "kind" not in doc:
            doc = doc["items"]
        items.extend(doc if isinstance(doc, list) else [] if doc is None else [doc])
    documents = [_document(item, f"document {i}", workspace) for i, item in enumerate(items, 1)]
    seen: set[str] = set()
    for doc in documents:
        if doc.label in seen:
            raise ApplyError(f"{doc.where}: {doc.label} is declared twice")
        seen.add(doc.label)
    return documents


def _document(item: Any, where: str, default_workspace: str) -> Document:
    if not isinstance(item, dict):
        raise ApplyError(f"{where}: a resource is a mapping with kind and name")
    fields = {k: v for k, v in item.items() if k not in READ_ONLY}
    try:
        kind = kind_named(str(fields.pop("kind", "")))
    except KeyError as exc:
        raise ApplyError(f"{where}: kind: {exc.args[0]}") from exc
    workspace = fields.pop("workspace", default_workspace)
    if isinstance(workspace, int) and not isinstance(workspace, bool):
        workspace = str(workspace)  # (YAML reads `workspace: 12` as a number)
    try:  # checked with the file: refused by the API, the file was left half applied
        _WORKSPACE.validate_python(workspace)
    except ValidationError as exc:
        raise ApplyError(
            f"{where} ({kind.singular} {fields.get('name')!r}): workspace: {exc.errors()[0]['msg']}"
        ) from exc
    try:
        kind.create.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise ApplyError(
            f"{where} ({kind.singular} {fields.get('name')!r}): {field}: {first['msg']}"
        ) from exc
    return Document(kind, workspace, str(fields["name"]), fields, where)


def _desired(doc: Document) -> dict[str, Any]:
    """The fields the resource must have: the file's, defaults for the rest, except the
    controller's own fields when the file does not name them."""
    body = doc.kind.create.model_validate(doc.fields).model_dump(mode="json", exclude={"name"})
    return {k: v for k, v in body.items() if k not in doc.kind.managed or k in doc.fields}


async def apply_documents(
    client: CatalogClient, documents: list[Document], *, prune: bool = False
) -> list[Change]:
    """Create or update each resource to match; with `prune`, delete what is not named."""
    order = {kind.plural: i for i, kind in enumerate(KINDS)}  # referenced kinds first
    changes: list[Change] = []
    for doc in sorted(documents, key=lambda d: order[d.kind.plural]):
        changes.append(Change(await _apply_one(client, doc), doc.label))
    if prune:
        changes += await _prune(client, documents)
    return changes


async def _apply_one(client: CatalogClient, doc: Document) -> str:
    """Create, update or leave one resource. A write that loses a race (the name was just
    created, the version just bumped, the row just deleted) reads the resource again and
    starts over, so concurrent applies of one file all end well."""
    desired = _desired(doc)
    for _ in range(ATTEMPTS):
        try:
            current = await client.get(doc.kind, doc.name, workspace=doc.workspace)
        except NotFoundError:
            try:
                await client.create(
                    doc.kind, {"name": doc.name, **desired}, workspace=doc.workspace
                )
            except ConflictError:
                continue  # created meanwhile: compare with that
            return "created"
        have = current.model_dump(mode="json")
        diff = {k: v for k, v in desired.items() if have.get(k) != v}
        if not diff:
            return "unchanged"
        try:
            await client.update(
                doc.kind, doc.name, diff, version=current.version, workspace=doc.workspace
            )
        except (ConflictError, NotFoundError):
            continue  # changed or deleted meanwhile: read it again
        return "updated"
    raise ConflictError(f"{doc.label} changed under every one of {ATTEMPTS} attempts")


async def _prune(client: CatalogClient, documents: list[Document]) -> list[Change]:
    named = {doc.label for doc in documents}
    with_keys = {doc.workspace for doc in documents if doc.kind is KEYS}
    changes: list[Change] = []
    for workspace in sorted({doc.workspace for doc in documents}):
        for kind in reversed(KINDS):  # dependents first
            if kind is KEYS and workspace not in with_keys:
                continue  # (keys are pruned only by a file that declares keys: see above)
            for item in await client.list_all(kind, workspace=workspace):
                label = f"{kind.plural.rstrip('s')} {workspace}/{item.name}"
                if label in named:
                    continue
                if await _prune_one(client, kind, workspace, item):
                    changes.append(Change("deleted", label))
    return changes


async def _prune_one(client: CatalogClient, kind: Kind[Any], workspace: str, item: Any) -> bool:
    """Delete `item` unless the controller made it, with a version check; a delete that finds
    the version just bumped (the controller writes statuses all the time) reads the resource
    again and judges it afresh. False if it is kept, or was deleted by someone else."""
    for _ in range(ATTEMPTS):
        if getattr(item, "autoprovisioned", False):
            return False
        try:
            await client.delete(kind, item.name, version=item.version, workspace=workspace)
            return True
        except NotFoundError:
            return False  # deleted by someone else meanwhile: what prune wanted
        except ConflictError:
            pass  # changed meanwhile: read it again
        try:
            item = await client.get(kind, item.name, workspace=workspace)
        except NotFoundError:
            return False
    raise ConflictError(
        f"{kind.plural.rstrip('s')} {workspace}/{item.name} changed under every one of "
        f"{ATTEMPTS} attempts to prune it"
    )
