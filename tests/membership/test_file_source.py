"""The sources file: strict validation naming the problem, a content-hash revision, and a
watched file whose atomic replacement is applied while invalid content changes nothing."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from shoal.discovery import Discovery
from shoal.membership import (
    MAX_FILE_BYTES,
    MAX_SOURCES,
    FileSource,
    SourceError,
    file_source,
    parse_sources,
)
from tests.helpers import wait_for
from tests.membership.conftest import StartWatch
from tests.membership.support import add_endpoint


def sources(*names: str, **extra: Any) -> bytes:
    return json.dumps(
        {"version": 1, "sources": [{"namespace": n} for n in names], **extra}
    ).encode()


def replace_atomically(path: Path, data: bytes) -> None:
    """What operators' tooling does: write a temporary file, rename it over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (sources("a", owner="me"), "unknown field `owner`"),
        (b'{"version": 1, "sources": [{"namespace": "a", "x": 1}]}', "unknown field `x`"),
        (json.dumps({"version": 2, "sources": []}).encode(), "version must be 1, got 2"),
        (sources("a", "b", "a"), "sources[2].namespace: duplicate namespace 'a'"),
        (sources(""), "sources[0].namespace: empty namespace"),
        (sources("a b"), "contains whitespace or '/'"),
        (sources("a/b"), "contains whitespace or '/'"),
        (sources(*(f"n{i}" for i in range(MAX_SOURCES + 1))), f"over the limit of {MAX_SOURCES}"),
        (b" " * (MAX_FILE_BYTES + 1), f"over the {MAX_FILE_BYTES}-byte limit"),
        (b"{not json", "malformed"),
        (b'{"version": 1}', "missing required field `sources`"),
        (sources("a", revision=""), "revision must be 1 to 256 characters"),
        (sources("a", connection_revision="x" * 257), "connection_revision must be 1 to 256"),
        (sources("a", revision=7), "expected `str | null`"),
    ],
    ids=[
        "unknown-field", "unknown-entry-field", "version", "duplicate", "empty", "whitespace",
        "slash", "too-many", "too-large", "not-json", "no-sources", "empty-revision",
        "long-connection-revision", "revision-not-a-string",
    ],
)  # fmt: skip
def test_an_invalid_sources_file_is_refused_naming_the_problem(data: bytes, problem: str) -> None:
    with pytest.raises(SourceError) as caught:
        parse_sources(data)
    assert problem.lower() in str(caught.value).lower()


def test_the_revision_is_a_hash_of_the_content_not_its_order_or_formatting() -> None:
    one = parse_sources(sources("a", "b"))
    two = parse_sources(
        b'{\n  "sources": [{"namespace": "b"}, {"namespace": "a"}],\n "version": 1}'
    )
    assert one == two and one.namespaces == {"a", "b"}
    assert parse_sources(sources("a")).revision != one.revision
    assert parse_sources(sources(*(f"n{i}" for i in range(MAX_SOURCES)))).namespaces


def test_a_files_own_revision_is_the_selections_and_a_connection_revision_changes_it() -> None:
    given = parse_sources(sources("a", revision="2026-12-01.3", connection_revision="c1"))
    assert (given.revision, given.connection_revision) == ("2026-12-01.3", "c1")
    hashed = parse_sources(sources("a", connection_revision="c1"))
    assert hashed.revision != parse_sources(sources("a", connection_revision="c2")).revision
    assert parse_sources(sources("a")).connection_revision is None  # the present format holds


async def test_an_atomic_replacement_is_applied_and_invalid_content_keeps_the_selection(
    start_watch: StartWatch, discovery: Discovery, tmp_path: Path
) -> None:
    await add_endpoint(discovery, "a", 1)
    await add_endpoint(discovery, "b", 2)
    path = tmp_path / "sources.json"
    path.write_bytes(sources("a"))
    watch = await start_watch(FileSource(path, poll_interval=5.0))
    first = watch.status.applied_revision
    assert watch.view.namespaces == {"a"} and first is not None

    replace_atomically(path, sources("a", "b"))  # seen by the file watch, well before a poll
    await wait_for(lambda: watch.status.applied_revision not in (None, first), timeout=4)
    assert watch.view.namespaces == {"a", "b"}
    applied = watch.status.applied_revision

    replace_atomically(path, sources("a", "a"))
    await wait_for(lambda: watch.status.last_error is not None, timeout=4)
    assert "duplicate namespace 'a'" in (watch.status.last_error or "")
    assert watch.view.namespaces == {"a", "b"}
    assert watch.status.applied_revision == applied
    assert watch.status.desired_revision is None  # the source offers nothing valid now

    replace_atomically(path, sources("b"))
    fixed = parse_sources(sources("b")).revision
    await wait_for(lambda: watch.status.applied_revision == fixed, timeout=4)
    assert watch.view.namespaces == {"b"}
    assert watch.status.last_error is None


async def test_a_missing_file_keeps_the_selection_and_the_poll_finds_it_again(
    start_watch: StartWatch, discovery: Discovery, tmp_path: Path
) -> None:
    await add_endpoint(discovery, "a", 1)
    path = tmp_path / "sources.json"
    path.write_bytes(sources("a"))
    watch = await start_watch(FileSource(path, poll_interval=0.05))
    path.unlink()
    await wait_for(lambda: "not found" in (watch.status.last_error or ""), timeout=4)
    assert watch.view.namespaces == {"a"} and len(watch.view.endpoints) == 1
    path.write_bytes(sources())
    empty = parse_sources(sources()).revision
    await wait_for(lambda: watch.status.applied_revision == empty, timeout=4)
    assert watch.status.last_error is None
    assert watch.view.namespaces == set() and watch.status.count == 0


async def test_a_sources_file_replaced_by_a_fifo_is_refused_and_never_blocks_the_loop(
    start_watch: StartWatch, discovery: Discovery, tmp_path: Path
) -> None:
    """open(2) of a FIFO with no writer waits for ever, and the file was opened on the event
    loop: the whole process stopped. Now it is opened without blocking and refused as not a
    regular file; the selection in force stays."""
    await add_endpoint(discovery, "a", 1)
    path = tmp_path / "sources.json"
    path.write_bytes(sources("a"))
    watch = await start_watch(FileSource(path, poll_interval=0.02))
    applied = watch.status.applied_revision
    done = threading.Event()

    def rescue() -> None:  # (on the tree before the fix: lets a blocked open return, so the
        while not done.wait(0.5):  # test fails instead of hanging)
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    os.replace(fifo, path)
    rescuer = threading.Thread(target=rescue, daemon=True)
    rescuer.start()
    try:
        await wait_for(lambda: "not a regular file" in (watch.status.last_error or ""), timeout=4)
        assert watch.status.applied_revision == applied and watch.view.namespaces == {"a"}
    finally:
        done.set()
        rescuer.join()


async def test_a_read_that_hangs_is_bounded_and_never_started_twice(
    start_watch: StartWatch, discovery: Discovery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file on a hung network mount: its read (in a thread) is awaited `read_timeout`
    seconds, then reported; the selection stays, and the hung read is awaited again rather
    than one more thread started at every poll."""
    await add_endpoint(discovery, "a", 1)
    path = tmp_path / "sources.json"
    path.write_bytes(sources("a"))
    source = FileSource(path, poll_interval=0.01, read_timeout=0.05)
    watch = await start_watch(source)
    applied = watch.status.applied_revision
    release, calls = threading.Event(), []
    real_read = file_source.read_bytes

    def hung_read(at: Path) -> bytes:
        calls.append(at)
        release.wait(30)
        return real_read(at)

    monkeypatch.setattr(file_source, "read_bytes", hung_read)
    try:
        await wait_for(lambda: "not read within 0.05s" in (watch.status.last_error or ""))
        await wait_for(lambda: source.timeouts >= 3)
        assert len(calls) == 1 and watch.status.applied_revision == applied
    finally:
        release.set()
    await wait_for(lambda: watch.status.last_error is None)


async def test_an_unchanged_sources_file_is_read_but_not_parsed_again(
    start_watch: StartWatch, discovery: Discovery, tmp_path: Path
) -> None:
    """Every poll parsed the file again, on the loop (4,096 names: 20-70 ms each). Now bytes
    identical to the last ones read are not parsed; new content is."""
    path = tmp_path / "sources.json"
    names = [f"n{i:05d}".ljust(64, "x") for i in range(MAX_SOURCES)]
    path.write_bytes(sources(*names))
    source = FileSource(path, poll_interval=0.01)
    watch = await start_watch(source)
    await wait_for(lambda: source.reads >= 10)
    assert source.parses == 1
    replace_atomically(path, sources(*names[1:]))
    changed = parse_sources(sources(*names[1:])).revision
    await wait_for(lambda: watch.status.applied_revision == changed, timeout=10)
    assert source.parses == 2


def test_an_error_about_a_huge_namespace_quotes_only_its_start_and_length() -> None:
    """A 1 MB namespace name was quoted whole into the error, hence into the status, the
    health report and the log. Now at most its first 64 characters and its length."""
    for name in ("a" * (MAX_FILE_BYTES - 100), "a " * ((MAX_FILE_BYTES - 100) // 2)):
        with pytest.raises(SourceError) as caught:
            parse_sources(sources(name))
        message = str(caught.value)
        assert len(message) < 300 and f"({len(name):,} characters)" in message, message


def test_a_50_mb_sources_file_is_refused_naming_its_size_without_reading_it(
    tmp_path: Path,
) -> None:
    """The error said `1048577 bytes, over the 1048576-byte limit` of any larger file: the
    bytes read, not the file's size (50 MB here), in the status and the log."""
    path = tmp_path / "sources.json"
    with path.open("wb") as file:
        file.truncate(50 * 1024 * 1024)
    with pytest.raises(SourceError) as caught:
        file_source.read_sources(path)
    message = f"{50 * 1024 * 1024} bytes, over the {MAX_FILE_BYTES}-byte limit"
    assert message in str(caught.value), caught.value
