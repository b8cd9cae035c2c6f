"""The bottom layer: what every other part of draftsmith may import, importing nothing of ours.

- errors a user can act on (`ConfigError`, `DiskFull`, `DamagedFile`) and the free-space checks behind `DiskFull`;
- `read_file` / `open_safetensors`: the one way every file draftsmith wrote or was handed is opened (JSON, JSON
  lines, YAML, safetensors, torch), refusing a damaged one in one line with its path, what is wrong and the fix;
- `write_atomically`: a file written whole or not at all (temp file + rename);
- the batch contract: rows of `input_ids`, `loss_mask`, `position_ids` (lists of equal length per row) and
  `collate`, which stacks them into tensors;
- the run-directory layout a training run writes and everything else reads:

      RUN/checkpoint-N/        one per save (checkpoint-N.tmp while it is written; never read)
      RUN/checkpoint-N/model/  the drafter of that step (a drafter directory)
      RUN/best/                the drafter of the best checkpoint, with best.json = {"step", metrics...}

- the drafter directory's `drafter.json`: {"schema_version", "method", method fields...}, written by
  `write_drafter_meta` and read by `read_drafter_meta` only (a file without schema_version is version 0).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file


class ConfigError(ValueError):
    """A recipe or override that does not fit the config schema."""


class DiskFull(OSError):
    """Not enough free space for a checkpoint, export or output file."""


class DamagedFile(ValueError):
    """A file that is there but does not read (truncated, not parseable, refused): its path, what, the fix."""


# the fixes `read_file` names for the files of a drafter directory and of an export
REDO_DRAFTER = "pass another checkpoint's model/ (RUN/checkpoint-N/model) or train the run again"
REDO_EXPORT = "export the run again (draftsmith export RUN --format FORMAT --out DIR)"


def one_line(e: BaseException) -> str:
    """An exception as one line: its message with newlines folded (KeyError's quotes dropped)."""
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    text = " ".join(str(text).split()) or type(e).__name__
    return text if isinstance(e, (ValueError, OSError, RuntimeError, KeyError)) else f"{type(e).__name__}: {text}"


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


def check_free(where: Path, need: int, what: str, fix: str) -> None:
    """Refuse to write `what` (about `need` bytes, plus 5% and 16 MB of slack) under `where` when the disk lacks it."""
    where = Path(where)
    probe = next((p for p in [where, *where.parents] if p.exists()), Path("."))
    free = shutil.disk_usage(probe).free
    if free < need * 1.05 + (16 << 20):
        raise DiskFull(f"not enough disk space for {what}: needs about {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free "
                       f"under {probe}; {fix}")


def is_disk_full(e: BaseException) -> bool:
    """An error raised by a write that ran out of space (torch's zip writer reports it as 'unexpected pos')."""
    return (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or \
        "unexpected pos" in str(e) or "No space left" in str(e)


# ---- opening files -------------------------------------------------------------------------------

def safetensors_damage(f: Path) -> str:
    """Why a .safetensors file cannot be whole (truncated, or a header that does not parse), or '': 'is truncated
    (...)'."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n)) if 8 + n <= size else None
    except (struct.error, ValueError, UnicodeDecodeError):
        return f"has no readable safetensors header ({size} bytes)"
    if header is None:
        return f"is truncated ({size} bytes, shorter than its header)"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size != 8 + n + end:
        return f"is truncated or damaged ({size} bytes, its header needs {8 + n + end})"
    return ""


def what_is_wrong(e: Exception) -> str:
    """What a reader's error says is wrong with a file, in a few words."""
    if isinstance(e, json.JSONDecodeError):
        return f"line {e.lineno}: not valid JSON ({e.msg})"
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        return f"line {e.problem_mark.line + 1}: not valid YAML ({e.problem})"
    if isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in str(e):  # torch.load(weights_only=True)
        # met a global it does not allow
        found = re.search(r"(GLOBAL \S+|Unsupported \S+ \S+)", str(e))
        return ("holds pickled code, not only tensors, and was refused (loading it could run that code"
                f"{': ' + found.group(1) if found else ''})")
    if isinstance(e, UnicodeDecodeError):
        return "is not text (UTF-8)"
    return f"does not read ({one_line(e)[:160]})"


def json_lines(text: str) -> list[tuple[int, Any]]:
    """(line number, value) of each non-blank line of JSON Lines text. Lines end at "\\n" alone (not splitlines: a JSON
    string may hold U+2028 raw). A line that does not parse raises json.JSONDecodeError placed in the whole text, so
    its lineno is the file's line."""
    rows, start = [], 0
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise json.JSONDecodeError(e.msg, text, start + e.pos) from None
        start += len(line) + 1
    return rows


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`path` whole or absent: `write(tmp)` fills a sibling .tmp (removed first, so a link can take its name), which is
    synced to disk and then renamed over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    write(tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_file(path: str | Path, fix: str):
    """A file by its suffix: .json -> its value, .jsonl -> a list of rows, .yaml/.yml -> its value, .safetensors ->
    {name: tensor}, .pt/.bin -> torch.load(weights_only=True). A missing, truncated or unparseable file, an empty one
    that should not be (JSON, tensors), or a pickle holding code raises one line `PATH[:LINE]: what is wrong; fix` (FileNotFoundError or DamagedFile)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {fix}")
    kind = path.suffix.lower()
    if path.stat().st_size == 0 and kind not in (".jsonl", ".yaml", ".yml"):
        raise DamagedFile(f"{path} is empty; {fix}")
    try:
        if kind == ".safetensors":
            why = safetensors_damage(path)
            if why:
                raise DamagedFile(f"{path} {why}; {fix}")
            return load_file(path)
        if kind in (".pt", ".bin"):
            return torch.load(path, weights_only=True)
        text = path.read_text()
        if kind == ".jsonl":
            return [row for _, row in json_lines(text)]
        if kind in (".yaml", ".yml"):
            return yaml.safe_load(text)
        return json.loads(text)
    except DamagedFile:
        raise
    except (OSError, ValueError, RuntimeError, EOFError, SafetensorError, pickle.UnpicklingError,
            yaml.YAMLError) as e:
        why = what_is_wrong(e)
        line = re.match(r"line (\d+): (.*)", why)
        raise DamagedFile(f"{path}:{line[1]}: {line[2]}; {fix}" if line else f"{path}: {why}; {fix}") from None


def open_safetensors(path: str | Path, fix: str):
    """safe_open(path) for lazy, memory-mapped reads, after the same checks as `read_file`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {fix}")
    why = safetensors_damage(path)
    if why:
        raise DamagedFile(f"{path} {why}; {fix}")
    try:
        return safe_open(str(path), framework="pt")
    except (OSError, SafetensorError) as e:
        raise DamagedFile(f"{path}: {what_is_wrong(e)}; {fix}") from None


# ---- the batch contract ----------------------------------------------------------------------------

def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Stack equal-length rows of lists into tensors; right-pad ragged ones (mask 0 on padding)."""
    keys = rows[0].keys()
    longest = max(len(r["input_ids"]) for r in rows)
    out = {}
    for k in keys:
        pad = 0
        out[k] = torch.tensor([list(r[k]) + [pad] * (longest - len(r[k])) for r in rows])
    if "attention_mask" not in out and any(len(r["input_ids"]) < longest for r in rows):
        out["attention_mask"] = torch.tensor([[1] * len(r["input_ids"]) + [0] * (longest - len(r["input_ids"]))
                                              for r in rows])
    return out


# ---- the run directory -----------------------------------------------------------------------------

BEST, BEST_FILE, DRAFTER_FILE = "best", "best.json", "drafter.json"
SCHEMA_VERSION = 1  # of drafter.json


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"checkpoint-{step}"


def checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first (a half-written checkpoint-N.tmp is ignored)."""
    found = [p for p in Path(run_dir).glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def find_drafter(run: str | Path) -> Path:
    """A drafter dir from a run: RUN itself if it is one, else RUN/best, else the latest checkpoint's model/."""
    run = Path(run)
    for d in (run, run / BEST):
        if (d / DRAFTER_FILE).is_file():
            return d
    found = [c / "model" for c in checkpoints(run) if (c / "model" / DRAFTER_FILE).is_file()]
    if not found:
        raise FileNotFoundError(f"{run} holds no drafter (no drafter.json, best/ or checkpoint-*/model/); train first")
    return found[-1]


def has_drafter(run: str | Path) -> bool:
    try:
        find_drafter(run)
        return True
    except FileNotFoundError:
        return False


def best_record(run_or_best: str | Path) -> dict:
    """best.json of a run's best/ (or of the best/ dir given): {"step", metrics...}; {} when there is none."""
    d = Path(run_or_best)
    path = d / BEST_FILE if (d / BEST_FILE).is_file() else d / BEST / BEST_FILE
    return read_file(path, "train the run again or pick a checkpoint's model/") if path.is_file() else {}


def write_drafter_meta(drafter_dir: str | Path, method: str, **fields) -> None:
    """drafter.json of a drafter directory: the method that reads it back, and its own fields."""
    path = Path(drafter_dir) / DRAFTER_FILE
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "method": method, **fields}, indent=2) + "\n")


def read_drafter_meta(drafter_dir: str | Path) -> dict:
    """drafter.json as a dict with its schema_version (0 for files written before it was recorded)."""
    path = Path(drafter_dir) / DRAFTER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{drafter_dir} has no {DRAFTER_FILE}; pass a run dir, its best/ or a checkpoint's "
                                "model/")
    meta = read_file(path, "export or train the drafter again, or pass an older checkpoint's model/")
    version = meta.setdefault("schema_version", 0)
    if version > SCHEMA_VERSION or "method" not in meta:
        raise ValueError(f"{path}: schema_version {version} with method {meta.get('method')!r} is not one this "
                         f"draftsmith reads (up to {SCHEMA_VERSION}); upgrade draftsmith")
    return meta
