"""LayerSkip benchmark: self-speculation against the exit layer E, before and after LayerSkip training.

    OMP_NUM_THREADS=1 python scripts/bench_layerskip.py [--run runs/layerskip-tiny-code] [--prompts 10]
        [--timing-prompts 5] [--repeats 3] [--max-new-tokens 128] [--gamma 4] [--part both|before|after]

Trains the default LayerSkip recipe on the reference target unless `--run` already holds a
finished run. Then, for the target before and after training:
- held-out loss over every held-out row;
- tau of greedy self-speculation with the exit-query cache (`EarlyExit`) for every E on `--prompts`
  held-out prompts, with its tokens checked against the target's own greedy ones;
- wall-clock speedup against the target's own decoding (`plain_generate`), with the exit-query
  cache and without it (`EarlyExitDraft`: a truncated copy with its own cache, verification
  recomputes layers [:E]); plain and speculative timed back to back per prompt (decoding/bench.py)
  on `--timing-prompts` prompts, `--repeats` rounds per E and kind; the median is reported;
- the verifying forward alone with and without the cache, interleaved, median of many repeats;
- at the E of the best median speedup: tau at temperature 1 (exact sampling), and transformers'
  own `generate(assistant_early_exit=E)` timed back to back against ours per prompt: same greedy
  tokens, and the median ratio of its time to ours.
Writes `benchmarks/layerskip.json`. On a small CPU target shared with other jobs timings are
noisy: tau is the portable figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.core import BEST, has_drafter
from draftsmith.data.reference import load_prompts
from draftsmith.decoding import DecodeStats, Sampling, speculative_generate
from draftsmith.decoding import cache as kv
from draftsmith.decoding.bench import measure as back_to_back
from draftsmith.decoding.evaluate import render_prompts
from draftsmith.models.layerskip import EarlyExit, EarlyExitDraft
from draftsmith.models.target import REFERENCE_TARGET
from draftsmith.train import layerskip as recipe
from draftsmith.train.target import measure

REPO = Path(__file__).resolve().parent.parent


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    """(seconds, fn(*args, **kwargs))."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def tau_by_exit(model, prompts, refs, max_new_tokens: int, gamma: int) -> dict[int, dict]:
    """Greedy tau, acceptance and token equality with the target's greedy output, for every exit layer."""
    out = {}
    for E in range(1, model.config.num_hidden_layers):
        stats, same, proposer = DecodeStats(), True, EarlyExit(model, E, gamma)
        for x, ref in zip(prompts, refs, strict=True):
            tokens, _ = speculative_generate(model, proposer, x, max_new_tokens, stats=stats)
            same &= torch.equal(tokens, ref)
        out[E] = {"tau": round(stats.tau, 3), "acceptance_by_position": [round(a, 3) for a in
                                                                        stats.acceptance_by_position()],
                  "greedy_matches_target": same}
        print(f"  E={E} tau={stats.tau:.3f} same={same}", flush=True)
    return out


def wall_clock(model, prompts, max_new_tokens: int, gamma: int, repeats: int) -> dict[int, dict]:
    """Every E with the exit-query cache and without: speedup over plain decoding timed back to back per prompt
    (decoding/bench.py), target and drafter ms per step; medians over `repeats` rounds."""
    kinds = {"cache": EarlyExit, "no_cache": EarlyExitDraft}
    out = {}
    for E in range(1, model.config.num_hidden_layers):
        out[E] = {}
        for k, cls in kinds.items():
            rounds = [back_to_back(model, functools.partial(cls, model, E, gamma), prompts, max_new_tokens)
                      for _ in range(repeats)]
            out[E][k] = {
                "speedup": round(statistics.median(r["speedup"] for r, _ in rounds), 3),
                "target_ms_per_step": round(statistics.median(1e3 * s.target_s / s.steps for _, s in rounds), 3),
                "drafter_ms_per_step": round(statistics.median(1e3 * s.drafter_s / s.steps for _, s in rounds), 3)}
        print(f"  E={E} speedup cache={out[E]['cache']['speedup']} no_cache={out[E]['no_cache']['speedup']}",
              flush=True)
    return out


def every_layer(split, tokens: torch.Tensor, cache) -> torch.Tensor:
    """The split forward without the exit-query cache: every layer for every token of tokens [1, n]."""
    return split.norm(split.run(split.embed(tokens[0]), range(len(split.layers)), cache))  # [1, n, H]


def verify_forward_ms(model, prompts, gamma: int, repeats: int) -> dict[int, dict]:
    """Median time of the verifying forward over [root, gamma drafted tokens] on each prompt's context,
    interleaved, after an untimed draft each time: `cache` = with the exit-query cache (layers [:E] for
    the last drafted token only, [E:] for all); `no_cache_split` = the same split forward running every
    layer for every token (isolates what the cache saves); `no_cache_hf` = the model's own forward,
    as the decoder verifies without the cache."""
    out = {}
    for E in range(1, model.config.num_hidden_layers):
        times = {"cache": [], "no_cache_split": [], "no_cache_hf": []}
        for x in prompts:
            ids, cache = x[0], kv.new_cache()
            model(input_ids=ids[None, :-1], cache=cache, use_cache=True)
            c = cache.get_seq_length()
            proposer = EarlyExit(model, E, gamma)
            verify, split = proposer.target_forward(cache), proposer.split
            for _ in range(repeats):
                tokens = torch.cat([ids[-1:], proposer.propose(ids, Sampling()).tokens])[None]  # [1, gamma+1]
                times["cache"].append(timed(verify, input_ids=tokens, attention_mask=None, cache=cache)[0])
                kv.crop(cache, c)
                times["no_cache_split"].append(timed(every_layer, split, tokens, cache)[0])
                kv.crop(cache, c)
                times["no_cache_hf"].append(timed(model.base_model, input_ids=tokens, cache=cache, use_cache=True)[0])
                kv.crop(cache, c)
        out[E] = {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}
        out[E]["saved_ms"] = round(out[E]["no_cache_split"] - out[E]["cache"], 3)
        print(f"  E={E} verify ms: {out[E]}", flush=True)
    return out


def hf_time_ratio(model, prompts, max_new_tokens: int, gamma: int, E: int, repeats: int) -> dict:
    """transformers' `generate(assistant_early_exit=E)` against ours, back to back per prompt."""
    ratios, same, proposer = [], True, EarlyExit(model, E, gamma)
    for _ in range(repeats):
        ours_s = hf_s = 0.0
        for x in prompts:
            s, (mine, _) = timed(speculative_generate, model, proposer, x, max_new_tokens)
            ours_s += s
            s, theirs = timed(model.generate, x, max_new_tokens=max_new_tokens, do_sample=False,
                              assistant_early_exit=E, num_assistant_tokens=gamma,
                              num_assistant_tokens_schedule="constant")
            hf_s += s
            same &= torch.equal(mine, theirs)
        ratios.append(hf_s / ours_s)
    return {"exit_layer": E, "hf_time_ratio": round(statistics.median(ratios), 3),
            "hf_time_ratio_rounds": [round(r, 3) for r in ratios], "same_greedy_tokens": same}


def sweep(model_dir: Path, rows: list[dict], args) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    recorded = model.generation_config.assistant_early_exit
    model.generation_config.assistant_early_exit = None  # plain greedy references; HF's early exit only when asked
    prompts = render_prompts(AutoTokenizer.from_pretrained(model_dir), rows)
    refs = [model.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False) for x in prompts]
    print(f"{model_dir}: tau by exit layer", flush=True)
    by_exit = tau_by_exit(model, prompts, refs, args.max_new_tokens, args.gamma)
    timing = prompts[: args.timing_prompts]
    print(f"{model_dir}: wall clock, {args.repeats} rounds of {len(timing)} prompts", flush=True)
    clock = wall_clock(model, timing, args.max_new_tokens, args.gamma, args.repeats)
    verify = verify_forward_ms(model, timing, args.gamma, repeats=20)
    for E in by_exit:
        by_exit[E] |= {"speedup": clock[E]["cache"]["speedup"], "speedup_without_cache": clock[E]["no_cache"]["speedup"],
                       "step_ms": clock[E], "verify_forward_ms": verify[E]}
    best = max(by_exit, key=lambda E: by_exit[E]["speedup"])
    stats = DecodeStats()
    for i, x in enumerate(prompts):
        speculative_generate(model, EarlyExit(model, best, args.gamma), x, args.max_new_tokens,
                             Sampling(1.0, generator=torch.Generator().manual_seed(i)), stats=stats)
    print(f"{model_dir}: best E={best}; HF assistant_early_exit", flush=True)
    return {"heldout": measure(model_dir), "recorded_exit_layer": recorded, "by_exit": by_exit, "best_exit": best,
            "best_exit_t1": {"tau": round(stats.tau, 3), "rule": "exact"},
            "hf_assistant_early_exit": hf_time_ratio(model, timing, args.max_new_tokens, args.gamma, best,
                                                     args.repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default=str(REPO / "runs/layerskip-tiny-code"))
    parser.add_argument("--prompts", type=int, default=10, help="held-out prompts for tau")
    parser.add_argument("--timing-prompts", type=int, default=5, help="the first N of them for wall-clock timing")
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds; medians are reported")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "benchmarks/layerskip.json"))
    parser.add_argument("--part", choices=("both", "before", "after"), default="both",
                        help="measure one model only and update its entry in --out (run the two in parallel)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    run = Path(args.run)
    train_s = None
    if not has_drafter(run / BEST):
        with torch.enable_grad():
            train_s = round(timed(recipe.main, ["--config", str(REPO / "recipes/layerskip/tiny-code.yaml"),
                                                f"loop.output_dir={run}"])[0], 1)
    rows = load_prompts(limit=args.prompts)
    parts = {}
    for part in ("before", "after") if args.part == "both" else (args.part,):
        start = time.perf_counter()
        parts[part] = sweep(REFERENCE_TARGET if part == "before" else run / BEST, rows, args)
        parts[part]["bench_seconds"] = round(time.perf_counter() - start, 1)
    out = Path(args.out)  # read only now: a parallel run of the other part may have written its entry
    result = (json.loads(out.read_text()) if args.part != "both" and out.is_file() else {}) | parts
    if "before" in result and "after" in result:
        result["heldout_loss_change"] = round(result["after"]["heldout"]["heldout_loss"]
                                              - result["before"]["heldout"]["heldout_loss"], 4)
    result |= {
        "train_seconds": train_s if train_s is not None else result.get("train_seconds"),
        "settings": {"prompts": args.prompts, "timing_prompts": args.timing_prompts, "repeats": args.repeats,
                     "max_new_tokens": args.max_new_tokens, "gamma": args.gamma, "run": str(run),
                     "recipe": "recipes/layerskip/tiny-code.yaml", "torch_threads": torch.get_num_threads()},
        "note": ("tau is exact and portable. Timings: batch 1, CPU, a 9.8M-parameter target on 2 cores shared "
                 "with other jobs; each figure is the median of back-to-back rounds (speedups, HF ratio) or of "
                 "interleaved repeats (verify_forward_ms), and still noisy. 'cache' = exit-query cache "
                 "(EarlyExit), 'no_cache' = truncated copy with its own cache (EarlyExitDraft)."),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {"best_exit": v["best_exit"], **{f: v["by_exit"][v["best_exit"]][f] for f in
                                                          ("tau", "speedup", "speedup_without_cache")},
                          "heldout_loss": v["heldout"]["heldout_loss"]} for k, v in parts.items()}, indent=2))

if __name__ == "__main__":
    main()
