"""The repository itself: no tracked symlink leads out of the tree (on a fresh clone it would
dangle, or worse, point at whatever the cloning machine has there)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYMLINK = "120000"


def tracked_symlinks(root: Path) -> dict[str, str]:
    """Every symlink the index of the git checkout at `root` tracks: path -> target, as
    stored (read from the index, so a checkout without symlink support still shows them)."""
    listing = subprocess.run(
        ["git", "ls-files", "-s", "-z"], cwd=root, capture_output=True, check=True
    ).stdout
    links: dict[str, str] = {}
    for entry in listing.split(b"\0"):
        if not entry:
            continue
        info, _, path = entry.partition(b"\t")
        mode, blob, _stage = info.split()
        if mode.decode() == SYMLINK:
            target = subprocess.run(
                ["git", "cat-file", "blob", blob.decode()],
                cwd=root,
                capture_output=True,
                check=True,
            ).stdout
            links[os.fsdecode(path)] = os.fsdecode(target)
    return links


def leaves_the_tree(root: Path, path: str, target: str) -> bool:
    """Whether symlink `path` (relative to `root`) pointing at `target` resolves outside
    `root`: an absolute target, or one whose `..`s climb out."""
    if os.path.isabs(target):
        return True
    resolved = os.path.normpath(os.path.join(root, os.path.dirname(path), target))
    return os.path.commonpath([resolved, os.path.normpath(root)]) != os.path.normpath(root)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_no_tracked_symlink_leaves_the_repository() -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    outside = {
        path: target
        for path, target in tracked_symlinks(ROOT).items()
        if leaves_the_tree(ROOT, path, target)
    }
    assert outside == {}, f"tracked symlinks pointing outside the repository: {outside}"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_symlink_check_finds_links_that_climb_out(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "docs" / "page.md").write_text("x")
    links = {
        ".bench": "/work/elsewhere/.bench",
        "docs/up": "../../outside",
        "docs/same": "page.md",
        "docs/root-readme": "../docs/page.md",
    }
    for path, target in links.items():
        (repo / path).symlink_to(target)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    found = tracked_symlinks(repo)
    assert found == links
    outside = {p for p, t in found.items() if leaves_the_tree(repo, p, t)}
    assert outside == {".bench", "docs/up"}
