"""The one recipe runner every drafter's entry script uses: config -> target -> data -> method -> evaluator -> loop.

    accelerate launch train/<method>.py --config recipes/<method>/<recipe>.yaml [key=value ...]

An entry script describes its method with a `Spec` (its Recipe, how to build the method and its checkpoint
evaluation, the metrics that evaluation logs) and calls `run(SPEC, argv)`; the runner does the rest the same way for
every method: the recipe and overrides validated and loop.best_metric checked against the metrics before anything
loads, the seed, the target (a family the method cannot take refused in one line: models/target.py `refusal`),
the training rows, the held-out rows (`eval.heldout_path`, `eval.heldout_split`, `eval.heldout_examples`), the
shared loop, and one-line errors through `cli`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.data.dataset import build_dataset, heldout_rows
from draftsmith.data.reference import load_prompts
from draftsmith.decoding.evaluate import make_checkpoint_evaluator
from draftsmith.models.target import Target, load_target, refusal
from draftsmith.train import config as C
from draftsmith.train.loop import Evaluate, Loop, collate

DECODING_OFF = "eval.num_prompts=0 turns decoding off, so tau is not measured"


@dataclasses.dataclass(frozen=True)
class Spec:
    """A method as its entry script hands it to `run`. `cfg` is the loaded Recipe throughout.

    build(cfg, target, train rows) -> the method (an nn.Module: `forward(batch) -> (loss, metrics)`, models/method.py)
    evaluator(cfg, target, method, held-out rows) -> evaluate(method, step) -> metrics, run at every checkpoint
    metric_names(cfg, target) -> the metrics that evaluation logs (loop.best_metric must be one); None before the
        target is loaded, where they depend on it (checked again once it is)
    data(cfg, target) -> the training rows (default: the recipe's `data` section through the shared pipeline)
    collate(cfg) -> the loop's collate function
    trains_target(cfg): the target's own weights train (not frozen when loaded)
    heldout: the evaluation reads held-out rows
    finish(cfg, target, loop): after training (e.g. what the best checkpoint records beside its weights)
    """

    recipe: type
    default_recipe: Path
    doc: str
    build: Callable[[Any, Target, Any], nn.Module]
    evaluator: Callable[[Any, Target, nn.Module, list[dict]], Evaluate]
    metric_names: Callable[[Any, Target | None], list[str] | None]
    data: Callable[[Any, Target], Any] = lambda cfg, target: build_dataset(cfg.data, target.tokenizer)
    collate: Callable[[Any], Callable] = lambda cfg: collate
    trains_target: Callable[[Any], bool] = lambda cfg: False
    heldout: bool = True
    finish: Callable[[Any, Target, Loop], None] | None = None


def check_metrics(spec: Spec, cfg, target: Target | None) -> None:
    names = spec.metric_names(cfg, target)
    if names is not None:
        C.check_best_metric(cfg.loop, names, "" if cfg.eval.num_prompts else DECODING_OFF)


def run(spec: Spec, argv: list[str] | None = None) -> Loop:
    """Train the method of `spec` under the recipe and overrides of `argv`; the finished Loop."""
    cfg = C.from_command_line(spec.recipe, spec.default_recipe, argv, spec.doc)
    check_metrics(spec, cfg, None)
    torch.manual_seed(cfg.loop.seed)
    target = load_target(cfg.target.path, cfg.target.dtype, cfg.target.trust_remote_code,
                         frozen=not spec.trains_target(cfg))
    why = refusal(target.config, spec.default_recipe.parent.name)  # the entry: its recipes are recipes/ENTRY/
    if why:
        raise ValueError(why)
    check_metrics(spec, cfg, target)
    train = spec.data(cfg, target)
    heldout = heldout_rows(cfg.data, target.tokenizer, cfg.eval.heldout_examples, cfg.eval.heldout_path,
                           cfg.eval.heldout_split) if spec.heldout else []
    method = spec.build(cfg, target, train)
    n_train = sum(p.numel() for p in method.parameters() if p.requires_grad)
    print(f"{type(method).__name__}: {n_train / 1e6:.2f}M trainable; train rows {len(train)}; held-out examples "
          f"{len(heldout)}", flush=True)
    loop = Loop(cfg.loop, method, train, evaluate=spec.evaluator(cfg, target, method, heldout),
                run_config=C.to_dict(cfg), collate_fn=spec.collate(cfg))
    loop.run()
    if spec.finish:
        spec.finish(cfg, target, loop)
    return loop


def decoder(cfg, model: nn.Module, tokenizer, **kwargs) -> Evaluate | None:
    """Tau by real speculative decoding of the recipe's held-out prompts (`eval.prompts`, `eval.num_prompts`,
    `eval.max_new_tokens`); None when eval.num_prompts is 0."""
    if not cfg.eval.num_prompts:
        return None
    return make_checkpoint_evaluator(model, tokenizer, load_prompts(Path(cfg.eval.prompts)), cfg.eval.max_new_tokens,
                                     num_prompts=cfg.eval.num_prompts, **kwargs)


def pad_token(tokenizer, token_id: int) -> int:
    """A recipe's special token id, or with -1 the tokenizer's pad token (0 where it has none)."""
    if token_id >= 0:
        return token_id
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
