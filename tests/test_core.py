"""The bottom layer (data/core.py): run-directory discovery and the versioned drafter.json."""

from __future__ import annotations

import json

import pytest

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
