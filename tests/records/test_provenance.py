"""A row's provenance: ``git_dirty`` says whether the code that ran differs from its commit."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from records.provenance import PACKAGES, git_dirty


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True, timeout=30)


@pytest.fixture
def repo(tmp_path) -> Path:
    if shutil.which("git") is None:
        pytest.fail("git is not on PATH; records.provenance needs it")
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / ".gitignore").write_text("__pycache__/\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "code")
    return tmp_path


def test_a_clean_checkout_is_clean_and_scratch_files_outside_the_packages_keep_it_so(repo):
    assert git_dirty(repo) is False
    (repo / "runs" / "sweeps").mkdir(parents=True)
    (repo / "runs" / "sweeps" / "t.jsonl").write_text("{}\n")
    (repo / "notes.txt").write_text("scratch")
    (repo / "methods" / "__pycache__").mkdir()
    (repo / "methods" / "__pycache__" / "x.pyc").write_text("")  # ignored
    assert git_dirty(repo) is False


@pytest.mark.parametrize("path", ["methods/my_method.py", "bench/search/new/thing.py", "analysis/x.py"])
def test_an_untracked_file_in_a_package_makes_the_row_dirty(repo, path):
    """A method file not committed yet runs (methods/ imports every module in it) on a commit that
    lacks it: the row must not claim that commit's code."""
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text("x = 1\n")
    assert git_dirty(repo) is True


def test_a_changed_tracked_file_anywhere_makes_the_row_dirty(repo):
    (repo / ".gitignore").write_text("__pycache__/\nruns/\n")
    assert git_dirty(repo) is True
