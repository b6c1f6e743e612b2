"""Layer 5: the OpenAI-compatible gateway.

`Frontend` serves `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` and
`/v1/models` for the models workers announce in discovery; see `app.py` for the wiring,
`watcher.py` for how the registry follows discovery, and `proxy.py` for the request path.
"""

from shoal.frontend.app import Frontend, FrontendConfig
from shoal.frontend.router import POLICIES

__all__ = ["POLICIES", "Frontend", "FrontendConfig"]
