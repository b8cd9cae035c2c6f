"""Throughput check of every recipe on one GPU, into benchmarks/gpu.json.

    draftsmith gpu-check                 # one GPU (sized for an H200, ~10 min): ~1B target, bf16, 200 steps each
    draftsmith gpu-check --smoke         # CPU, tiny target, 6 steps each (bf16 too): the whole check end to end

Builds a Llama target from a config (random weights: throughput does not depend on them) with the reference
target's tokenizer, saves it with save_pretrained, then runs each recipe of models/registry.py (Medusa-1 and -2,
EAGLE-1 and -3, P-EAGLE, DFlash, LayerSkip, distillation) in-process through its entry script's main(). Per recipe it
records training tokens/s (evaluations excluded), peak GPU memory, and the step time split between the frozen target's forward and the rest
(drafter forward, backward, optimizer), timed by hooks on the target's decoder with a device synchronisation.
Then it decodes with the trained drafter (`draftsmith evaluate`: tau at T=0 and T=1, and whether greedy speculative
output equals the target's own greedy output) with the target in float32 and in bfloat16. The report is rewritten
after each recipe, so a check cut short keeps the recipes it finished.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.models.registry import RECIPES
from draftsmith.models.target import REFERENCE_TARGET, Target
from draftsmith.recipes import RECIPES as SHIPPED
from draftsmith.train import evaluate
from draftsmith.train.entries import TRAIN
from draftsmith.train.guard import cli

# ~1.03B parameters (TinyLlama's shape with the reference vocabulary of 8192), or a tiny one for --smoke
GPU_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4)
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2)
# the registry's recipes; bf16: trained under bf16 autocast, frozen: the frozen target stored in bf16 (not where the
# recipe trains the target itself)
CHECKS = {r.key: r for r in RECIPES}
TRAINS_TARGET = {"layerskip"}


def layer_overrides(name: str, L: int) -> list[str]:
    """The recipes' layer choices, made for the 8-layer reference target (layers 2, 4, 6), at the same relative
    depths of the check's L-layer target: DFlash's fused layers, LayerSkip's one exit layer decoded at each
    checkpoint, and the distilled draft's depth."""
    quarter = L // 4
    fused = [f"dflash.aux_layers=[{quarter},{L // 2},{3 * L // 4}]"]
    return {"dflash": fused, "dspark": fused,
            "layerskip": [f"eval.exit_layers=[{quarter}]", f"loop.best_metric=tau_exit{quarter}"],
            "distill": [f"distill.layers={quarter}"]}.get(name, [])


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class TargetTimer:
    """While active: tokens trained on, and seconds spent in the frozen target's decoder forward, during training
    steps (the method in train mode; checkpoint evaluations run it in eval mode and are excluded). The method is
    the module called with a batch dict; its frozen target is its `target` (a Target), if it has one."""

    def __init__(self):
        self.seconds, self.tokens, self.method, self.frozen_target, self._t = 0.0, 0, None, False, 0.0

    def __enter__(self) -> TargetTimer:
        self.handle = register_module_forward_pre_hook(self.find)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def find(self, module: nn.Module, args) -> None:
        if self.method is None and args and isinstance(args[0], dict) and "input_ids" in args[0]:
            self.method = module
            module.register_forward_pre_hook(self.count)
            self.count(module, args)
            target = getattr(module, "target", None)
            if isinstance(target, Target):
                self.frozen_target = True
                target.model.get_decoder().register_forward_pre_hook(self.start)
                target.model.get_decoder().register_forward_hook(self.stop)

    def count(self, module, args) -> None:
        if module.training:
            self.tokens += args[0]["input_ids"].numel()

    def start(self, module, args) -> None:
        sync()
        self._t = time.perf_counter()

    def stop(self, module, args, output) -> None:
        sync()
        if self.method.training:
            self.seconds += time.perf_counter() - self._t


def build_target(out: Path, smoke: bool) -> dict:
    """A random Llama of the check's shape with the reference tokenizer, saved to `out`; its shape and size."""
    shape = SMOKE_SHAPE if smoke else GPU_SHAPE
    ref = LlamaConfig.from_pretrained(REFERENCE_TARGET)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=ref.vocab_size, tie_word_embeddings=False,
                                         max_position_embeddings=2048, bos_token_id=ref.bos_token_id,
                                         eos_token_id=ref.eos_token_id, pad_token_id=ref.pad_token_id, **shape))
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.float32 if smoke else torch.bfloat16).save_pretrained(out)
    for f in REFERENCE_TARGET.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return {"params": params, **shape, "vocab_size": ref.vocab_size, "weights": "random (from config)"}


def run(name: str, work: Path, common: list[str], depth: int, decode_tokens: int) -> dict:
    """Train one recipe in-process under the timer on the check's `depth`-layer target, then decode with it; its
    throughput and decoding record."""
    recipe = CHECKS[name]
    precise = ["loop.mixed_precision=bf16", *([] if name in TRAINS_TARGET else ["target.dtype=bfloat16"])]
    extra = ["eval.heldout_examples=8", *layer_overrides(name, depth)]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    with TargetTimer() as timer:
        loop = TRAIN[recipe.entry].main(["--config", str(SHIPPED / recipe.recipe), f"loop.output_dir={work / name}",
                                   *common, *precise, *extra])
    wall = time.perf_counter() - t
    rows = [json.loads(r) for r in (work / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    seconds = loop.state.train_seconds
    out = {"steps": loop.state.step, "train_tokens": timer.tokens, "train_seconds": round(seconds, 2),
           "tokens_per_s": round(timer.tokens / seconds, 1),
           "loss_first": train[0]["loss"], "loss_last": train[-1]["loss"], "wall_seconds": round(wall, 1),
           "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available()
           else None}
    if timer.frozen_target:
        out.update(target_forward_seconds=round(timer.seconds, 2), rest_seconds=round(seconds - timer.seconds, 2),
                   target_forward_share=round(timer.seconds / seconds, 3))
    else:
        out["note"] = "trains the target itself: no frozen target forward to separate"
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if evals:
        out["eval_seconds"] = evals[-1].get("eval/eval_seconds")
    del loop
    gc.collect()  # the next recipe's peak memory is its own
    out["decode"] = {dtype: decode(work / name, dtype, decode_tokens) for dtype in ("float32", "bfloat16")}
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


def decode(run_dir: Path, dtype: str, tokens: int) -> dict:
    """Real speculative decoding with the run's best drafter, the target in `dtype`: tau at T=0 and T=1, speedup
    at T=0, and greedy equality with the target's own decoding; an error is recorded, not raised, so that one
    failing decode leaves the other recipes' figures."""
    try:
        r = evaluate.main(["--drafter", str(run_dir / "best"), "--num-prompts", "4", "--max-new-tokens", str(tokens),
                           "--temperatures", "0", "1", "--dtype", dtype, "--out", str(run_dir / f"decode_{dtype}.json")])
    except Exception as e:  # the check reports what failed and goes on
        return {"error": f"{type(e).__name__}: {e}"}
    t0, t1 = r["by_temperature"]["0"], r["by_temperature"]["1"]
    return {"tau_t0": round(t0["tau"], 3), "tau_t1": round(t1["tau"], 3), "speedup_t0": round(t0["speedup"], 3),
            "greedy_matches_target": t0["greedy_matches_target"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny target, 6 steps per recipe")
    parser.add_argument("--steps", type=int, default=200, help="steps per recipe on the GPU")
    parser.add_argument("--recipes", nargs="+", choices=list(CHECKS), default=list(CHECKS))
    parser.add_argument("--work", type=Path, default=None, help="default: runs/gpu-check[-smoke]")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/gpu.json, runs/gpu-check-smoke/gpu.json with --smoke")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; run with --smoke for the CPU check")
    work = args.work or Path("runs/gpu-check-smoke" if args.smoke else "runs/gpu-check")
    out = args.out or Path("runs/gpu-check-smoke/gpu.json" if args.smoke else "benchmarks/gpu.json")
    shutil.rmtree(work, ignore_errors=True)
    target = build_target(work / "target", args.smoke)
    depth = target["num_hidden_layers"]
    steps, batch, length, decode_tokens = (6, 2, 128, 8) if args.smoke else (args.steps, 8, 512, 64)
    common = [f"target.path={work / 'target'}", f"loop.max_steps={steps}", f"loop.save_every={steps}",
              f"loop.batch_size={batch}", f"loop.log_every={max(1, steps // 10)}", "loop.keep_last=1",
              f"data.max_length={length}", f"data.limit={steps * batch * 2}", "eval.num_prompts=2",
              f"eval.max_new_tokens={8 if args.smoke else 32}",
              "loop.divergence_factor=0"]  # random weights: loss spikes say nothing; stop on NaN/inf only
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else \
        f"CPU ({platform.processor() or 'unknown'}, {torch.get_num_threads()} threads)"
    report = {"mode": "smoke" if args.smoke else "gpu", "device": device, "torch": torch.__version__, "target": target,
              "run": {"steps": steps, "batch_size": batch, "max_length": length,
                      "precision": "bf16 autocast; frozen targets stored in bf16",
                      "timing": "target_forward_seconds: frozen target decoder forward, synchronised; rest: drafter, "
                                "backward, optimizer; evaluation excluded",
                      "decode": f"draftsmith evaluate on the best checkpoint: 4 held-out prompts x {decode_tokens} "
                                "tokens, T=0 and T=1, target in float32 and bfloat16",
                      "layers": {name: o for name in args.recipes if (o := layer_overrides(name, depth))}},
              "recipes": {}}
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.recipes:
        report["recipes"][name] = run(name, work, common, depth, decode_tokens)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(out)
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    cli(main)
