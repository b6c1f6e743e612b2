"""The Redis URL of `--limits` may carry a password (in its userinfo or as `?password=`): it
never reaches a log line or `/health`, whatever state the limits go through."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from shoal.frontend.keys.limits import Limits
from tests.helpers import wait_for
from tests.redis_server import RedisServer

SECRET = "hunter2-limits-secret"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.mark.parametrize("form", ["userinfo", "query"])
async def test_the_redis_password_reaches_no_log_and_no_health(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, form: str
) -> None:
    where = redis_server.url.removeprefix("redis://")
    url = (
        f"redis://default:{SECRET}@{where}"
        if form == "userinfo"
        else f"redis://{where}/0?username=default&password={SECRET}"
    )
    caplog.set_level(logging.DEBUG)
    limits = Limits(url)
    await limits.start()
    try:
        await wait_for(lambda: limits.shared)
        seen = [json.dumps(limits.describe())]
        redis_server.stop()
        await wait_for(lambda: not limits.shared)
        seen.append(json.dumps(limits.describe()))
        redis_server.start()
        await wait_for(lambda: limits.shared)
    finally:
        await limits.stop()
    assert "Redis at" in caplog.text  # the transitions were logged, naming where
    for text in [caplog.text, *seen]:
        assert SECRET not in text
