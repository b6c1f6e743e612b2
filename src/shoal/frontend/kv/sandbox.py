"""`BoundedSandbox`: the `jinja2` sandbox a worker's chat template is rendered in, bounding
work, not only access (`shoal.frontend.kv.prompt` renders with it).

Every loop iteration, call and attribute read checks a deadline; every string built (`*`,
`+`, `~`, `%`, string methods and filters) is held to a size limit, before it is built where
its size can be foreseen. One C-level call runs to its end holding the GIL (and with it the
frontend's event loop, whichever thread renders), so a method, filter or test not known
linear and quick in C on a string (`QUICK_OPS`), or not taking a list or dict a step at a
time (`ITEM_OPS`), is given no value over `OP_BOUND` characters or items: `wordcount`,
`wordwrap`, `sort` or `tojson` of a million of them are refused before they run. Likewise no
integer over `INT_BITS` is made or used, refused before the arithmetic that would make it:
`a ** 8` of `a = ((10 ** 60) ** 60) ** 60` is one C multiplication of a second, and
arithmetic on, or printing, such numbers is quadratic in their digits.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from types import BuiltinMethodType
from typing import Any, cast

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shoal.frontend.kv.chain import Deferred
from shoal.frontend.kv.sizes import built, chars, int_bits, wide

RENDER_SECONDS = 0.5  # a template's time budget for one chat
MAX_TEXT = 1 << 20  # characters: what a render keeps, and (beyond the chat's own) any string
OP_BOUND = 1 << 16  # characters or items: the most an operation not known quick is given
INLINE_SECONDS = 0.002  # CPU time of a render on the event loop
INLINE_OP = 4096  # and the most an operation not known quick is given there
INT_BITS = 1 << 15  # bits: the largest integer a template makes or uses (~9,900 digits)
QUICK_OPS = frozenset(
    [
        "strip",
        "lstrip",
        "rstrip",
        "startswith",
        "endswith",
        "lower",
        "upper",
        "split",
        "rsplit",
        "splitlines",
        "replace",
        "join",
        "find",
        "rfind",
        "count",
        "capitalize",
        "partition",
        "rpartition",
        "trim",
        "length",
        "string",
        "default",
        "d",
        "first",
        "last",
        "tojson",
        "safe",
        "escape",
        "e",
        "int",
        "float",
        "abs",
        "format",
        "format_map",
    ]
)
"""On a string: methods, filters and tests that run in C, in time linear in it (or less)."""
ITEM_OPS = frozenset(
    [
        "length",
        "first",
        "last",
        "default",
        "d",
        "list",
        "reverse",
        "items",
        "keys",
        "values",
        "get",
        "map",
        "select",
        "reject",
        "selectattr",
        "rejectattr",
        "Namespace",
    ]
)
"""On a list, tuple or dict: calls that take it whole in constant time or go through it a
step at a time in Python (each step checked, the GIL given up between them); any other
(printing, `string`, `tojson`, `join`, `sort`, `sum`, ...) converts or compares it whole in
C. Every test is quick on a string, and on a list or dict but those comparing or printing
it (`COMPARING_TESTS`)."""
COMPARING_TESTS = frozenset(["in", "lower", "upper", "eq", "equalto", "ne", "gt", "ge", "lt", "le"])
COMPARING_TESTS |= {"==", "!=", ">", ">=", "<", "<=", "greaterthan", "lessthan"}
BOUNDED_ITER = "__bounded_iter"  # the filter every loop's iterable goes through
BOUNDED_TEXT = "__bounded_text"  # and every piece of a `~` concatenation
_DICT_ATTRIBUTES = frozenset(dir(dict))
_STR_METHODS = frozenset(n for n in dir(str) if not n.startswith("_")) - {"format", "format_map"}


class TemplateOverrun(jinja2.TemplateError):
    """A template exceeded its time or size budget (disabled for its model, unless the
    chat's own size explains it)."""


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """A sandbox that bounds work, not only access: each `render` has a deadline, checked
    at every loop iteration, call and attribute read, and a size limit no string it builds
    may pass (the chat's own size and `MAX_TEXT` more); its output is cut at `MAX_TEXT`. An
    operation not known quick on a long value (`QUICK_OPS`, `ITEM_OPS`) is not given one over
    `OP_BOUND` (`INLINE_OP` inline), printing a list or dict included; no integer over
    `INT_BITS` is made or used (arithmetic on them is quadratic, printing them too)."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "-", "//", "/"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=self._printed)
        self._local = threading.local()
        self.globals.pop("lipsum", None)  # builds as much text as asked
        self.globals["range"] = self._range
        self.globals["raise_exception"] = _raise
        for name, fn in list(self.filters.items()):
            self.filters[name] = self._bounded_filter(fn, name)
        # (filters, not globals: a filter is called directly, a global through `call`)
        self.filters[BOUNDED_ITER] = self._iter
        self.filters[BOUNDED_TEXT] = self._text
        for name, fn in list(self.tests.items()):
            test = cast(Callable[..., Any], fn)
            self.tests[name] = self._bounded_filter(test, name, True, name not in COMPARING_TESTS)

    def render(
        self,
        template: jinja2.Template,
        deadline: float,
        limit: int,
        inline: bool = False,
        /,
        **context: Any,
    ) -> str:
        """`template` rendered with `context`: at most `MAX_TEXT` characters are kept (the
        render stops there), `TemplateOverrun` past `deadline` or a string over `limit`.
        `TemplateOverrun` too for an operation not known quick given a value over `OP_BOUND`.
        `inline`: `INLINE_SECONDS` of CPU time instead of `deadline`, `Deferred` for an
        operation not known quick on a value over `INLINE_OP`, `TemplateOverrun` for an
        output over `limit` (the caller defers it)."""
        self._local.limit = limit
        self._local.inline = inline
        if inline:  # the budget is the loop thread's CPU time, checked when the clock's is out
            self._local.deadline = time.monotonic() + INLINE_SECONDS
            self._local.cpu_deadline = time.thread_time() + INLINE_SECONDS
        else:
            self._local.deadline = deadline
        out: list[str] = []
        size = 0
        try:
            # (`template.generate` but for its second generator and traceback rewriting)
            for chunk in template.root_render_func(template.new_context(context)):
                out.append(chunk)
                size += len(chunk)
                if size >= MAX_TEXT or (inline and size > limit):
                    if inline:
                        raise TemplateOverrun("an inline render's output is too long")
                    break
                if not len(out) % 32:  # (every loop, call and lookup checks too)
                    self.check()
        finally:
            self._local.deadline = None
            self._local.limit = MAX_TEXT
            self._local.inline = False
            self._local.cpu_deadline = None
        return "".join(out)[:MAX_TEXT]

    @property
    def limit(self) -> int:
        """No string the render in progress builds may be longer."""
        limit: int = getattr(self._local, "limit", MAX_TEXT)
        return limit

    def check(self) -> None:
        deadline = getattr(self._local, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            cpu = getattr(self._local, "cpu_deadline", None)
            if cpu is not None and (spent := time.thread_time()) < cpu:
                # Inline: the process was preempted, the template did not use the time.
                self._local.deadline = time.monotonic() + cpu - spent
                return
            raise TemplateOverrun(f"the chat template ran past {RENDER_SECONDS:g}s")

    def _check_op(
        self, name: str, args: Iterable[Any], text_ok: bool, items_ok: bool = False
    ) -> None:
        """Refuse to give operation `name` a string (unless `text_ok`: it is linear in C on
        one) or a list, tuple or dict (unless `items_ok`: it takes one a step at a time)
        over `OP_BOUND` characters or items (a list by the characters and items it holds):
        one C call on it would hold the GIL, so the event loop, too long. Inline: over
        `INLINE_OP`, and `Deferred` (the thread's render will judge)."""
        inline = getattr(self._local, "inline", False)
        bound = INLINE_OP if inline else OP_BOUND
        for value in args:
            if isinstance(value, str):
                size = 0 if text_ok else len(value)
            elif isinstance(value, list | tuple | dict):
                size = 0 if items_ok else chars(value, bound)
            elif isinstance(value, int):
                _check_int(value.bit_length())
                continue
            else:
                continue
            if size > bound:
                if inline:
                    raise Deferred
                raise TemplateOverrun(
                    f"the chat template gave {name} over {bound} characters or items"
                )

    # -- hooks every template's code goes through -------------------------------------

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        __self.check()
        target = getattr(__obj, "__self__", None)
        limit = __self.limit
        name = getattr(__obj, "__name__", "")
        _check_growth(name, (target, *args), kwargs, limit)
        if target is not __self and not isinstance(__obj, jinja2.runtime.Macro):
            # (this sandbox's own hooks and a macro's steps are checked themselves)
            values = (target, *args, *kwargs.values())
            __self._check_op(name, values, name in QUICK_OPS, name in ITEM_OPS)
        if type(target) is str and type(__obj) is BuiltinMethodType:
            # A string's own method (`strip`): safe to call, given no context (what
            # `Context.call` does for it, but for the lookups that find it needs none).
            kwargs.pop("_block_vars", None)
            kwargs.pop("_loop_vars", None)
            return _bounded(__obj(*args, **kwargs), limit)
        return _bounded(super().call(__context, __obj, *args, **kwargs), limit)

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.check()
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES and attribute in obj:
            # (what the sandbox gives, without its failed `getattr` first: a message's key)
            return obj[attribute]
        if type(obj) is str and attribute in _STR_METHODS:  # (what the sandbox gives too)
            return getattr(obj, attribute)
        return super().getattr(obj, attribute)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`str.format`/`format_map`, as read (`s.format`, `s['format']`): refused when wide."""
        wrapped = super().wrap_str_format(value)
        if wrapped is not None and wide(value.__self__, "{"):
            raise TemplateOverrun("the chat template asked for too wide a format")
        return wrapped

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.check()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        self.check()
        if operator == "+" and type(left) is str and type(right) is str:  # (the usual one)
            if len(left) + len(right) > self.limit:
                raise TemplateOverrun("the chat template built too large a sequence")
            return left + right
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise TemplateOverrun("the chat template raised a number to a large power")
        if isinstance(left, int) or isinstance(right, int):
            _check_int(int_bits(operator, left, right))
        if operator == "%" and isinstance(left, str):
            if wide(left, "%"):
                raise TemplateOverrun("the chat template asked for too wide a format")
            self._check_op("%", right if isinstance(right, tuple) else (right,), True)
        if built(operator, left, right, self.limit) > self.limit:
            raise TemplateOverrun("the chat template would build too large a sequence")
        return _bounded(super().call_binop(context, operator, left, right), self.limit)

    def _range(self, *args: int) -> Iterator[int]:
        if len(range(*args)) > MAX_TEXT:
            raise TemplateOverrun("the chat template asked for too large a range")
        return self._iter(range(*args))

    def _iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        self.check()
        for item in iterable:
            self.check()
            yield item

    def _text(self, value: Any) -> Any:
        """A piece of a `~` concatenation (printed there)."""
        self.check()
        self._check_op("~", (value,), True)
        return _bounded(value, self.limit)

    def _printed(self, value: Any) -> Any:
        """What `{{ ... }}` prints (`finalize`)."""
        if type(value) is not str:  # (a string is printed in time linear in it)
            self._check_op("print", (value,), True)
        return value

    def _bounded_filter(
        self,
        fn: Callable[..., Any],
        name: str = "",
        text_ok: bool | None = None,
        items_ok: bool | None = None,
    ) -> Callable[..., Any]:
        """Filter (or test) `fn`, named `name` (by default its function's name), checked
        before it runs: `text_ok` and `items_ok` as `_check_op` takes them (by default,
        whether `name` is in `QUICK_OPS`, `ITEM_OPS`)."""
        name = name or fn.__name__.removeprefix("do_")
        text_ok = name in QUICK_OPS if text_ok is None else text_ok
        items_ok = name in ITEM_OPS if items_ok is None else items_ok

        @functools.wraps(fn)
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self.check()
            text = [i for i, a in enumerate(args) if isinstance(a, str)][:1]  # the filtered value
            limit = self.limit
            _check_growth(name, args[text[0] :] if text else (None, *args), kwargs, limit)
            self._check_op(name, (*args, *kwargs.values()), text_ok, items_ok)
            return _bounded(fn(*args, **kwargs), limit)

        return bounded

    def make_globals(self, d: MutableMapping[str, Any] | None) -> MutableMapping[str, Any]:
        """A template's globals as one plain dict (jinja's `ChainMap` is walked twice per
        render): this environment's are set once, in `__init__`, and a template cannot
        change either."""
        return {**self.globals, **(d or {})}

    # -- every loop and concatenation goes through the hooks above ----------------------

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = _filter(BOUNDED_ITER, cast(nodes.Expr, loop.iter))
        for concat in list(tree.find_all(nodes.Concat)):
            concat.nodes = [_filter(BOUNDED_TEXT, n) for n in concat.nodes]
        return tree


def _filter(name: str, node: nodes.Expr) -> nodes.Expr:
    """`node|name` as a template expression."""
    expr = nodes.Filter(node, name, [], [], None, None)
    expr.set_lineno(node.lineno)
    return expr


def _check_growth(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> None:
    """Refuse, before it runs, a call that would build more than `limit` characters: any
    count above it, or a string method (or filter) `name` on `args[0]` growing it past it."""
    for value in (*args, *kwargs.values()):
        if type(value) is int and value > limit:
            raise TemplateOverrun(f"the chat template asked for over {limit} of something")
    target, rest = args[0], args[1:]
    if not isinstance(target, str):
        return
    size = len(target)
    if (
        name == "replace"
        and len(rest) >= 2
        and isinstance(rest[0], str)
        and isinstance(rest[1], str)
    ):
        old, new = rest[0], rest[1]
        count = size + 1 if not old else target.count(old)
        size += count * max(0, len(new) - len(old))
    elif name == "expandtabs":
        tab = rest[0] if rest and isinstance(rest[0], int) else kwargs.get("tabsize", 8)
        size += target.count("\t") * tab if isinstance(tab, int) else 0
    elif name == "indent":
        width = rest[0] if rest else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width
        size += (target.count("\n") + 1) * width if isinstance(width, int) else 0
    elif name == "format" and wide(target, "%"):
        size = limit + 1
    elif name == "translate" and rest:  # (each character may become the longest value)
        table = rest[0]
        values = table.values() if isinstance(table, dict) else table
        if isinstance(values, str) or not isinstance(values, Iterable):
            longest = 1
        else:
            longest = max((len(v) for v in values if isinstance(v, str)), default=1)
        size *= max(1, longest)
    if size > limit:
        raise TemplateOverrun(f"the chat template would build {size} characters with {name}")


def _check_int(bits: int) -> None:
    """Refuse an integer of `bits` (made or used): over `INT_BITS`, one C-level operation
    on it (`*`, `//`, `str`) would hold the GIL, so the event loop, too long."""
    if bits > INT_BITS:
        raise TemplateOverrun(f"the chat template would use an integer of {bits} bits")


def _bounded(value: Any, limit: int) -> Any:
    if isinstance(value, str | list | tuple):
        if len(value) > limit:
            raise TemplateOverrun("the chat template built too large a sequence")
    elif isinstance(value, int):
        _check_int(value.bit_length())
    return value


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
