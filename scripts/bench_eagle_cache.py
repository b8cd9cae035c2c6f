"""EAGLE-3 offline vs online: cache disk per token, time to write the cache, training throughput.

    python scripts/bench_eagle_cache.py [--recipe recipes/eagle3/tiny-code.yaml] [--limit 800] [--epochs 1]
        [--work runs/bench-eagle-cache] [--out benchmarks/eagle_cache.json]

With an EAGLE-3 recipe (default: the reference target's, packed rows of 256 tokens, batch 8; a real
target's, e.g. recipes/eagle3/smollm2-135m.yaml, measures a 30-layer target): writes
the bf16 cache with `draftsmith cache`, then trains the same number of steps (whole epochs)
online and offline from the same seed, and reports tokens/s and seconds per epoch two ways: wall time
(the loop's train_seconds: data loading and cache reads included, evaluation excluded) and CPU time per
step, (CPU of an S-step run - CPU of a 1-step run) / (S - 1), which setup and evaluation cancel out of
and which other jobs on a shared machine barely move; and per token, the drafter's own step (the offline cost)
beside the target's forward (online less offline). Also how far the bf16 cache moves the losses.
Writes `benchmarks/eagle_cache.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from draftsmith.train import eagle3

REPO = Path(__file__).resolve().parent.parent


def train(overrides: list[str], out: Path) -> dict:
    """One train/eagle3.py run in-process -> steps, wall train_seconds, process CPU seconds, per-step losses."""
    cpu = time.process_time()
    loop = eagle3.main([*overrides, f"loop.output_dir={out}"])
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return {"steps": loop.state.step, "train_seconds": loop.state.train_seconds, "losses": losses,
            "cpu_seconds": time.process_time() - cpu}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/eagle3/tiny-code.yaml")
    parser.add_argument("--limit", type=int, default=800, help="training examples (data.limit)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--work", default=str(REPO / "runs/bench-eagle-cache"), help="cache and runs (deleted first)")
    parser.add_argument("--out", default=str(REPO / "benchmarks/eagle_cache.json"))
    args = parser.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)

    data = [f"data.limit={args.limit}"]
    t, child_cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    recipe = REPO / args.recipe
    subprocess.run([sys.executable, "-m", "draftsmith.train.cli", "cache", "--config",
                    str(recipe), *data, "--out", str(work / "cache")], check=True)
    write_seconds, usage = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
    write_cpu = usage.ru_utime + usage.ru_stime - child_cpu.ru_utime - child_cpu.ru_stime
    manifest = json.loads((work / "cache/manifest.json").read_text())
    disk = sum(p.stat().st_size for p in (work / "cache").iterdir())
    rows, tokens = manifest["rows"], manifest["tokens"]
    batch = yaml.safe_load(recipe.read_text())["loop"]["batch_size"]
    per_epoch = rows // batch
    steps = args.epochs * per_epoch
    common = [f"--config={recipe}", *data, "loop.best_metric=", "eval.num_prompts=0", "eval.heldout_examples=8"]
    offline = [f"offline.path={work / 'cache'}"]
    runs = {}
    for mode, extra in [("online", []), ("offline", offline)]:
        one = train([*common, *extra, "loop.max_steps=1"], work / f"{mode}-1")
        full = train([*common, *extra, f"loop.max_steps={steps}", f"loop.save_every={steps}",
                      f"loop.log_every={max(1, steps // 20)}"], work / mode)
        runs[mode] = {**full, "cpu_per_step": (full["cpu_seconds"] - one["cpu_seconds"]) / (steps - 1)}

    def throughput(run: dict) -> dict:
        wall, cpu = run["train_seconds"] / run["steps"], run["cpu_per_step"]
        step_tokens = batch * tokens / rows
        return {"wall_seconds_per_epoch": round(wall * per_epoch, 2), "wall_tokens_per_s": round(step_tokens / wall, 1),
                "cpu_seconds_per_epoch": round(cpu * per_epoch, 2), "cpu_tokens_per_s": round(step_tokens / cpu, 1)}

    on, off = runs["online"], runs["offline"]
    result = {
        "command": " ".join(["python", "scripts/bench_eagle_cache.py", *(sys.argv[1:] if argv is None else argv)]),
        "recipe": args.recipe, "target": manifest["target"],
        "eagle": yaml.safe_load((work / "online/config.yaml").read_text())["eagle"],
        "host": f"CPU, {torch.get_num_threads()} torch thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
                f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end (shared with other jobs: "
                "wall figures are contended, CPU figures much less)",
        "cache": {"rows": rows, "tokens": tokens, "layers": manifest["layers"], "dtype": manifest["dtype"],
                  "hidden_size": manifest["hidden_size"], "shards": len(manifest["shards"]),
                  "bytes_per_token_estimate": manifest["bytes_per_token"],
                  "bytes_per_token_on_disk": round(disk / tokens, 1), "disk_bytes": disk,
                  "write_wall_seconds": round(write_seconds, 2), "write_cpu_seconds": round(write_cpu, 2),
                  "write_note": "the whole cache_hidden_states.py process: start, target load, data, forwards, writes"},
        "steps": steps, "steps_per_epoch": per_epoch, "batch_size": batch,
        "online": throughput(on), "offline": throughput(off),
        "offline_speedup_wall": round(on["train_seconds"] / off["train_seconds"], 3),
        "offline_speedup_cpu": round(on["cpu_per_step"] / off["cpu_per_step"], 3),
        # where a token's CPU time goes: offline is the drafter's own step (its TTT forwards and backwards, the
        # teacher's head, the cache reads), and online adds the target's forward; the drafter's share bounds offline
        "cpu_ms_per_token": {k: round(1e3 * step_s * rows / (batch * tokens), 3) for k, step_s in (
            ("online", on["cpu_per_step"]), ("drafter_step_offline", off["cpu_per_step"]),
            ("target_forward", on["cpu_per_step"] - off["cpu_per_step"]))},
        "bf16_cache_loss_max_abs_diff": round(max(abs(a - b) for a, b in zip(on["losses"], off["losses"], strict=True)), 6),
        "final_loss": {"online": on["losses"][-1], "offline": off["losses"][-1]},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
