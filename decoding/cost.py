"""What verification costs: the verify-cost curve, and the speedup model that uses it.

    curve = verify_cost_curve(model)                      # {k: seconds of one forward over k new tokens}
    predicted_speedup(alpha, c, gamma, relative(curve))   # tokens per step / cost of a step in 1-token forwards

On a GPU a forward over a handful of tokens costs about what one token does, so the classic model
(Leviathan et al. 2023) prices a verification of gamma + 1 tokens as one plain step. On a CPU the cost
grows with k (SmolLM2-135M on 2 cores: ~2.3-2.8x a 1-token forward at k = 8), so every drafted token
that is rejected costs real time; the curve measures it, and the model prices each step with it:

    speedup(gamma) = E[tokens per step] / (v(gamma + 1) + gamma * c)
    E[tokens per step] = (1 - alpha^(gamma + 1)) / (1 - alpha)

where v(k) is the forward over k tokens relative to a 1-token forward (v(1) = 1) and c the drafter's
time per drafted token relative to a 1-token forward of the target.
"""

from __future__ import annotations

import bisect
import random
import statistics
import time

import torch

from draftsmith.decoding import cache as kv
from draftsmith.decoding.generate import LazyLogits, decoder_forward, lazy_head, lm_head

KS = (1, 2, 4, 8, 16, 32)
GAMMAS = range(1, 9)  # chain lengths the speedup model considers


@torch.no_grad()
def verify_cost_curve(model, ks: tuple[int, ...] = KS, context: int = 200, repeats: int = 7,
                      seed: int = 0) -> dict[int, float]:
    """Median seconds of one forward over k new tokens on a `context`-token KV cache, for each k.

    The forward is the decoder's: where it runs the head lazily (`generate.lazy_head`: on a CPU), the body over
    the k tokens and the head over rows [0, 2), the first block every verification computes (a path accepting
    m >= 2 drafts computes about log2(m) blocks more, which the curve leaves out); elsewhere the whole model.
    The k values are measured in a shuffled order each round, so load from other jobs on a shared
    machine falls on all of them alike; the cache is cropped back to `context` after every forward.
    """
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    lazy, forward = lazy_head(model, device), decoder_forward(model, device)
    head = lm_head(model, forward)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, context + max(ks)), generator=g).to(device)  # [1, context + K]
    cache = kv.new_cache()
    forward(input_ids=ids[:, :context], position_ids=torch.arange(context, device=device)[None], cache=cache,
            use_cache=True)  # the context (no [context, V] logits)
    times: dict[int, list[float]] = {k: [] for k in ks}
    order = list(ks)
    rng = random.Random(seed)
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        rng.shuffle(order)
        for k in order:
            pos = torch.arange(context, context + k, device=device)[None]  # [1, k]
            t0 = time.perf_counter()
            out = forward(input_ids=ids[:, context:context + k], position_ids=pos, cache=cache, use_cache=True)
            if lazy:
                LazyLogits(model, out.last_hidden_state[0], head)[0]  # rows [0, min(k, 2))
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
            kv.crop(cache, context)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def relative(curve: dict[int, float]) -> dict[int, float]:
    """The curve in units of a 1-token forward."""
    return {k: s / curve[1] for k, s in curve.items()}


def verify_cost(rel: dict[int, float], k: int) -> float:
    """v(k): linear interpolation between the measured points (and extrapolation past the last two)."""
    if k in rel:
        return rel[k]
    ks = sorted(rel)
    i = min(max(bisect.bisect(ks, k), 1), len(ks) - 1)  # ks[i - 1] < k < ks[i], or the first / last two
    lo, hi = ks[i - 1], ks[i]
    return rel[lo] + (rel[hi] - rel[lo]) * (k - lo) / (hi - lo)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens per step (bonus included) of a chain of gamma drafts with i.i.d. acceptance alpha."""
    return gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, c: float, gamma: int, rel: dict[int, float] | None = None) -> float:
    """Speedup over plain decoding; without a curve, a verification costs one plain step (the GPU model)."""
    return expected_tokens(alpha, gamma) / ((verify_cost(rel, gamma + 1) if rel else 1.0) + gamma * c)


def drafting_cost(stats: dict) -> float | None:
    """c: drafter seconds per drafted node over target seconds per verification forward, from a DecodeStats summary
    (None: nothing drafted)."""
    if not stats["drafted_tokens"]:
        return None
    return (stats["drafter_s"] / stats["drafted_tokens"]) / (stats["target_s"] / stats["target_forwards"])


def speedup_model(stats, gamma: int, max_gamma: int, rel: dict[int, float], plain_step_s: float) -> dict:
    """alpha and c from one chain evaluation (DecodeStats); predicted speedup for each gamma with each step priced
    by the target's verify-cost curve `rel` and the drafter's cost per token relative to a plain decoding step
    (`c_plain`); gamma* its argmax. `predicted_speedup_flat` is the classic model, which prices a verification as
    one plain step and c against the verification forward (about right on a GPU)."""
    alpha = sum(stats.passed.values()) / max(1, sum(stats.reached.values()))
    c = drafting_cost(stats.summary()) or 0.0
    c_plain = stats.drafter_s / max(1, stats.drafted) / plain_step_s
    predicted = {g: predicted_speedup(alpha, c_plain, g, rel) for g in GAMMAS if g <= max_gamma}
    best = max(predicted, key=predicted.get)
    return {"alpha": alpha, "c": c, "c_plain": c_plain, "gamma": gamma, "predicted_tau": expected_tokens(alpha, gamma),
            "predicted_speedup": predicted[gamma], "predicted_speedup_flat": predicted_speedup(alpha, c, gamma),
            "predicted_by_gamma": {str(g): s for g, s in predicted.items()}, "gamma_star": best,
            "predicted_at_gamma_star": predicted[best]}


def alpha_from_tau(tau: float, gamma: int) -> float:
    """The i.i.d. acceptance alpha in [0, 1) whose chain of gamma drafts gives tau = expected_tokens(alpha, gamma)
    (bisection: tau increases with alpha)."""
    lo, hi = 0.0, 1.0 - 1e-9
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, gamma) < tau else (lo, mid)
    return lo
