"""The catalog's resources as pydantic models: what a client sends and what it reads back.

Each kind has a spec (the fields a user or the controller sets), a create body (spec + name),
a patch body (every spec field optional, plus the `version` it expects) and a read model
(spec + name, workspace, version and timestamps). Secrets appear only by name: a provider's
`auth_secret` names a secret the frontend resolves itself, and no field can carry its value.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    create_model,
    field_validator,
)
from pydantic.fields import FieldInfo

from shoal.bounds import MAX_DEPTH, TooDeep, check_json_depth

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+/-]*$"
WORKSPACE_PATTERN = r"^[a-z0-9][a-z0-9-]*$"
SECRET_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

# Bounds that keep whatever the API accepts carriable by everything downstream:
FREE_FORM_DEPTH = MAX_DEPTH // 2
"""Nesting of a free-form field (`spec`, `engine_args`): any document carrying a row (a list
page, an apply file) stays within `shoal.bounds.MAX_DEPTH`, which every decoder checks."""
FREE_FORM_BYTES = 64 * 1024
"""A free-form field as UTF-8 JSON: `engine_args` become a worker's flags, far under the OS
limits on its command line (128 KiB per argument, 2 MiB in all)."""
ENGINE_ARGS_COUNT = 100
DEPLOYMENT_NAME_LENGTH = 150
"""A deployment's worker log files (`{workspace}-{name}-{replica}.log`) stay under 255 bytes,
and its provider `deployment-{name}` is a valid name."""
TARGETS_LENGTH = 100
BASE_URL_LENGTH = 2048
"""With `TARGETS_LENGTH`, a route stays under a third of the store's 1 MiB value limit per
provider serving each target entity (tests/catalog/test_api_limits.py builds the largest)."""


def _no_dot_segments(name: str) -> str:
    """Refuse `.` and `..` between slashes: a URL holding them addresses another name."""
    if any(segment in (".", "..") for segment in name.split("/")):
        raise ValueError("a '.' or '..' segment is refused (its URL would name another resource)")
    return name


def _free_form(value: dict[str, Any]) -> dict[str, Any]:
    """Refuse a free-form value over `FREE_FORM_DEPTH` levels or `FREE_FORM_BYTES`."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except RecursionError:  # only a value built in Python gets here: bodies are bounded first
        raise TooDeep(FREE_FORM_DEPTH) from None
    check_json_depth(text, FREE_FORM_DEPTH)  # the field's own object is level 1
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > FREE_FORM_BYTES:
        raise ValueError(f"{size} bytes as JSON, over the {FREE_FORM_BYTES}-byte limit")
    return value


def _no_credentials(url: str | None) -> str | None:
    """Refuse userinfo (`user:password@`) in a URL; the message never repeats the URL."""
    if url is not None and "@" in urlsplit(url).netloc:
        raise ValueError(
            "credentials in the URL are refused: name the secret holding them in auth_secret"
        )
    return url


def _no_query(url: str | None) -> str | None:
    """Refuse a query or a fragment in a base URL: the gateway never sends them to the
    provider (requests go to `{base_url}/chat/completions`), and a `?key=` is a secret."""
    if url is not None and ("?" in url or "#" in url):
        raise ValueError(
            "a query or fragment in base_url is refused: it is never sent to the provider "
            "(name the secret holding a key in auth_secret)"
        )
    return url


Name = Annotated[str, Field(min_length=1, max_length=200, pattern=NAME_PATTERN)]
ResourceName = Annotated[Name, AfterValidator(_no_dot_segments)]  # a new resource's own name
DeploymentName = Annotated[
    str,
    Field(min_length=1, max_length=DEPLOYMENT_NAME_LENGTH, pattern=NAME_PATTERN),
    AfterValidator(_no_dot_segments),
]
FreeForm = Annotated[dict[str, Any], AfterValidator(_free_form)]
WorkspaceName = Annotated[str, Field(min_length=1, max_length=63, pattern=WORKSPACE_PATTERN)]
Text = Annotated[str, Field(max_length=4000)]
Version = Annotated[StrictInt, Field(ge=1, le=2**62)]
Flag = StrictBool  # JSON true/false only: 0 and "yes" are refused


class Strict(BaseModel):
    """Unknown fields are refused (422 naming them): a typo never silently does nothing."""

    model_config = ConfigDict(extra="forbid")


class Meta(BaseModel):
    """What the catalog keeps about every row: its name, workspace and version."""

    name: str
    workspace: str
    version: int = Field(description="bumped by every change; send it back to update safely")
    created_at: datetime
    updated_at: datetime


class ProviderStatus(StrEnum):
    CREATED = "CREATED"
    READY = "READY"
    ERROR = "ERROR"
    LOST = "LOST"


class ServedModel(Strict):
    model_entity: Name
    served_model_name: Annotated[str, Field(min_length=1, max_length=400)]


class ProviderSpec(Strict):
    """Where inference is served: an OpenAI-compatible URL, or models in a fleet namespace."""

    type: Literal["url", "fleet"] = Field(
        description="url: an OpenAI-compatible base_url; fleet: models in shoal discovery"
    )
    base_url: (
        Annotated[
            str,
            Field(max_length=BASE_URL_LENGTH, pattern=r"^https?://\S+$"),
            AfterValidator(_no_credentials),
            AfterValidator(_no_query),
        ]
        | None
    ) = Field(
        None,
        validate_default=True,
        description="required for type url, refused for fleet; no credentials (auth_secret)",
    )
    auth_secret: Annotated[str, Field(max_length=200, pattern=SECRET_PATTERN)] | None = Field(
        None, description="the name of a secret the frontend resolves; never its value"
    )
    namespace: Annotated[str, Field(max_length=200, pattern=NAME_PATTERN)] | None = None
    enabled_models: list[Annotated[str, Field(max_length=400)]] | None = Field(
        None, max_length=10000, description="allow-list of served model names; null allows all"
    )
    description: Text = ""
    autoprovisioned: Flag = Field(False, description="made by the controller, not a user")
    status: ProviderStatus = ProviderStatus.CREATED
    status_message: Text = ""
    served_models: list[ServedModel] | None = Field(
        None, max_length=100000, description="written by the models controller"
    )

    @field_validator("base_url")
    @classmethod
    def _base_url_for_kind(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("type")
        if kind == "url" and not value:
            raise ValueError("required when type is url")
        if kind == "fleet" and value:
            raise ValueError("only for type url (a fleet provider serves from discovery)")
        return value


class ModelSpec(Strict):
    """A model entity: one model, whoever serves it."""

    description: Text = ""
    base_model: Annotated[str, Field(max_length=400)] = ""
    format: Annotated[str, Field(max_length=100)] = ""
    context_length: Annotated[StrictInt, Field(ge=1, le=100_000_000)] | None = None
    providers: list[Annotated[str, Field(max_length=300, pattern=r"^[^/\s]+/\S+$")]] = Field(
        default_factory=list, max_length=10000, description='providers serving it, "workspace/name"'
    )
    spec: FreeForm = Field(
        default_factory=dict, description=f"free-form, at most {FREE_FORM_DEPTH} levels deep"
    )
    autoprovisioned: Flag = Field(False, description="made by the controller, not a user")


class Target(Strict):
    model_entity: Name
    weight: Annotated[StrictInt, Field(ge=0, le=1_000_000)] = 1


class VirtualModelSpec(Strict):
    """A public name served by the gateway, routed to a model entity or weighted targets."""

    description: Text = ""
    default_model: Name
    targets: list[Target] = Field(default_factory=list, max_length=TARGETS_LENGTH)
    autoprovisioned: Flag = Field(False, description="made by the controller, not a user")
    status_message: Text = Field(
        "", description="written by the models controller: why its route is not published"
    )


class DeploymentStatus(StrEnum):
    CREATED = "CREATED"
    PENDING = "PENDING"
    READY = "READY"
    DELETING = "DELETING"
    DELETED = "DELETED"
    ERROR = "ERROR"


class StatusChange(BaseModel):
    status: DeploymentStatus
    message: str
    at: datetime


class DeploymentSpec(Strict):
    """Run `replicas` workers of a model with an engine, in a discovery namespace."""

    model: Annotated[str, Field(min_length=1, max_length=400)]
    engine: Literal["mocker", "openai", "llamacpp"]
    engine_args: FreeForm = Field(
        default_factory=dict,
        max_length=ENGINE_ARGS_COUNT,
        description="flags of `shoal worker`: {speedup: 0} is --speedup 0",
    )
    replicas: Annotated[StrictInt, Field(ge=0, le=10000)] = 1
    namespace: Annotated[str, Field(max_length=200, pattern=NAME_PATTERN)] = "default"
    description: Text = ""
    status: DeploymentStatus = DeploymentStatus.CREATED
    status_message: Text = ""


Limit = Annotated[StrictInt, Field(ge=1, le=10**12)]


_NUMBER = re.compile(r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$")


def _iso_time(value: Any) -> Any:
    """A time is an ISO 8601 string, as the schema says: a bare number is refused."""
    if isinstance(value, int | float) or (isinstance(value, str) and _NUMBER.match(value)):
        raise ValueError("a time is an ISO 8601 string, e.g. 2030-01-01T00:00:00Z")
    return value


def _utc(moment: datetime) -> datetime:
    """A time without an offset is UTC (as `rotate` always read it): beside an aware time a
    naive one cannot even be compared, so a key's grants could not be computed at all."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


Time = Annotated[datetime, BeforeValidator(_iso_time), AfterValidator(_utc)]


KEY_MODELS_BYTES = 512 * 1024
"""A key's `models` as UTF-8 JSON: every live secret of the key is a grant carrying them in one
store value (1 MiB); at the 1 MiB body bound, in 4-byte characters, they made a grant the store
refused, so the key could never be used."""


def _models_within(models: list[str]) -> list[str]:
    size = len(json.dumps(models, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > KEY_MODELS_BYTES:  # (a row stored over it cannot be read: its grants are kept)
        raise ValueError(f"{size} bytes as JSON, over the {KEY_MODELS_BYTES}-byte limit")
    return models


class KeySpec(Strict):
    """An API key of the workspace: which models it may use and how fast. The secret is
    never a field: the catalog makes it on create and rotate, shows it once, keeps its hash."""

    description: Text = ""
    models: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=400)]], AfterValidator(_models_within)
    ] = Field(
        default_factory=list,
        max_length=1000,
        description="served names (virtual or fleet) it may use; empty: every one "
        f"(at most {KEY_MODELS_BYTES} bytes as JSON)",
    )
    rpm: Limit | None = Field(None, description="requests per minute; null: no limit")
    tpm: Limit | None = Field(None, description="tokens (prompt + completion) per minute")
    max_parallel: Limit | None = Field(None, description="requests at once, per frontend")
    expires_at: Time | None = Field(None, description="refused from then on; null: never")
    disabled: Flag = Field(False, description="refused at once while true")
    metadata: dict[
        Annotated[str, Field(max_length=200)], Annotated[str, Field(max_length=1000)]
    ] = Field(default_factory=dict, max_length=100, description="free-form labels")


class Credential(BaseModel):
    """One secret of a key, by its hash: SHA-256 of the secret and the server pepper."""

    hash: str
    created_at: datetime
    expires_at: datetime | None = Field(None, description="set when a rotation retires it")


class RotateKey(Strict):
    """`old_valid_until`: when the key's current secrets stop working (default: at once)."""

    old_valid_until: Time | None = None


class ProviderCreate(ProviderSpec):
    name: ResourceName


class ModelCreate(ModelSpec):
    name: ResourceName


class VirtualModelCreate(VirtualModelSpec):
    name: ResourceName


class DeploymentCreate(DeploymentSpec):
    name: DeploymentName


class KeyCreate(KeySpec):
    name: ResourceName


class Patch(Strict):
    version: Version | None = Field(None, description="answer 409 unless the row has it")


def patch_of(spec: type[BaseModel]) -> type[Patch]:
    """The PATCH body of `spec`: every field optional, with the spec's own type and limits
    (an explicit null is refused where the field is not nullable), plus `version`."""
    fields: dict[str, Any] = {}
    for name, info in spec.model_fields.items():
        optional = FieldInfo.merge_field_infos(info, default=None)
        optional.default_factory = None
        fields[name] = (info.annotation, optional)
    name = spec.__name__.removesuffix("Spec") + "Patch"
    return create_model(name, __base__=Patch, __doc__=f"Changes to a {name[:-5]}.", **fields)


ProviderPatch = patch_of(ProviderSpec)
ModelPatch = patch_of(ModelSpec)
VirtualModelPatch = patch_of(VirtualModelSpec)
DeploymentPatch = patch_of(DeploymentSpec)
KeyPatch = patch_of(KeySpec)


class Provider(ProviderSpec, Meta):
    model_config = ConfigDict(extra="ignore")

    # as stored: a row from before the 2048-character bound stays readable and patchable
    base_url: str | None = Field(None, validate_default=True, description="as stored")


# Read models take rows as stored: a row written before a bound was added (more targets, a
# deeper spec) stays readable, alone and in a page; an update of it must bring it within.


class Model(ModelSpec, Meta):
    model_config = ConfigDict(extra="ignore")

    spec: dict[str, Any] = Field(default_factory=dict, description="free-form")


class VirtualModel(VirtualModelSpec, Meta):
    model_config = ConfigDict(extra="ignore")

    targets: list[Target] = Field(default_factory=list)


class Deployment(DeploymentSpec, Meta):
    model_config = ConfigDict(extra="ignore")

    engine_args: dict[str, Any] = Field(default_factory=dict, description="the worker's flags")

    status_history: list[StatusChange] = Field(
        default_factory=list, description="every status change, oldest first (the last 100)"
    )


class Key(KeySpec, Meta):
    model_config = ConfigDict(extra="ignore")

    credentials: list[Credential] = Field(
        default_factory=list, description="the hashes of its live secrets (never a secret)"
    )


class KeyWithSecret(Key):
    """A key as create and rotate answer it: with its new secret, shown this once."""

    secret: str


class Workspace(BaseModel):
    name: str
    version: int
    created_at: datetime


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """The OpenAI error format, as the gateway answers errors."""

    error: ErrorDetail
