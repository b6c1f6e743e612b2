"""`shoal worker --chat-template PATH`: a regular file of at most the metadata-file bound is
read; anything else is refused in one line naming the flag, before it is read whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shoal.cli.main import build_parser
from shoal.cli.worker import make_engine
from shoal.worker.engines.mocker import MockerEngine
from shoal.worker.metadata import MAX_METADATA_FILE


def engine_for(template: str) -> MockerEngine:
    args = build_parser().parse_args(["worker", "--model", "m", "--chat-template", template])
    engine = make_engine(args)
    assert isinstance(engine, MockerEngine)
    return engine


def refusal(template: str) -> str:
    with pytest.raises(SystemExit) as exited:
        engine_for(template)
    message = str(exited.value.code)
    assert message.startswith("shoal worker: --chat-template ") and "\n" not in message
    return message


def test_a_template_file_is_published_as_it_is(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }} ☃")
    assert engine_for(str(template)).chat_template == "{{ messages }} ☃"


def test_a_device_or_a_fifo_is_refused_as_not_a_regular_file_unread(tmp_path: Path) -> None:
    """`/dev/zero` was read whole: the worker grew to 1.7 GB before anything checked it (a
    FIFO would block the start for ever)."""
    assert "/dev/zero: not a regular file" in refusal("/dev/zero")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert f"{fifo}: not a regular file" in refusal(str(fifo))


def test_a_template_over_the_metadata_file_bound_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.jinja"
    with big.open("wb") as f:
        f.truncate(MAX_METADATA_FILE + 1)  # (sparse)
    assert f"larger than {MAX_METADATA_FILE:,} bytes" in refusal(str(big))
    assert "cannot read" in refusal(str(tmp_path / "missing.jinja"))
