"""EAGLE-3 offline vs online: cache disk per token, time to write the cache, training throughput.

    python scripts/bench_eagle_cache.py [--limit 800] [--epochs 1] [--work runs/bench-eagle-cache]

On the reference target with recipes/eagle3/tiny-code.yaml (packed rows of 256 tokens, batch 8): writes
the bf16 cache with scripts/cache_hidden_states.py, then trains the same number of steps (whole epochs)
online and offline from the same seed, and reports tokens/s and seconds per epoch from the loop's own
train_seconds (data loading and cache reads included, evaluation excluded) and process CPU time, and how
far the bf16 cache moves the losses. Writes `benchmarks/eagle_cache.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from draftsmith.train import eagle3

REPO = Path(__file__).resolve().parent.parent


def train(overrides: list[str], out: Path) -> dict:
    cpu = time.process_time()
    loop = eagle3.main([*overrides, f"loop.output_dir={out}"])
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return {"steps": loop.state.step, "train_seconds": loop.state.train_seconds, "losses": losses,
            "cpu_seconds": time.process_time() - cpu}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=800, help="reference chat examples (data.limit)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--work", default=str(REPO / "runs/bench-eagle-cache"), help="cache and runs (deleted first)")
    parser.add_argument("--out", default=str(REPO / "benchmarks/eagle_cache.json"))
    args = parser.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)

    data = [f"data.limit={args.limit}"]
    t = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "scripts/cache_hidden_states.py"), "--config",
                    str(REPO / "recipes/eagle3/tiny-code.yaml"), *data, "--out", str(work / "cache")], check=True)
    write_seconds = time.perf_counter() - t
    manifest = json.loads((work / "cache/manifest.json").read_text())
    disk = sum(p.stat().st_size for p in (work / "cache").iterdir())
    rows, tokens = manifest["rows"], manifest["tokens"]
    batch = 8  # the recipe's loop.batch_size
    steps = args.epochs * (rows // batch)
    common = [*data, f"loop.max_steps={steps}", f"loop.save_every={steps}", f"loop.log_every={max(1, steps // 20)}",
              "loop.best_metric=", "eval.num_prompts=0", "eval.heldout_examples=8"]
    online = train(common, work / "online")
    offline = train([*common, f"offline.path={work / 'cache'}"], work / "offline")

    def throughput(run: dict) -> dict:
        s = run["train_seconds"]
        return {"train_seconds": round(s, 2), "tokens_per_s": round(run["steps"] * batch * tokens / rows / s, 1),
                "seconds_per_epoch": round(s / run["steps"] * (rows // batch), 2),
                "process_cpu_seconds": round(run["cpu_seconds"], 2)}

    result = {
        "command": "python scripts/bench_eagle_cache.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "recipe": "recipes/eagle3/tiny-code.yaml", "target": manifest["target"],
        "host": f"CPU, {torch.get_num_threads()} torch threads (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}),"
                " shared with other jobs: compare the two runs, not absolute figures",
        "cache": {"rows": rows, "tokens": tokens, "layers": manifest["layers"], "dtype": manifest["dtype"],
                  "hidden_size": manifest["hidden_size"], "shards": len(manifest["shards"]),
                  "bytes_per_token_estimate": manifest["bytes_per_token"],
                  "bytes_per_token_on_disk": round(disk / tokens, 1), "disk_bytes": disk,
                  "write_seconds": round(write_seconds, 2),
                  "write_seconds_note": "the whole cache_hidden_states.py process: target load, data, forwards, writes"},
        "steps": steps, "batch_size": batch,
        "online": throughput(online), "offline": throughput(offline),
        "offline_speedup": round(online["train_seconds"] / offline["train_seconds"], 3),
        "offline_speedup_cpu": round(online["cpu_seconds"] / offline["cpu_seconds"], 3),
        "cpu_note": "process CPU time of the whole run (setup and the final held-out evaluation included, alike in "
                    "both); less sensitive than wall time to the other jobs on this machine",
        "bf16_cache_loss_max_abs_diff": max(abs(a - b) for a, b in zip(online["losses"], offline["losses"],
                                                                         strict=True)),
        "final_loss": {"online": online["losses"][-1], "offline": offline["losses"][-1]},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
