"""Distil a separate draft model from any Hugging Face causal LM (DistillSpec / GKD).

    accelerate launch train/distill.py --config recipes/distill/tiny-code.yaml [key=value ...]

Loads the target frozen, builds the draft (`distill.init`: the target's first layers copied, a
narrower config, or an existing checkpoint; its tokenizer is checked against the target's before
anything trains), builds the offline sequences (the fixed dataset, the target's regenerated
answers from `draftsmith regenerate`, or both) with the target's tokenizer and chat template
(assistant tokens only in the loss), and hands the method (models/distill.py) to the shared loop.
At every checkpoint tau is measured by real speculative decoding of held-out prompts with the
decoder's draft-model proposer; the best checkpoint by `loop.best_metric` (tau) is kept in `best/`,
a plain Hugging Face model directory that `target.generate(..., assistant_model=...)` and vLLM load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import datasets

from draftsmith.data.dataset import DataConfig, build_dataset
from draftsmith.decoding.evaluate import decode_metric_names
from draftsmith.models.distill import Distill, DistillConfig, build_draft
from draftsmith.recipes import RECIPES
from draftsmith.train import config as C
from draftsmith.train.guard import cli
from draftsmith.train.loop import Loop
from draftsmith.train.runner import Spec, decoder, run


@dataclasses.dataclass
class EvalConfig(C.EvalConfig):
    """The shared evaluation (only its prompts: a draft model has no held-out row metrics), at temperatures."""

    temperatures: list[float] = dataclasses.field(default_factory=lambda: [0.0])  # tau is the first's

    def __post_init__(self):
        super().__post_init__()
        if not self.temperatures or min(self.temperatures) < 0:
            raise C.ConfigError("eval.temperatures: at least one, all >= 0")


@dataclasses.dataclass
class Recipe(C.DrafterRecipe):
    data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(max_length=256))
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


def build_sequences(cfg: Recipe, tokenizer) -> datasets.Dataset:
    """The offline training rows: the fixed data, the regenerated data in its place, or after it (a data.extra
    source)."""
    regenerated = cfg.distill.regenerated
    if cfg.distill.sequences != "fixed" and not Path(regenerated).is_file():
        raise C.ConfigError(f"distill.regenerated: {regenerated} not found; write it with "
                            "draftsmith regenerate --target <target> --out <file>.jsonl")
    data = {"fixed": cfg.data, "regenerated": dataclasses.replace(cfg.data, path=regenerated),
            "mixed": dataclasses.replace(cfg.data, extra=[*cfg.data.extra, regenerated])}[cfg.distill.sequences]
    return build_dataset(data, tokenizer)


def metric_names(cfg: Recipe) -> list[str]:
    """The metrics the checkpoint evaluation logs under this recipe: decoding's alone (none with eval.num_prompts=0)."""
    names = decode_metric_names(tuple(cfg.eval.temperatures), cfg.distill.gamma) + ["eval_seconds"]
    return names if cfg.eval.num_prompts else []


SPEC = Spec(Recipe, RECIPES / "distill/tiny-code.yaml", __doc__,
            build=lambda cfg, target, train: Distill(target, build_draft(target, cfg.distill), cfg.distill),
            evaluator=lambda cfg, target, method, heldout: decoder(cfg, target.model, target.tokenizer,
                                                                   temperatures=tuple(cfg.eval.temperatures)),
            metric_names=lambda cfg, target: metric_names(cfg),
            data=lambda cfg, target: build_sequences(cfg, target.tokenizer), heldout=False)


def main(argv: list[str] | None = None) -> Loop:
    return run(SPEC, argv)


if __name__ == "__main__":
    cli(main)
