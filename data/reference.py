"""The reference corpus: the running interpreter's standard library, as text every Python has.

Files are split train / held-out by a stable hash of their path relative to the stdlib root
(about 95/5). Two kinds of examples come from each file: the raw file, and chat examples
built with `ast` (user: a function or class header with its docstring; assistant: a newline, then
its body, as the code continues after the docstring).
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
HELDOUT_PERCENT = 5
MAX_BODY_CHARS = 1500  # longer bodies make poor prompts for a 512-token target
PROMPTS_PATH = Path(__file__).parent / "reference_prompts.jsonl"


@dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str

    @property
    def split(self) -> str:
        bucket = int(hashlib.sha256(self.relpath.encode()).hexdigest()[:8], 16) % 100
        return "heldout" if bucket < HELDOUT_PERCENT else "train"


def stdlib_files(root: Path | None = None) -> list[SourceFile]:
    """The stdlib's `.py` files, without test folders and site-packages, sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("test") for part in rel.parts[:-1]):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(SourceFile(rel.as_posix(), text))
    return files


def corpus_fingerprint(files: list[SourceFile]) -> dict:
    """Python version and hashes that identify the corpus a target was trained on."""
    names = "\n".join(f.relpath for f in files).encode()
    contents = hashlib.sha256()
    for f in files:
        contents.update(f.text.encode())
    return {"python_version": sys.version.split()[0], "num_files": len(files),
            "file_list_sha256": hashlib.sha256(names).hexdigest(), "content_sha256": contents.hexdigest()}


def chat_examples(source: SourceFile) -> list[dict]:
    """Header + docstring -> body examples for every documented function and class of a file."""
    try:
        tree = ast.parse(source.text)
    except SyntaxError:
        return []
    lines = source.text.splitlines(keepends=True)
    examples = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        doc_end = node.body[0].end_lineno
        header = "".join(lines[start:doc_end])
        body = "".join(lines[doc_end:node.end_lineno])
        indent = len(header) - len(header.lstrip(" "))
        header = "".join(line[indent:] for line in header.splitlines(keepends=True))
        body = "".join(line[indent:] if line.strip() else line.lstrip(" ")
                       for line in body.splitlines(keepends=True))
        if body.strip() and len(body) <= MAX_BODY_CHARS:
            examples.append({"messages": [{"role": "user", "content": header.rstrip("\n")},
                                          {"role": "assistant", "content": "\n" + body.rstrip("\n")}],
                             "source": f"{source.relpath}:{node.lineno}"})
    return examples


def write_heldout_prompts(files: list[SourceFile], path: Path = PROMPTS_PATH) -> int:
    """Write the held-out chat prompts (user turn only, reference answer beside it) as JSONL."""
    rows = []
    for f in files:
        if f.split == "heldout":
            for ex in chat_examples(f):
                rows.append({"messages": ex["messages"][:1], "reference": ex["messages"][1]["content"],
                             "source": ex["source"]})
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return len(rows)


def load_prompts(path: Path = PROMPTS_PATH, limit: int | None = None) -> list[dict]:
    """Held-out prompts as rows of `{"messages": [...]}` or `{"prompt": "raw text"}`."""
    from draftsmith.data.dataset import check_json_rows

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} not found; give a JSONL of {{\"messages\": [...]}} or "
                                "{\"prompt\": ...} rows (eval.prompts / --prompts)")
    check_json_rows(path, ("messages", "prompt"), "prompts file")
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return rows[:limit] if limit else rows
