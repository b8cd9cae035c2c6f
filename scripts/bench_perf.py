"""Measure the decoder's per-step cost, the sharded evaluation and adaptive gamma.

    python scripts/bench_perf.py [--sections verify eval adaptive profile] [--medusa runs/medusa1-tiny-code/best]
        [--eagle DIR] [--drafters NAME ...] [--repeats N] [--cut] [--compile] [--out benchmarks/perf.json]

verify: on the reference target, a prompt's greedy continuation drafted 4 tokens at a time (all
accepted, or all rejected) against plain decoding through the same loop: seconds per verification
step over seconds per plain step (`verify_over_plain`, gamma 4: forward over 5 tokens, the accept rule,
rollback, commit), beside the target alone over the same 5 and 1 tokens on the same context
(`model_5_over_1`, decoding/cost.py's curve): the difference is the decoder's own overhead.
eval: the checkpoint evaluation's decoding (8 held-out prompts x 64 tokens, the main job's settings, the
Medusa tree of --medusa or else prompt lookup), timed in one process and sharded over 2 gloo processes
(decoding/evaluate.py `sharded`); tau must be equal.
adaptive: the leaderboard's prompts (`draftsmith bench`: 20 held-out x 128 tokens), per prompt back to back:
plain decoding, each fixed gamma, and adaptive gamma (decoding/adaptive.py, at most the largest fixed
gamma), over the prompts --repeats times (adaptive's estimates carry over, as in a server), for prompt lookup, the untrained 2-layer draft model, and with --eagle an EAGLE run's chain and
EAGLE-2 tree (depth). Greedy; every output checked against plain decoding. With --repeats > 1 also
adaptive over the best fixed gamma chosen without seeing the pass it is timed on (`..._held_out`: for each pass, the
fixed gamma fastest over the other passes, timed on that one). --cut also times adaptive without the knob (`adaptive_cut`:
the whole draft, cut at the depth chosen with it in hand), for drafters whose draft costs next to nothing.
profile: where the time of prompt lookup decoding goes, ours against Hugging Face's `prompt_lookup_num_tokens`
(cProfile, 20 prompts x 128 tokens): the torch matmuls, attention, our decoder's own code (decoding/*.py) and
Hugging Face's generation code, each as cumulative seconds.
Timings on shared cores are noisy: the load average is recorded before and after each section.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.reference import PROMPTS_PATH, load_prompts
from draftsmith.decoding.adaptive import AdaptiveGamma
from draftsmith.decoding.cost import relative, verify_cost_curve
from draftsmith.decoding.evaluate import Shard, evaluate, render_prompts, sharded
from draftsmith.decoding.generate import plain_generate, speculative_generate
from draftsmith.decoding.metrics import DecodeStats
from draftsmith.decoding.proposers import DraftModel, PromptLookup, Proposer, truncated_copy
from draftsmith.decoding.tree import DraftTree
from draftsmith.models.registry import load_proposer
from draftsmith.models.target import REFERENCE_TARGET

REPO = Path(__file__).resolve().parent.parent


def load(path: str):
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer, AutoModelForCausalLM.from_pretrained(path).eval()


class Continuation(Proposer):
    """Drafts the next gamma tokens of a known continuation, each shifted by `shift` (0: all accepted)."""

    def __init__(self, continuation: torch.Tensor, gamma: int, shift: int, vocab: int):
        self.ref, self.gamma, self.shift, self.vocab = continuation, gamma, shift, vocab

    def propose(self, ids, sampling):
        return DraftTree.chain((self.ref[ids.numel(): ids.numel() + self.gamma] + self.shift) % self.vocab)


@torch.no_grad()
def verify_section(target, prompts, compile: bool) -> dict:
    new, gamma, V = 128, 4, target.config.vocab_size
    out = {}
    for mode in [False, True] if compile else [False]:
        plain, accepted, rejected = DecodeStats(), DecodeStats(), DecodeStats()
        plain_generate(target, prompts[0], 8, compile=mode)  # warm-up (and compilation)
        for x in prompts[:8]:
            ref, _ = plain_generate(target, x, new + gamma + 1, eos_token_id=[], compile=mode)
            plain_generate(target, x, new, eos_token_id=[], stats=plain, compile=mode)
            for stats, shift in ((accepted, 0), (rejected, 1)):
                out_ids, _ = speculative_generate(target, Continuation(ref[0], gamma, shift, V), x, new,
                                                  eos_token_id=[], stats=stats, compile=mode)
                assert torch.equal(out_ids, ref[:, : out_ids.shape[1]])
        step = {name: s.target_s / s.steps for name, s in
                (("plain", plain), ("accepted", accepted), ("rejected", rejected))}
        out["compiled" if mode else "eager"] = {
            "plain_step_s": step["plain"], "verify_step_s_all_accepted": step["accepted"],
            "verify_step_s_all_rejected": step["rejected"],
            "verify_over_plain_all_accepted": step["accepted"] / step["plain"],
            "verify_over_plain_all_rejected": step["rejected"] / step["plain"]}
    context = int(sum(x.shape[1] for x in prompts[:8]) / 8) + new // 2
    curve = verify_cost_curve(target, ks=(1, gamma + 1), context=context, repeats=31)
    out["model_alone"] = {"context": context, "forward_1_s": curve[1], f"forward_{gamma + 1}_s": curve[gamma + 1],
                          f"model_{gamma + 1}_over_1": curve[gamma + 1] / curve[1]}
    return out


def _eval_worker(rank: int, world: int, port: int, args: dict, queue) -> None:
    from torch import distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    queue.put((rank, timed_evaluation(**args, shard=Shard(rank, world))))
    dist.destroy_process_group()


@torch.no_grad()
def timed_evaluation(target_path: str, drafter: str, shard: Shard | None = None) -> dict:
    """The checkpoint evaluation's decoding twice: the first call also times the plain baseline, as the
    first checkpoint does; the second reuses it, as every later checkpoint does."""
    tokenizer, target = load(target_path)
    prompts = render_prompts(tokenizer, load_prompts(limit=8))
    proposer = load_proposer(drafter, target)
    baselines, out = {}, {}
    with sharded(shard or Shard()):
        for call in ("first", "later"):
            t = time.perf_counter()
            r = evaluate(target, proposer, prompts, 64, check_greedy=False, baselines=baselines)
            out[call] = {"seconds": time.perf_counter() - t, "tau": r["tau"],
                         "acceptance_by_position": r["acceptance_by_position"]}
    return out


def eval_section(target_path: str, drafter: str) -> dict:
    args = {"target_path": target_path, "drafter": drafter}
    out = {"drafter": drafter, "prompts": 8, "max_new_tokens": 64}
    for threads in (torch.get_num_threads(), 1):
        torch.set_num_threads(threads)
        out[f"one_process_{threads}_threads"] = timed_evaluation(**args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_eval_worker, args=(rank, 2, port, args, queue)) for rank in range(2)]
    t = time.perf_counter()
    for p in procs:
        p.start()
    ranks = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(60)
    out["two_processes_1_thread"] = {**ranks[0], "rank1": ranks[1], "with_start_s": time.perf_counter() - t}
    one = out["one_process_1_threads"]
    out["tau_equal"] = all(ranks[0][c]["tau"] == one[c]["tau"] for c in ("first", "later"))
    for c in ("first", "later"):
        out[f"speedup_two_over_one_{c}"] = {
            k.removeprefix("one_process_"): v[c]["seconds"] / ranks[0][c]["seconds"]
            for k, v in out.items() if k.startswith("one_process_")}
    return out


@torch.no_grad()
def adaptive_section(target, tokenizer, eagle: str | None, num_prompts: int, new: int,
                     only: list[str] | None = None, repeats: int = 1, cut: bool = False) -> dict:
    prompts = render_prompts(tokenizer, load_prompts(PROMPTS_PATH, limit=num_prompts))
    curve = verify_cost_curve(target)
    rel, plain_step_s = relative(curve), curve[1]
    V = target.config.vocab_size
    draft = truncated_copy(target, 2)
    drafters = {  # name -> (make(depth), knob, fixed depths)
        "prompt_lookup": (lambda g: PromptLookup(g, 2), "num_pred_tokens", [1, 2, 3, 4, 6, 8, 10]),
        "draft_model": (lambda g: DraftModel(draft, V, g), "gamma", [1, 2, 3, 4, 5]),
    }
    if eagle:
        drafters["eagle_chain"] = (lambda g: load_proposer(eagle, target, mode="chain", gamma=g), "gamma",
                                   [1, 2, 3, 4, 5, 6])
        drafters["eagle_tree"] = (lambda g: load_proposer(eagle, target, mode="tree", top_k=4, depth=g,
                                                          total_tokens=24), "depth", [2, 3, 4, 5, 6])
    out = {"verify_cost_relative": {str(k): v for k, v in rel.items()}, "num_prompts": len(prompts),
           "max_new_tokens": new, "prompts": str(PROMPTS_PATH), "repeats": repeats}
    for name, (make, knob, depths) in drafters.items():
        if only and name not in only:
            continue
        start_load = os.getloadavg()
        variants = {f"fixed_{g}": make(g) for g in depths}
        variants["adaptive"] = AdaptiveGamma(make(max(depths)), rel, plain_step_s, knob=knob)
        if cut:  # drafted in full, then cut at the depth chosen with the draft in hand
            variants["adaptive_cut"] = AdaptiveGamma(make(max(depths)), rel, plain_step_s)
        stats = {v: DecodeStats() for v in variants}
        plain, matches = DecodeStats(), True
        passes = {v: [0.0] * repeats for v in variants}  # seconds per pass over the prompts
        for p in variants.values():
            speculative_generate(target, p, prompts[0], 8)  # warm-up
        for i, x in enumerate(prompts * repeats):
            ref, _ = plain_generate(target, x, new, stats=plain)
            for v, p in variants.items():
                t = time.perf_counter()
                out_ids, _ = speculative_generate(target, p, x, new, stats=stats[v])
                passes[v][i // len(prompts)] += time.perf_counter() - t
                matches &= torch.equal(out_ids, ref)
        secs = {v: sum(t) for v, t in passes.items()}
        row = {v: {"tau": s.tau, "speedup": plain.wall_s / secs[v], "seconds": secs[v], "seconds_per_pass": passes[v]}
               for v, s in stats.items()}
        fixed = [v for v in row if not v.startswith("adaptive")]
        best = max(fixed, key=lambda v: row[v]["speedup"])
        # the best fixed gamma chosen without seeing the pass it is timed on: picked on the other passes, timed on this
        # one (the maximum over all passes of several noisy timings is biased upwards by the choice itself)
        held_out = sum(passes[min(fixed, key=lambda v: secs[v] - passes[v][r])][r] for r in range(repeats))
        gammas = variants["adaptive"].gammas
        out[name] = {"by_variant": row, "plain_s": plain.wall_s, "best_fixed": best,
                     "adaptive_over_best_fixed": row["adaptive"]["speedup"] / row[best]["speedup"],
                     **({"adaptive_over_best_fixed_held_out": held_out / secs["adaptive"]} if repeats > 1 else {}),
                     **({"adaptive_cut_over_best_fixed": row["adaptive_cut"]["speedup"] / row[best]["speedup"]}
                        if cut else {}),
                     "adaptive_mean_depth": sum(gammas) / max(1, len(gammas)),
                     "adaptive_depth_histogram": {str(g): gammas.count(g) for g in sorted(set(gammas))},
                     "greedy_matches_target": matches, "load_average": [start_load, os.getloadavg()]}
        print(f"{name}: best fixed {best} {row[best]['speedup']:.3f}x, adaptive {row['adaptive']['speedup']:.3f}x "
              f"(mean depth {out[name]['adaptive_mean_depth']:.2f}), greedy==target {matches}", flush=True)
    return out


@torch.no_grad()
def profile_section(target, tokenizer, num_prompts: int, new: int) -> dict:
    prompts = render_prompts(tokenizer, load_prompts(limit=num_prompts))
    runs = {"ours": lambda x: speculative_generate(target, PromptLookup(10, 2), x, new),
            "hf": lambda x: target.generate(x, max_new_tokens=new, do_sample=False, prompt_lookup_num_tokens=10,
                                            max_matching_ngram_size=2)}
    out = {}
    for name, decode in runs.items():
        decode(prompts[0])  # warm-up
        prof = cProfile.Profile()
        prof.enable()
        for x in prompts:
            decode(x)
        prof.disable()
        st = pstats.Stats(prof).stats  # (file, line, function) -> (calls, primitive, own s, cumulative s, callers)
        parts = {"total_s": lambda k: True, "linear_s": lambda k: "_nn.linear" in k[2],
                 "attention_s": lambda k: "scaled_dot_product_attention" in k[2],
                 "draftsmith_decoding_s": lambda k: "/decoding/" in k[0],
                 "transformers_generation_s": lambda k: "transformers/generation" in k[0]}
        out[name] = {part: sum(v[2] for k, v in st.items() if match(k)) for part, match in parts.items()}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(REFERENCE_TARGET))
    parser.add_argument("--sections", nargs="+", default=["verify", "eval", "adaptive"],
                        choices=["verify", "eval", "adaptive", "profile"])
    parser.add_argument("--medusa", default=str(REPO / "runs/medusa1-tiny-code/best"),
                        help="drafter of the eval section (the main job's best checkpoint); prompt lookup if absent")
    parser.add_argument("--eagle", help="an EAGLE run's best/ for the adaptive section")
    parser.add_argument("--drafters", nargs="+", choices=["prompt_lookup", "draft_model", "eagle_chain", "eagle_tree"],
                        help="adaptive section: only these drafters (default: all)")
    parser.add_argument("--cut", action="store_true",
                        help="adaptive section: also adaptive without the knob (the whole draft, cut at the depth "
                             "chosen once it is drafted)")
    parser.add_argument("--compile", action="store_true", help="verify section: also with the forward compiled")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1,
                        help="adaptive section: passes over the prompts (timings of shared cores vary by ~5%% a pass)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the eval section also uses the default)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "perf.json")
    args = parser.parse_args(argv)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    tokenizer, target = load(args.target)
    result = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result["settings"] = {"command": " ".join(["python scripts/bench_perf.py", *(argv if argv is not None else sys.argv[1:])]),
                          "target": args.target, "device": "cpu", "torch_threads": args.threads, "batch_size": 1,
                          "greedy": True}
    for section in args.sections:
        start, load_start = time.perf_counter(), os.getloadavg()
        if section == "verify":
            prompts = render_prompts(tokenizer, load_prompts(limit=8))
            out = verify_section(target, prompts, args.compile)
        elif section == "eval":
            torch.set_num_threads(default_threads)
            drafter = args.medusa if Path(args.medusa).is_dir() else "ngram"
            out = eval_section(args.target, drafter)
            torch.set_num_threads(args.threads)
        elif section == "adaptive":
            out = adaptive_section(target, tokenizer, args.eagle, args.num_prompts, args.max_new_tokens, args.drafters,
                                   args.repeats, args.cut)
        else:
            out = profile_section(target, tokenizer, args.num_prompts, args.max_new_tokens)
        out["load_average"] = {"start": load_start, "end": os.getloadavg()}
        out["seconds"] = time.perf_counter() - start
        out["command"] = result["settings"]["command"]  # the sections of one file may come from different runs
        if section == "adaptive" and args.drafters:  # some drafters: theirs replace those of an earlier run
            out = {**result.get(section, {}), **out, **{n: {**out[n], "command": out["command"]} for n in args.drafters}}
        result[section] = out
        print(json.dumps({section: out}, indent=1)[:3000], flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
