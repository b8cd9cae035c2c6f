"""The documentation states what is and runs as written.

    bash scripts/test.sh tests/test_docs.py

(a) No tracked file's name or text carries development history (run numbers, work periods, issue numbers): history
lives in git. (b) Every `draftsmith ...`, `python scripts/...`, `bash scripts/...` and `accelerate launch train/...`
command written in README.md and docs/*.md exists: each draftsmith command answers `--help` (in this process),
each script answers `--help`, each named recipe and entry script is a file.
(c) pyproject.toml lists every folder the wheel ships package data from. (d) The README stays under 400 lines and
benchmarks/ under 40 files.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# written so that this file does not match itself
HISTORY = re.compile(r"(?<![A-Za-z])stop[ _-]?\d+\b|\bses(?:sion)s?\b|\bissues? ?#?\d+|(?<![\w&/])#\d{2,}\b", re.I)
# third-party text that must stay as it is: CPython's source in the reference prompts, pytest's fixture scope
EXEMPT = {"data/reference_prompts.jsonl": ["# See iss" + "ue 24875."], "*": ['scope="ses' + 'sion"']}


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.split()


def test_no_tracked_file_carries_development_history():
    found = []
    for name in tracked_files():
        if HISTORY.search(name):
            found.append(f"{name}: its name")
        path = REPO / name
        if not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary: plots, gzipped data, weights
            continue
        for literal in EXEMPT.get(name, []) + EXEMPT["*"]:
            text = text.replace(literal, "")
        for m in HISTORY.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{name}:{line}: {text[max(0, m.start() - 40):m.end() + 20]!r}")
    assert not found, "history belongs in git, not in files:\n" + "\n".join(found[:50])


def test_the_readme_stays_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 400


def test_benchmarks_stay_few():
    """benchmarks/ keeps each series' current result, a series' runs as named entries of one file
    (benchmarks/README.md)."""
    files = sorted(f.name for f in (REPO / "benchmarks").iterdir())
    assert len(files) <= 40, f"{len(files)} files in benchmarks/; merge a new run into its series' file as an entry"


def expand(name: str) -> list[str]:
    """`leaderboard_{tau,acceptance}.png` -> its names."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [n for part in m.group(1).split(",") for n in expand(name[:m.start()] + part + name[m.end():])]


def result_files(text: str) -> list[str]:
    """The benchmarks/ file names in `text` (`benchmarks/NAME`, or `NAME` in backticks), braces expanded."""
    cited = re.findall(r"benchmarks/([\w.{},-]+)", text) + re.findall(r"`([\w.{},-]+)`", text)
    return [n for c in cited for n in expand(c.rstrip(".,")) if n.endswith((".json", ".md", ".png"))]


def test_every_cited_benchmark_file_exists_or_is_pending():
    """A result file the docs cite is in benchmarks/, or benchmarks/README.md marks it pending."""
    index = REPO / "benchmarks" / "README.md"
    rows = [line for line in index.read_text().splitlines() if line.startswith("| `")]
    pending = {name for line in rows if "pending" in line for name in result_files(line.split(" | ")[0])}
    missing = []
    for doc in [*DOCS, index]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            names = re.findall(r"benchmarks/([\w.{},-]+)", line)
            names = [name for c in names for name in expand(c.rstrip(".,")) if name.endswith((".json", ".md", ".png"))]
            if doc == index and line.startswith("| `"):
                names += result_files(line.split(" | ")[0])
            missing += [f"{doc.name}:{n}: {name}" for name in names
                        if not (REPO / "benchmarks" / name).is_file() and name not in pending]
    assert not missing, "cited but not in benchmarks/:\n" + "\n".join(missing)


# ---- (b) the commands the docs write --------------------------------------------------------------------

FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
INLINE = re.compile(r"`((?:draftsmith|python scripts/|bash scripts/|accelerate launch)[^`]*)`")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")  # METHOD, RECIPE, COMMAND


def written_commands() -> list[tuple[str, str]]:
    """(doc, command line) for every command in a code block or an inline code span of the docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in FENCE.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.split(r"\s#\s|\s#$", line, maxsplit=1)[0].strip()
                if re.match(r"(\w+=\S+\s+)*(draftsmith|python scripts/|bash scripts/|accelerate launch)", line):
                    found.append((doc.name, line))
        found += [(doc.name, cmd) for cmd in INLINE.findall(FENCE.sub("", text))]
    return found


def words(line: str) -> list[str]:
    try:
        tokens = shlex.split(line)
    except ValueError:  # an unbalanced quote in an elided command
        tokens = line.split()
    while tokens and re.match(r"^\w+=", tokens[0]):  # OMP_NUM_THREADS=1 python ...
        tokens.pop(0)
    return tokens


def checks() -> dict[tuple[str, ...], str]:
    """What to check -> where the docs write it: ("draftsmith", argv...) to run with --help, ("script", path) to run
    with --help, ("file", path) to exist."""
    todo: dict[tuple[str, ...], str] = {}
    for doc, line in written_commands():
        tokens = words(line)
        where = f"{doc}: {line}"
        if tokens[:1] == ["draftsmith"] and len(tokens) > 1 and not PLACEHOLDER.match(tokens[1]):
            argv = tokens[1:2]  # the command's own help
            if tokens[1] == "train" and len(tokens) > 2 and not PLACEHOLDER.match(tokens[2]):
                argv = tokens[1:3]
                if len(tokens) > 3 and "=" not in tokens[3] and not tokens[3].startswith("-") \
                        and not PLACEHOLDER.match(tokens[3]) and tokens[3] != "...":
                    argv = tokens[1:4]
            todo.setdefault(("draftsmith", *argv), where)
        elif tokens[:1] == ["python"] and tokens[1].startswith("scripts/"):
            todo.setdefault(("script", tokens[1]), where)
        elif tokens[:1] == ["bash"] and tokens[1].startswith("scripts/"):
            todo.setdefault(("file", tokens[1]), where)
        elif tokens[:2] == ["accelerate", "launch"]:
            for i, token in enumerate(tokens):
                if token.startswith("train/") and token.endswith(".py"):
                    todo.setdefault(("file", token), where)
                if token in ("--config", "--config_file") and i + 1 < len(tokens) and tokens[i + 1].endswith(
                        (".yaml", ".json")):
                    todo.setdefault(("file", tokens[i + 1]), where)
    return {check: where for check, where in todo.items() if not any(PLACEHOLDER.match(part) for part in
                                                                     re.split(r"[/.]", check[-1]))}


CHECKS = checks()


def test_the_docs_write_commands():
    assert any(kind == "draftsmith" for kind, *_ in CHECKS)
    assert ("file", "scripts/main.sh") in CHECKS and ("file", "scripts/test.sh") in CHECKS


@pytest.mark.parametrize("check", sorted(CHECKS), ids=" ".join)
def test_a_written_command_exists(check, capsys):
    kind, *rest = check
    where = CHECKS[check]
    if kind == "file":
        assert (REPO / rest[0]).is_file(), f"{where}: {rest[0]} does not exist"
    elif kind == "script":
        path = REPO / rest[0]
        assert path.is_file(), f"{where}: {rest[0]} does not exist"
        done = subprocess.run([sys.executable, str(path), "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{where}: --help failed: {done.stderr[-500:]}"
    else:
        from draftsmith.train.cli import run

        if rest:
            with pytest.raises(SystemExit) as stop:
                run([*rest, "--help"])
            assert stop.value.code in (0, None), f"{where}: {stop.value.code}"
        else:
            run(["--help"])
        assert capsys.readouterr().out.strip(), f"{where}: --help printed nothing"


def test_every_folder_of_package_data_is_a_listed_package():
    """setuptools takes each folder that holds package data and has an importable name for a package, and warns (a
    warning it will make an error) unless pyproject.toml lists it: the list must follow the tree."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = set()
    for package, globs in tool["package-data"].items():
        root = REPO / tool["package-dir"][package]
        for glob in globs:
            for f in root.glob(glob):
                parts = f.parent.relative_to(root).parts
                if f.is_file() and all(part.isidentifier() for part in parts):
                    folders.add(".".join([package, *parts]))
    assert folders - set(tool["packages"]) == set()
