"""Train a DFlash drafter (block diffusion): a small drafter on the target's features fills a block of tokens in one
forward; with dflash.markov_rank > 0 a DSpark drafter (train/dspark.py's recipe).

    accelerate launch train/dflash.py --config recipes/dflash/tiny-code.yaml [key=value ...]

The target stays frozen and runs in the loop (online), or its features come from the hidden-state cache an EAGLE-3
recipe of the same target, layers and data writes (`draftsmith cache`, then offline.path=DIR): the cache's `aux`
are the fused layers' features and its final `hidden` the teacher's, through the target's head at the drafted
positions only (over the draft vocabulary's rows, with dflash.draft_vocab_size). At every checkpoint the held-out
rows give per-slot loss, top-1 accuracy and conditional acceptance (`cond_acc_i`, whose running product predicts
tau), and tau is measured by real speculative decoding of held-out prompts with the DFlash proposer; recipes keep
the best checkpoint by tau.
"""

from __future__ import annotations

import dataclasses

import torch

from draftsmith.data.dataset import DataConfig
from draftsmith.decoding.evaluate import decode_metric_names
from draftsmith.models.dflash import DFlash, DFlashConfig, mask_token
from draftsmith.recipes import RECIPES
from draftsmith.train import config as C
from draftsmith.train.eagle import (
    EvalConfig,
    OfflineConfig,
    kept_draft_vocab,
    training_collate,
    training_rows,
)
from draftsmith.train.guard import cli
from draftsmith.train.loop import Loop, collate
from draftsmith.train.runner import Spec, decoder, run


@dataclasses.dataclass
class Recipe(C.DrafterRecipe):
    data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(max_length=256, pack=True))
    offline: OfflineConfig = dataclasses.field(default_factory=OfflineConfig)
    dflash: DFlashConfig = dataclasses.field(default_factory=DFlashConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)  # mode chain; gamma = the tokens a block drafts


def heldout_metrics(method: DFlash, rows: list[dict], batch_size: int = 8) -> dict[str, float]:
    """Per-slot held-out loss, accuracy and conditional acceptance at fixed (seeded) anchors, averaged over batches,
    and `expected_tau` = 1 + sum_i prod_{j<=i} cond_acc_j."""
    device = method.drafter.fc.weight.device
    per_batch = []
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for i in range(0, len(rows), batch_size):
            per_batch.append(method.blocks({k: v.to(device) for k, v in collate(rows[i: i + batch_size]).items()})[1])
    means = {k: sum(m[k] for m in per_batch) / len(per_batch) for k in per_batch[0]}
    cond = torch.tensor([means[f"cond_acc_{i}"] for i in range(method.cfg.drafts)])
    return {**{f"heldout_{k}": v for k, v in means.items()}, "expected_tau": 1 + float(cond.cumprod(0).sum())}


def metric_names(cfg: Recipe) -> list[str]:
    """The metrics the checkpoint evaluation logs under this recipe (loop.best_metric must be one)."""
    K = cfg.dflash.drafts
    names = [f"heldout_{m}_{i}" for i in range(K) for m in ("loss", "acc", "cond_acc")] + ["expected_tau"]
    return names + (decode_metric_names((0.0,), K) if cfg.eval.num_prompts else []) + ["eval_seconds"]


def check_eval(cfg: Recipe) -> list[str]:
    """`metric_names`, once eval is checked to draft what DFlash drafts."""
    if cfg.eval.mode != "chain" or cfg.eval.gamma != cfg.dflash.drafts:
        raise C.ConfigError("eval: DFlash drafts a chain of block_size - 1 tokens (DSpark, dflash.markov_rank > 0: "
                            f"block_size); set eval.mode=chain and eval.gamma={cfg.dflash.drafts}")
    return metric_names(cfg)


def evaluator(cfg: Recipe, target, method: DFlash, heldout: list[dict]):
    """Held-out per-slot acceptance (`heldout_metrics`) and tau by real decoding, at every checkpoint."""
    decode = decoder(cfg, target.model, target.tokenizer, proposer_kwargs={"gamma": cfg.eval.gamma})

    def evaluate(m: DFlash, step: int) -> dict:
        metrics = heldout_metrics(m, heldout)
        if decode is not None:
            metrics.update(decode(m, step))
            print(f"step {step}: tau={metrics['tau']:.3f} (expected from cond_acc {metrics['expected_tau']:.3f}; "
                  f"greedy, {cfg.eval.num_prompts} prompts x {cfg.eval.max_new_tokens} tokens)", flush=True)
        return metrics
    return evaluate


def build(cfg: Recipe, target, train) -> DFlash:
    """The method: its mask token (`mask_token`) and, with dflash.draft_vocab_size, its draft vocabulary: that of the
    checkpoint loop.init_from names (its head's rows), else the training rows' most frequent trained tokens."""
    size = cfg.dflash.draft_vocab_size
    ids = kept_draft_vocab(cfg.loop.init_from, size, "dflash", "a DFlash run", train, target) if size else None
    return DFlash(target, cfg.dflash, mask_token(target, cfg.dflash.mask_token_id), ids)


SPEC = Spec(Recipe, RECIPES / "dflash/tiny-code.yaml", __doc__, build=build, evaluator=evaluator,
            metric_names=lambda cfg, target: check_eval(cfg),
            data=lambda cfg, target: training_rows(cfg, target, cfg.dflash.target_layers(
                target.config.get_text_config().num_hidden_layers)),
            collate=training_collate)


def main(argv: list[str] | None = None) -> Loop:
    return run(SPEC, argv)


if __name__ == "__main__":
    cli(main)
