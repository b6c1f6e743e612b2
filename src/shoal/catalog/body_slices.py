"""A large body's long list decoded and validated on the event loop a slice at a time.

`json.loads` is one C call that holds the GIL, so the catalog's decoding thread (`api._DECODER`)
did not spare the event loop: a usage batch of 1 MiB held it ~6-10 ms all the same. A body
model that names one of its list fields in `validated_in_slices` (`UsageBatch.rows`) is read
here instead: its members once with their values left encoded (one pass that only skips
them), the other members decoded and validated as one small body, then the list's items
decoded and validated `SLICE_BYTES` at a time (`shoal.slices.decoded_slices`), yielding to the
loop before each slice. What the slices cannot tell is valid (a refused field, what msgspec
refuses and `json.loads` takes, a body nesting too deep) gives None: the caller then decodes
the body whole, for the very answer it gave before.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, cast

import msgspec
from pydantic import BaseModel, TypeAdapter, ValidationError

from shoal.bounds import MAX_DEPTH, TooDeep, json_depth_exceeds
from shoal.slices import ItemTooLarge, decoded_slices

SLICE_BYTES = 16 << 10
"""Bytes of items decoded and validated in one step on the event loop at most (16 KiB of a
usage batch: ~80 rows, ~0.5 ms of pydantic)."""

_MEMBERS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_VALUES = msgspec.json.Decoder(list[Any])


def sliced_field(model: Any) -> str | None:
    """The list field of `model` (a body's type) validated in slices, if it names one."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    name = getattr(model, "validated_in_slices", None)
    return name if name in model.model_fields else None


async def validated_in_slices(body: bytes, field: Any, name: str) -> Any:
    """`body` validated as FastAPI's body `field` (a model with the list field `name`), its
    list's items a slice at a time with a yield to the loop before each; None when it may be
    invalid (the caller decodes it whole for the answer)."""
    model = field.field_info.annotation
    try:
        members = _MEMBERS.decode(body)
        items = _ITEMS.decode(members.pop(name))
    except (msgspec.DecodeError, KeyError):
        return None
    if sum(map(len, members.values())) > SLICE_BYTES or len(items) > _most(model, name):
        return None
    try:
        rest = {key: _value(raw) for key, raw in members.items()}
    except (ValueError, TooDeep):
        return None
    valid, errors = field.validate({**rest, name: []}, {}, loc=("body",))
    if errors:
        return None
    adapter = _adapter(model, name)
    values: list[Any] = []
    # in the body an item sits two levels down (its object, the list); in a slice one
    slices = cast(
        AsyncGenerator[list[Any], None],
        decoded_slices(
            items, _VALUES, slice_bytes=SLICE_BYTES, item_bytes=SLICE_BYTES, depth=MAX_DEPTH - 1
        ),
    )
    try:
        async with aclosing(slices):
            async for piece in slices:
                values += _validated(adapter, piece)
    except (msgspec.DecodeError, ItemTooLarge, TooDeep, ValidationError):
        return None
    setattr(valid, name, values)
    return valid


def _value(raw: msgspec.Raw) -> Any:
    """A member as `json.loads` decodes it, `TooDeep` when it nests too deep for the body."""
    if json_depth_exceeds(raw, MAX_DEPTH - 1):  # (the body's object is one level)
        raise TooDeep(MAX_DEPTH)
    return json.loads(bytes(raw))


def _validated(adapter: TypeAdapter[list[Any]], items: list[Any]) -> list[Any]:
    """One slice of items validated, as FastAPI validates a body."""
    return adapter.validate_python(items, from_attributes=True)


@functools.cache
def _adapter(model: type[BaseModel], name: str) -> TypeAdapter[list[Any]]:
    return TypeAdapter(cast(Any, model.model_fields[name].annotation))


def _most(model: type[BaseModel], name: str) -> float:
    """The items the list field `name` may have (its `max_length`, which pydantic keeps in
    the field's metadata)."""
    bounds = [getattr(m, "max_length", None) for m in model.model_fields[name].metadata]
    return min((bound for bound in bounds if isinstance(bound, int)), default=float("inf"))
