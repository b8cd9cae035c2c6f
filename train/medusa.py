"""Train Medusa heads (Medusa-1) or heads + backbone (Medusa-2) on any Hugging Face causal LM.

    accelerate launch train/medusa.py --config recipes/medusa/medusa1-tiny-code.yaml [key=value ...]

Loads the target frozen (Medusa-1) or wraps it with LoRA / unfreezes it (Medusa-2), builds the
chat data with the target's own tokenizer and template (assistant tokens only in the loss),
and hands everything to the shared loop. At every checkpoint the evaluator scores per-head
top-1/top-k accuracy on held-out rows and, through the bundled decoder, tau on held-out prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from draftsmith.data.chat import NoAssistantTokens, tokenize_example
from draftsmith.data.packing import pack
from draftsmith.data.reference import chat_examples, stdlib_files
from draftsmith.models.medusa import Medusa, MedusaConfig, head_losses
from draftsmith.models.target import REFERENCE_TARGET, load_target
from draftsmith.train import config as C
from draftsmith.train.loop import Loop, collate

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class TargetConfig:
    path: str = str(REFERENCE_TARGET)
    dtype: str = "float32"
    trust_remote_code: bool = False


@dataclasses.dataclass
class DataConfig:
    """Chat examples from the reference corpus (stdlib functions: header + docstring -> body)."""

    seq_len: int = 256
    max_examples: int = 0  # training examples kept (0: all)
    heldout_examples: int = 64  # held-out examples scored for per-head accuracy at every checkpoint

    def __post_init__(self):
        if self.seq_len < 8:
            raise C.ConfigError("data.seq_len: must be >= 8")


@dataclasses.dataclass
class EvalConfig:
    topk: int = 5  # per-head top-k accuracy on held-out rows


@dataclasses.dataclass
class Recipe:
    target: TargetConfig = dataclasses.field(default_factory=TargetConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    medusa: MedusaConfig = dataclasses.field(default_factory=MedusaConfig)
    loop: C.LoopConfig = dataclasses.field(default_factory=C.LoopConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


def build_rows(tokenizer, cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """Packed training rows and unpacked held-out rows, each with input_ids, loss_mask, position_ids."""
    def tokenized(split: str, limit: int) -> list[dict]:
        out = []
        for f in stdlib_files():
            if f.split != split:
                continue
            for ex in chat_examples(f):
                try:
                    row = tokenize_example(tokenizer, ex)
                except NoAssistantTokens:
                    continue
                if len(row["input_ids"]) <= cfg.seq_len:
                    out.append(row)
                if limit and len(out) >= limit:
                    return out
        return out

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train = pack(tokenized("train", cfg.max_examples), cfg.seq_len, pad)
    heldout = [{**r, "position_ids": list(range(len(r["input_ids"])))}
               for r in tokenized("heldout", cfg.heldout_examples)]
    return train, heldout


def head_accuracy(method: Medusa, rows: list[dict], topk: int, batch_size: int = 8) -> dict[str, float]:
    """Per-head loss and top-1/top-k accuracy on held-out rows, token-weighted over batches."""
    device = next(method.heads.parameters()).device
    sums: dict[str, float] = {}
    for i in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[i: i + batch_size]).items()}
        hidden = method.target.tap(batch["input_ids"], batch.get("attention_mask"), batch["position_ids"]).hidden
        _, metrics = head_losses(method.heads, hidden, batch["input_ids"], batch["loss_mask"],
                                 batch["position_ids"], topk)
        n = batch["loss_mask"].sum().item()
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v * n
        sums["_n"] = sums.get("_n", 0.0) + n
    n = sums.pop("_n", 1.0)
    return {k: v / n for k, v in sums.items()}


def main(argv: list[str] | None = None) -> Loop:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "recipes/medusa/medusa1-tiny-code.yaml"))
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. loop.max_steps=10")
    args = parser.parse_args(argv)
    cfg = C.load(Recipe, args.config, args.overrides)

    torch.manual_seed(cfg.loop.seed)
    target = load_target(cfg.target.path, cfg.target.dtype, cfg.target.trust_remote_code)
    train, heldout = build_rows(target.tokenizer, cfg.data)
    if not train:
        raise ValueError(f"no training example fits data.seq_len={cfg.data.seq_len}; raise it")
    method = Medusa(target, cfg.medusa)
    n_train = sum(p.numel() for p in method.parameters() if p.requires_grad)
    print(f"medusa ({cfg.medusa.backbone} backbone): {cfg.medusa.num_heads} heads, {n_train / 1e6:.2f}M trainable; "
          f"train rows {len(train)} x {cfg.data.seq_len}; held-out examples {len(heldout)}")

    def evaluate(m: Medusa, step: int) -> dict:
        return head_accuracy(m, heldout, cfg.eval.topk)

    loop = Loop(cfg.loop, method, train, evaluate=evaluate, run_config=C.to_dict(cfg))
    method.progress = lambda: loop.state.step / cfg.loop.max_steps
    loop.run()
    return loop


if __name__ == "__main__":
    main()
