"""The GPU throughput check (train/gpu_check.py) in its CPU smoke mode: the report and its timing split, and (slow)
every recipe of the check end to end through `draftsmith gpu-check --smoke`, so the check is known to run before a
GPU is at hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.train import cli, gpu_check


def test_smoke_trains_each_recipe_and_splits_the_step_time(tmp_path):
    # its own process: the check's bf16 accelerate state would outlive it in this one
    done = subprocess.run([sys.executable, "-m", "draftsmith.train.gpu_check", "--smoke", "--recipes", "medusa1",
                           "layerskip", "eagle3", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "gpu.json")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    assert report["mode"] == "smoke" and report["target"]["num_hidden_layers"] == 4
    # the recipes' layer choices for the 8-layer reference target, at the same depth of this 4-layer one
    assert report["run"]["layers"] == {"layerskip": ["eval.exit_layers=[1]", "loop.best_metric=tau_exit1"]}
    assert gpu_check.layer_overrides("dflash", 22) == ["dflash.aux_layers=[5,11,16]"]
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


@pytest.mark.slow
def test_smoke_runs_every_recipe_of_the_check_through_the_command(tmp_path, capsys):
    # as a user runs it in a fresh directory, before any GPU: `draftsmith gpu-check --smoke`, defaults only
    done = subprocess.run([str(Path(sys.executable).with_name("draftsmith")), "gpu-check", "--smoke"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    with pytest.raises(SystemExit):
        cli.run(["gpu-check", "--help"])
    assert "runs/gpu-check-smoke/gpu.jsonwith--smoke" in "".join(capsys.readouterr().out.split())  # as wrapped
    report = json.loads((tmp_path / "runs/gpu-check-smoke/gpu.json").read_text())  # where --help says
    assert list(report["recipes"]) == list(gpu_check.CHECKS)  # every recipe of the registry, in its order
    for name, r in report["recipes"].items():
        assert r["steps"] == 6 and r["train_tokens"] > 0 and r["tokens_per_s"] > 0, name
        assert r["eval_seconds"] is not None and math.isfinite(r["loss_first"]) and math.isfinite(r["loss_last"]), name
        for dtype in ("float32", "bfloat16"):
            assert "error" not in r["decode"][dtype] and r["decode"][dtype]["tau_t0"] >= 1, (name, r["decode"])
        assert r["decode"]["float32"]["greedy_matches_target"] is True, name
