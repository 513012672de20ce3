"""The README and docs/ point only at what the repository holds: every relative link (and its #anchor), every
repository path they name in backticks, every test docs/claims.md cites; no file mentions the design notes and
papers that are not in the repository; the README stays a front door; every command is documented.  Reads
files only: no cluster, nothing imported but the command lines' parsers."""

from __future__ import annotations

import argparse
import glob
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: top-level directories and files a backticked repository path starts with
TOP = ("ecrec/", "docs/", "tests/", "scripts/", "baselines/", "proto/", "cuda_kernels/", ".ci/")
ROOT_FILES = ("README.md", "LICENSE", "pyproject.toml")
#: flags whose value a command writes (the file need not exist)
OUTPUT_FLAGS = ("--json", "--plot", "--out")
#: written in two parts, so that this file does not mention them itself
ABSENT = ("DESIGN" + ".md", "reference" + "/")

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`([^`\n]+)`")


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_and_anchor_exists(page):
    missing = []
    for m in LINK.finditer(_prose(page.read_text())):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            missing.append(target)
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            missing.append(f"{target} (no such heading)")
    assert not missing, f"{_rel(page)} links to what is not there: {missing}"


def _named_paths(text: str) -> list[str]:
    """The repository paths named inside inline code: every word that starts with a top-level directory (or is
    a top-level file), except the value of an output flag."""
    out = []
    for span in CODE.findall(_prose(text)):
        words = span.split()
        for i, word in enumerate(words):
            word = word.strip("()[],;:'\"")
            if i and words[i - 1] in OUTPUT_FLAGS:
                continue
            if word.startswith(TOP) or word in ROOT_FILES:
                out.append(word.split("::", 1)[0])
    return out


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_repository_path_named_exists(page):
    names = _named_paths(page.read_text())
    missing = sorted({name for name in names if not glob.glob(str(ROOT / name))})
    assert not missing, f"{_rel(page)} names paths the repository does not hold: {missing}"


def test_the_path_finder_finds_paths_and_skips_outputs():
    text = ("`ecrec/bench/cli.py`, `tests/test_docs.py::test_x`, `ecrec-bench compare --json docs/x.json --plot "
            "docs/y.png`, `--from-results docs/results`, `pyproject.toml`, `erasure/merge.py`\n```\n`docs/no.md`\n```")
    assert _named_paths(text) == ["ecrec/bench/cli.py", "tests/test_docs.py", "docs/results", "pyproject.toml"]


def _tracked_text_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                               timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):  # not a git checkout: every file under the root
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    out = []
    for name in filter(None, names):
        path = ROOT / name
        if path.is_file() and path.suffix not in (".png", ".json", ".pyc"):
            out.append(path)
    return out


def test_no_file_mentions_files_the_repository_does_not_hold():
    found = []
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}: {word}" for word in ABSENT if word in text]
    assert not found, f"cite the paper or a docs/ page by name instead: {found}"


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/ (at most 250)"
    text = README.read_text()
    # the quick start's two commands, as CI and the first-time reader run them
    assert ("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e '.[dev]' && .venv/bin/ecrec-bench "
            "compare --preset quick --json compare.json --plot compare.png\n.venv/bin/python -m pytest\n") in text
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in text, f"the README does not link docs/{page.name}"


def _tests_defined() -> dict[str, set[str]]:
    """tests/ file name -> the functions and fixtures it defines."""
    return {p.name: set(re.findall(r"^\s*def (\w+)\(", p.read_text(), re.M)) for p in (ROOT / "tests").glob("*.py")}


def _defines(names: set[str], wanted: str) -> bool:
    wanted = wanted.split("[", 1)[0]  # a parametrized case: the function
    if wanted.endswith("*"):
        return any(n.startswith(wanted[:-1]) for n in names)
    return wanted in names


def test_claims_cite_tests_that_exist():
    defined = _tests_defined()
    every = set().union(*defined.values())
    missing, cited = [], 0
    for span in CODE.findall((ROOT / "docs" / "claims.md").read_text()):
        m = re.fullmatch(r"(?:tests/)?((?:test_\w+|conftest)\.py)(?:::(\S+))?", span)
        if m:
            cited += 1
            file, name = m.groups()
            if file not in defined:
                missing.append(span)
            elif name and not _defines(defined[file], name):
                missing.append(span)
        elif re.fullmatch(r"test_\w+\*?(\[.*\])?", span):
            cited += 1
            if not _defines(every, span):
                missing.append(span)
    assert cited > 100, f"only {cited} test references found in docs/claims.md"
    assert not missing, f"docs/claims.md cites tests that do not exist: {missing}"


def _subcommands(parser: argparse.ArgumentParser) -> set[str]:
    return {name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


def test_every_command_is_documented():
    from ecrec import cli
    from ecrec.bench.cli import SUBCOMMANDS

    operations = (ROOT / "docs" / "operations.md").read_text()
    server = _subcommands(cli.build_parser()) | _subcommands(cli.build_client_parser())
    assert server >= {"local", "coordinator", "serve", "status", "snapshot", "restore"}
    assert not [c for c in server if f"ecrec-server {c}" not in operations], "ecrec-server commands not in operations"
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    assert not [c for c in SUBCOMMANDS if f"ecrec-bench {c}" not in benchmarks], "ecrec-bench commands not documented"
