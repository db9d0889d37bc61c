"""Every document a tracked file points at must exist in the repository.

The tracked text files (``git ls-files``; binary files skipped) are scanned for

* paths of Markdown files (anything ending in ``.md``), in prose, links, comments and
  docstrings;
* paths under ``docs/`` or ``results/`` written in backticks (`` `results/paper/` ``);
* section references such as ``docs/paper.md, section "Setups"`` (single or double quotes):
  the file must have a heading that starts with that name.

A path resolves against the repository root, then against the referencing file's directory.
A bare file name with no directory part also resolves to a tracked file of that name
anywhere in the repository (a table of outputs in ``paper_figs/`` names them bare). What is
not a reference: URLs, paths qualified by a repository (``owner/repo:path``, anything right
after a colon), placeholders and globs (``results/<name>.jsonl``, ``results/**``), paths git
ignores (output folders such as ``results/demo/``), ``.jsonl`` row files named as outputs of
a run, and, in Python, a string literal that is nothing but one file name (a path the code
builds, often in a temporary folder).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

URL = re.compile(r"\b[A-Za-z][\w+.-]*://\S+")
# A path ending in .md; not preceded by a path character or a colon (repository-qualified
# paths such as owner/repo:README.md belong to another repository).
MD_PATH = re.compile(r"(?<![\w./:-])((?:/|\.{1,2}/)?[\w.-]*(?:/[\w.-]+)*[\w-]\.md)(?![\w-])")
BACKTICK_PATH = re.compile(r"`((?:docs|results)/[^`\s]*)`")
SECTION = re.compile(r"""(?<![\w./:-])([\w./-]*[\w-]\.md),?\s+section\s+(["'])(.+?)\2""")
PY_LONE_LITERAL = re.compile(r"""(["'])[\w./-]+\.md\1""")
PLACEHOLDER = set("<>*?{}$[]")


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True)
    return [f for f in out.stdout.decode().split("\0") if f]


def read_text(path: Path) -> str | None:
    """The file as text, or None for binary (a NUL byte, or not UTF-8) and missing files."""
    try:
        data = path.read_bytes()
    except OSError:  # listed by git but absent from the work tree (deleted, not yet committed)
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def git_ignored(root: Path, ref: str) -> bool:
    out = subprocess.run(["git", "check-ignore", "-q", "--no-index", ref], cwd=root, capture_output=True)
    return out.returncode == 0


def resolve(root: Path, referrer: str, ref: str, by_name: dict[str, list[str]]) -> Path | None:
    """The file or folder ``ref`` names, or None when nothing in the repository matches."""
    candidates = []
    if ref.startswith("/"):
        candidates.append(Path(ref))
    else:
        candidates += [root / ref, (root / referrer).parent / ref]
    for c in candidates:
        c = c.resolve()
        if (c == root or root in c.parents) and c.exists():
            return c
    if "/" not in ref.rstrip("/") and by_name.get(ref):
        return root / by_name[ref][0]
    return None


def headings(path: Path) -> list[str]:
    text = read_text(path) or ""
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]


def dangling_references(root: Path, files: list[str]) -> list[str]:
    """``file:line: reference (why)`` for every reference in ``files`` that does not resolve."""
    root = root.resolve()
    by_name: dict[str, list[str]] = {}
    for f in files:
        by_name.setdefault(Path(f).name, []).append(f)
    problems = []
    for f in files:
        text = read_text(root / f)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            line = URL.sub(" ", line)
            if f.endswith(".py"):
                line = PY_LONE_LITERAL.sub(" ", line)
            refs = {m.group(1) for m in MD_PATH.finditer(line)}
            for m in BACKTICK_PATH.finditer(line):
                ref = m.group(1)
                if PLACEHOLDER & set(ref) or ref.endswith(".jsonl"):
                    continue
                refs.add(ref)
            for ref in sorted(refs):
                if resolve(root, f, ref, by_name) is None and not git_ignored(root, ref):
                    problems.append(f"{f}:{n}: {ref} (no such file in the repository)")
            for m in SECTION.finditer(line):
                ref, name = m.group(1), m.group(3)
                target = resolve(root, f, ref, by_name)
                if target is None or not target.is_file():
                    continue  # already reported above
                if not any(h == name or h.startswith(name) for h in headings(target)):
                    problems.append(f"{f}:{n}: {ref}, section {name!r} (no such heading in {ref})")
    return problems


def test_no_dangling_document_references():
    try:
        files = tracked_files(REPO)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout, cannot list tracked files: {e}")
    problems = dangling_references(REPO, files)
    assert not problems, (
        f"{len(problems)} reference(s) to files or sections that do not exist:\n  " + "\n  ".join(problems)
    )


def test_the_scanner_catches_a_missing_document(tmp_path):
    """A reference to a document that is not there is reported; existing ones are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "paper.md").write_text("# Paper\n\n## Setups\n\ntext\n")
    # Spelled in parts so that this file itself holds none of the dangling references.
    missing, section = "PAPER" + ".md", "sec" + "tion"
    (tmp_path / "step.py").write_text(
        f'"""Defaults are the paper\'s setup ({missing} {section} 2).\n\n'
        f'See docs/paper.md, {section} "Setups", and docs/paper.md, {section} "Nope".\n"""\n'
        'OUT = "table_output.md"  # a path the code builds\n'
    )
    (tmp_path / "README.md").write_text(
        "Numbers: `results/paper/` and [the paper](docs/paper.md); code at "
        "https://github.com/o/r/blob/main/GONE.md and o/r:" + missing + ".\n"
    )
    problems = dangling_references(tmp_path, ["docs/paper.md", "step.py", "README.md"])
    assert problems == [
        f"step.py:1: {missing} (no such file in the repository)",
        f"step.py:3: docs/paper.md, {section} 'Nope' (no such heading in docs/paper.md)",
        "README.md:1: results/paper/ (no such file in the repository)",
    ], problems
