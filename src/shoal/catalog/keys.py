"""API keys in the catalog: secrets made on create and rotate, shown once, kept as hashes.

A secret is `sk-shoal-` and 32 random bytes (URL-safe base64). The database keeps only its
`hash_secret(secret, pepper)` in the key's `credentials`; the create and rotate answers are
the only places the secret ever appears. Rotating adds a new secret and ends the current ones
at `old_valid_until` (default: at once), so clients move over without a gap. The pepper is the
server's `--key-pepper` (`SHOAL_KEY_PEPPER`), the same on the catalog and every frontend that
checks keys: a database dump alone cannot test a guessed secret.
"""

import secrets
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import FastAPI, Path

from shoal.catalog.kinds import KEYS
from shoal.catalog.repository import Repository
from shoal.catalog.resources import NAME_PATTERN, WORKSPACE_PATTERN, KeyCreate, KeyWithSecret
from shoal.catalog.resources import RotateKey as RotateBody
from shoal.discovery.grants import SECRET_PREFIX, hash_secret

WorkspaceParam = Annotated[str, Path(min_length=1, max_length=63, pattern=WORKSPACE_PATTERN)]
NameParam = Annotated[str, Path(min_length=1, max_length=200, pattern=NAME_PATTERN)]


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def credential(secret: str, pepper: str, now: datetime | None = None) -> dict[str, Any]:
    """The stored form of a new secret: its hash and when it was made."""
    made = now or datetime.now(UTC)
    return {"hash": hash_secret(secret, pepper), "created_at": made.isoformat(), "expires_at": None}


def key_routes(
    app: FastAPI, repo: Repository, pepper: str, write: list[Any], responses: dict[int | str, Any]
) -> None:
    """`POST .../keys` (create, answering the secret once) and `POST .../keys/{name}`
    (rotate: a new secret for the key, answered once; the old ones end at `old_valid_until`)."""
    base = "/v1/workspaces/{workspace}/keys"
    common: dict[str, Any] = {"responses": responses, "tags": ["keys"], "dependencies": write}

    @app.post(
        base, response_model=KeyWithSecret, status_code=201, operation_id="create_keys", **common
    )
    async def create_key(workspace: WorkspaceParam, body: KeyCreate) -> KeyWithSecret:
        secret = new_secret()
        made = await repo.create(
            KEYS, workspace, body, kept={"credentials": [credential(secret, pepper)]}
        )
        return KeyWithSecret(**made.model_dump(), secret=secret)

    @app.post(
        f"{base}/{{name:path}}",
        response_model=KeyWithSecret,
        operation_id="rotate_keys",
        **common,
    )
    async def rotate_key(
        workspace: WorkspaceParam, name: NameParam, body: RotateBody | None = None
    ) -> KeyWithSecret:
        now = datetime.now(UTC)
        until = (body.old_valid_until if body is not None else None) or now
        until = until if until.tzinfo else until.replace(tzinfo=UTC)
        secret = new_secret()
        made = await repo.rotate_credentials(
            KEYS, workspace, name, credential(secret, pepper, now), until
        )
        return KeyWithSecret(**made.model_dump(), secret=secret)
