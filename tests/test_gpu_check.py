"""The GPU throughput check (train/gpu_check.py) in its CPU smoke mode: the report and its timing split."""

from __future__ import annotations

import json

import pytest

from draftsmith.train import gpu_check


def test_smoke_trains_each_recipe_and_splits_the_step_time(tmp_path):
    report = gpu_check.main(["--smoke", "--recipes", "medusa1", "layerskip", "--work", str(tmp_path / "work"),
                             "--out", str(tmp_path / "gpu.json")])
    assert json.loads((tmp_path / "gpu.json").read_text()) == report
    assert report["mode"] == "smoke" and report["target"]["num_hidden_layers"] == 4
    medusa, layerskip = report["recipes"]["medusa1"], report["recipes"]["layerskip"]
    for r in (medusa, layerskip):
        assert r["steps"] == 6 and r["tokens_per_s"] > 0 and r["eval_seconds"] is not None
    # 6 steps x 2 rows x up to 128 tokens went through training, evaluations not counted
    assert 0 < medusa["train_tokens"] <= 6 * 2 * 128
    assert medusa["tokens_per_s"] == pytest.approx(medusa["train_tokens"] / medusa["train_seconds"], rel=0.05)
    assert 0 < medusa["target_forward_seconds"] < medusa["train_seconds"]
    assert medusa["target_forward_seconds"] + medusa["rest_seconds"] == \
        pytest.approx(medusa["train_seconds"], abs=0.02)
    assert "target_forward_seconds" not in layerskip and "trains the target itself" in layerskip["note"]
