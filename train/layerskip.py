"""LayerSkip: train the target so that its own first layers draft for it (self-speculative decoding).

    accelerate launch train/layerskip.py --config recipes/layerskip/tiny-code.yaml [key=value ...]

Continues training the target (every weight, or LoRA adapters) with the early-exit loss, its
curriculum and layer dropout (models/layerskip.py). At every checkpoint it scores the held-out
rows (final loss, per-exit loss and top-1 agreement with the final layer) and measures tau of
self-speculative greedy decoding at each exit layer of `eval.exit_layers` on held-out prompts;
the best checkpoint is kept by `loop.best_metric` (tau at `eval.select_exit` by default).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import GenerationConfig

from draftsmith.data.core import BEST, best_record, collate, write_drafter_meta
from draftsmith.data.dataset import DataConfig
from draftsmith.data.reference import load_prompts
from draftsmith.decoding.evaluate import evaluate, render_prompts
from draftsmith.models.layerskip import LayerSkip, LayerSkipConfig, early_exit
from draftsmith.models.target import target_fields
from draftsmith.recipes import RECIPES
from draftsmith.train import config as C
from draftsmith.train.guard import cli
from draftsmith.train.loop import Loop
from draftsmith.train.runner import Spec, run


@dataclasses.dataclass
class EvalConfig(C.EvalConfig):
    """The shared evaluation (held-out rows: per-exit loss and agreement), decoding at every exit layer."""

    exit_layers: list[int] = dataclasses.field(default_factory=lambda: [2, 4])
    gamma: int = 4  # tokens drafted per step

    def __post_init__(self):
        super().__post_init__()
        if self.gamma < 1:
            raise C.ConfigError("eval.gamma: must be >= 1")


@dataclasses.dataclass
class Recipe(C.DrafterRecipe):
    data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(max_length=512, pack=True))
    layerskip: LayerSkipConfig = dataclasses.field(default_factory=LayerSkipConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


def heldout_scores(method: LayerSkip, rows: list[dict], batch_size: int = 8) -> dict[str, float]:
    """Final and per-exit held-out loss and top-1 agreement with the final layer, token-weighted."""
    sums: dict[str, float] = {}
    total = 0
    device = next(method.parameters()).device
    for i in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[i: i + batch_size]).items()}
        _, metrics = method(batch)
        n = int(batch["loss_mask"][:, 1:].sum())
        total += n
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v * n
    return {f"heldout_{k}": v / max(1, total) for k, v in sums.items()}


def evaluate_checkpoint(method: LayerSkip, heldout: list[dict], prompts: list[torch.Tensor], cfg: EvalConfig,
                        baselines: dict) -> dict:
    """Held-out per-exit scores, then tau and speedup of greedy self-speculation at every exit layer."""
    metrics = heldout_scores(method, heldout)
    model = method.plain_model()  # the early-exit draft shares its weights
    for E in cfg.exit_layers if prompts else ():
        results = evaluate(model, early_exit(model, E, cfg.gamma), prompts, cfg.max_new_tokens, check_greedy=False,
                           baselines=baselines)
        metrics[f"tau_exit{E}"], metrics[f"speedup_exit{E}"] = results["tau"], results["speedup"]
    if prompts:
        print("tau by exit layer: " + ", ".join(f"E={E}: {metrics[f'tau_exit{E}']:.3f}" for E in cfg.exit_layers),
              flush=True)
    return metrics


def metric_names(cfg: Recipe, L: int) -> list[str]:
    """The metrics `evaluate_checkpoint` logs for an L-layer target under this recipe."""
    exits = range(1, L) if cfg.layerskip.e_scale > 0 else ()
    names = ["heldout_loss_final", *[f"heldout_{m}_exit{l}" for l in exits for m in ("loss", "agree")]]
    if cfg.eval.num_prompts:
        names += [f"{m}_exit{E}" for E in cfg.eval.exit_layers for m in ("tau", "speedup")]
    return names + ["eval_seconds"]


def check_eval(cfg: Recipe, target) -> list[str] | None:
    """`metric_names` once the target's depth is known, the exit layers checked against it."""
    if target is None:
        return None
    L = target.config.get_text_config().num_hidden_layers
    bad = [E for E in cfg.eval.exit_layers if not 1 <= E < L]
    if bad:
        raise C.ConfigError(f"eval.exit_layers: {bad} out of range for a {L}-layer target; use 1..{L - 1}")
    return metric_names(cfg, L)


def evaluator(cfg: Recipe, target, method: LayerSkip, heldout: list[dict]):
    prompts = render_prompts(target.tokenizer, load_prompts(Path(cfg.eval.prompts), cfg.eval.num_prompts or None)
                             )[: cfg.eval.num_prompts]
    baselines: dict = {}  # plain decoding timed once: the target's size, not its weights, sets its speed
    return lambda m, step: evaluate_checkpoint(m, heldout, prompts, cfg.eval, baselines)


def finish(cfg: Recipe, target, loop: Loop) -> None:
    """The best exit layer recorded with the best checkpoint."""
    best, record = loop.run_dir / BEST, best_record(loop.run_dir)
    if loop.accelerator.is_main_process and record and cfg.eval.num_prompts:
        record_exit_layer(best, {E: record[f"tau_exit{E}"] for E in cfg.eval.exit_layers},
                          target_fields({"target": target.path, "target_as_given": target.given}))


SPEC = Spec(Recipe, RECIPES / "layerskip/tiny-code.yaml", __doc__,
            build=lambda cfg, target, train: LayerSkip(target.model, target.tokenizer, cfg.layerskip),
            evaluator=evaluator, metric_names=check_eval, trains_target=lambda cfg: not cfg.layerskip.lora,
            finish=finish)


def main(argv: list[str] | None = None) -> Loop:
    return run(SPEC, argv)


def record_exit_layer(model_dir: Path, tau_by_exit: dict[int, float], origin: dict | None = None) -> int:
    """Write the best exit layer where decoders look for it: drafter.json and generation_config.json
    (`assistant_early_exit`, which transformers' generate uses for self-speculation). `origin`: the target it was
    trained from, as every drafter.json records it (`target_fields`)."""
    exit_layer = max(tau_by_exit, key=tau_by_exit.get)
    write_drafter_meta(model_dir, "layerskip", exit_layer=exit_layer, tau_by_exit=tau_by_exit, **(origin or {}))
    gen = GenerationConfig.from_pretrained(model_dir)
    gen.assistant_early_exit = exit_layer
    gen.save_pretrained(model_dir)
    return exit_layer


if __name__ == "__main__":
    cli(main)
