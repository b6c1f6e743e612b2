"""Layer 3: endpoint instances, model cards and taints kept in the store."""

from shoal.discovery.keys import EndpointId, ModelKey, Query
from shoal.discovery.routes import (
    ROUTES,
    FleetTarget,
    Route,
    RouteError,
    Target,
    UrlTarget,
    decode_route,
    delete_route,
    publish_route,
    route_key,
)
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
    "ROUTES",
    "Added",
    "Discovery",
    "DiscoveryEvent",
    "EndpointId",
    "FleetTarget",
    "InstanceInfo",
    "ModelConflictError",
    "ModelInstance",
    "ModelKey",
    "Query",
    "Removed",
    "Route",
    "RouteError",
    "TaintsUpdated",
    "Target",
    "UrlTarget",
    "decode_route",
    "delete_route",
    "publish_route",
    "route_key",
]
