"""Serving a target and its drafters in llama-server and decoding the same prompts with our decoder, shared by the
llama.cpp benchmarks (scripts/bench_llama_cpp.py, scripts/bench_peers.py).

    from draftsmith.models.serve_bench import ours, serve, target_ggufs
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from draftsmith.decoding.generate import speculative_generate
from draftsmith.decoding.metrics import DecodeStats
from draftsmith.decoding.verify import Sampling
from draftsmith.models import llama_cpp, zoo


def target_ggufs(name: str, target_dir: Path, precisions: list[str]) -> dict[str, Path]:
    """precision -> the target's GGUF, cached under the llama.cpp cache: f32 / f16 by llama.cpp's converter, q4_1
    (a named target's original quantisation) assembled from its PyPI package."""
    home = llama_cpp.cache_home() / "gguf"
    home.mkdir(parents=True, exist_ok=True)
    out = {}
    for p in precisions:
        f = home / f"{target_dir.name}-{p}.gguf"
        if not f.is_file() and p in ("f32", "f16", "bf16"):
            llama_cpp.convert(target_dir, f, p)
        elif not f.is_file():
            if name not in zoo.NAMED_TARGETS:
                raise SystemExit(f"precision {p}: only a named target ({', '.join(zoo.NAMED_TARGETS)}) has an original "
                                 "GGUF; choose f32/f16")
            spec = zoo.NAMED_TARGETS[name]
            with tempfile.TemporaryDirectory(dir=home) as tmp:
                zoo.assemble(zoo.download(spec.packages, Path(tmp)), spec.members, Path(tmp) / "x.gguf")
                (Path(tmp) / "x.gguf").rename(f)
        out[p] = f
    return out


@torch.no_grad()
def ours(model, proposer, prompts: list[torch.Tensor], max_new: int, gamma: int, temperatures) -> dict:
    """Our decoder with the same drafter (`proposer`, a chain of `gamma`: models.registry.load_proposer of a drafter dir), on the
    same prompt ids: tau, acceptance by position (conditional, and llama.cpp's: accepted at k / steps) per
    temperature."""
    out = {}
    for t in temperatures:
        stats, outputs = DecodeStats(), []
        for i, x in enumerate(prompts):
            y, _ = speculative_generate(model, proposer, x, max_new,
                                        Sampling(t, generator=torch.Generator().manual_seed(i)), stats=stats)
            outputs.append(y[0, x.shape[1]:].tolist())
        out[f"{t:g}"] = {"tau": stats.tau, "acceptance_by_position": stats.acceptance_by_position(),
                         "accepted_at_by_step": [stats.passed[k] / max(1, stats.steps) for k in range(1, gamma + 1)],
                         "steps": stats.steps, "new_tokens": stats.new_tokens, "outputs": outputs}
    return out


def serve(model: Path, args: list[str], prompts: list[list[int]], max_new: int, temperatures, threads: int) -> dict:
    """One llama-server for one way of decoding: every prompt at every temperature, pooled."""
    out = {}
    with llama_cpp.Server(model, args, threads) as server:
        server.complete(prompts[0], 8, 0.0)  # warm-up
        for t in temperatures:
            runs = [server.complete(p, max_new, t, seed=i) for i, p in enumerate(prompts)]
            steps, accepted = sum(r["verify_steps"] for r in runs), sum(r["accepted"] for r in runs)
            depth = max((len(r["accepted_at"]) for r in runs), default=0)
            at = [sum(r["accepted_at"][k] for r in runs if k < len(r["accepted_at"])) for k in range(depth)]
            new = sum(r["new_tokens"] for r in runs)
            seconds = sum(r["new_tokens"] / r["tokens_per_s"] for r in runs if r["tokens_per_s"])
            out[f"{t:g}"] = {"tokens_per_s": new / seconds, "new_tokens": new, "verify_steps": steps,
                             "drafted": sum(r["drafted"] for r in runs), "accepted": accepted,
                             "acceptance_length": 1 + accepted / steps if steps else None,
                             "accepted_at_by_step": [a / steps for a in at] if steps else [],
                             "outputs": [r["tokens"] for r in runs]}
    return out
