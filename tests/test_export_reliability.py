"""Exports carry a target reference that resolves from anywhere, the same way for every method; LayerSkip exports;
`draftsmith evaluate` measures every export format as the checkpoint evaluation measured the checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig

from draftsmith.models.export import EXPORT_FILE
from draftsmith.models.registry import export, load
from draftsmith.models.target import REFERENCE_TARGET
from draftsmith.train import distill, eagle3, layerskip, medusa
from draftsmith.train import evaluate as evaluate_command

GIVEN = "models/reference-target"  # the recipes' relative target.path
TINY = ["loop.max_steps=1", "loop.batch_size=2", "data.limit=8", "data.pack=false", "eval.num_prompts=1",
        "eval.max_new_tokens=8", f"target.path={GIVEN}"]
RUNS = {  # method -> (entry point, overrides, formats)
    "medusa": (medusa.main, ["eval.heldout_examples=4"], ["medusa", "tgi", "vllm", "hf"]),
    "eagle3": (eagle3.main, ["eval.heldout_examples=4", "eagle.draft_vocab_size=512", "eagle.num_layers=1"],
               ["sglang", "vllm", "speculators"]),  # one layer: SGLang's format holds no more
    "distill": (distill.main, [], ["hf", "vllm"]),
    "layerskip": (layerskip.main, ["eval.heldout_examples=4", "eval.exit_layers=[2]"], ["hf"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One tiny run per method (1 step, 1 evaluation), trained from the repository with the relative target path."""
    root, cwd = tmp_path_factory.mktemp("runs"), os.getcwd()
    os.chdir(REPO)
    try:
        for name, (main, extra, _) in RUNS.items():
            main([f"loop.output_dir={root / name}", *TINY, *extra])
    finally:
        os.chdir(cwd)
    return {name: root / name for name in RUNS}


def exports(runs, root: Path):
    for name, (_, _, formats) in RUNS.items():
        for fmt in formats:
            yield name, fmt, export(runs[name] / "best", fmt, root / f"{name}-{fmt}")


def test_every_export_records_the_target_as_an_absolute_path_and_as_given(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # exported and read back away from the repository
    absolute = str(REFERENCE_TARGET.resolve())
    for name in ("medusa", "eagle3", "distill", "layerskip"):
        meta = json.loads((runs[name] / "best" / "drafter.json").read_text())
        assert (meta["target"], meta["target_as_given"]) == (absolute, GIVEN), name
    for name, fmt, out in exports(runs, tmp_path):
        side = json.loads((out / EXPORT_FILE).read_text())
        assert side["method"] == json.loads((runs[name] / "best" / "drafter.json").read_text())["method"]
        assert side["format"] == fmt and side["drafter"] == str((runs[name] / "best").resolve())
        assert (side["target"], side["target_as_given"]) == (absolute, GIVEN), (name, fmt)
        config = json.loads((out / "config.json").read_text())
        if name == "medusa" and fmt in ("medusa", "tgi", "vllm"):
            assert config["base_model_name_or_path"] == absolute
        if fmt == "speculators":
            assert config["speculators_config"]["verifier"]["name_or_path"] == absolute
        load(side["method"], fmt, out)  # every loader finds the target from here


def test_layerskip_export_is_the_trained_target_with_assistant_early_exit(runs, tmp_path):
    best = runs["layerskip"] / "best"
    out = export(best, "hf", tmp_path / "ls")
    assert GenerationConfig.from_pretrained(out).assistant_early_exit == 2
    assert json.loads((best / "drafter.json").read_text())["exit_layer"] == 2
    exported, trained = load_file(out / "model.safetensors"), load_file(best / "model.safetensors")
    assert exported.keys() == trained.keys() and all(torch.equal(exported[k], trained[k]) for k in trained)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 8 and (out / "tokenizer.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ls"]  # no temporary directory left beside it


def test_evaluate_measures_every_export_as_the_checkpoint_evaluation_did(runs, tmp_path):
    evaluate = evaluate_command
    for name, fmt, out in exports(runs, tmp_path):
        best = json.loads((runs[name] / "best" / "best.json").read_text())
        logged = best["tau"] if name != "layerskip" else best["tau_exit2"]
        result = evaluate.main(["--drafter", str(out), "--num-prompts", "1", "--max-new-tokens", "8",
                                "--out", str(tmp_path / f"{name}-{fmt}.json")])
        assert result["tau"] == pytest.approx(logged), (name, fmt)
        assert result["greedy_matches_target"] is True, (name, fmt)


def test_an_export_the_disk_cannot_hold_is_refused_before_writing(runs, tmp_path, monkeypatch):
    from draftsmith.data import core

    real = core.shutil.disk_usage
    monkeypatch.setattr(core.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(core.DiskFull) as e:
        export(runs["medusa"] / "best", "hf", tmp_path / "out")
    assert core.one_line(e.value).startswith("not enough disk space for the hf export: needs about 0.0")
    assert core.one_line(e.value).endswith("; free space or choose another --out")
    assert list(tmp_path.iterdir()) == []
