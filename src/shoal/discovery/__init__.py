"""Layer 3: endpoint instances, model cards and taints kept in the store."""

from shoal.discovery.keys import EndpointId, ModelKey, Query
from shoal.discovery.service import (
    Added,
    Discovery,
    DiscoveryEvent,
    InstanceInfo,
    ModelConflictError,
    ModelInstance,
    Removed,
    TaintsUpdated,
)

__all__ = [
    "Added",
    "Discovery",
    "DiscoveryEvent",
    "EndpointId",
    "InstanceInfo",
    "ModelConflictError",
    "ModelInstance",
    "ModelKey",
    "Query",
    "Removed",
    "TaintsUpdated",
]
