"""The discovery key layout, a public contract (see DESIGN.md, "Discovery keys").

shoal/v1/instances/{namespace}/{component}/{endpoint}/{instance_id:x}        -> endpoint instance
shoal/v1/models/{namespace}/{component}/{endpoint}/{instance_id:x}           -> base model card
shoal/v1/models/{namespace}/{component}/{endpoint}/{instance_id:x}/{suffix}  -> LoRA adapter card
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from shoal.store import MAX_KEY_BYTES

ROOT = "shoal/v1/"
INSTANCES = ROOT + "instances/"
MODELS = ROOT + "models/"

# (`fullmatch`: `$` would also match before a trailing newline, letting "abc\n" through.)
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_SUFFIX_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
QUOTED_CHARS = 64
"""The most characters of an outside value an error message quotes (then its length)."""


def quoted(value: str, limit: int = QUOTED_CHARS) -> str:
    """`value` as `repr` shows it, cut to its first `limit` characters and its length when
    longer: an error about a 1 MB value must not carry it into status, health and logs."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value):,} characters)"


def check_name(kind: str, value: str) -> str:
    """Namespaces, components and endpoints: letters, digits, `_` and `-`."""
    if not _NAME_RE.fullmatch(value):
        raise ValueError(
            f"invalid {kind} {quoted(value)}: use letters, digits, '_' and '-' (max 64)"
        )
    return value


def check_suffix(value: str) -> str:
    if not _SUFFIX_RE.fullmatch(value):
        raise ValueError(
            f"invalid adapter suffix {quoted(value)}: use letters, digits, '.', '_' and '-'"
        )
    return value


@dataclass(frozen=True, slots=True, order=True)
class EndpointId:
    """`namespace.component.endpoint`: where a worker serves."""

    namespace: str
    component: str
    endpoint: str

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)
        check_name("component", self.component)
        check_name("endpoint", self.endpoint)

    @classmethod
    def parse(cls, dotted: str) -> EndpointId:
        parts = dotted.split(".")
        if len(parts) != 3:
            raise ValueError(f"invalid endpoint {dotted!r}: expected namespace.component.endpoint")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.namespace}.{self.component}.{self.endpoint}"

    @property
    def path(self) -> str:
        return f"{self.namespace}/{self.component}/{self.endpoint}"


@dataclass(frozen=True, slots=True)
class ModelKey:
    """One model served by one endpoint instance: the base model (suffix None) or an adapter.

    `key` is its store key, made once: readers index a fleet's cards by it, and keys sort
    in store order (the base model before its adapters), so passes over them are
    deterministic. It hashes as its store key (a string caches its hash).
    """

    endpoint: EndpointId
    instance_id: int
    suffix: str | None = None
    key: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        key = f"{MODELS}{self.endpoint.path}/{self.instance_id:x}"
        object.__setattr__(self, "key", key if self.suffix is None else f"{key}/{self.suffix}")

    def __hash__(self) -> int:
        return hash(self.key)

    def __lt__(self, other: ModelKey) -> bool:
        return self.key < other.key

    def sort_key(self) -> str:
        """The order of keys (their store keys): `sorted(keys, key=ModelKey.sort_key)`."""
        return self.key

    @property
    def instance_key(self) -> str:
        """The store key of its endpoint instance."""
        key = self.key
        end = len(key) if self.suffix is None else len(key) - len(self.suffix) - 1
        return INSTANCES + key[len(MODELS) : end]

    def __str__(self) -> str:
        s = f"{self.endpoint}/{self.instance_id:x}"
        return s if self.suffix is None else f"{s}/{self.suffix}"


def instance_key(endpoint: EndpointId, instance_id: int) -> str:
    return f"{INSTANCES}{endpoint.path}/{instance_id:x}"


@functools.lru_cache(maxsize=4096)
def _endpoint(namespace: str, component: str, endpoint: str) -> EndpointId:
    """One validated `EndpointId` per name: keys are parsed by the thousand on every listing."""
    return EndpointId(namespace, component, endpoint)


def parse_instance_id(text: str) -> int:
    """An instance id as keys spell it: lowercase hex with no leading zeros (`2a`, never
    `002A`), so that one instance has exactly one key and an alias can never shadow it.
    It is a lease id: 64 bits at most (16 digits)."""
    if len(text) > 16:
        raise ValueError(f"instance id {quoted(text)} is longer than 64 bits")
    value = int(text, 16)
    if value < 0 or f"{value:x}" != text:
        raise ValueError(f"instance id {text!r} is not canonical lowercase hex ({value:x})")
    return value


def check_key_size(key: str) -> None:
    """ValueError for a key over the stores' bound (`MAX_KEY_BYTES`): another writer's (etcd
    takes keys up to its request bound, 1.5 MiB), refused before it is parsed."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key):,} characters, over the {MAX_KEY_BYTES}-byte bound")


def parse_model_key(key: str) -> ModelKey:
    """Inverse of `ModelKey.key`; raises ValueError naming the key if it does not fit."""
    check_key_size(key)
    if not key.startswith(MODELS):
        raise ValueError(f"not a model key: {quoted(key, 200)}")
    parts = key[len(MODELS) :].split("/")
    if len(parts) not in (4, 5):
        raise ValueError(f"malformed model key {quoted(key, 200)}")
    try:
        endpoint = _endpoint(*parts[:3])
        instance_id = parse_instance_id(parts[3])
        suffix = check_suffix(parts[4]) if len(parts) == 5 else None
    except ValueError as exc:
        raise ValueError(f"malformed model key {quoted(key, 200)}: {exc}") from None
    return ModelKey(endpoint, instance_id, suffix)


def parse_instance_key(key: str) -> tuple[EndpointId, int]:
    check_key_size(key)
    if not key.startswith(INSTANCES):
        raise ValueError(f"not an instance key: {quoted(key, 200)}")
    parts = key[len(INSTANCES) :].split("/")
    if len(parts) != 4:
        raise ValueError(f"malformed instance key {quoted(key, 200)}")
    try:
        return _endpoint(*parts[:3]), parse_instance_id(parts[3])
    except ValueError as exc:
        raise ValueError(f"malformed instance key {quoted(key, 200)}: {exc}") from None


@dataclass(frozen=True, slots=True)
class Query:
    """Which part of discovery to read: everything, or a namespace, component or endpoint."""

    namespace: str | None = None
    component: str | None = None
    endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.component is not None and self.namespace is None:
            raise ValueError("a query by component needs its namespace")
        if self.endpoint is not None and self.component is None:
            raise ValueError("a query by endpoint needs its component")

    def _path(self) -> str:
        parts = [p for p in (self.namespace, self.component, self.endpoint) if p is not None]
        return "".join(p + "/" for p in parts)

    @property
    def models_prefix(self) -> str:
        return MODELS + self._path()

    @property
    def instances_prefix(self) -> str:
        return INSTANCES + self._path()
