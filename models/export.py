"""An export format (writer + loader) and the atomic, no-clobber directory write every format goes through.

Each method's module lists its formats (`FORMATS = {name: Format}`), found through models/registry.py.
`write_export` writes into a temporary sibling of `out` and renames it into place only once the writer has
finished, so an interrupted export never leaves a partial directory. A non-empty `out` is refused unless
`overwrite`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.data.core import (
    REDO_EXPORT,
    DiskFull,
    check_free,
    dir_bytes,
    is_disk_full,
    one_line,
    read_drafter_meta,
    read_file,
)
from draftsmith.models.target import target_fields

EXPORT_FILE = "draftsmith_export.json"  # in every export: method, format and the target it verifies with


@dataclass(frozen=True)
class Format:
    """write(drafter_dir, tmp_dir, final_dir) fills tmp_dir; load(dir) reads the format back; with_target: it also
    writes the target's weights (counted in the free-space check)."""

    write: Callable[[Path, Path, Path], None]
    load: Callable[[Path], Any]
    help: str = ""
    with_target: bool = False


def write_json(path: Path, obj: dict) -> None:
    """A config file as the engines' loaders read it (indented JSON, final newline)."""
    path.write_text(json.dumps(obj, indent=2) + "\n")


def vllm_parallel_drafting_token_id(config: dict) -> int:
    """The token vLLM feeds at parallel-drafting slots (P-EAGLE, DFlash), read in vLLM's order
    (vllm/v1/worker/gpu/spec_decode/utils.py get_parallel_drafting_token_id): dflash_config.mask_token_id,
    mask_token_id, dspark_noise_token_id, pard_token, ptd_token_id."""
    found = [((config.get("dflash_config") or {}).get("mask_token_id"))] + [
        config.get(k) for k in ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")]
    ids = [i for i in found if i is not None]
    if not ids:
        raise ValueError("config.json names no parallel-drafting token (dflash_config.mask_token_id, mask_token_id, "
                         "dspark_noise_token_id, pard_token or ptd_token_id); vLLM refuses it")
    return int(ids[0])


def write_export(drafter_dir: str | Path, name: str, fmt: Format, out: str | Path, overwrite: bool = False) -> Path:
    """Write the drafter at `drafter_dir` to `out` in format `fmt` (named `name`), atomically."""
    drafter_dir, out = Path(drafter_dir), Path(out).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass --overwrite or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    target = read_drafter_meta(drafter_dir).get("target") or ""
    need = dir_bytes(drafter_dir) + (dir_bytes(Path(target)) if fmt.with_target and target and Path(target).is_dir()
                                     else 0)
    check_free(out.parent, need, f"the {name} export", "free space or choose another --out")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        try:
            fmt.write(drafter_dir, tmp, out)
            record_target(tmp, drafter_dir, name)
        except (OSError, RuntimeError) as e:
            if is_disk_full(e):
                raise DiskFull(f"the disk filled up while writing the {name} export ({one_line(e)}); nothing was "
                               f"left at {out}; free space or choose another --out") from e
            raise
        _publishable(tmp)
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def record_target(tmp: Path, drafter_dir: Path, name: str) -> None:
    """Add method, format, target and the drafter it came from to the export's draftsmith_export.json."""
    meta = read_drafter_meta(drafter_dir)
    side = tmp / EXPORT_FILE
    record = read_file(side, REDO_EXPORT) if side.is_file() else {}
    decoding = {k: meta[k] for k in ("tree_choices", "exit_layer", "gamma") if k in meta}  # as checkpoints decoded
    write_json(side, {**record, "method": meta["method"], "format": name, **target_fields(meta),
                      "drafter": str(Path(drafter_dir).resolve()), **decoding})


def _publishable(root: Path) -> None:
    """Give the export the permissions of a normal directory tree (mkdtemp creates it 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)
