"""Layer 5: the OpenAI-compatible gateway.

`Frontend` serves `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and
`/v1/models` for the models workers announce in discovery; see `app.py` for the wiring,
`endpoints.py` for the routes, `config.py` for the settings, and the subpackages, from the
bottom up: `http` (the server, upstream connections, errors), `registry` (the fleet, its
watcher, routing policies, metrics), `keys` (API keys, limits, usage), `virtual` (virtual
models and providers), `kv` (KV-aware routing), `proxy` (the request path, migration,
disaggregation) and `dashboard` (`/ui`).
"""

from shoal.frontend.app import Frontend
from shoal.frontend.config import FrontendConfig
from shoal.frontend.registry.router import POLICIES

__all__ = ["POLICIES", "Frontend", "FrontendConfig"]
