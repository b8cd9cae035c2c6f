"""One config story: typed dataclasses, YAML recipes, dotted `key=value` overrides.

An unknown key or a bad value fails before anything loads, naming the key and the closest
valid one. Recipes are data: YAML is read with `yaml.safe_load`, never evaluated as code.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

import draftsmith.data
import draftsmith.models
from draftsmith.data.core import ConfigError, read_file
from draftsmith.data.reference import PROMPTS_PATH
from draftsmith.models.target import TargetConfig
from draftsmith.recipes import RECIPES

# folders shipped inside the package, so that a recipe's `models/reference-target` or `recipes/...` works anywhere
SHIPPED = {"models": Path(draftsmith.models.__file__).parent, "data": Path(draftsmith.data.__file__).parent,
           "recipes": RECIPES}


@dataclasses.dataclass
class LoopConfig:
    """The shared training loop."""

    output_dir: str = "runs/default"
    seed: int = 0
    max_steps: int = 1000
    max_epochs: float = 1.0e9
    # stop once this much training time (evaluations excluded) is spent; 0: no limit. Schedules (warm-up, decay)
    # run over whichever of max_steps and max_minutes is further spent
    max_minutes: float = 0.0
    batch_size: int = 8  # per device, per micro-step
    grad_accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float = 0.05
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    save_every: int = 500
    keep_last: int = 2
    best_metric: str = ""  # key of an evaluation metric; empty: no best checkpoint
    best_mode: Literal["max", "min"] = "max"
    early_stop_patience: int = 0  # evaluations without a new best before stopping; 0: never
    # stop (keeping the last good checkpoint) when a step's loss exceeds divergence_factor x the median loss of the
    # last divergence_window steps (those since the start or resume, at first); 0: stop only on a NaN or infinite loss
    divergence_factor: float = 10.0
    divergence_window: int = 20
    resume: Literal["auto", "never"] = "auto"
    # in a multi-process launch, how long a rank waits in a collective for the others (torch's process group
    # timeout), and how long a rank may stay silent (no heartbeat) while the others wait for its longer work (rank 0
    # writing a checkpoint): past it the launch ends naming that rank (train/ranks.py)
    collective_timeout_minutes: float = 10.0
    # a checkpoint (RUN/checkpoint-<step>) of this method whose trained weights start the run, with a fresh optimizer,
    # schedule and data position: a trained drafter fine-tuned on new data. This run's own checkpoints resume first
    init_from: str = ""
    log_every: int = 10
    tracker: Literal["none", "wandb", "tensorboard", "trackio"] = "none"
    project: str = "draftsmith"

    def __post_init__(self):
        _check(self.max_steps > 0, "loop.max_steps", "must be > 0")
        _check(self.batch_size > 0, "loop.batch_size", "must be > 0")
        _check(self.max_minutes >= 0, "loop.max_minutes", "must be >= 0 (0: no time limit)")
        _check(self.grad_accum > 0, "loop.grad_accum", "must be > 0")
        _check(self.lr > 0, "loop.lr", "must be > 0")
        _check(0 <= self.warmup_ratio < 1, "loop.warmup_ratio", "must be in [0, 1)")
        _check(self.save_every > 0, "loop.save_every", "must be > 0")
        _check(self.keep_last >= 1, "loop.keep_last", "must be >= 1")
        _check(self.grad_clip >= 0, "loop.grad_clip", "must be >= 0 (0 disables clipping)")
        _check(self.divergence_factor == 0 or self.divergence_factor > 1, "loop.divergence_factor",
               "must be > 1 (0: stop only on NaN/inf)")
        _check(self.divergence_window >= 2, "loop.divergence_window", "must be >= 2")
        _check(self.collective_timeout_minutes > 0, "loop.collective_timeout_minutes", "must be > 0")


@dataclasses.dataclass
class EvalConfig:
    """The `eval` section of every recipe: held-out rows scored at every checkpoint (the reference held-out split
    unless heldout_path is set) and the held-out prompts decoded there to measure tau. A method adds its own
    decoding settings in a subclass beside its entry script."""

    heldout_path: str = ""  # held-out conversations (any data.path format); empty: the reference held-out split
    heldout_split: str = "heldout"
    heldout_examples: int = 64
    prompts: str = str(PROMPTS_PATH)  # held-out prompts decoded at every checkpoint (JSONL, messages or prompt)
    num_prompts: int = 8  # 0: no decoding at checkpoints
    max_new_tokens: int = 64

    def __post_init__(self):
        _check(self.heldout_examples >= 0, "eval.heldout_examples", "must be >= 0")
        _check(self.num_prompts >= 0, "eval.num_prompts", "must be >= 0 (0: no decoding at checkpoints)")
        _check(self.max_new_tokens >= 1, "eval.max_new_tokens", "must be >= 1")


@dataclasses.dataclass
class DrafterRecipe:
    """The sections every drafter recipe has; each method's Recipe adds `data`, its own section and `eval`."""

    target: TargetConfig = dataclasses.field(default_factory=TargetConfig)
    loop: LoopConfig = dataclasses.field(default_factory=LoopConfig)


def check_best_metric(cfg: LoopConfig, produced: list[str], off: str = "") -> None:
    """Refuse, before anything loads, a loop.best_metric the recipe's checkpoint evaluation will not produce.
    `produced`: the metric names it will log; `off`: why it produces none (e.g. decoding turned off)."""
    key = cfg.best_metric
    if not key or key in produced:
        return
    if not produced:
        raise ConfigError(f"loop.best_metric={key!r}: {off or 'this recipe evaluates nothing at checkpoints'}; "
                          "set loop.best_metric='' or turn the evaluation on")
    close = difflib.get_close_matches(key, produced, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    why = f" ({off})" if off else ""
    raise ConfigError(f"loop.best_metric={key!r} is not a metric this recipe's evaluation produces{why}; {hint}"
                      f"choose one of {sorted(produced)}")


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {why}")


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


YAML_BOOLS = {False: ("no", "off", "false"), True: ("yes", "on", "true")}  # PyYAML reads these as booleans


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML or command-line value to the annotated type, or raise ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return build(tp, value, prefix=key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is Literal:
        if isinstance(value, bool):  # YAML 1.1 reads no/off/yes/on as booleans: back to the choice spelt so
            value = next((a for a in args if isinstance(a, str) and a.lower() in YAML_BOOLS[value]), value)
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}{hint}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            value = yaml.safe_load(value if value.startswith("[") else f"[{value}]")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
            return tuple(_coerce(v, a, key) for v, a in zip(value, args, strict=True))
        item = args[0] if args else Any
        return origin(_coerce(v, item, key) for v in value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
        try:
            out = tp(float(value)) if tp is int and isinstance(value, str) and "e" in value.lower() else tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}") from None
        if tp is int and isinstance(value, float) and value != int(value):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return out
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def build(cls, values: dict[str, Any], prefix: str = ""):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys with a suggestion."""
    fields = _fields(cls)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {sorted(fields)}"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{prefix}{e}" if prefix and not str(e).startswith(prefix) else str(e)) from None


def _set_dotted(tree: dict, dotted: str, value: str) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: '{part}' is not a section")
        tree = node
    tree[parts[-1]] = value


def shipped(path: str) -> str:
    """A relative path into a shipped folder (models/, data/, recipes/) that is not there from the working directory:
    the shipped file, so that recipes work outside the checkout; any other path unchanged."""
    p = Path(path)
    if p.is_absolute() or not p.parts or p.parts[0] not in SHIPPED or p.exists():
        return path
    packaged = SHIPPED[p.parts[0]].joinpath(*p.parts[1:])
    return str(packaged) if packaged.exists() else path


INPUTS = ("path", "extra", "heldout_path", "prompts", "init_from", "regenerated", "checkpoint")  # keys naming files


def _shipped_paths(tree: dict) -> dict:
    def find(v):  # a path, or a list of them
        return shipped(v) if isinstance(v, str) else [find(x) for x in v] if isinstance(v, list) else v
    return {k: _shipped_paths(v) if isinstance(v, dict) else find(v) if k in INPUTS else v for k, v in tree.items()}


def load(cls, path: str | Path | None = None, overrides: list[str] = ()):
    """Recipe YAML (optional) + `key=value` overrides -> validated `cls` instance (the recipe and the files it reads,
    `INPUTS`, found by `shipped`)."""
    tree: dict = {}
    if path is not None:
        path = Path(shipped(str(path)))
        if not path.is_file():
            raise ConfigError(f"recipe {path} not found; pass --config with a YAML file under recipes/")
        tree = read_file(path, "fix the recipe (YAML: `section:` lines, then indented `key: value` lines)") or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"recipe {path}: top level must be a mapping")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. loop.lr=3e-4)")
        key, value = item.split("=", 1)
        try:
            value = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({getattr(e, 'problem', e)}); quote "
                              "it or fix the brackets") from None
        _set_dotted(tree, key.strip(), value)
    return build(cls, _shipped_paths(tree))


def to_dict(cfg) -> dict:
    """Plain nested dict of a config, for YAML and trackers."""
    def plain(v):
        return list(v) if isinstance(v, tuple) else v
    out = dataclasses.asdict(cfg)

    def walk(d):
        return {k: walk(v) if isinstance(v, dict) else plain(v) for k, v in d.items()}
    return walk(out)


def from_command_line(cls, default_recipe: str | Path, argv: list[str] | None, doc: str | None):
    """The entry scripts' command line: `--config RECIPE.yaml` then dotted `key=value` overrides."""
    import argparse

    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(default_recipe), help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. loop.max_steps=10")
    args = parser.parse_args(argv)
    return load(cls, args.config, args.overrides)
