"""The membership errors.

- `ConfigError` (a `ValueError`): a source configuration that breaks a rule; refused at start.
- `SourceError`: a source could not yield a valid selection now (missing or invalid file);
  the last valid selection stays in force.
- `MembershipError`: the first selection could not be set up in time.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A namespace source configuration that breaks a rule; the message names the rule."""


class SourceError(Exception):
    """A source has no valid selection to offer now; the message says why."""


class MembershipError(RuntimeError):
    """The first selection was not set up within its bound."""
