"""The `draftsmith` command: one entry point for training, evaluation, export, benchmarks and data jobs.

    draftsmith train METHOD [RECIPE] [key=value ...]    # in this process; RECIPE: a shipped name or a YAML file
    draftsmith train medusa medusa2-tiny-code loop.max_steps=10 loop.output_dir=runs/m2
    draftsmith evaluate --drafter RUN/best [...]        # tau, acceptance by position, speedup
    draftsmith export RUN --format FORMAT --out DIR     # a serving engine's format (gguf: llama.cpp)
    draftsmith llama-cpp [--build]                      # where llama.cpp is, or build it once into the cache
    draftsmith bench [...]                              # the leaderboard
    draftsmith cache --config RECIPE --out DIR          # EAGLE's offline hidden-state cache
    draftsmith regenerate --target DIR --out FILE       # the target's own answers as training data
    draftsmith self-distill --target NAME [--finalize]  # self-distilled chat data for a named real target
    draftsmith gpu-check [--smoke]                      # training throughput of every recipe on one GPU
    draftsmith plan --target NAME|CONFIG [--seq 2048]   # EAGLE-3's memory per GPU under each launcher, from configs
    draftsmith COMMAND --help                           # a command's options

METHOD is one of train/entries.py's TRAIN (the registry's training entries and `target`); with no RECIPE it trains
on the method's default recipe (the embedded reference target). On many GPUs, launch the same entry script with
accelerate: `accelerate launch train/METHOD.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from draftsmith.models import llama_cpp
from draftsmith.recipes import RECIPES
from draftsmith.train import bench, cache, evaluate, export, gpu_check, memory_plan, regenerate, self_distill
from draftsmith.train.entries import TRAIN
from draftsmith.train.guard import cli

COMMANDS: dict[str, Callable] = {"evaluate": evaluate.main, "export": export.main, "bench": bench.main,
                                 "cache": cache.main, "regenerate": regenerate.main, "self-distill": self_distill.main,
                                 "gpu-check": gpu_check.main, "llama-cpp": llama_cpp.main, "plan": memory_plan.main}


def shipped_recipes(method: str) -> list[str]:
    """The names of METHOD's shipped recipes, recipes/METHOD/*.yaml."""
    return sorted(p.stem for p in (RECIPES / method).glob("*.yaml"))


def recipe_path(method: str, recipe: str) -> Path:
    """A recipe by shipped name (`medusa2-tiny-code`) or as a YAML path."""
    if recipe.endswith((".yaml", ".yml")):
        return Path(recipe)
    shipped = RECIPES / method / f"{recipe}.yaml"
    if not shipped.is_file():
        raise SystemExit(f"draftsmith train {method}: no recipe {recipe!r}; shipped: "
                         f"{', '.join(shipped_recipes(method))}, or pass a YAML file")
    return shipped


def train_help() -> str:
    """`draftsmith train --help`: the command line, then every METHOD with its shipped recipes."""
    width = max(map(len, TRAIN))
    return ("usage: draftsmith train METHOD [RECIPE] [key=value ...]\n\n"
            "Trains METHOD in this process on RECIPE (a shipped name or a YAML file; none: the method's default\n"
            "recipe, on the embedded reference target), with dotted key=value overrides. `draftsmith train METHOD\n"
            "--help` lists the method's options.\n\nmethods and their shipped recipes:\n"
            + "\n".join(f"  {m:<{width}}  {', '.join(shipped_recipes(m))}" for m in TRAIN))


def train(argv: list[str]):
    """`draftsmith train METHOD [RECIPE] [key=value ...]` -> the entry script's main (its Loop)."""
    if argv[:1] in (["-h"], ["--help"]):
        print(train_help())
        raise SystemExit(0)  # as every command's --help ends
    if not argv or argv[0] not in TRAIN:
        raise SystemExit(f"draftsmith train METHOD [RECIPE] [key=value ...]; METHOD: {', '.join(TRAIN)}")
    method, rest = argv[0], argv[1:]
    if rest and "=" not in rest[0] and not rest[0].startswith("-"):
        rest = ["--config", str(recipe_path(method, rest[0])), *rest[1:]]
    return cli(TRAIN[method].main, rest)


def run(argv: list[str]):
    """Run one command line; what the command returns (the Loop of a training run, an export's path, ...)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return None
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train(rest)
    if command not in COMMANDS:
        raise SystemExit(f"draftsmith: unknown command {command!r}; choose train or one of {', '.join(COMMANDS)}")
    return cli(COMMANDS[command], rest)


def main(argv: list[str] | None = None) -> None:
    """The console script: exit status 0 unless the command fails."""
    run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
