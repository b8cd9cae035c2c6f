"""Checkpoints of the training loop (train/loop.py): writing them atomically, verifying, and exact resume.

DeepSpeed's optimizer state is sharded: it is saved and restored with accelerate's `save_state`/`load_state` (frozen
parameters excluded) and only under the world size that wrote it. Otherwise the whole optimizer state is written by
parameter name (torch.distributed.checkpoint's full state dict), so single-process, DDP and FSDP2 checkpoints resume
under any world size and under one another.

Run directory layout:
    config.yaml, command.txt, metrics.jsonl (config and command written once the resume decision is made)
    run.lock            pid and host of the trainer using the directory (train/guard.py)
    checkpoint-<step>/  trainable.safetensors, optimizer.pt (keyed by parameter name), scheduler.pt, rng.safetensors,
                        state.json, config.yaml, model/ (method.save_pretrained), and manifest.json (sizes and
                        checksums of the rest, written last); under DeepSpeed deepspeed/ (every rank's ZeRO
                        shards) instead of optimizer.pt and scheduler.pt
    best/               a copy of the best checkpoint's model/ plus best.json

Resume takes the newest checkpoint whose manifest verifies (a corrupt one is skipped with a warning) and
refuses one whose trainable tensors do not fit the method, naming the config keys that differ.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import save_file
from torch import distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from draftsmith.data.core import (
    DiskFull,
    check_free,
    checkpoint_dir,
    checkpoints,
    is_disk_full,
    one_line,
    read_file,
)
from draftsmith.train import guard
from draftsmith.train.config import ConfigError


@dataclass
class LoopState:
    """Where training stands: optimizer steps done and the data position."""

    step: int = 0
    epoch: int = 0
    micro_batch: int = 0  # micro-batches of this epoch already consumed (all ranks together)
    best_value: float | None = None
    evals_since_best: int = 0
    train_seconds: float = 0.0  # wall time spent in training steps (evaluations and saves excluded)
    eval_seconds: float = 0.0  # wall time spent in checkpoint evaluations
    wall_seconds: float = 0.0  # wall time of the run's launches, each up to its last checkpoint
    world_size: int = 1  # processes that wrote the checkpoint (micro_batch counts global micro-batches of it)

def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    np_state = np.random.get_state()
    meta = {"python": _listify(random.getstate()),
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    return tensors, meta


def _listify(x):
    return [_listify(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tupleify(x):
    return tuple(_tupleify(v) for v in x) if isinstance(x, list) else x


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(_tupleify(meta["python"]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters the optimizer owns, by name (frozen parts are never checkpointed)."""
    return {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


def newest_verified(run_dir: Path, warn: Callable[[str], None] = print) -> Path | None:
    """The newest checkpoint whose manifest verifies; each newer one that does not is skipped with a warning."""
    for ckpt in reversed(checkpoints(run_dir)):
        why = guard.verify(ckpt)
        if not why:
            return ckpt
        warn(f"warning: skipping {ckpt}: {why}; resuming from an older checkpoint if one verifies")
    return None


def config_changes(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested configs, as 'key: old -> new'."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def _atomic_dir(final: Path, write: Callable[[Path], None]) -> None:
    """Write a directory under a temporary name, then rename it into place."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    _replace(tmp, final)


def _replace(tmp: Path, final: Path) -> None:
    """Rename a finished temporary directory into place, replacing any older one."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


class Checkpoints:
    """The loop's checkpoint writing and resume, a base of `Loop`, whose accelerator, prepared method, optimizer,
    scheduler, state, cfg, run_dir and run_config it reads, and whose `wait_for_everyone` lets the other ranks wait
    for as long as rank 0 writes."""

    def _whole_trainable(self):
        """Context in which the trainable parameters are whole for rank 0's write (a collective)."""
        if self.zero3:
            import deepspeed

            return deepspeed.zero.GatheredParameters([p for p in self.method.parameters() if p.requires_grad])
        return _materialised(self.method, self.accelerator.is_main_process) if self.fsdp else contextlib.nullcontext()

    def save(self, metrics: dict, is_best: bool = False) -> Path:
        """Write checkpoint-<step> atomically (every rank its DeepSpeed shards, rank 0 the rest), prune old
        ones, and refresh best/."""
        acc = self.accelerator
        final = checkpoint_dir(self.run_dir, self.state.step)
        tmp = final.with_name(final.name + ".tmp")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            check_free(self.run_dir, self._checkpoint_bytes(), f"{final.name}",
                             f"free space there or move the run (loop.output_dir); {self._last_good()} is intact")
            tmp.mkdir(parents=True)
        self.wait_for_everyone()
        try:
            optimizer = None
            if self.deepspeed:
                acc.save_state(str(tmp / "deepspeed"), exclude_frozen_parameters=True)
            else:  # whole and keyed by parameter name; a collective under FSDP2
                optimizer = get_optimizer_state_dict(self.method, self.optimizer.optimizer,
                                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            with self._whole_trainable():
                if acc.is_main_process:
                    self._write(tmp, metrics, optimizer)
        except (OSError, RuntimeError) as e:
            if not is_disk_full(e):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise DiskFull(f"the disk filled up while writing {final.name} ({one_line(e)}); nothing of "
                                 f"it was kept, {self._last_good()} is intact; free space and run again") from e
        self.wait_for_everyone()
        if acc.is_main_process:
            guard.write_manifest(tmp)  # last: a checkpoint without a verifying manifest is never resumed from
            _replace(tmp, final)
            if is_best and (final / "model").exists():
                _atomic_dir(self.run_dir / "best", lambda d: (
                    shutil.copytree(final / "model", d, dirs_exist_ok=True),
                    (d / "best.json").write_text(json.dumps({"step": self.state.step, **metrics}))))
            for old in checkpoints(self.run_dir)[: -self.cfg.keep_last]:
                shutil.rmtree(old)
        self.wait_for_everyone()
        self.saved_step = self.state.step
        return final

    def _write(self, d: Path, metrics: dict, optimizer: dict | None) -> None:
        """Rank 0's part of a checkpoint: trainable weights, optimizer and scheduler (unless DeepSpeed holds
        them), RNG, loop and method state, and the method's own artefact."""
        model = self.unwrapped
        save_file(trainable_state(model), d / "trainable.safetensors")
        if optimizer is not None:
            torch.save(optimizer, d / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), d / "scheduler.pt")
        tensors, meta = _rng_state()
        save_file(tensors, d / "rng.safetensors")
        extra = model.extra_state()
        self.state.wall_seconds = time.perf_counter() - self.started
        (d / "state.json").write_text(json.dumps({**self.state.__dict__, "backend": self.backend, "rng": meta,
                                                  "metrics": metrics, "method": extra}))
        (d / "config.yaml").write_text(yaml.safe_dump(self.run_config, sort_keys=False))
        model.save_pretrained(d / "model")

    def _checkpoint_bytes(self) -> int:
        """Bytes the next checkpoint needs: the last one's size, else the trainable weights, AdamW's two fp32
        moments and the method's artefact (counted as the weights again)."""
        last = checkpoints(self.run_dir)
        if last and guard.manifest_bytes(last[-1]):
            return guard.manifest_bytes(last[-1])
        n = [(p.numel(), p.element_size()) for p in self.method.parameters() if p.requires_grad]
        return sum(k * (2 * size + 8) for k, size in n)

    def _last_good(self) -> str:
        last = [c for c in checkpoints(self.run_dir) if not guard.verify(c)]
        return f"the last good checkpoint {last[-1]}" if last else "no earlier checkpoint"

    def load(self, ckpt: Path) -> None:
        """Restore weights, optimizer, scheduler, data position and RNG from a checkpoint."""
        acc, model = self.accelerator, self.unwrapped
        fix = f"move {ckpt} aside to resume from the checkpoint before it, or set loop.resume=never"
        state = read_file(ckpt / "state.json", fix)
        world = state.get("world_size", 1)
        written = state.pop("backend", "ddp")
        if self.deepspeed != (ckpt / "deepspeed").is_dir():
            raise ValueError(f"{ckpt} was written {'with' if not self.deepspeed else 'without'} DeepSpeed; resume "
                             "with the launcher config that wrote it, or set loop.resume=never with a new loop.output_dir")
        if self.deepspeed:
            if world != acc.num_processes:
                raise ValueError(f"{ckpt} holds DeepSpeed ZeRO shards of {world} processes, not {acc.num_processes}; "
                                 f"resume with {world} processes (sharded optimizer state), or set loop.resume=never")
            acc.load_state(str(ckpt / "deepspeed"), load_module_strict=False)
        else:
            weights = read_file(ckpt / "trainable.safetensors", fix)
            self._check_fits(ckpt, model, weights, "resume", "restore those values to resume, or train afresh in a "
                             "new loop.output_dir (or loop.resume=never)")
            # whole state dicts by parameter name, sharded here as this launch shards (FSDP2) or copied (DDP)
            options = StateDictOptions(full_state_dict=dist.is_initialized(), strict=False)
            set_model_state_dict(self.method, weights, options=options)
            set_optimizer_state_dict(self.method, self.optimizer.optimizer,
                                     read_file(ckpt / "optimizer.pt", fix), options=options)
            self.scheduler.load_state_dict(read_file(ckpt / "scheduler.pt", fix))
        _set_rng_state(read_file(ckpt / "rng.safetensors", fix), state.pop("rng"))
        state.pop("metrics", None)
        extra = state.pop("method", None)
        if extra is not None:
            model.load_extra_state(extra)
        self.state = LoopState(**state)
        self.spent_seconds = self.state.train_seconds
        examples = self.state.micro_batch * self.cfg.batch_size * world  # of this epoch, all ranks together
        per_micro = self.cfg.batch_size * acc.num_processes
        if examples % per_micro:
            raise ValueError(f"{ckpt} stopped {examples} examples into its epoch, not a whole number of "
                             f"{per_micro}-example global micro-batches; resume with {world} processes")
        self.state.micro_batch, self.state.world_size = examples // per_micro, acc.num_processes
        self.saved_step = self.state.step
        acc.print(f"resumed from {ckpt} at step {self.state.step}"
                  + (f" ({world} processes wrote it, {acc.num_processes} resume it)" if world != acc.num_processes else "")
                  + (f" (written under {written}, resumed under {self.backend})" if written != self.backend else ""))

    def start_from(self, method: nn.Module, ckpt: Path) -> None:
        """Load the trained weights of `ckpt` (loop.init_from) into the method before it is prepared; the optimizer,
        schedule and data position start afresh."""
        fix = "pass loop.init_from= a checkpoint-<step> directory of a run of this method"
        why = guard.verify(ckpt) if ckpt.is_dir() else "not a directory"
        if why:
            raise ValueError(f"loop.init_from={ckpt}: {why}; {fix}")
        weights = read_file(ckpt / "trainable.safetensors", fix)
        self._check_fits(ckpt, method, weights, "start from", "set those keys as it was trained, or start afresh "
                         "without loop.init_from")
        method.load_state_dict(weights, strict=False)  # the trainable tensors, all of them (checked just above)
        step = read_file(ckpt / "state.json", fix)["step"]
        self.accelerator.print(f"started from the weights of {ckpt} (step {step}); optimizer and schedule afresh")

    def _check_fits(self, ckpt: Path, model: nn.Module, weights: dict[str, torch.Tensor], verb: str, fix: str) -> None:
        """Refuse a checkpoint whose trainable tensors (names, shapes) differ from the model's, naming the config keys
        that changed since it was written (outside loop, eval and data, which shape no tensor)."""
        mine = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
        shapes = {n: tuple(t.shape) for n, t in weights.items()}
        if mine == shapes:
            return
        old = read_file(ckpt / "config.yaml", "set loop.resume=never") if (ckpt / "config.yaml").is_file() else {}
        changed = [c for c in config_changes(old, self.run_config) if not c.startswith(("loop.", "eval.", "data."))]
        diff = sorted(set(mine) ^ set(shapes)) or sorted(n for n in mine if mine[n] != shapes[n])
        why = f"changed keys: {'; '.join(changed)}" if changed else f"tensors differ: {diff[:3]}"
        raise ConfigError(f"cannot {verb} {ckpt}: it was trained with another model shape ({why}); {fix}")


@contextlib.contextmanager
def _materialised(model: nn.Module, writer: bool):
    """On the writing rank, swap the trainable FSDP2 parameters (DTensor shards) for whole copies in host memory
    until the context ends; every rank takes part in gathering them, one parameter at a time. Unlike
    FSDPModule.unshard, this survives `state_dict()`, which FSDP2 makes reshard its units, so save_pretrained and
    the checkpoint read ordinary tensors; FSDP2's own state stays sharded throughout."""
    swapped = []
    for name, p in model.named_parameters():
        if p.requires_grad and isinstance(p, DTensor):
            whole = p.full_tensor()  # a collective
            if writer:
                owner, _, attr = name.rpartition(".")
                module = model.get_submodule(owner)
                swapped.append((module, attr, p))
                setattr(module, attr, nn.Parameter(whole.cpu(), requires_grad=True))
            del whole
    try:
        yield
    finally:
        for module, attr, p in swapped:
            setattr(module, attr, p)
