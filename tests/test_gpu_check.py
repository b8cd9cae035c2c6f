"""The GPU throughput check (train/gpu_check.py) in its CPU smoke mode: the report and its timing split."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_smoke_trains_each_recipe_and_splits_the_step_time(tmp_path):
    # its own process: the check's bf16 accelerate state would outlive it in this one
    done = subprocess.run([sys.executable, "-m", "draftsmith.train.gpu_check", "--smoke", "--recipes", "medusa1",
                           "layerskip", "eagle3", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "gpu.json")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["mode"] == "smoke" and report["target"]["num_hidden_layers"] == 4
    medusa, layerskip = report["recipes"]["medusa1"], report["recipes"]["layerskip"]
    for r in (medusa, layerskip, report["recipes"]["eagle3"]):  # trained and evaluated under bf16 autocast
        assert r["steps"] == 6 and r["tokens_per_s"] > 0 and r["eval_seconds"] is not None
    # 6 steps x 2 rows x up to 128 tokens went through training, evaluations not counted
    assert 0 < medusa["train_tokens"] <= 6 * 2 * 128
    assert medusa["tokens_per_s"] == pytest.approx(medusa["train_tokens"] / medusa["train_seconds"], rel=0.05)
    assert 0 < medusa["target_forward_seconds"] < medusa["train_seconds"]
    assert medusa["target_forward_seconds"] + medusa["rest_seconds"] == \
        pytest.approx(medusa["train_seconds"], abs=0.02)
    assert "target_forward_seconds" not in layerskip and "trains the target itself" in layerskip["note"]
    # each trained drafter then decodes for real: greedy output equal to the target's in float32
    for r in (medusa, layerskip):
        assert r["decode"]["float32"]["greedy_matches_target"] is True and r["decode"]["float32"]["tau_t0"] >= 1
        assert set(r["decode"]["bfloat16"]) >= {"tau_t0", "tau_t1", "greedy_matches_target"}
