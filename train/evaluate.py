"""Measure a drafter by real speculative decoding with its target.

    draftsmith evaluate --drafter SPEC [--target DIR] [--prompts FILE] [--num-prompts 8]
        [--max-new-tokens 64] [--temperatures 0 1] [--rule auto|greedy|exact|typical] [--plot acc.png]
        --out results.json

SPEC: a drafter checkpoint directory (a run's best/ or a checkpoint's model/), an export written by
`draftsmith export` (any format: its draftsmith_export.json names method, format and target), `ngram`
(prompt lookup), `suffix` (suffix decoding), `lookahead`, or `draft:DIR` (a draft model with the target's tokenizer). The target
defaults to the one the drafter records (the reference target for the others); the defaults (8
prompts x 64 tokens, greedy, the drafter's own tree / gamma / exit layer) are those of the
checkpoint evaluation during training, so a logged tau is reproduced without flags. Prompts come
from the reference target's held-out set unless
`--prompts FILE` (JSONL; each line `{"messages": [...]}` rendered with the target's chat template, or
`{"prompt": "raw text"}`) is given. Prints a table and writes tau, acceptance by position, the
accepted-length histogram, speedup over the target's own decoding, and greedy equality checked
token by token against `target.generate(do_sample=False)`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.core import DRAFTER_FILE, REDO_EXPORT, read_drafter_meta, read_file
from draftsmith.data.reference import PROMPTS_PATH, load_prompts
from draftsmith.decoding.evaluate import evaluate, render_prompts
from draftsmith.decoding.proposers import DraftModel
from draftsmith.models.eagle_proposer import EagleProposer
from draftsmith.models.export import EXPORT_FILE
from draftsmith.models.layerskip import early_exit
from draftsmith.models.medusa import MedusaProposer, chain_choices
from draftsmith.models.registry import load, load_proposer
from draftsmith.models.target import REFERENCE_TARGET, check_target, load_target
from draftsmith.models.zoo import resolve_target
from draftsmith.train.guard import cli


def table(results: dict) -> str:
    lines = [f"{'T':>5} {'tau':>6} {'speedup':>8} {'greedy==target':>15}  acceptance by position"]
    for t, r in results["by_temperature"].items():
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        lines.append(f"{t:>5} {r['tau']:6.3f} {r['speedup']:8.2f}x {str(r['greedy_matches_target']):>15}  {acc}")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for t, r in results["by_temperature"].items():
        acc = r["acceptance_by_position"]
        a.plot(range(1, len(acc) + 1), acc, marker="o", label=f"T={t} (tau {r['tau']:.2f})")
        hist = r["accept_length_histogram"]
        b.bar([int(k) for k in hist], list(hist.values()), alpha=0.5, label=f"T={t}")
    a.set(xlabel="draft position", ylabel="conditional acceptance", ylim=(0, 1.05), title="acceptance by position")
    b.set(xlabel="tokens committed per target forward", ylabel="steps", title="accepted length (tau) histogram")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def recorded_target(spec: str) -> str:
    """The target a drafter directory or export records (drafter.json / draftsmith_export.json), else the reference;
    a LayerSkip checkpoint verifies with itself."""
    d = Path(spec.removeprefix("draft:"))
    export = read_file(d / EXPORT_FILE, REDO_EXPORT) if (d / EXPORT_FILE).is_file() else {}
    meta = read_drafter_meta(d) if (d / DRAFTER_FILE).is_file() else {}
    if export.get("target"):
        return export["target"]
    if meta.get("method") == "layerskip":
        return str(d)
    return meta.get("target") or str(REFERENCE_TARGET)


def export_proposer(path: Path, target_path: str, gamma: int | None, dtype: torch.dtype):
    """(verifying model, tokenizer, proposer) for an export of any format, read back through its own loader."""
    side = read_file(path / EXPORT_FILE, REDO_EXPORT)
    loaded = load(side["method"], side["format"], path)
    if side["method"] == "layerskip":  # the export is the target; its first E layers draft
        model, exit_layer = loaded
        return model.to(dtype), AutoTokenizer.from_pretrained(path), early_exit(model, exit_layer, gamma or 4)
    if side["method"] == "medusa":  # verified by the backbone it names (Medusa-2: its own merged backbone)
        target, heads = loaded.target, loaded.heads
        choices = [tuple(c) for c in side["tree_choices"]] if side.get("tree_choices") else \
            chain_choices(heads.num_heads)
        return target.model.to(dtype), target.tokenizer, MedusaProposer(heads.to(dtype), choices)
    target = load_target(target_path, dtype)
    if side["method"] == "eagle":
        drafter, meta = loaded
        return target.model, target.tokenizer, EagleProposer(drafter.to(dtype), target.embed, target.lm_head,
                                                             meta["aux_layers"], gamma=gamma or 5)
    V = target.config.get_text_config().vocab_size
    return target.model, target.tokenizer, DraftModel(loaded.to(dtype), V, gamma or side.get("gamma", 5))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", help="Hugging Face causal LM directory or a named target (default: the one the drafter records)")
    parser.add_argument("--drafter", required=True, help="checkpoint dir, export dir, ngram, suffix, lookahead or draft:DIR")
    parser.add_argument("--prompts", default=str(PROMPTS_PATH), help="JSONL of messages or prompt rows")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument("--rule", default="auto", choices=["auto", "greedy", "exact", "typical"])
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--gamma", type=int, help="draft tokens per step (default: the drafter's own, else 5)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write a PNG of acceptance by position and the tau histogram")
    parser.add_argument("--out", required=True, help="results JSON")
    args = parser.parse_args(argv)
    args.target = resolve_target(args.target or recorded_target(args.drafter))
    check_target(args.target, "--target")
    dtype = getattr(torch, args.dtype)
    extra = {"gamma": args.gamma} if args.gamma and args.drafter.startswith("draft:") else {}
    if (Path(args.drafter) / EXPORT_FILE).is_file():
        target, tokenizer, proposer = export_proposer(Path(args.drafter), args.target, args.gamma, dtype)
        target = target.to(args.device)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device)
        proposer = load_proposer(args.drafter, target, tokenizer, **extra)
    prompts = render_prompts(tokenizer, load_prompts(Path(args.prompts), limit=args.num_prompts))
    results = evaluate(target, proposer, prompts, args.max_new_tokens, tuple(args.temperatures), args.rule,
                       seed=args.seed, top_k=args.top_k, top_p=args.top_p)
    results["settings"].update(target=args.target, drafter=args.drafter, prompts=args.prompts, dtype=args.dtype,
                               device=args.device, **extra)
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    cli(main)
