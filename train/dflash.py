"""Train a DFlash drafter (block diffusion): a small drafter on the target's features fills a block of K tokens in
one forward.

    accelerate launch train/dflash.py --config recipes/dflash/tiny-code.yaml [key=value ...]

The target stays frozen and runs in the loop (online). At every checkpoint the held-out rows give per-slot
loss, top-1 accuracy and conditional acceptance (`cond_acc_i`, whose running product predicts tau), and tau
is measured by real speculative decoding of held-out prompts with the DFlash proposer; recipes keep the best
checkpoint by tau.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from draftsmith.data.dataset import DataConfig, build_dataset, heldout_rows
from draftsmith.data.reference import load_prompts
from draftsmith.decoding.evaluate import make_checkpoint_evaluator
from draftsmith.models.dflash import DFlash, DFlashConfig
from draftsmith.models.target import load_target
from draftsmith.recipes import RECIPES
from draftsmith.train import config as C
from draftsmith.train.eagle import EvalConfig
from draftsmith.train.loop import Loop, collate


@dataclasses.dataclass
class Recipe(C.DrafterRecipe):
    data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(max_length=256, pack=True))
    dflash: DFlashConfig = dataclasses.field(default_factory=DFlashConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)  # mode chain; gamma = block_size - 1


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
    cond = torch.tensor([means[f"cond_acc_{i}"] for i in range(method.cfg.block_size - 1)])
    return {**{f"heldout_{k}": v for k, v in means.items()}, "expected_tau": 1 + float(cond.cumprod(0).sum())}


def main(argv: list[str] | None = None) -> Loop:
    cfg = C.from_command_line(Recipe, RECIPES / "dflash/tiny-code.yaml", argv, __doc__)
    if cfg.eval.mode != "chain" or cfg.eval.gamma != cfg.dflash.block_size - 1:
        raise C.ConfigError("eval: DFlash drafts a chain of block_size - 1 tokens; set eval.mode=chain and "
                            f"eval.gamma={cfg.dflash.block_size - 1}")

    torch.manual_seed(cfg.loop.seed)
    target = load_target(cfg.target.path, cfg.target.dtype, cfg.target.trust_remote_code)
    mask = cfg.dflash.mask_token_id
    if mask < 0:
        mask = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    train = build_dataset(cfg.data, target.tokenizer)
    heldout = heldout_rows(cfg.data, target.tokenizer, limit=cfg.eval.heldout_examples)
    method = DFlash(target, cfg.dflash, mask)
    n_train = sum(p.numel() for p in method.parameters() if p.requires_grad)
    print(f"DFlash: {n_train / 1e6:.2f}M trainable, {cfg.dflash.num_layers} layer(s) on target layers {method.layers}, "
          f"block {cfg.dflash.block_size}, mask token {mask}; train rows {len(train)}; held-out examples {len(heldout)}")

    decode = make_checkpoint_evaluator(target.model, target.tokenizer, load_prompts(Path(cfg.eval.prompts)),
                                       cfg.eval.max_new_tokens, num_prompts=cfg.eval.num_prompts,
                                       proposer_kwargs={"gamma": cfg.eval.gamma}) if cfg.eval.num_prompts else None

    def evaluate(m: DFlash, step: int) -> dict:
        metrics = heldout_metrics(m, heldout)
        if decode is not None:
            metrics.update(decode(m, step))
            print(f"step {step}: tau={metrics['tau']:.3f} (expected from cond_acc {metrics['expected_tau']:.3f}; "
                  f"greedy, {cfg.eval.num_prompts} prompts x {cfg.eval.max_new_tokens} tokens)", flush=True)
        return metrics

    loop = Loop(cfg.loop, method, train, evaluate=evaluate, run_config=C.to_dict(cfg))
    loop.run()
    return loop


if __name__ == "__main__":
    main()
