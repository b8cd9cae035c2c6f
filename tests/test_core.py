"""The bottom layer (data/core.py): run-directory discovery, the versioned drafter.json and opening files."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.data import core


def drafter(d, method="medusa", **fields):
    d.mkdir(parents=True)
    core.write_drafter_meta(d, method, **fields)
    return d


def test_run_discovery_ignores_a_half_written_checkpoint(tmp_path):
    for step in (1, 2, 10):
        drafter(tmp_path / f"checkpoint-{step}" / "model")
    drafter(tmp_path / "checkpoint-11.tmp" / "model")  # an interrupted save
    (tmp_path / "checkpoint-12.tmp").mkdir()
    assert [c.name for c in core.checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2", "checkpoint-10"]
    assert core.find_drafter(tmp_path) == tmp_path / "checkpoint-10" / "model"  # numeric order, .tmp never
    best = drafter(tmp_path / "best")
    (best / "best.json").write_text(json.dumps({"step": 2, "tau": 2.5}))
    assert core.find_drafter(tmp_path) == best and core.find_drafter(best) == best
    assert core.best_record(tmp_path) == core.best_record(best) == {"step": 2, "tau": 2.5}
    assert core.has_drafter(tmp_path) and not core.has_drafter(tmp_path / "checkpoint-12.tmp")
    with pytest.raises(FileNotFoundError, match="holds no drafter"):
        core.find_drafter(tmp_path / "checkpoint-12.tmp")


def test_drafter_json_is_versioned_and_old_files_stay_readable(tmp_path):
    d = drafter(tmp_path / "new", "eagle", version=3, aux_layers=[2, 4])
    assert json.loads((d / "drafter.json").read_text()) == {"schema_version": core.SCHEMA_VERSION, "method": "eagle",
                                                            "version": 3, "aux_layers": [2, 4]}
    assert core.read_drafter_meta(d)["aux_layers"] == [2, 4]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "drafter.json").write_text(json.dumps({"method": "distill", "gamma": 4}))
    assert core.read_drafter_meta(tmp_path / "old") == {"method": "distill", "gamma": 4, "schema_version": 0}
    (tmp_path / "future").mkdir()
    (tmp_path / "future" / "drafter.json").write_text(json.dumps({"method": "x", "schema_version": 99}))
    with pytest.raises(ValueError, match="schema_version 99"):
        core.read_drafter_meta(tmp_path / "future")
    with pytest.raises(FileNotFoundError, match="has no drafter.json"):
        core.read_drafter_meta(tmp_path)


def test_collate_pads_ragged_rows_and_masks_the_padding():
    batch = core.collate([{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4], "loss_mask": [1]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def damaged_files(d):
    """One damaged file of each kind read_file opens, and the regex its one line must match (path first)."""
    save_file({"w": torch.zeros(64)}, d / "whole.safetensors")
    (d / "cut.safetensors").write_bytes((d / "whole.safetensors").read_bytes()[:200])
    torch.save({"w": torch.zeros(4)}, d / "whole.pt")
    (d / "cut.pt").write_bytes((d / "whole.pt").read_bytes()[:60])

    class Code:  # a pickle that would run a command when loaded without weights_only
        def __reduce__(self):
            return os.system, ("true",)
    torch.save({"w": Code()}, d / "code.pt")
    (d / "bad.json").write_text('{"a": 1,\n "b": }\n')
    (d / "bad.yaml").write_text("loop:\n  lr: 1e-3\n  steps: [1,\n  x: y: z\n")
    (d / "bad.jsonl").write_text('{"a": 1}\n\n{"a":\n')
    (d / "empty.json").write_text("")
    return {"cut.safetensors": r"cut.safetensors is truncated or damaged \(200 bytes, its header needs 328\)",
            "cut.pt": r"cut.pt: does not read \(PytorchStreamReader failed",
            "code.pt": r"code.pt: holds pickled code, not only tensors, and was refused .*GLOBAL posix.system",
            "bad.json": r"bad.json:2: not valid JSON \(Expecting value\)",
            "bad.yaml": r"bad.yaml:4: not valid YAML \(expected ',' or '\]', but got ':'\)",
            "bad.jsonl": r"bad.jsonl:3: not valid JSON",
            "empty.json": r"empty.json is empty",
            "gone.json": r"gone.json is missing"}


def test_read_file_refuses_a_damaged_file_in_one_line_naming_path_problem_and_fix(tmp_path):
    for name, expected in damaged_files(tmp_path).items():
        with pytest.raises((core.DamagedFile, FileNotFoundError)) as e:
            core.read_file(tmp_path / name, "the fix")
        line = str(e.value)
        assert "\n" not in line and line.startswith(str(tmp_path / name)) and line.endswith("; the fix"), line
        assert re.search(expected, line), line
    assert core.read_file(tmp_path / "whole.safetensors", "-")["w"].shape == (64,)
    assert core.read_file(tmp_path / "whole.pt", "-")["w"].shape == (4,)
    with pytest.raises(core.DamagedFile, match="cut.safetensors is truncated"):
        core.open_safetensors(tmp_path / "cut.safetensors", "the fix")
    with core.open_safetensors(tmp_path / "whole.safetensors", "-") as f:
        assert f.get_tensor("w").shape == (64,)
