"""Seconds per EAGLE training step (forward, backward, optimizer step) of the shipped tiny-code recipes, at 1, 3 and 5
unrolled training-time-test steps, under each recipe's loop.mixed_precision (bf16: CPU autocast, as the loop runs it) and
without the acceptance metrics (as the loop runs the steps it does not log), optionally against models/eagle.py as it
was at another git revision.

    python scripts/bench_train_step.py [--baseline REV] [--repeats 6] [--out benchmarks/train_step.json]

Both versions train side by side in one process on the same batches, one step each in turn, so that the machine's
noise (shared cores) hits them alike; each figure is the median over the repeats after the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from draftsmith.data.dataset import build_dataset
from draftsmith.models import eagle
from draftsmith.models.target import load_target
from draftsmith.train import config as C
from draftsmith.train.eagle import Recipe
from draftsmith.train.loop import collate, keep_freed_memory

REPO = Path(__file__).resolve().parent.parent
RECIPES = {"eagle1": "recipes/eagle/tiny-code.yaml", "eagle3": "recipes/eagle3/tiny-code.yaml"}


def module_at(rev: str):
    """models/eagle.py as it was at git revision `rev`: its source run as a module of another name (it is not on any
    import path; the package's own eagle module stays as it is)."""
    source = subprocess.run(["git", "show", f"{rev}:models/eagle.py"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout
    module = sys.modules["eagle_baseline"] = types.ModuleType("eagle_baseline")  # dataclasses look it up
    exec(compile(source, f"{rev}:models/eagle.py", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="", help="a git revision whose models/eagle.py is timed beside today's")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/train_step.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    keep_freed_memory()  # as the training loop does on CPU
    versions = {"now": eagle}
    if args.baseline:
        versions[args.baseline] = module_at(args.baseline)
    out = {"settings": {"command": " ".join(["python scripts/bench_train_step.py", *sys.argv[1:]]),
                        "batch": "4 packed rows x 256 tokens of each recipe's training data", "threads":
                        torch.get_num_threads(), "repeats": args.repeats}, "ms_per_step": {}}
    for method, recipe in RECIPES.items():
        cfg = C.from_command_line(Recipe, REPO / recipe, ["--config", str(REPO / recipe)], "")
        target = load_target(str(REPO / cfg.target.path))
        rows = build_dataset(cfg.data, target.tokenizer)
        ids = eagle.draft_vocab(rows, target.config.vocab_size, cfg.eagle.draft_vocab_size) \
            if cfg.eagle.version == 3 else None
        models = {name: m.Eagle(target, m.EagleConfig(**{k: v for k, v in vars(cfg.eagle).items()  # the fields it has
                                                         if k in m.EagleConfig.__dataclass_fields__}), ids).train()
                  for name, m in versions.items()}
        for m in models.values():
            m.measuring = False  # as the loop runs the steps it does not log (all but 1 in loop.log_every)
        opts = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]) for name, m in models.items()}
        batches = [collate([rows[i] for i in range(4 * r, 4 * r + 4)]) for r in range(args.repeats)]
        steps = (1, 3, 5) if cfg.eagle.version == 3 else (1,)
        times: dict = {(name, k): [] for name in models for k in steps}
        for batch in batches:
            for k in steps:
                for name, m in models.items():
                    start = time.perf_counter()
                    with torch.autocast("cpu", torch.bfloat16, enabled=cfg.loop.mixed_precision == "bf16"):
                        loss, _ = m.ttt(batch, k)
                    loss.backward()
                    opts[name].step()
                    opts[name].zero_grad()
                    times[name, k].append(time.perf_counter() - start)
        out["ms_per_step"][method] = {f"ttt_steps={k}": {name: round(1000 * statistics.median(times[name, k][1:]), 1)
                                                          for name in models} for k in steps}
        print(method, out["ms_per_step"][method], flush=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
