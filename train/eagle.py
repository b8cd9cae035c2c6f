"""Train an EAGLE-1 drafter (or, through train/eagle3.py, an EAGLE-3 drafter) on any Hugging Face causal LM.

    accelerate launch train/eagle.py --config recipes/eagle/tiny-code.yaml [key=value ...]
    accelerate launch train/eagle3.py --config recipes/eagle3/tiny-code.yaml [key=value ...]

The target stays frozen. Its features come from a forward in the loop (online) or from a cache
written by `draftsmith cache` (`offline.path`, offline); the EAGLE-3 draft vocabulary
is built once from the loss-masked training tokens and kept in the checkpoint. At every checkpoint
the held-out rows give per-step loss, top-1 accuracy and the conditional acceptance decoding sees
(`cond_acc_k`, whose running product predicts tau), and tau is measured by real speculative
decoding of held-out prompts with the EAGLE proposer (chain or EAGLE-2 dynamic tree); recipes keep
the best checkpoint by tau.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch

from draftsmith.data.core import read_file
from draftsmith.data.dataset import DataConfig, build_dataset, cache_key
from draftsmith.data.hidden_cache import HiddenCache, collate_features, teacher_stats
from draftsmith.decoding.evaluate import decode_metric_names
from draftsmith.models.eagle import Eagle, draft_vocab
from draftsmith.models.eagle_config import EagleConfig, aux_layers
from draftsmith.recipes import RECIPES
from draftsmith.train import config as C
from draftsmith.train.guard import cli
from draftsmith.train.loop import Loop, collate
from draftsmith.train.runner import Spec, decoder, run


@dataclasses.dataclass
class OfflineConfig:
    path: str = ""  # a hidden-state cache from `draftsmith cache`; empty: run the target online


@dataclasses.dataclass
class EvalConfig(C.EvalConfig):
    """The shared evaluation, decoding with an EAGLE chain or EAGLE-2 tree."""

    mode: Literal["chain", "tree"] = "chain"  # tree: EAGLE-2 dynamic tree
    gamma: int = 5  # chain length
    top_k: int = 8  # EAGLE-2: children per node and frontier width
    depth: int = 5  # EAGLE-2: drafting rounds
    total_tokens: int = 32  # EAGLE-2: nodes kept

    def __post_init__(self):
        super().__post_init__()
        if min(self.gamma, self.top_k, self.depth, self.total_tokens) < 1:
            raise C.ConfigError("eval: gamma, top_k, depth and total_tokens must be >= 1")

    def proposer_kwargs(self) -> dict:
        return dict(mode=self.mode, gamma=self.gamma, top_k=self.top_k, depth=self.depth,
                    total_tokens=self.total_tokens)


@dataclasses.dataclass
class Recipe(C.DrafterRecipe):
    data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(max_length=256, pack=True))
    offline: OfflineConfig = dataclasses.field(default_factory=OfflineConfig)
    eagle: EagleConfig = dataclasses.field(default_factory=EagleConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


@torch.no_grad()
def heldout_batches(method: Eagle, rows: list[dict], batch_size: int = 8) -> list[dict]:
    """Held-out rows collated in batches with what the frozen target gives them, computed once: its features
    (`hidden`, `aux`) and for EAGLE-3 its teacher's whole-vocabulary log-normaliser and argmax (`log_z`, `greedy`),
    the keys of an offline cache (data/hidden_cache.py). Each checkpoint's held-out pass then runs the drafter alone."""
    device = method.drafter.fc.weight.device
    out = []
    for i in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[i: i + batch_size]).items()}
        f, g = method.features(batch)  # [b, s, H], [b, s, n*H]
        batch["hidden"] = f
        if method.cfg.version == 3:
            batch["aux"] = g
            batch["log_z"], batch["greedy"] = teacher_stats(method.target, f, method.cfg.logit_chunk)  # [b, s] each
        out.append(batch)
    return out


def heldout_metrics(method: Eagle, batches: list[dict], steps: int) -> dict[str, float]:
    """Per-step held-out loss, accuracy and conditional acceptance (averaged over `heldout_batches`) for `steps`
    unrolled steps (the chain length, also beyond the steps trained), `expected_tau` = 1 + sum_k prod_{i<=k}
    cond_acc_i, the greedy chain's tau they predict, and `expected_tau_t1` the same from accept_k, the chain's at
    temperature 1."""
    per_batch = [method.ttt(batch, steps)[1] for batch in batches]
    means = {k: sum(m[k] for m in per_batch) / len(per_batch) for k in per_batch[0]}

    def tau(name: str) -> float:
        return 1 + float(torch.tensor([means[f"{name}_{k}"] for k in range(steps)]).cumprod(0).sum())
    return {**{f"heldout_{k}": v for k, v in means.items()}, "expected_tau": tau("cond_acc"),
            "expected_tau_t1": tau("accept")}


def training_rows(cfg, target, layers: list[int]):
    """The recipe's training rows (`data`), or with offline.path its hidden-state cache, refused unless it holds this
    target's features of `layers` (the method's hidden_states indices) for the recipe's data."""
    if not cfg.offline.path:
        return build_dataset(cfg.data, target.tokenizer)
    cache = HiddenCache(cfg.offline.path, target, layers)
    written = cache.manifest["meta"].get("data_key")
    if written != cache_key(cfg.data, target.tokenizer):
        raise ValueError(f"offline.path={cfg.offline.path} was written from other data than this recipe's `data` "
                         "section, or by another version of the data pipeline; rewrite it with draftsmith cache and "
                         f"this recipe (`--reuse {cfg.offline.path}` links the shards whose tokens are unchanged)")
    return cache


def training_collate(cfg) -> Callable:
    """The loop's collate: of cached rows (their features too) with offline.path, else of token rows."""
    return collate_features if cfg.offline.path else collate


def metric_names(cfg: Recipe) -> list[str]:
    """The metrics the checkpoint evaluation logs under this recipe (loop.best_metric must be one)."""
    e = cfg.eval
    names = [f"heldout_{m}_{k}" for k in range(e.gamma) for m in ("loss", "acc", "cond_acc", "accept")] + \
        ["expected_tau", "expected_tau_t1"]
    if e.num_prompts:
        names += decode_metric_names((0.0,), e.gamma if e.mode == "chain" else e.depth)
    return names + ["eval_seconds"]


def draft_ids(cfg: Recipe, target, train) -> torch.Tensor | None:
    """EAGLE-3's draft vocabulary: that of the checkpoint loop.init_from names (its head's rows), else the training
    rows' most frequent loss-masked tokens (None: EAGLE-1's whole vocabulary)."""
    if cfg.eagle.version != 3:
        return None
    return kept_draft_vocab(cfg.loop.init_from, cfg.eagle.draft_vocab_size, "eagle", "an EAGLE-3 run", train, target)


def kept_draft_vocab(init_from: str, size: int, section: str, run: str, train, target) -> torch.Tensor:
    """A drafter's draft vocabulary of `size` tokens: that of the checkpoint `init_from` names, when it has one (a
    fine-tune keeps its head's rows), else the training rows' most frequent loss-masked tokens."""
    if init_from:
        state = read_file(Path(init_from) / "state.json", f"pass loop.init_from= a checkpoint-<step> directory of {run}")
        ids = (state.get("method") or {}).get("draft_ids")
        if ids is not None:
            if len(ids) != size:
                raise C.ConfigError(f"loop.init_from={init_from} has a draft vocabulary of {len(ids)} tokens; set "
                                    f"{section}.draft_vocab_size={len(ids)}")
            return torch.tensor(ids)
    return draft_vocab(train, target.config.get_text_config().vocab_size, size)


def checkpoint_evaluator(cfg: Recipe, target, heldout: list[dict]) -> Callable[[Eagle, int], dict]:
    """The loop's `evaluate(method, step)`: the held-out metrics (the target's part of them computed at the first
    call and kept, `heldout_batches`) and tau by real decoding of eval.num_prompts prompts."""
    decode = decoder(cfg, target.model, target.tokenizer, proposer_kwargs=cfg.eval.proposer_kwargs())
    batches: list[dict] = []

    def evaluate(m: Eagle, step: int) -> dict:
        if not batches:
            batches.extend(heldout_batches(m, heldout))
        metrics = heldout_metrics(m, batches, cfg.eval.gamma)
        if decode is not None:
            metrics.update(decode(m, step))
            print(f"step {step}: tau={metrics['tau']:.3f} (expected from cond_acc {metrics['expected_tau']:.3f}; "
                  f"{cfg.eval.mode}, greedy, {cfg.eval.num_prompts} prompts x {cfg.eval.max_new_tokens} tokens)",
                  flush=True)
        return metrics
    return evaluate


def spec(default_recipe: Path, doc: str, recipe: type = Recipe, build=None) -> Spec:
    """The EAGLE entry point's Spec; `recipe` (a Recipe with more sections) and `build(cfg, target, train rows) ->
    method` let a variant of the method (train/p_eagle.py) reuse it."""
    return Spec(recipe, default_recipe, doc,
                build=build or (lambda cfg, target, train: Eagle(target, cfg.eagle, draft_ids(cfg, target, train))),
                evaluator=lambda cfg, target, method, heldout: checkpoint_evaluator(cfg, target, heldout),
                metric_names=lambda cfg, target: metric_names(cfg),
                data=lambda cfg, target: training_rows(cfg, target, aux_layers(
                    cfg.eagle, target.config.get_text_config().num_hidden_layers)),
                collate=training_collate)


SPEC = spec(RECIPES / "eagle/tiny-code.yaml", __doc__)


def main(argv: list[str] | None = None) -> Loop:
    return run(SPEC, argv)


if __name__ == "__main__":
    cli(main)
