"""Config: typed recipes, dotted overrides, clear errors; every shipped recipe parses."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.train import config as C
from draftsmith.train.entries import TRAIN
from draftsmith.train.target import Recipe as TargetRecipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def test_overrides_are_typed():
    cfg = C.load(TargetRecipe, None, ["loop.lr=3e-4", "loop.max_steps=12", "model.num_layers=2",
                                      "loop.betas=[0.8, 0.9]", "loop.schedule=linear"])
    assert cfg.loop.lr == 3e-4 and cfg.loop.max_steps == 12 and cfg.model.num_layers == 2
    assert cfg.loop.betas == (0.8, 0.9) and cfg.loop.schedule == "linear"
    # YAML reads `no` as False: a choice spelt so still parses (overrides and recipe files both go through YAML)
    assert C.load(TargetRecipe, None, ["loop.mixed_precision=no"]).loop.mixed_precision == "no"
    assert C.load(TargetRecipe, None, ["loop.mixed_precision=bf16"]).loop.mixed_precision == "bf16"
    with pytest.raises(C.ConfigError, match="loop.mixed_precision: True is not one of"):
        C.load(TargetRecipe, None, ["loop.mixed_precision=true"])


@pytest.mark.parametrize("override, message", [
    ("loop.lrr=1", "unknown config key 'loop.lrr'; did you mean 'loop.lr'"),
    ("lop.lr=1", "unknown config key 'lop'; did you mean 'loop'"),
    ("loop.schedule=cosin", "did you mean 'cosine'"),
    ("loop.max_steps=ten", "loop.max_steps: expected int"),
    ("loop.max_steps=0", "loop.max_steps: must be > 0"),
    ("loop.max_steps=2.5", "expected an integer"),
    ("loop.lr", "must look like key=value"),
])
def test_bad_config_names_the_key_and_the_fix(override, message):
    with pytest.raises(C.ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        C.load(TargetRecipe, None, [override])


def test_missing_recipe_file_is_a_clear_error(tmp_path):
    with pytest.raises(C.ConfigError, match="not found"):
        C.load(TargetRecipe, tmp_path / "nope.yaml")


def test_yaml_is_data_not_code(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("loop: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(Exception, match="could not determine a constructor"):
        C.load(TargetRecipe, path)


@pytest.mark.parametrize("recipe", sorted(p for p in RECIPES.glob("*/*.yaml") if p.parent.name != "accelerate"),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_recipe_parses_against_its_script(recipe):
    script = TRAIN[recipe.parent.name]
    cfg = C.load(script.Recipe, recipe)
    assert C.to_dict(cfg)
