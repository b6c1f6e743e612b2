"""Layer 5: which namespaces a frontend serves, followed as they change.

What belongs here: namespace sources (a JSON file an operator's tooling rewrites, or
discovery itself) that yield complete selections, and the membership watch that turns a
selection into a view of the endpoint instances in force, with its status. It reads
discovery (layer 3) and never imports another layer-5 package: the frontend subscribes to
the view it publishes.
"""

from shoal.membership.discovery_source import DiscoverySource, EndpointPrefix
from shoal.membership.errors import ConfigError, MembershipError, SourceError
from shoal.membership.feed import DiscoveryFeed
from shoal.membership.file_source import MAX_FILE_BYTES, MAX_SOURCES, FileSource, parse_sources
from shoal.membership.selection import Selection, Source
from shoal.membership.view import EndpointView, Membership, MembershipStatus
from shoal.membership.watch import MembershipWatch

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_SOURCES",
    "ConfigError",
    "DiscoveryFeed",
    "DiscoverySource",
    "EndpointPrefix",
    "EndpointView",
    "FileSource",
    "Membership",
    "MembershipError",
    "MembershipStatus",
    "MembershipWatch",
    "Selection",
    "Source",
    "SourceError",
    "parse_sources",
]
