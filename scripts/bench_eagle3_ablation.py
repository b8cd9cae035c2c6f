"""EAGLE-3 ablation: head initialisation, fc_norm, training-time-test schedule and loss, beside EAGLE-1, all trained on
the same data for the same wall-clock budget; and EAGLE-3's peak training memory per token on a 262k vocabulary.

    python scripts/bench_eagle3_ablation.py [--budget-minutes 3.5] [--variants NAME ...] [--concurrent N]
        [--num-prompts 8] [--max-new-tokens 64] [--runs-dir runs/eagle3_ablation] [--memory]
        [--out benchmarks/eagle3_ablation.json]

Each variant of benchmarks/eagle3_ablation_variants.yaml is a shipped recipe (EAGLE-1's or EAGLE-3's) with overrides
(the `d_` ones: one factor at a time from the shipped EAGLE-3 default), trained by
`draftsmith bench`'s `train` for `--budget-minutes` of training time (`loop.max_minutes`, the step limit
lifted, so the schedules run over the budget) into `--runs-dir/<variant>`, with one evaluation at the
end (its drafter is what is measured). With `--concurrent N`, N variants train at once with one thread each,
so that the variants of a group share the cores equally for the same wall-clock budget (N = 4 on 2 cores and a
14-minute budget give each about the compute of 3.5 minutes alone). Each drafter then decodes the same held-out prompts as a chain
(gamma 5) and as an EAGLE-2 tree (the leaderboard's CPU tree: top_k 8, depth 5, 24 nodes) at
temperature 0 (output checked token by token against the target's greedy `generate`) and at temperature
1 (exact verification), one seed per prompt. Resumable: a variant whose run holds a drafter is not
retrained, and one already measured in `--out` with the same run and steps is not re-evaluated.

`--screen` measures instead, without decoding, each drafter's expected acceptance on `--heldout-rows` held-out rows of
the reference data: per draft step k, acc_k (draft top-1 = target top-1) and accept_k (sum_v min(p_v, q_v) over the
target's whole vocabulary: what exact verification at temperature 1 accepts), and the chain tau they predict
(`expected_tau`, `expected_tau_t1`: 1 + sum_k prod_{i<=k}), into the file's `screen` section; a cheap way to rank many
variants trained one after another on quiet cores before decoding the few that matter. `--heldout-data FILE` takes the
rows from FILE instead (data/regenerated/reference-target/heldout_t1.jsonl.gz: the target's own sampled answers to
held-out prompts, what decoding at T=1 sees), recorded in the section `screen_<FILE's name>`.

`--memory-target NAME` measures the same step on a real target (gemma3-270m: its 262,144-token vocabulary) with
draft vocabularies 2048 and 32000. `--memory` measures one EAGLE-3 training step (forward and backward, ttt_steps 5, draft vocabulary 32000) on a
random Gemma-3-shaped target (hidden 640, 4 layers, tied embeddings, vocabulary 32768 and 262144) with
`eagle.logit_chunk` 0 (the whole sequence at once, as before) and 64, each in a fresh process: peak resident
memory during the step above the resident memory before it (Linux VmHWM, reset through /proc/self/clear_refs),
per token of the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml

from draftsmith.data.core import find_drafter, has_drafter
from draftsmith.data.dataset import DataConfig, heldout_rows
from draftsmith.data.reference import PROMPTS_PATH, load_prompts
from draftsmith.decoding.evaluate import evaluate, render_prompts
from draftsmith.models.eagle import load_eagle
from draftsmith.models.registry import load_proposer
from draftsmith.models.target import REFERENCE_TARGET, load_target
from draftsmith.train import bench
from draftsmith.train.config import shipped
from draftsmith.train.eagle import heldout_batches, heldout_metrics

REPO = Path(__file__).resolve().parent.parent

VARIANTS = {name: (key, overrides) for name, (key, overrides) in
            yaml.safe_load((REPO / "benchmarks/eagle3_ablation_variants.yaml").read_text()).items()}
SCREEN_STEPS = 5  # draft steps the screen measures (the chain's gamma)
# one evaluation, at the end of the budget, on a few held-out rows and prompts: the decoding below measures
COMMON = ["loop.save_every=1000000", "eval.heldout_examples=16", "eval.num_prompts=2"]
DECODINGS = {"chain": dict(mode="chain", gamma=5), "tree": dict(mode="tree", top_k=8, depth=5, total_tokens=24)}
TEMPERATURES = (0.0, 1.0)


def train_variant(name: str, run: Path, budget: float, target: str, threads: int | None = None) -> dict:
    key, overrides = VARIANTS[name]
    load = os.getloadavg()[0]
    wall = None
    if not has_drafter(run):
        method = bench.for_target(bench.BY_KEY[key], target)  # a named target's own recipe
        wall = bench.train(method, run, budget, target, overrides + COMMON, threads)
    record = bench.training_record(run, find_drafter(run), "eval/tau")
    return {"method": key, "overrides": overrides, "steps": record["steps"], "train_seconds": record["train_seconds"],
            "wall_seconds_with_evaluation": wall, "load_average_1min_at_start": load if wall else None}


def decode(run: Path, target, prompts, max_new_tokens: int, baselines: dict) -> dict:
    out = {}
    for mode, kwargs in DECODINGS.items():
        proposer = load_proposer(str(find_drafter(run)), target.model, **kwargs)
        r = evaluate(target.model, proposer, prompts, max_new_tokens, TEMPERATURES, baselines=baselines)
        out[mode] = {f"T{t}": {"tau": round(r["by_temperature"][t]["tau"], 4),
                               "acceptance_by_position": [round(a, 3) for a in
                                                          r["by_temperature"][t]["acceptance_by_position"][:5]]}
                     for t in r["by_temperature"]}
        out[mode]["T0"]["greedy_matches_target"] = r["by_temperature"]["0"]["greedy_matches_target"]
        print(f"  {mode}: tau T=0 {out[mode]['T0']['tau']:.3f}, T=1 {out[mode]['T1']['tau']:.3f}", flush=True)
    return out


def screen(run: Path, target, rows: list[dict]) -> dict:
    """The drafter's held-out per-step top-1 agreement and temperature-1 acceptance, and the chain tau they predict."""
    with torch.no_grad():
        method = load_eagle(find_drafter(run), target).eval()
        m = heldout_metrics(method, heldout_batches(method, rows), SCREEN_STEPS)
    out = {"expected_tau": round(m["expected_tau"], 4), "expected_tau_t1": round(m["expected_tau_t1"], 4),
           **{name: [round(m[f"heldout_{name}_{k}"], 4) for k in range(SCREEN_STEPS)] for name in ("acc", "accept")}}
    print(f"  expected tau T=0 {out['expected_tau']:.3f}, T=1 {out['expected_tau_t1']:.3f}", flush=True)
    return out


MEMORY_STEP = """
import ctypes, json, sys, torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from draftsmith.models.eagle import Eagle
from draftsmith.models.eagle_config import EagleConfig
from draftsmith.models.target import Target, load_target
vocab, chunk, draft, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
if path:  # a real target (a named one resolves): its own vocabulary
    target = load_target(path)
    vocab = target.config.get_text_config().vocab_size
else:
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=640, intermediate_size=2048, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512)
    target = Target(Gemma3ForCausalLM(config).eval().requires_grad_(False), None, "random-gemma3")
draft_ids = torch.randperm(vocab)[:draft].sort().values
m = Eagle(target, EagleConfig(version=3, ttt_steps=5, draft_vocab_size=draft, logit_chunk=chunk), draft_ids).train()
b, s = 2, 512
batch = {"input_ids": torch.randint(0, vocab, (b, s)), "loss_mask": torch.ones(b, s, dtype=torch.long)}
def kib(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field))
ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: RSS = live memory
before = kib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
loss, _ = m(batch)
loss.backward()
peak = kib("VmHWM")
print(json.dumps({"target_vocab": vocab, "draft_vocab": draft, "logit_chunk": chunk, "tokens": b * s, "loss": loss.item(),
                  "peak_above_start_mib": round((peak - before) / 1024, 1),
                  "peak_per_token_kib": round((peak - before) / (b * s), 1)}))
"""


# glibc: large blocks always mmapped and unmapped when freed, so RSS follows the live tensors (not a reused heap)
ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}


def memory_step(vocab: int, chunk: int, draft: int = 32000, target: str = "") -> dict:
    """One measured training step in a fresh process (MEMORY_STEP)."""
    done = subprocess.run([sys.executable, "-c", MEMORY_STEP, str(vocab), str(chunk), str(draft), target], cwd=REPO,
                          env=ENV, capture_output=True, text=True, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"memory: {row}", flush=True)
    return row


def memory_real(target: str) -> dict:
    """The same step on a real target, draft vocabularies 2048 (teacher logits dominate) and 32000, chunked or not."""
    rows = [memory_step(0, chunk, draft, target) for draft in (2048, 32000) for chunk in (0, 64)]
    return {"setup": f"one EAGLE-3 training step (forward + backward, ttt_steps 5) on {target} (its own weights and "
                     "vocabulary), random token ids, batch 2 x 512, fp32 on CPU, each in a fresh process as above",
            "rows": rows}


def memory() -> dict:
    rows = [memory_step(vocab, chunk) for vocab in (32768, 262144) for chunk in (0, 64)]
    return {"setup": "one EAGLE-3 training step (forward + backward, ttt_steps 5, draft vocabulary 32000) on a random "
                     "Gemma-3-shaped target (Gemma3ForCausalLM: hidden 640, 4 layers, tied embeddings), batch 2 x "
                     "512 tokens, fp32 on CPU, each in a fresh process (glibc MALLOC_MMAP_THRESHOLD_=131072, malloc_trim before "
                     "the step); peak RSS during the step above RSS before it",
            "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-minutes", type=float, default=3.5)
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS),
                        help="none: only --memory")
    parser.add_argument("--concurrent", type=int, default=1,
                        help="train this many variants at once, one thread each, so that each of a group gets the "
                             "same share of the cores for the same wall-clock budget")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "eagle3_ablation")
    parser.add_argument("--screen", action="store_true",
                        help="record held-out expected acceptance (no decoding) in the `screen` section")
    parser.add_argument("--heldout-rows", type=int, default=32, help="--screen: held-out rows of the reference data")
    parser.add_argument("--heldout-data", default="", help="--screen: held-out conversations from this file instead")
    parser.add_argument("--memory", action="store_true", help="also measure peak training memory per token")
    parser.add_argument("--memory-target", default="", help="also measure it on this real target (e.g. gemma3-270m)")
    parser.add_argument("--target", default=str(REFERENCE_TARGET),
                        help="the reference target, or a named real one (smollm2-135m-instruct): its own recipes, "
                             "held-out prompts and rows")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "eagle3_ablation.json")
    args = parser.parse_args(argv)
    named = args.target in bench.TARGET_RECIPES
    board = json.loads(args.out.read_text()) if args.out.is_file() else {}
    board.setdefault("variants", {})
    section = "variants" if not args.screen else "screen" + (
        f"_{Path(args.heldout_data).name.split('.')[0]}" if args.heldout_data else "")
    command = " ".join(["python scripts/bench_eagle3_ablation.py", *(argv if argv is not None else sys.argv[1:])])
    key = f"{section}_settings" if args.screen else "settings" if args.variants else "memory_settings"
    board[key] = board.get(key) if not (args.variants or args.memory) else {
        "command": command,
        "target": args.target, "budget_minutes": args.budget_minutes,
        **({"heldout_rows": args.heldout_rows, "heldout_data": args.heldout_data, "steps": SCREEN_STEPS}
           if args.screen else
           {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "decodings": DECODINGS}),
        "common_overrides": COMMON, "temperatures": list(TEMPERATURES),
        "concurrent": args.concurrent,
        "hardware": f"CPU, {os.cpu_count()} cores (training: " + (
            f"{args.concurrent} variants at once, one thread each" if args.concurrent > 1 else "torch's default threads")
        + "; decoding: 1 thread); the load average at each variant's start is recorded with it"}
    torch.set_num_threads(1)
    target = load_target(args.target)
    real = f"data/real/{args.target}"  # a named target's shipped data
    prompts = render_prompts(target.tokenizer, load_prompts(shipped(f"{real}/heldout_prompts.jsonl") if named
                                                            else PROMPTS_PATH, args.num_prompts))
    rows = heldout_rows(DataConfig(max_length=256), target.tokenizer, args.heldout_rows,
                        args.heldout_data or (shipped(f"{real}/heldout.jsonl.gz") if named else "")) if args.screen else []
    baselines: dict = {}
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrent) as pool:  # groups of --concurrent start together and end together
        trained = list(pool.map(lambda name: train_variant(name, args.runs_dir / name, args.budget_minutes, args.target,
                                                           1 if args.concurrent > 1 else None), args.variants))
    for name, entry in zip(args.variants, trained, strict=True):
        run = args.runs_dir / name
        print(f"[{name}] {VARIANTS[name]}", flush=True)
        entry["concurrent"] = args.concurrent
        old = board.get(section, {}).get(name, {})
        if old.get("steps") == entry["steps"] and old.get("run") == str(run):
            print(f"  measured before ({entry['steps']} steps)", flush=True)
            continue
        entry.update(run=str(run), **(screen(run, target, rows) if args.screen else
                                      decode(run, target, prompts, args.max_new_tokens, baselines)))
        entry["seconds_since_start"] = round(time.perf_counter() - start, 1)
        board.setdefault(section, {})[name] = entry
        save(board, args.out)
    if args.memory:
        board["memory"] = memory()
    if args.memory_target:
        board.setdefault("memory_real", {})[args.memory_target] = {**memory_real(args.memory_target), "command": command}
    save(board, args.out)
    print(screen_table(board, section) if args.screen else table(board))
    print(f"wrote {args.out}")
    return board


def table(board: dict) -> str:
    """The variants as a Markdown table (the README's)."""
    lines = ["| variant | overrides | steps | tau T=0 chain | tau T=0 tree | tau T=1 chain | tau T=1 tree |",
             "|---|---|---|---|---|---|---|"]
    for name, v in board["variants"].items():
        lines.append(f"| {name} | {' '.join(v['overrides']) or v['method'] + ' recipe'} | {v['steps']} | {v['chain']['T0']['tau']:.2f} "
                     f"| {v['tree']['T0']['tau']:.2f} | {v['chain']['T1']['tau']:.2f} | {v['tree']['T1']['tau']:.2f} |")
    return "\n".join(lines)


def screen_table(board: dict, section: str = "screen") -> str:
    """The screened variants of `section` as a Markdown table (the README's)."""
    lines = ["| variant | overrides | steps | accept_k (T=1), k = 0..4 | acc_k (T=0) | expected tau T=0 | T=1 |",
             "|---|---|---|---|---|---|---|"]
    for name, v in board[section].items():
        lines.append(f"| {name} | {' '.join(v['overrides']) or v['method'] + ' recipe'} | {v['steps']} | "
                     f"{' '.join(f'{a:.2f}' for a in v['accept'])} | {' '.join(f'{a:.2f}' for a in v['acc'])} | "
                     f"{v['expected_tau']:.2f} | {v['expected_tau_t1']:.2f} |")
    return "\n".join(lines)


def save(board: dict, out: Path) -> None:
    """Write `board` over `out`, keeping the variants (and memory figures) another run of this script wrote there."""
    disk = json.loads(out.read_text()) if out.is_file() else {}
    for section in {"variants", "screen", *(k for k in board if k.startswith("screen_") and not k.endswith("settings"))}:
        board[section] = {**disk.get(section, {}), **board.get(section, {})}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**disk, **board}, indent=1) + "\n")


if __name__ == "__main__":
    main()
