"""The catalog's resources as pydantic models: what a client sends and what it reads back.

Each kind has a spec (the fields a user or the controller sets), a create body (spec + name),
a patch body (every spec field optional, plus the `version` it expects) and a read model
(spec + name, workspace, version and timestamps). Secrets appear only by name: a provider's
`auth_secret` names a secret the frontend resolves itself, and no field can carry its value.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    create_model,
    field_validator,
)
from pydantic.fields import FieldInfo

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+/-]*$"
WORKSPACE_PATTERN = r"^[a-z0-9][a-z0-9-]*$"
SECRET_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

Name = Annotated[str, Field(min_length=1, max_length=200, pattern=NAME_PATTERN)]
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
    base_url: Annotated[str, Field(max_length=2000, pattern=r"^https?://\S+$")] | None = Field(
        None, validate_default=True, description="required for type url, refused for fleet"
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
    spec: dict[str, Any] = Field(default_factory=dict, description="free-form")
    autoprovisioned: Flag = Field(False, description="made by the controller, not a user")


class Target(Strict):
    model_entity: Name
    weight: Annotated[StrictInt, Field(ge=0, le=1_000_000)] = 1


class VirtualModelSpec(Strict):
    """A public name served by the gateway, routed to a model entity or weighted targets."""

    description: Text = ""
    default_model: Name
    targets: list[Target] = Field(default_factory=list, max_length=1000)
    autoprovisioned: Flag = Field(False, description="made by the controller, not a user")


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
    engine_args: dict[str, Any] = Field(default_factory=dict)
    replicas: Annotated[StrictInt, Field(ge=0, le=10000)] = 1
    namespace: Annotated[str, Field(max_length=200, pattern=NAME_PATTERN)] = "default"
    description: Text = ""
    status: DeploymentStatus = DeploymentStatus.CREATED
    status_message: Text = ""


class ProviderCreate(ProviderSpec):
    name: Name


class ModelCreate(ModelSpec):
    name: Name


class VirtualModelCreate(VirtualModelSpec):
    name: Name


class DeploymentCreate(DeploymentSpec):
    name: Name


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


class Provider(ProviderSpec, Meta):
    model_config = ConfigDict(extra="ignore")


class Model(ModelSpec, Meta):
    model_config = ConfigDict(extra="ignore")


class VirtualModel(VirtualModelSpec, Meta):
    model_config = ConfigDict(extra="ignore")


class Deployment(DeploymentSpec, Meta):
    model_config = ConfigDict(extra="ignore")

    status_history: list[StatusChange] = Field(
        default_factory=list, description="every status change, oldest first (the last 100)"
    )


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
