"""Layer 3: endpoint instances, model cards and taints kept in the store."""

from shoal.discovery.keys import EndpointId, ModelKey, Query
from shoal.discovery.records import (
    Added,
    DiscoveryEvent,
    InstanceInfo,
    ModelInstance,
    Removed,
    TaintsUpdated,
)
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
from shoal.discovery.service import Discovery, ModelConflictError

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
