"""Held-out evaluation of a drafter by real speculative decoding, and the per-checkpoint evaluator.

    results = evaluate(target, proposer, render_prompts(tokenizer, load_prompts(limit=20)), max_new_tokens=128)
    evaluate_fn = make_checkpoint_evaluator(target, tokenizer, num_prompts=8)   # Loop(..., evaluate=evaluate_fn)

Speedup is wall-clock time per generated token of the target's own decoding (the same loop with no
draft) over that of speculative decoding, on the same prompts in the same process. With `batch` > 1
prompts are decoded together (`generate.generate_batch`: one target forward verifies every sequence's
draft per round), the baseline too: the speedup is then the one at that batch size, while tau, the
acceptance and the tokens stay the batch-1 ones. The per-checkpoint evaluator decodes all its prompts
together.
Greedy equality with `target.generate(do_sample=False)` is checked token by token at temperature 0;
`greedy_matches_target` is None when it was not checked.

Data-parallel ranks share the work: inside `sharded(Shard(rank, world, lockstep))` (the training loop
enters it at every checkpoint) each rank decodes prompts[rank::world], prompt i always with seed + i,
and the per-rank statistics are gathered and merged (counts add exactly), so tau, the acceptance and
the greedy check equal a one-rank evaluation's. With `lockstep` (a target sharded by ZeRO-3 or FSDP2,
whose forwards are collectives) the ranks also start each prompt together and step together to the
end of the longest (`speculative_generate(lockstep=True)`); a rank without a prompt in the last round
decodes prompt 0 and discards it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from draftsmith.data.chat import to_messages
from draftsmith.decoding.generate import generate_batch
from draftsmith.decoding.metrics import DecodeStats
from draftsmith.decoding.proposers import NoDraft, Proposer
from draftsmith.decoding.verify import Sampling


def render_prompts(tokenizer, rows: list[dict]) -> list[torch.Tensor]:
    """Prompt rows -> token ids [1, L]: `messages` through the chat template, `prompt` as raw text."""
    out = []
    for i, row in enumerate(rows):
        if "messages" in row:
            try:
                messages = to_messages({"messages": row["messages"]})  # content: a string or text parts
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        elif "prompt" in row:
            text = row["prompt"]
        else:
            raise ValueError(f"prompt {i}: needs 'messages' (OpenAI format) or 'prompt' (raw text)")
        ids = tokenizer(text, add_special_tokens="messages" not in row, return_tensors="pt")["input_ids"]
        if ids.numel() == 0:
            raise ValueError(f"prompt {i} is empty after tokenization")
        out.append(ids)
    return out


def _seeded(temperature: float, seed: int, sampling: dict) -> Sampling:
    return Sampling(temperature, generator=torch.Generator().manual_seed(seed), **sampling)


@dataclass(frozen=True)
class Shard:
    """This process's share of an evaluation: prompts[rank::world]; lockstep as in the module docstring. `meet`, if
    given, is called before the statistics are gathered: the training loop's wait for every rank, which lets a rank
    whose share decodes longer take longer than a collective's timeout."""

    rank: int = 0
    world: int = 1
    lockstep: bool = False
    meet: Callable[[], None] | None = None

    def rounds(self, n: int) -> list[int | None]:
        """Global indices of the prompts this rank decodes; None: a lockstep round with nothing left to decode."""
        mine = list(range(self.rank, n, self.world))
        return mine + [None] * ((math.ceil(n / self.world) - len(mine)) if self.lockstep else 0)

    def gather(self, stats: DecodeStats, matches: bool) -> tuple[DecodeStats, bool]:
        """Every rank's statistics merged in rank order, and whether every rank's greedy outputs matched."""
        if self.world == 1:
            return stats, matches
        from torch import distributed as dist

        if self.meet is not None:
            self.meet()
        parts: list = [None] * self.world
        dist.all_gather_object(parts, (stats, matches))
        merged = DecodeStats()
        for part, _ in parts:
            merged.merge(part)
        return merged, all(m for _, m in parts)


_SHARD = Shard()


@contextlib.contextmanager
def sharded(shard: Shard):
    """Evaluations inside the context decode this rank's share of the prompts and gather the statistics."""
    global _SHARD
    previous, _SHARD = _SHARD, shard
    try:
        yield
    finally:
        _SHARD = previous


def _batches(shard: Shard, n: int, batch: int) -> list[list[int | None]]:
    """This rank's rounds (`Shard.rounds`) in groups of `batch` decoded together (one at a time in lockstep)."""
    rounds, size = shard.rounds(n), 1 if shard.lockstep else batch
    return [rounds[k:k + size] for k in range(0, len(rounds), size)]


def _decode(target, proposers: list[Proposer], prompts: list[torch.Tensor], chunk: list[int | None],
            max_new_tokens: int, temperature: float, seed: int, sampling: dict, rule: str, stats: DecodeStats,
            lockstep: bool) -> list[torch.Tensor]:
    """One group of prompts (`_batches`) decoded together, prompt i on seed + i; a lockstep round without a prompt
    (None) decodes prompt 0 and leaves `stats` alone."""
    outs, _ = generate_batch(target, proposers[:len(chunk)], [prompts[i or 0].to(target.device) for i in chunk],
                             max_new_tokens, [_seeded(temperature, seed + (i or 0), sampling) for i in chunk], rule,
                             stats=stats if None not in chunk else None, lockstep=lockstep)
    return outs


def baseline(target, prompts: list[torch.Tensor], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, batch: int = 1, **sampling) -> DecodeStats:
    """The target's own decoding of the prompts (tau 1), timed; sharded and batched like `evaluate`."""
    stats, shard = DecodeStats(), _SHARD
    for chunk in _batches(shard, len(prompts), batch):
        _decode(target, [NoDraft() for _ in chunk], prompts, chunk, max_new_tokens, temperature, seed, sampling,
                "auto", stats, shard.lockstep)
    return shard.gather(stats, True)[0]


def evaluate(target, proposer: Proposer | Callable[[], Proposer], prompts: list[torch.Tensor],
             max_new_tokens: int = 128, temperatures: tuple[float, ...] = (0.0,), rule: str = "auto",
             check_greedy: bool = True, baselines: dict[float, DecodeStats] | None = None, seed: int = 0,
             warm_up: bool = True, batch: int = 1, **sampling) -> dict:
    """Decode every prompt at every temperature; tau, acceptance, speedup and greedy equality.

    `proposer`: a proposer, or for `batch` > 1 a function making a fresh one (one per sequence decoded together).
    `batch`: prompts decoded together (`generate_batch`: one target forward verifies all their drafts per round;
    each rank batches its share); at T=0 tau, acceptance and the tokens are the batch-1 ones (at T>0 the same
    distribution; what a proposer learns across sequences, EAGLE's sampled-tree draw rates, it learns per instance),
    and the speedup is the one at batch `batch`: the baseline is batched the same way. `baselines` (temperature -> plain-decoding stats): missing
    temperatures are measured here and added to the dict, so a caller can reuse them (at the same `batch`).
    `warm_up`: one short decode of the first batch first, untimed, so that the timings exclude what a process's first
    decode pays once (a caller that decoded before may skip it). `sampling` takes top_k / top_p. Returns the first
    temperature's figures at the top level and all of them under `by_temperature`.
    """
    start = time.perf_counter()
    target.eval()
    shard = _SHARD
    baselines = {} if baselines is None else baselines
    if isinstance(proposer, Proposer):
        if batch > 1:
            raise ValueError(f"evaluate with batch={batch} needs a function making a fresh proposer per sequence "
                             "(proposers keep per-sequence state), not one proposer")
        proposers = [proposer]
    else:
        proposers = [proposer() for _ in range(1 if shard.lockstep else batch)]
    first = list(range(min(len(proposers), len(prompts))))
    if warm_up:
        _decode(target, proposers, prompts, first, 4, 0.0, seed, sampling, rule, DecodeStats(), shard.lockstep)
    by_t = {}
    for temperature in temperatures:
        stats, matches = DecodeStats(), True
        for chunk in _batches(shard, len(prompts), batch):
            outs = _decode(target, proposers, prompts, chunk, max_new_tokens, temperature, seed, sampling, rule,
                           stats, shard.lockstep)
            if check_greedy and temperature == 0:
                for i, out in zip(chunk, outs, strict=True):
                    with torch.no_grad():
                        ref = target.generate(prompts[i or 0].to(target.device), max_new_tokens=max_new_tokens,
                                              do_sample=False, synced_gpus=shard.lockstep)
                    matches &= i is None or torch.equal(out, ref)
        stats, matches = shard.gather(stats, matches)
        if temperature not in baselines:
            baselines[temperature] = baseline(target, prompts, max_new_tokens, temperature, seed, batch, **sampling)
        base = baselines[temperature]
        by_t[f"{temperature:g}"] = {
            **stats.summary(),
            "speedup": (base.wall_s / base.new_tokens) / (stats.wall_s / stats.new_tokens),
            "baseline_wall_s": base.wall_s,
            "greedy_matches_target": matches if check_greedy and temperature == 0 else None,
        }
    first_t = by_t[f"{temperatures[0]:g}"]
    return {**first_t, "by_temperature": by_t, "eval_seconds": time.perf_counter() - start,
            "settings": {"max_new_tokens": max_new_tokens, "temperatures": list(temperatures), "rule": rule,
                         "lossy": rule == "typical", "num_prompts": len(prompts), "seed": seed,
                         "ranks": shard.world, "batch": batch, **sampling}}


def flat_metrics(results: dict) -> dict[str, float]:
    """Scalars for trackers: tau (first temperature), tau_t<T>, acceptance_pos<k>, speedup, eval cost
    (`decode_seconds` too: the training loop overwrites `eval_seconds` with the whole checkpoint evaluation's)."""
    out = {"tau": results["tau"], "speedup": results["speedup"], "eval_prompts": results["settings"]["num_prompts"],
           "eval_seconds": results["eval_seconds"], "decode_seconds": results["eval_seconds"]}
    for t, r in results["by_temperature"].items():
        out[f"tau_t{t}"] = r["tau"]
    for k, a in enumerate(results["acceptance_by_position"], 1):
        out[f"acceptance_pos{k}"] = a
    if results.get("greedy_matches_target") is not None:
        out["greedy_matches_target"] = float(results["greedy_matches_target"])
    return out


def decode_metric_names(temperatures: tuple[float, ...] = (0.0,), depth: int = 1) -> list[str]:
    """The names `flat_metrics` gives a checkpoint evaluation at these temperatures, drafting up to `depth` tokens."""
    return ["tau", "speedup", "eval_prompts", "eval_seconds", "decode_seconds", *[f"tau_t{t:g}" for t in temperatures],
            *[f"acceptance_pos{k}" for k in range(1, depth + 1)]]


def make_checkpoint_evaluator(target, tokenizer, prompts: list[dict] | None = None, max_new_tokens: int = 64,
                              temperatures: tuple[float, ...] = (0.0,), num_prompts: int = 8, rule: str = "auto",
                              check_greedy: bool = False, proposer_kwargs: dict | None = None
                              ) -> Callable[[torch.nn.Module, int], dict]:
    """The training loop's `evaluate(method_module, step)`: tau of `method_module.proposer(target, **proposer_kwargs)`.

    Prompts default to the reference target's held-out set; the first `num_prompts` are used (the
    evaluation's cost scales with num_prompts x max_new_tokens x len(temperatures); `eval_seconds`
    reports it). All of a rank's prompts are decoded together (`evaluate(batch=num_prompts)`: one target forward
    verifies every sequence's draft per round), so `speedup` is the one at that batch size; tau is the batch-1 one.
    The plain-decoding baseline for speedup is timed, and the warm-up decode run, once, at the first call. Use
    `tau` as `loop.best_metric` (mode max).
    """
    from draftsmith.data.reference import load_prompts

    rows = (prompts if prompts is not None else load_prompts())[:num_prompts]
    ids = render_prompts(tokenizer, rows)
    baselines: dict[float, DecodeStats] = {}

    def evaluate_checkpoint(method_module: torch.nn.Module, step: int) -> dict:
        was_training = method_module.training
        method_module.eval()
        results = evaluate(target, lambda: method_module.proposer(target, **(proposer_kwargs or {})), ids,
                           max_new_tokens, temperatures, rule, check_greedy, baselines,
                           warm_up=not baselines, batch=len(ids))  # warm after the first
        method_module.train(was_training)
        return flat_metrics(results)

    return evaluate_checkpoint
