"""`shoal frontend` and `shoal up`: every flag falls back to `SHOAL_<NAME>`; stopping while starting."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from shoal.cli.frontend import config_from_args, serve
from shoal.cli.main import build_parser
from shoal.cli.up import banner
from shoal.frontend import FrontendConfig
from shoal.frontend.registry.watcher import ModelWatcher


def test_frontend_flags_have_laptop_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "STORE",
        "PORT",
        "NAMESPACE",
        "API_KEY",
        "ROUTER",
        "RETRIES",
        "FIRST_BYTE_TIMEOUT",
    ):
        monkeypatch.delenv(f"SHOAL_{name}", raising=False)
    config = config_from_args(build_parser().parse_args(["frontend"]))
    assert (config.port, config.router, config.retries, config.inhibit_seconds) == (
        8000, "round-robin", 2, 5.0,
    )  # fmt: skip
    assert (config.reconcile_interval, config.namespaces, config.api_keys) == (30.0, (), ())
    assert config.first_byte_timeout == 60.0
    assert config.store_url is None  # open_store() then picks default_store_url()


def test_frontend_flags_fall_back_to_shoal_environment_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    env = {
        "SHOAL_STORE": "memory://x",
        "SHOAL_HOST": "0.0.0.0",
        "SHOAL_PORT": "9100",
        "SHOAL_NAMESPACE": "a,b",
        "SHOAL_ROUTER": "least-loaded",
        "SHOAL_RECONCILE_INTERVAL": "7.5",
        "SHOAL_API_KEY": "k1,k2",
        "SHOAL_MAX_BODY": "1234",
        "SHOAL_RETRIES": "4",
        "SHOAL_INHIBIT_SECONDS": "1.5",
        "SHOAL_FIRST_BYTE_TIMEOUT": "0",
        "SHOAL_CACHE_DIR": str(tmp_path),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = config_from_args(build_parser().parse_args(["frontend"]))
    assert config.store_url == "memory://x"
    assert (config.host, config.port, config.router) == ("0.0.0.0", 9100, "least-loaded")
    assert config.namespaces == ("a", "b")
    assert config.api_keys == ("k1", "k2")
    assert (config.reconcile_interval, config.max_body, config.retries) == (7.5, 1234, 4)
    assert (config.inhibit_seconds, config.cache_dir) == (1.5, tmp_path)
    assert config.first_byte_timeout == 0.0
    flagged = config_from_args(
        build_parser().parse_args(
            ["frontend", "--port", "9200", "--router", "prefix", "--first-byte-timeout", "2.5"]
        )
    )
    assert (flagged.port, flagged.router, flagged.first_byte_timeout) == (9200, "prefix", 2.5)
    with pytest.raises(SystemExit):  # a usage error naming the flag (tests/cli/test_common.py)
        build_parser().parse_args(["frontend", "--first-byte-timeout", "-1"])


def test_up_defaults_to_two_workers_of_a_mock_model(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORKERS", "MODEL", "PORT"):
        monkeypatch.delenv(f"SHOAL_{name}", raising=False)
    args = build_parser().parse_args(["up"])
    assert (args.workers, args.model, args.port, args.store) == (2, "mock-llm", 8000, None)


def test_up_banner_has_ready_to_paste_examples() -> None:
    text = banner("http://127.0.0.1:8000", "mock-llm", 2, "sqlite:////tmp/other.db")
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in text
    assert '"model": "mock-llm"' in text
    assert 'OpenAI(base_url="http://127.0.0.1:8000/v1"' in text
    assert "shoal worker --model mock-llm --store sqlite:////tmp/other.db" in text


def test_key_flags_reach_the_frontend_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTH", "KEY_PEPPER", "LIMITS", "CATALOG_URL", "ADMIN_TOKEN"):
        monkeypatch.delenv(f"SHOAL_{name}", raising=False)
    plain = config_from_args(build_parser().parse_args(["frontend"]))
    assert (plain.auth, plain.key_pepper, plain.limits_url, plain.catalog_url) == (
        "api-key", "", None, None,
    )  # fmt: skip
    monkeypatch.setenv("SHOAL_KEY_PEPPER", "p")
    monkeypatch.setenv("SHOAL_ADMIN_TOKEN", "t")
    args = ["frontend", "--auth", "keys", "--limits", "redis://h:6379", "--catalog-url", "http://c"]
    config = config_from_args(build_parser().parse_args(args))
    assert (config.auth, config.key_pepper, config.limits_url) == ("keys", "p", "redis://h:6379")
    assert (config.catalog_url, config.catalog_token) == ("http://c", "t")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["frontend", "--auth", "nobody"])


async def test_a_stop_signal_ends_a_frontend_still_loading_discovery(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A large fleet takes its time to load once the store answered: SIGTERM meanwhile stops
    the frontend then, not once everything is loaded."""
    loading = asyncio.Event()

    async def endless_load(self: ModelWatcher) -> None:  # the store answered; loading goes on
        self.store_answered.set()
        loading.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(ModelWatcher, "start", endless_load)
    config = FrontendConfig(store_url="memory://stop-while-loading", port=0, cache_dir=tmp_path)
    serving = asyncio.create_task(serve(config))
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loading.wait(), 10)
        os.kill(os.getpid(), signal.SIGTERM)  # (serve's handler sets its stop event)
        assert await asyncio.wait_for(serving, 10) == 0
    finally:
        serving.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
