"""`Skeletons`: a chat template's output by the shape of the chat, filled with its contents.

Rendering the template is most of a chat's preparation, and most chats have a shape seen
before: the same roles (and other fields) in the same order, only the contents new. A shape's
render is made once with each content replaced by a `Placeholder`, a string holding a marker,
and the output is kept cut at the markers (the skeleton); a chat of that shape is then its
skeleton with its contents put in place of the markers: a dictionary lookup and a join.

That is the template's own output only if the template did nothing with a content but copy
it into its output. So a placeholder answers the template's questions about it from the real
content and records each question and its answer (an observation: its truth, length,
equality or containment of a constant, prefix or suffix), takes `strip`/`trim` as a content
of its own (derived, filled with the real content stripped), and refuses everything else
(slicing, iterating, splitting, any other method or filter, formatting with a width): the
render stops and the shape is rendered whole from then on. A skeleton is used for a chat only
when every observation holds for the chat's contents, else the shape is made again from it.
A content that reaches the output other than copied (a message or the messages given to
`tojson` or printed as a whole) leaves its marker escaped: its name is still there, so the
output is not cut into a skeleton and the shape is rendered whole.

Exact for what passes through the sandbox's hooks and the placeholder's own methods. Not
seen: a template computing on a copy of a content (a concatenation tested for its length),
or a content looked for inside a constant (`content in 'abc'`); such a template is misrendered,
which costs only the pick (a worker renders its own prompt, the answer is the same).

Bounded in bytes (`capacity`: the skeletons' texts and the shapes' values), least recently
used out. Thread-safe: renders run on the event loop and in the tokenizer's thread.
"""

from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NoReturn

MARK = '\x00<shoal-ph-%d&">\x00'  # changed by any escaping (HTML, JSON, URL): no marker then,
_MARKS = re.compile(r"\x00<shoal-ph-(\d+)&\">\x00")
_MANGLED = re.compile(r"\x00|shoal-ph-", re.IGNORECASE)  # but its name is still there
_PLAIN_FORMAT = re.compile(r"(?:[^%]|%%|%s)*")
ENTRY_BYTES = 400  # an entry's own objects
PART_BYTES = 60  # a part of a skeleton (its slot and a short string or an int)
DERIVING = frozenset({"strip", "lstrip", "rstrip"})
OBSERVING = frozenset({"startswith", "endswith"})
_CONTENT = "\x00content"  # a content's place in a shape
MAX_MESSAGES = 1024  # a longer chat is rendered whole: its shape is worth no more than its render


class Inspected(Exception):
    """A template did with a placeholder what its skeleton cannot stand for."""


class _Recorder:
    """One skeleton render: its placeholders' real values and what the template observed."""

    def __init__(self) -> None:
        self.values: list[str] = []
        self.derived: list[tuple[int, str, str | None] | None] = []  # (from, method, chars)
        self.observations: dict[tuple[int, str, tuple[str, ...]], Any] = {}
        self.inspected = ""

    def placeholder(self, real: str, derived: tuple[int, str, str | None] | None) -> Placeholder:
        ident = len(self.values)
        self.values.append(real)
        self.derived.append(derived)
        return Placeholder(MARK % ident, self, ident)

    def inspect(self, what: str) -> NoReturn:
        self.inspected = self.inspected or what
        raise Inspected(what)


class Placeholder(str):
    """A content in a skeleton render (see the module): its text is its marker."""

    _recorder: _Recorder
    _ident: int

    def __new__(cls, marker: str, recorder: _Recorder, ident: int) -> Placeholder:
        self = super().__new__(cls, marker)
        self._recorder = recorder
        self._ident = ident
        return self

    @property
    def real(self) -> str:
        return self._recorder.values[self._ident]

    def observe(self, op: str, args: tuple[str, ...] = ()) -> Any:
        result = _OPS[op](self.real, *args)
        self._recorder.observations[(self._ident, op, args)] = result
        return result

    def attribute(self, name: str) -> Any:
        """What the template gets for `content.<name>`."""
        if name in DERIVING:
            return lambda chars=None: self.derive(name, chars)
        if name in OBSERVING:
            return lambda fix: self.observe(name, (_plain(self, fix),))
        self._recorder.inspect(f"the template calls {name} on a content")

    def derive(self, method: str, chars: Any) -> Placeholder:
        if chars is not None and type(chars) is not str:
            self._recorder.inspect(f"{method} with {type(chars).__name__}")
        real = getattr(self.real, method)(chars)
        return self._recorder.placeholder(real, (self._ident, method, chars))

    def refuse(self, *_: Any) -> NoReturn:
        self._recorder.inspect("the template computes on a content")

    def __bool__(self) -> bool:
        return bool(self.observe("bool"))

    def __len__(self) -> int:
        return int(self.observe("len"))

    def __eq__(self, other: object) -> bool:
        return bool(self.observe("eq", (_plain(self, other),)))

    def __ne__(self, other: object) -> bool:
        return not self.observe("eq", (_plain(self, other),))

    def __contains__(self, item: object) -> bool:
        return bool(self.observe("contains", (_plain(self, item),)))

    def __format__(self, spec: str) -> str:
        if spec:
            self.refuse()
        return str.__str__(self)

    __hash__ = __iter__ = __getitem__ = __lt__ = __le__ = __gt__ = __ge__ = refuse  # type: ignore[assignment]
    __mul__ = __rmul__ = __mod__ = __rmod__ = refuse  # type: ignore[assignment]


def _plain(placeholder: Placeholder, value: Any) -> str:
    """A constant the template compares a content with: a plain string, else refused."""
    if type(value) is not str:
        placeholder.refuse()
    return value


_OPS: dict[str, Callable[..., Any]] = {
    "bool": bool,
    "len": len,
    "eq": str.__eq__,
    "contains": str.__contains__,
    "startswith": str.startswith,
    "endswith": str.endswith,
}


def has_placeholder(value: Any) -> bool:
    if isinstance(value, Placeholder):
        return True
    return isinstance(value, tuple | list) and any(isinstance(v, Placeholder) for v in value)


def checked_binop(operator: str, left: Any, right: Any) -> None:
    """In a skeleton render: refuse `*` with a content and a `%` format with a width."""
    if isinstance(left, Placeholder):
        left.refuse()
    if operator == "*" and isinstance(right, Placeholder):
        right.refuse()
    if operator == "%" and has_placeholder(right) and not _PLAIN_FORMAT.fullmatch(left):
        placeholder = (
            right
            if isinstance(right, Placeholder)
            else next(v for v in right if isinstance(v, Placeholder))
        )
        placeholder.refuse()


def filtered(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """A filter given a content: (True, its value) when the skeleton stands for it, (False,
    None) when the filter may run on the placeholder as on the content; refused otherwise."""
    found = (v for v in (*args, *kwargs.values()) if isinstance(v, Placeholder))
    placeholder: Placeholder | None = next(found, None)
    if placeholder is None:
        return False, None
    if args and args[0] is placeholder:
        if name == "trim":
            chars = args[1] if len(args) > 1 else kwargs.get("chars")
            return True, placeholder.derive("strip", chars)
        if name in ("length", "count"):
            return True, len(placeholder)
        if name == "string":
            return True, placeholder
        if name in ("default", "d"):
            return False, None  # (Undefined or, with boolean=True, its truth: observed)
    placeholder.refuse()
    raise AssertionError  # (refused)


class _Entry:
    __slots__ = ("cost", "derived", "observations", "parts")

    def __init__(
        self,
        parts: list[str | int],
        derived: list[tuple[int, str, str | None] | None],
        observations: list[tuple[int, str, tuple[str, ...], Any]],
        cost: int,
    ) -> None:
        self.parts = parts
        self.derived = derived
        self.observations = observations
        self.cost = cost

    def fill(self, contents: list[str]) -> str | None:
        """The skeleton filled with `contents`; None if an observation does not hold."""
        values = list(contents)
        for derived in self.derived[len(contents) :]:
            assert derived is not None
            source, method, chars = derived
            values.append(getattr(values[source], method)(chars))
        for ident, op, args, result in self.observations:
            if _OPS[op](values[ident], *args) != result:
                return None
        return "".join([p if isinstance(p, str) else values[p] for p in self.parts])


_WHOLE = _Entry([], [], [], ENTRY_BYTES)  # a shape its template inspects: rendered whole


class Skeletons:
    """Skeletons of one template's renders by the shape of the chat (see the module)."""

    def __init__(self, capacity: int, passed: tuple[type[Exception], ...] = ()) -> None:
        self.capacity = capacity
        self.passed = passed  # errors of a skeleton render raised as they are (its budgets)
        self.bytes = 0
        self.filled = 0  # chats made from a skeleton (for the tests and benchmarks)
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def render(self, messages: list[Any], render: Callable[[list[Any]], str]) -> str:
        """`render(messages)`'s text (the messages as `_message` makes them), from the
        skeleton of their shape when it stands for them."""
        if len(messages) > MAX_MESSAGES:
            return render(messages)
        key = _shape(messages)
        if key is None:
            return render(messages)
        contents = [m["content"] for m in messages]
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is _WHOLE:
            return render(messages)
        if entry is not None and (text := entry.fill(contents)) is not None:
            self.filled += 1
            return text
        recorder = _Recorder()
        marked = [{**m, "content": recorder.placeholder(m["content"], None)} for m in messages]
        try:
            out: str | None = render(marked)
        except Inspected:
            out = None
        except self.passed:
            raise  # (the render's budgets: the whole render would spend as much)
        except Exception:
            # The template's own error (its message may quote a content), or a refusal it
            # turned into another error: the whole render says which.
            out = None
        entry = _WHOLE if out is None or recorder.inspected else _skeleton(out, recorder)
        self._keep(key, entry, _cost(key))
        if entry is _WHOLE:
            return render(messages)
        text = entry.fill(contents)
        assert text is not None  # (its observations were made on these contents)
        self.filled += 1
        return text

    def _keep(self, key: tuple[Any, ...], entry: _Entry, key_cost: int) -> None:
        cost = entry.cost + key_cost
        if cost > self.capacity // 8:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.cost + key_cost
            self._entries[key] = entry
            self.bytes += cost
            while self.bytes > self.capacity:
                old_key, old = self._entries.popitem(last=False)
                self.bytes -= old.cost + _cost(old_key)


def _shape(messages: list[Any]) -> tuple[Any, ...] | None:
    """What a render sees of the messages but their contents (None: a message is not a
    plain mapping of hashable values, rendered whole)."""
    shape: list[tuple[Any, ...]] = []
    for message in messages:
        if type(message) is not dict or type(message.get("content")) is not str:
            return None
        fields: list[Any] = []
        for name, value in message.items():
            if name == "content":
                fields.append(_CONTENT)
            elif type(value) is str or value is None:
                fields.append((name, value))
            elif type(value) in (int, float, bool):
                fields.append((name, type(value).__name__, value))  # (1, 1.0 and True differ)
            else:
                return None
        shape.append(tuple(fields))
    return tuple(shape)


def _cost(key: tuple[Any, ...]) -> int:
    cost = sys.getsizeof(key)
    for fields in key:
        cost += sys.getsizeof(fields) + 64 * len(fields)
        for field in fields:
            if type(field) is tuple and type(field[-1]) is str:
                cost += len(field[-1])
    return cost


def _skeleton(out: str, recorder: _Recorder) -> _Entry:
    pieces = _MARKS.split(out)
    parts: list[str | int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            parts.append(int(piece))
        elif piece:
            if _MANGLED.search(piece):  # (a marker the template changed: cannot be filled)
                return _WHOLE
            parts.append(piece)
    if any(type(p) is int and p >= len(recorder.values) for p in parts):
        return _WHOLE
    observations = [(*k, v) for k, v in recorder.observations.items()]
    cost = (
        ENTRY_BYTES
        + sum(PART_BYTES + (len(p) if type(p) is str else 0) for p in parts)
        + 100 * (len(observations) + len(recorder.derived))
    )
    return _Entry(parts, list(recorder.derived), observations, cost)
