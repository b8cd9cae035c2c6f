#!/usr/bin/env bash
# Throughput check of every recipe on one GPU, into benchmarks/gpu.json.
#
#   bash scripts/gpu_check.sh            # one GPU (sized for an H200, ~10 min): ~1B target, bf16, 200 steps each
#                                        # (GPU_CHECK_STEPS=N to change the steps)
#   bash scripts/gpu_check.sh --smoke    # CPU, tiny target, 6 steps each: checks the script end to end
#
# Builds a Llama target from a config (random weights: throughput does not depend on them) with the
# reference target's tokenizer, saves it with save_pretrained, then runs each recipe whose entry
# script exists (Medusa-1, Medusa-2, LayerSkip, EAGLE-1, EAGLE-3, distillation) in-process through
# its own main(). Per recipe it records training tokens/s (evaluations excluded), peak GPU memory,
# and the step time split between the frozen target's forward and the rest (drafter forward,
# backward, optimizer), timed by hooks on the target's decoder with a device synchronisation.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=gpu
[[ "${1:-}" == "--smoke" ]] && MODE=smoke
OUT=${GPU_CHECK_OUT:-benchmarks/gpu.json}
[[ "$MODE" == smoke ]] && OUT=${GPU_CHECK_OUT:-runs/gpu-check-smoke/gpu.json}
# whatever environment is active (a venv, conda, a system install) if it has draftsmith; else the repository's .venv
if ! python -c "import draftsmith" 2>/dev/null; then
  [[ -z "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" && -x .venv/bin/python ]] || {
    echo "gpu_check: the active python ($(command -v python)) cannot import draftsmith; pip install -e . into it," \
         "or run bash scripts/test.sh once to create .venv" >&2; exit 1; }
  source .venv/bin/activate
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
MODE=$MODE OUT=$OUT python - <<'EOF'
import gc
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.models.target import REFERENCE_TARGET
from draftsmith.train import loop as L

smoke = os.environ["MODE"] == "smoke"
if not smoke and not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device; run with --smoke for the CPU check")
work = Path("runs/gpu-check-smoke" if smoke else "runs/gpu-check")
shutil.rmtree(work, ignore_errors=True)
target_dir = work / "target"

# ~1.03B parameters (TinyLlama's shape with the reference vocabulary of 8192), or a tiny one for --smoke
shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2) if smoke else \
    dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4)
ref = LlamaConfig.from_pretrained(REFERENCE_TARGET)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=ref.vocab_size, tie_word_embeddings=False, max_position_embeddings=2048,
                                     bos_token_id=ref.bos_token_id, eos_token_id=ref.eos_token_id,
                                     pad_token_id=ref.pad_token_id, **shape))
n_params = sum(p.numel() for p in model.parameters())
model.to(torch.float32 if smoke else torch.bfloat16).save_pretrained(target_dir)
del model
for f in REFERENCE_TARGET.iterdir():
    if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
        shutil.copy(f, target_dir / f.name)

steps, batch, length = (6, 2, 128) if smoke else (int(os.environ.get("GPU_CHECK_STEPS", 200)), 8, 512)
common = [f"target.path={target_dir}", f"loop.max_steps={steps}", f"loop.save_every={steps}", f"loop.batch_size={batch}",
          f"loop.log_every={max(1, steps // 10)}", "loop.keep_last=1", f"data.max_length={length}",
          f"data.limit={steps * batch * 2}", "eval.num_prompts=2", f"eval.max_new_tokens={8 if smoke else 32}"]
bf16 = [] if smoke else ["loop.mixed_precision=bf16"]
frozen_bf16 = [] if smoke else ["target.dtype=bfloat16"]
# name -> (entry script, recipe, overrides)
heldout = ["eval.heldout_examples=8"]
RECIPES = {
    "medusa1": ("train/medusa.py", "recipes/medusa/medusa1-tiny-code.yaml", [*bf16, *frozen_bf16, *heldout]),
    "medusa2": ("train/medusa.py", "recipes/medusa/medusa2-tiny-code.yaml", [*bf16, *frozen_bf16, *heldout]),
    "layerskip": ("train/layerskip.py", "recipes/layerskip/tiny-code.yaml",
                  [*bf16, *heldout, "eval.exit_layers=[2]", "loop.best_metric=tau_exit2"]),
    "eagle1": ("train/eagle.py", "recipes/eagle/tiny-code.yaml", [*bf16, *frozen_bf16, *heldout]),
    "eagle3": ("train/eagle3.py", "recipes/eagle3/tiny-code.yaml", [*bf16, *frozen_bf16, *heldout]),
    "distill": ("train/distill.py", "recipes/distill/tiny-code.yaml", [*bf16, *frozen_bf16]),
}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TargetTimer:
    """Tokens trained on, and seconds spent in the frozen target's decoder forward, during training steps
    (evaluations excluded)."""

    def __init__(self):
        self.seconds, self.tokens, self.counting, self._t = 0.0, 0, True, 0.0

    def attach(self, method):
        method.register_forward_pre_hook(self.count)
        target = getattr(method, "target", None)
        decoder = target.model.get_decoder() if hasattr(target, "model") else None
        if decoder is None:
            return False
        decoder.register_forward_pre_hook(self.start)
        decoder.register_forward_hook(self.stop)
        return True

    def count(self, module, args):
        if self.counting:
            self.tokens += args[0]["input_ids"].numel()

    def start(self, module, args):
        sync()
        self._t = time.perf_counter()

    def stop(self, module, args, output):
        sync()
        if self.counting:
            self.seconds += time.perf_counter() - self._t


def run(name, entry, recipe, extra):
    spec = importlib.util.spec_from_file_location(f"_gpu_check_{name}", entry)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timer, seen = TargetTimer(), {}
    run_loop, checkpoint = L.Loop.run, L.Loop.checkpoint

    def timed_run(self):
        seen["frozen_target"] = timer.attach(self.unwrapped)
        return run_loop(self)

    def untimed_checkpoint(self):
        timer.counting = False
        try:
            return checkpoint(self)
        finally:
            timer.counting = True

    L.Loop.run, L.Loop.checkpoint = timed_run, untimed_checkpoint
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    try:
        loop = module.main(["--config", recipe, f"loop.output_dir={work / name}", *common, *extra])
    finally:
        L.Loop.run, L.Loop.checkpoint = run_loop, checkpoint
    wall = time.perf_counter() - t
    rows = [json.loads(r) for r in (work / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    out = {"steps": loop.state.step, "train_seconds": round(loop.state.train_seconds, 2),
           "tokens_per_s": round(timer.tokens / loop.state.train_seconds, 1),
           "loss_first": train[0]["loss"], "loss_last": train[-1]["loss"], "wall_seconds": round(wall, 1),
           "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None}
    if seen["frozen_target"]:
        out["target_forward_seconds"] = round(timer.seconds, 2)
        out["rest_seconds"] = round(loop.state.train_seconds - timer.seconds, 2)
        out["target_forward_share"] = round(timer.seconds / loop.state.train_seconds, 3)
    else:
        out["note"] = "trains the target itself: no frozen target forward to separate"
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if evals:
        out["eval_seconds"] = evals[-1].get("eval/eval_seconds")
    print(f"{name}: {json.dumps(out)}", flush=True)
    del loop
    gc.collect()  # the next recipe's peak memory is its own
    return out


results = {}
for name, (entry, recipe, extra) in RECIPES.items():
    if not Path(entry).is_file():
        results[name] = {"skipped": f"{entry} does not exist yet"}
        continue
    results[name] = run(name, entry, recipe, extra)

device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor() or 'unknown'}, " \
    f"{torch.get_num_threads()} threads)"
report = {"mode": os.environ["MODE"], "device": device, "torch": torch.__version__,
          "target": {"params": n_params, **shape, "vocab_size": ref.vocab_size, "weights": "random (from config)"},
          "run": {"steps": steps, "batch_size": batch, "max_length": length,
                  "precision": "fp32" if smoke else "bf16 autocast; frozen targets stored in bf16",
                  "timing": "target_forward_seconds: frozen target decoder forward, synchronised; rest: drafter, "
                            "backward, optimizer; evaluation excluded"},
          "recipes": results}
out = Path(os.environ["OUT"])
out.parent.mkdir(parents=True, exist_ok=True)
tmp = out.with_suffix(".tmp")
tmp.write_text(json.dumps(report, indent=2) + "\n")
tmp.replace(out)
print(f"wrote {out}")
EOF
