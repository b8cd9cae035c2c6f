"""The `draftsmith` command, called in-process: train a method on its default recipe, then export the run."""

from __future__ import annotations

import json
import re

import pytest

from draftsmith.models import registry
from draftsmith.recipes import RECIPES
from draftsmith.train import bench, cli, gpu_check
from draftsmith.train import config as C

TINY = ["data.limit=48", "data.max_length=128", "data.cache=false", "loop.batch_size=2", "loop.max_steps=2",
        "loop.save_every=2", "loop.log_every=1", "eval.heldout_examples=6", "eval.num_prompts=1",
        "eval.max_new_tokens=4", "eval.tree_budget=4", "eval.tree_ranks=2"]


def test_train_then_export(tiny_chat_target, tmp_path, capsys):
    run = tmp_path / "run"
    loop = cli.run(["train", "medusa", f"target.path={tiny_chat_target}", f"loop.output_dir={run}", *TINY])
    assert loop.state.step == 2 and (run / "best" / "drafter.json").is_file()
    assert json.loads((run / "best" / "drafter.json").read_text())["variant"] == "medusa1"  # the default recipe
    out = cli.run(["export", str(run), "--format", "medusa", "--out", str(tmp_path / "export")])
    assert out == tmp_path / "export" and (out / "medusa_lm_head.safetensors").is_file()
    assert json.loads((out / "draftsmith_export.json").read_text())["format"] == "medusa"
    assert "exported" in capsys.readouterr().out


def test_recipes_by_name_or_file_and_bad_commands_fail_in_one_line(capsys):
    assert cli.recipe_path("medusa", "medusa2-tiny-code") == RECIPES / "medusa" / "medusa2-tiny-code.yaml"
    assert str(cli.recipe_path("eagle", "mine.yaml")) == "mine.yaml"
    with pytest.raises(SystemExit, match="shipped: medusa1-smollm2-135m, medusa1-tiny-code"):
        cli.recipe_path("medusa", "nope")
    with pytest.raises(SystemExit, match="METHOD: medusa, eagle"):
        cli.run(["train", "mystery"])
    with pytest.raises(SystemExit, match="unknown command 'fly'"):
        cli.run(["fly"])
    assert cli.main(["--help"]) is None  # the console script's exit status is 0
    assert "draftsmith train METHOD [RECIPE]" in capsys.readouterr().out


def test_recipe_inputs_resolve_to_the_shipped_files_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = C.load(cli.TRAIN["medusa"].Recipe, "recipes/medusa/medusa1-tiny-code.yaml", ["loop.output_dir=runs/x"])
    assert cfg.target.path == str(C.SHIPPED["models"] / "reference-target")  # recipe: models/reference-target
    assert cfg.loop.output_dir == "runs/x"  # outputs stay where the user runs
    assert C.shipped("data/not-shipped.jsonl") == "data/not-shipped.jsonl"
    regenerated = "data/regenerated/reference-target/train.jsonl.gz"
    cfg = C.load(cli.TRAIN["eagle3"].Recipe, None, [f"data.extra=['', {regenerated}]"])  # each of a list of paths
    assert cfg.data.extra == ["", str(C.SHIPPED["data"] / "regenerated/reference-target/train.jsonl.gz")]


def test_every_advertised_command_is_wired_and_answers_its_help(capsys):
    advertised = set(re.findall(r"^    draftsmith ([a-z-]+)", cli.__doc__, re.M)) - {"COMMAND"}
    assert advertised == {"train", *cli.COMMANDS} >= {"train", "evaluate", "export", "bench", "cache", "regenerate",
                                                       "self-distill", "gpu-check"}
    for command in cli.COMMANDS:
        with pytest.raises(SystemExit) as e:
            cli.run([command, "--help"])
        assert e.value.code == 0, command
        assert "usage:" in capsys.readouterr().out


def test_the_registry_is_the_one_method_list_the_cli_leaderboard_and_gpu_check_read():
    assert list(cli.TRAIN) == registry.ENTRIES
    assert all((RECIPES / r.recipe).is_file() and r.entry in cli.TRAIN for r in registry.RECIPES)
    keys = [r.key for r in registry.RECIPES]
    assert [m.key for m in bench.METHODS if m.script] == keys == list(gpu_check.CHECKS)


def test_train_help_exits_0_with_every_method_and_its_shipped_recipes(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: draftsmith train METHOD [RECIPE]")
    listed = {method: recipes.split(", ") for method, recipes in
              (line.split(None, 1) for line in out.split("methods and their shipped recipes:\n")[1].splitlines())}
    assert listed == {method: sorted(p.stem for p in (RECIPES / method).glob("*.yaml")) for method in cli.TRAIN}
    assert "medusa2-tiny-code" in listed["medusa"] and "gemma3-270m" in listed["eagle3"]


def test_export_help_lists_each_methods_formats_from_the_registry(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "--help"])
    assert e.value.code == 0
    listed, method = {}, None
    for line in capsys.readouterr().out.split("formats by method:\n")[1].splitlines():
        if line.startswith("    "):
            listed[method].append(line.split()[0])
        else:
            method = line.strip()
            listed[method] = []
    assert listed == {m: list(p.formats) for m, p in registry.METHODS.items()}
    assert "speculators" in listed["eagle"] and listed["layerskip"] == ["hf"]
