"""Train Medusa heads (Medusa-1) or heads + backbone (Medusa-2) on any Hugging Face causal LM.

    accelerate launch train/medusa.py --config recipes/medusa/medusa1-tiny-code.yaml [key=value ...]

Loads the target frozen (Medusa-1) or wraps it with LoRA / unfreezes it (Medusa-2), builds the
chat data with the target's own tokenizer and template (assistant tokens only in the loss),
and hands everything to the shared loop. At every checkpoint the evaluator scores per-head
top-1/top-k accuracy on held-out rows, builds the greedy Medusa tree from the measured per-head
rank accuracy, and measures tau by real speculative decoding of held-out prompts with the bundled
decoder (greedy, so lossless); recipes keep the best checkpoint by tau.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from draftsmith.data.dataset import DataConfig
from draftsmith.decoding.evaluate import decode_metric_names
from draftsmith.models.medusa import (
    Medusa,
    MedusaConfig,
    chain_choices,
    greedy_tree,
    heldout_accuracy,
    target_passes,
    verifier_model,
)
from draftsmith.recipes import RECIPES
from draftsmith.train import config as C
from draftsmith.train.guard import cli
from draftsmith.train.loop import Loop
from draftsmith.train.runner import Spec, decoder, run


def _data_default() -> DataConfig:
    return DataConfig(max_length=256, pack=True)


@dataclasses.dataclass
class EvalConfig(C.EvalConfig):
    """The shared evaluation, plus per-head accuracy and the Medusa tree."""

    topk: int = 5  # per-head top-k accuracy on held-out rows
    tree: Literal["chain", "tree"] = "tree"  # tree: greedy Medusa tree from measured per-head rank accuracy
    tree_budget: int = 31  # nodes of the tree
    tree_ranks: int = 8  # candidates per head considered by the tree builder

    def __post_init__(self):
        super().__post_init__()
        for ok, key in [(self.tree_budget >= 1, "tree_budget"), (self.tree_ranks >= 1, "tree_ranks")]:
            if not ok:
                raise C.ConfigError(f"eval.{key}: must be positive")


@dataclasses.dataclass
class Recipe(C.DrafterRecipe):
    data: DataConfig = dataclasses.field(default_factory=_data_default)
    medusa: MedusaConfig = dataclasses.field(default_factory=MedusaConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


def evaluate_checkpoint(method: Medusa, passes: list[tuple[dict, torch.Tensor, torch.Tensor]], decode,
                        cfg: EvalConfig, step: int) -> dict:
    """Per-head accuracy on held-out rows (`target_passes`); with prompts, the greedy tree from the measured
    per-head rank accuracy (kept as the checkpoint's tree) and tau by real greedy decoding through the shared
    evaluator (`acceptance_pos{k}` is the acceptance of head k, conditional on heads 1..k-1 accepted)."""
    metrics, acc = heldout_accuracy(method.heads, passes, cfg.topk, cfg.tree_ranks)  # acc [K, R]
    if decode is None:
        return metrics
    method.choices = chain_choices(method.heads.num_heads)
    if cfg.tree == "tree":
        method.choices, metrics["expected_tau"] = greedy_tree(acc, cfg.tree_budget)
    metrics.update(decode(method, step))
    print(f"step {step}: tau={metrics['tau']:.3f} ({cfg.tree} of {len(method.choices)} nodes, greedy, "
          f"{cfg.num_prompts} held-out prompts x {cfg.max_new_tokens} tokens)", flush=True)
    return metrics


def metric_names(cfg: Recipe) -> list[str]:
    """The metrics `evaluate_checkpoint` logs under this recipe (loop.best_metric must be one)."""
    K, topk = cfg.medusa.num_heads, cfg.eval.topk
    names = [f"head{k}_{m}" for k in range(1, K + 1) for m in ("loss", "top1", *([f"top{topk}"] if topk > 1 else []))]
    if cfg.eval.num_prompts:
        names += decode_metric_names((0.0,), K) + (["expected_tau"] if cfg.eval.tree == "tree" else [])
    return names + ["eval_seconds"]


def evaluator(cfg: Recipe, target, method: Medusa, heldout: list[dict]):
    """Per-head accuracy on the held-out rows and tau by real decoding, at every checkpoint."""
    decode = decoder(cfg, verifier_model(method.target), target.tokenizer)
    frozen = not any(p.requires_grad for p in target.parameters())  # Medusa-1: one target pass serves every checkpoint
    passes: list = []

    def evaluate(m: Medusa, step: int) -> dict:
        nonlocal passes
        passes = passes if frozen and passes else target_passes(m.target, heldout)
        return evaluate_checkpoint(m, passes, decode, cfg.eval, step)
    return evaluate


SPEC = Spec(Recipe, RECIPES / "medusa/medusa1-tiny-code.yaml", __doc__,
            build=lambda cfg, target, train: Medusa(target, cfg.medusa), evaluator=evaluator,
            metric_names=lambda cfg, target: metric_names(cfg))


def main(argv: list[str] | None = None) -> Loop:
    return run(SPEC, argv)


if __name__ == "__main__":
    cli(main)
