"""Timing speculative decoding against plain decoding, and the decoding variants a benchmark compares.

    row = evaluate_variants({"chain": Drafting(target, lambda g: PromptLookup())}, prompts, 128, seed=0, rel=rel)

`measure` is the one timing loop of the project's benchmarks: per prompt, plain decoding by the verifying model
and speculative decoding run back to back with the same seed, so both see the same load on a shared machine;
speedup is plain time per token over speculative time per token. A trained method builds its variants in its
own module (models/registry.py); the untrained baselines are in BASELINES.
"""

from __future__ import annotations

import functools
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from draftsmith.decoding.cost import GAMMAS, speedup_model
from draftsmith.decoding.generate import plain_generate, speculative_generate
from draftsmith.decoding.metrics import DecodeStats
from draftsmith.decoding.proposers import DraftModel, Lookahead, PromptLookup, Proposer, truncated_copy
from draftsmith.decoding.suffix import SuffixDecoding
from draftsmith.decoding.verify import Sampling

TEMPERATURES = (0.0, 1.0)


@dataclass
class Drafting:
    """One way to decode with a method: the model that verifies, and its proposer at a chain length gamma."""

    verifier: nn.Module
    proposer: Callable[[int | None], Proposer]
    modules: list[nn.Module] = field(default_factory=list)  # what the drafter runs, to count its parameters
    gamma: int | None = None  # fixed chain length; None where drafts vary (trees, n-gram matches)
    max_gamma: int = max(GAMMAS)


def write_figures(out: Path, figures: dict, settings: dict) -> dict:
    """Write a benchmark's figures to `out` as JSON, with `settings` plus the hardware and the command line."""
    figures["settings"] = {**settings,
                           "hardware": f"CPU, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}",
                           "command": " ".join([Path(sys.executable).name, *sys.argv])}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"wrote {out}")
    return figures


def _sampling(temperature: float, seed: int) -> Sampling:
    return Sampling(temperature, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def measure(verifier, make: Callable[[], Proposer], prompts: list[torch.Tensor], max_new_tokens: int,
            temperature: float = 0.0, seed: int = 0) -> tuple[dict, DecodeStats]:
    """Per prompt, back to back: plain decoding, then speculative decoding (seed + i for both).

    At temperature 0 the speculative tokens must equal the plain greedy ones token for token (plain
    decoding is checked against `generate(do_sample=False)` in tests/test_decoding_generate.py).
    """
    spec, plain, matches = DecodeStats(), DecodeStats(), True
    proposer = make()
    speculative_generate(verifier, proposer, prompts[0], 4)  # warm-up, not timed
    plain_generate(verifier, prompts[0], 4)
    for i, x in enumerate(prompts):
        ref, _ = plain_generate(verifier, x, max_new_tokens, _sampling(temperature, seed + i), stats=plain)
        out, _ = speculative_generate(verifier, proposer, x, max_new_tokens, _sampling(temperature, seed + i),
                                      stats=spec)
        matches &= torch.equal(out, ref)
    per_token = spec.wall_s / spec.new_tokens
    return {**spec.summary(), "speedup": (plain.wall_s / plain.new_tokens) / per_token,
            "plain_wall_s": plain.wall_s, "plain_new_tokens": plain.new_tokens,
            "greedy_matches_target": matches if temperature == 0 else None}, spec


def count_params(modules: list[nn.Module], verifier: nn.Module) -> tuple[int, int]:
    """(parameters the drafter runs, those of them not shared with the verifying model)."""
    params = {p.data_ptr(): p.numel() for m in modules for p in m.parameters()}
    shared = {p.data_ptr() for p in verifier.parameters()}
    return sum(params.values()), sum(n for ptr, n in params.items() if ptr not in shared)


def evaluate_variants(variants: dict[str, Drafting], prompts, max_new_tokens: int, seed: int,
                      rel: dict[int, float]) -> dict:
    """Every variant at every temperature of TEMPERATURES; for a fixed-length chain, the speedup model on the
    target's verify-cost curve `rel` (decoding/cost.py) and, where its gamma* differs, a measurement there."""
    out = {}
    for name, d in variants.items():
        make = functools.partial(d.proposer, d.gamma)
        verifier = d.verifier.eval()
        total, new = count_params(d.modules, verifier)
        row = {"gamma": d.gamma, "drafter_params": total, "new_params": new, "by_temperature": {}}
        for temperature in TEMPERATURES:
            result, stats = measure(verifier, make, prompts, max_new_tokens, temperature, seed)
            row["by_temperature"][f"{temperature:g}"] = result
            print(f"    {name} T={temperature:g}: tau {result['tau']:.3f} speedup {result['speedup']:.2f}x"
                  + (f" greedy==target {result['greedy_matches_target']}" if temperature == 0 else ""), flush=True)
            if temperature == 0 and d.gamma is not None:
                model = speedup_model(stats, d.gamma, d.max_gamma, rel,
                                      result["plain_wall_s"] / result["plain_new_tokens"])
                model["measured_speedup"] = result["speedup"]
                if model["gamma_star"] != d.gamma:
                    star, _ = measure(verifier, functools.partial(d.proposer, model["gamma_star"]), prompts,
                                      max_new_tokens, 0.0, seed)
                    model.update(measured_at_gamma_star=star["speedup"], tau_at_gamma_star=star["tau"],
                                 greedy_matches_target_at_gamma_star=star["greedy_matches_target"])
                row["speedup_model"] = model
        out[name] = row
    return out


# ---- the untrained baselines: (drafter dir, always None; target) -> variants ----------------------------

def ngram(drafter_dir, target) -> dict[str, Drafting]:
    return {"chain": Drafting(target, lambda g: PromptLookup(num_pred_tokens=10, max_ngram_size=2))}


def suffix(drafter_dir, target) -> dict[str, Drafting]:
    # vLLM's suffix defaults where they apply: trie depth 24, min_token_prob 0.1; up to 16 tokens per draft
    return {"chain": Drafting(target, lambda g: SuffixDecoding(max_spec=16)),
            "tree": Drafting(target, lambda g: SuffixDecoding(max_spec=16, max_children=4))}


def lookahead(drafter_dir, target) -> dict[str, Drafting]:
    # window 2, n-gram 3, 2 guesses: the CPU-sized setting of scripts/bench_decode.py
    return {"tree": Drafting(target, lambda g: Lookahead(window=2, ngram=3, guesses=2))}


def draft(drafter_dir, target) -> dict[str, Drafting]:
    model = truncated_copy(target, 2)  # untrained: the target's first 2 layers, weights shared
    V = target.config.get_text_config().vocab_size
    return {"chain": Drafting(target, lambda g: DraftModel(model, V, g), [model], gamma=5)}


BASELINES = {"ngram": ngram, "suffix": suffix, "lookahead": lookahead, "draft": draft}
