"""Secrets of external providers, resolved on the frontend and never read from the store.

A `url` route target names its secret (`openai-key`); the frontend looks up the environment
variable `SHOAL_SECRET_<NAME>` (the name upper-cased, every character other than a letter or
digit turned into `_`: `SHOAL_SECRET_OPENAI_KEY`), then the file `<secrets dir>/<name>` (one
file per secret, as a Kubernetes secret mounts them; surrounding whitespace is dropped; at most
64 KiB of UTF-8).
Names come from the store, so they are checked before they touch the file system, and values
are checked before they go into a header.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

ENV_PREFIX = "SHOAL_SECRET_"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_VALUE = re.compile(r"^[\x21-\x7e]+$")  # visible ASCII: nothing that could split a header
MAX_SECRET_FILE = 64 * 1024  # bytes read of a secret file; a longer one is refused


class SecretError(LookupError):
    """A secret that cannot be used; the message says where it was looked for."""


def env_name(name: str) -> str:
    """The environment variable that holds secret `name`."""
    return ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", name.upper())


class Secrets:
    """Resolves secret names to values from the environment, then a secrets directory."""

    def __init__(self, directory: Path | None = None, environ: Mapping[str, str] | None = None):
        self.directory = directory
        self.environ = os.environ if environ is None else environ

    def resolve(self, name: str) -> str:
        """The value of secret `name`; `SecretError` if it is missing, empty or unusable."""
        if not _NAME.match(name):
            raise SecretError(
                f"secret name {name!r} is not valid: letters, digits and ._- only, "
                "starting with a letter or digit"
            )
        variable = env_name(name)
        value = self.environ.get(variable)
        where = variable
        if value is None and self.directory is not None:
            path = self.directory / name
            where = str(path)
            value = _read(name, path)
        if value is None:
            places = (
                variable if self.directory is None else f"{variable} or {self.directory / name}"
            )
            raise SecretError(f"secret {name!r} is not set on this frontend ({places})")
        value = value.strip()
        if not _VALUE.match(value):
            raise SecretError(
                f"secret {name!r} from {where} is empty or holds characters other than "
                "visible ASCII"
            )
        return value


def _read(name: str, path: Path) -> str | None:
    """The text of secret file `path` (None if there is none); `SecretError` if it cannot be
    read, is over `MAX_SECRET_FILE` bytes, or is not UTF-8 (a binary key, a latin-1 file)."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_SECRET_FILE + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SecretError(f"secret {name!r}: cannot read {path}: {exc}") from None
    if len(data) > MAX_SECRET_FILE:
        raise SecretError(f"secret {name!r}: {path} is over {MAX_SECRET_FILE} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise SecretError(f"secret {name!r}: {path} is not UTF-8 text") from None
