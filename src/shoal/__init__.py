"""shoal: an open control plane and OpenAI-compatible gateway for LLM fleets."""

__version__ = "0.1.0"
