"""Layer 6: the KV event relay (`shoal kv-relay`).

What belongs here: following a membership view (`shoal.membership`, layer 5), one
`KvSubscription` (`shoal.kv.subscription`) per member that publishes KV events, and
republishing each batch to NATS JetStream in the layout of `shoal.kv.stream`, with the
status a probe reads. It imports no other layer-5 or layer-6 package: the frontend reads
the stream through `shoal.kv.stream`, never through this package.
"""

from shoal.relay.relay import KvRelay, RelayConfig
from shoal.relay.status import StatusServer

__all__ = ["KvRelay", "RelayConfig", "StatusServer"]
