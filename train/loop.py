"""The one training loop every method uses.

A method meets the contract of models/method.py (`Method`, defaults in `MethodBase`): `forward(batch)` returns
`(loss, metrics)`, its trainable parameters are those with `requires_grad`, and the loop reads its `param_groups`,
`extra_state`, `save_pretrained` and `sharded_refusal` and sets its `progress` and `measuring`.
The loop owns everything else: accelerate, gradient accumulation, mixed precision, clipping,
schedule, trackers, `metrics.jsonl`, checkpoints, best-checkpoint keeping and exact resume.

Distributed runs (launcher configs in recipes/accelerate/): under DDP and DeepSpeed ZeRO-2 every
rank holds the whole target; at checkpoints every rank decodes its share of the held-out prompts
and the statistics are gathered (decoding/evaluate.py, `sharded`), so tau is the one-rank tau; rank 0
alone writes metadata, trackers and exports. Under ZeRO-3 and FSDP2 the target is sharded, so the
ranks also decode in lockstep (same sequence of forwards, each layer gathering its parameters in its
forward; FSDP2's root parameters, such as embeddings and drafter heads, stay gathered for the
evaluation), still each on its own share of the prompts.

Checkpoints, their layout and exact resume: train/checkpoint.py.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import yaml
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, InitProcessGroupKwargs, broadcast_object_list, set_seed
from torch import nn
from torch.distributed.fsdp import FSDPModule
from tqdm.auto import tqdm

from draftsmith.data.core import (
    checkpoint_dir,
    checkpoints,
    collate,
    write_atomically,
)
from draftsmith.decoding.evaluate import Shard, sharded
from draftsmith.models.method import missing
from draftsmith.train import guard
from draftsmith.train.checkpoint import Checkpoints, LoopState, newest_verified
from draftsmith.train.config import ConfigError, LoopConfig
from draftsmith.train.ranks import Lost, Ranks, launcher_store

Evaluate = Callable[[nn.Module, int], dict]
METRICS = "metrics.jsonl"  # every logged line, each step once (`keep_metrics_through`)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or inf, or exploded relative to its recent history."""


class EpochSampler:
    """Seeded permutation per epoch, cut into global micro-batches and sharded by rank.

    Micro-batch j of epoch e for rank r is perm_e[j*G + r*b : j*G + (r+1)*b] with G = b * world,
    so the data position is a pair (e, j) and resuming from it sees each example exactly once.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.n, self.b, self.seed, self.rank, self.world = n, batch_size, seed, rank, world
        self.per_epoch = n // (batch_size * world)
        if self.per_epoch == 0:
            raise ValueError(f"dataset of {n} rows is smaller than one global batch ({batch_size} x {world}); "
                             "lower loop.batch_size or add data")

    def batches(self, epoch: int, start: int):
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        G = self.b * self.world
        for j in range(start, self.per_epoch):
            lo = j * G + self.rank * self.b
            yield j, perm[lo: lo + self.b]


def run_progress(cfg: LoopConfig, step: int, seconds: float) -> float:
    """Fraction of the run done after `step` optimizer steps and `seconds` of training time: whichever
    budget is further spent, loop.max_steps or loop.max_minutes. Schedules follow it, so a run stopped
    by its time budget has still warmed up and decayed over that budget."""
    steps = step / cfg.max_steps
    return min(1.0, max(steps, seconds / (60 * cfg.max_minutes)) if cfg.max_minutes else steps)


def lr_factor(cfg: LoopConfig, step: int, seconds: float = 0.0) -> float:
    """Learning-rate multiplier: linear warm-up over loop.warmup_ratio of the run, then the schedule."""
    progress = run_progress(cfg, step, seconds)
    w = cfg.warmup_ratio
    if progress < w:
        return min(1.0, max((step + 1) / cfg.max_steps, progress) / w)
    if cfg.schedule == "constant":
        return 1.0
    decay = min(1.0, (progress - w) / (1 - w))
    return 0.5 * (1 + math.cos(math.pi * decay)) if cfg.schedule == "cosine" else 1.0 - decay


def keep_freed_memory() -> None:
    """Under glibc, keep freed blocks of up to 32 MiB in the heap rather than unmapped (M_MMAP_THRESHOLD) and the
    heap untrimmed below 1 GiB (M_TRIM_THRESHOLD). A CPU training step makes and frees many [positions, vocabulary]
    buffers of a few MiB; returned to the kernel, each is page-faulted in afresh at its next use (EAGLE-3's step
    567 -> 510 ms with glibc's tunables set so). Elsewhere (no glibc) a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


class Loop(Checkpoints):
    """Train `method` on `dataset` under `cfg`; call `evaluate` at every checkpoint."""

    def __init__(self, cfg: LoopConfig, method: nn.Module, dataset, evaluate: Evaluate | None = None,
                 run_config: dict | None = None, collate_fn=collate):
        self.cfg, self.dataset, self.evaluate, self.collate = cfg, dataset, evaluate, collate_fn
        self.run_dir = Path(cfg.output_dir)
        self.run_config = run_config or {}
        self.lock = guard.RunLock(self.run_dir)
        tracker = None if cfg.tracker == "none" else cfg.tracker
        if tracker and importlib.util.find_spec(tracker) is None:
            raise ValueError(f"loop.tracker={tracker} needs the {tracker} package: pip install {tracker}, "
                             "or set loop.tracker=none")
        if tracker == "wandb" and not os.environ.get("WANDB_API_KEY"):
            os.environ.setdefault("WANDB_MODE", "offline")
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and os.environ.get("LOCAL_RANK", "0") == "0":
            guard.clear_stale_build_locks()  # DeepSpeed builds its ops from the Accelerator on; one rank per machine
        if AcceleratorState._shared_state.get("_mixed_precision", cfg.mixed_precision) != cfg.mixed_precision:
            AcceleratorState._reset_state()  # an earlier Loop in this process (a notebook, the tests) chose another
        # a collective waits this long for a rank that stopped; longer waits meet outside collectives (`wait_for_everyone`)
        timeout = timedelta(minutes=cfg.collective_timeout_minutes)
        self.accelerator = Accelerator(mixed_precision=cfg.mixed_precision, log_with=tracker,
                                       project_dir=str(self.run_dir), gradient_accumulation_steps=cfg.grad_accum,
                                       step_scheduler_with_optimizer=False,
                                       kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
        acc = self.accelerator
        self.ranks = Ranks(acc.process_index, acc.num_processes, timeout.total_seconds(),
                           f"loop.collective_timeout_minutes={cfg.collective_timeout_minutes:g}") \
            if acc.num_processes > 1 and launcher_store() else None
        if self.accelerator.is_main_process:  # a second trainer on this directory refuses here, before it writes
            self.lock.acquire()
            atexit.register(self.lock.release)
        try:
            self._start(method, tracker)
        except BaseException:
            self.lock.release()
            raise

    def _start(self, method: nn.Module, tracker: str | None) -> None:
        """Prepare the method and optimizer, resume if a checkpoint verifies, then record the run's config."""
        cfg = self.cfg
        self._check_launch(method)
        if missing(method):
            raise TypeError(f"{type(method).__name__} does not meet the method contract (models/method.py): it lacks "
                            f"{', '.join(missing(method))}; derive it from MethodBase")
        if self.sharded and method.sharded_refusal:
            raise ValueError(method.sharded_refusal)
        set_seed(cfg.seed)
        if self.accelerator.device.type == "cpu":
            keep_freed_memory()
        groups = method.param_groups(cfg.lr)
        if not any(g["params"] for g in groups):
            raise ValueError("the method has no trainable parameters")
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.spent_seconds = 0.0  # training time of the slowest rank, which the schedules and loop.max_minutes read
        method.progress = lambda: self.progress
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, step, self.spent_seconds))
        if cfg.init_from and not (cfg.resume == "auto" and checkpoints(self.run_dir)):  # a resume comes first
            self.start_from(method, Path(cfg.init_from))  # before prepare, which copies or shards the weights
        self.method, self.optimizer, self.scheduler = self.accelerator.prepare(method, optimizer, scheduler)
        self.state = LoopState(world_size=self.accelerator.num_processes)
        self.saved_step = -1  # step of the last checkpoint written or loaded
        self.losses: list[float] = []  # recent step losses, for the divergence stop
        if cfg.resume == "auto":
            found = newest_verified(self.run_dir, self.accelerator.print) if self.accelerator.is_main_process else None
            self.wait_for_everyone()  # rank 0 checks every newer checkpoint's checksums: as long as that takes
            found = broadcast_object_list([found])[0]
            if found is None and checkpoints(self.run_dir):
                raise ValueError(f"no checkpoint in {self.run_dir} verifies (see the warnings above); set "
                                 "loop.resume=never with a new loop.output_dir to start afresh")
            if found is not None:
                self.load(found)
        if self.accelerator.is_main_process:  # only now that the resume is decided
            self.run_dir.mkdir(parents=True, exist_ok=True)
            keep_metrics_through(self.run_dir / METRICS, self.state.step)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.run_config, sort_keys=False))
            (self.run_dir / "command.txt").write_text(" ".join(["python", *sys.argv]) + "\n")
        if tracker:  # TensorBoard hides the points an earlier launch logged past this step (wandb cannot: a new run)
            self.accelerator.init_trackers(cfg.project, config=_flat(self.run_config),
                                           init_kwargs={"tensorboard": {"purge_step": self.state.step + 1}})

    def _check_launch(self, method: nn.Module) -> None:
        """Refuse launches this loop cannot serve; fill DeepSpeed's "auto" batch and clipping from the recipe, and
        FSDP2's layer classes to shard from the models inside the method."""
        acc, cfg = self.accelerator, self.cfg
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != acc.num_processes:
            raise RuntimeError(f"{launched} processes were launched but accelerate sees {acc.num_processes}: without "
                               "GPUs launch DDP with ACCELERATE_USE_CPU=true (gloo); accelerate runs DeepSpeed and FSDP "
                               "on GPUs only")
        if self.fsdp:
            plugin = acc.state.fsdp_plugin
            if plugin.fsdp_version != 2:
                raise ValueError("FSDP1 is not supported: set fsdp_version: 2 in the accelerate config "
                                 "(recipes/accelerate/fsdp2.yaml)")
            if plugin.transformer_cls_names_to_wrap is None:  # each decoder layer its own FSDP unit
                present = {type(m).__name__ for m in method.modules()}
                plugin.transformer_cls_names_to_wrap = sorted(
                    {n for m in method.modules() for n in getattr(m, "_no_split_modules", None) or ()} & present)
        if not self.deepspeed:
            return
        ds = acc.state.deepspeed_plugin.deepspeed_config
        want = {"train_micro_batch_size_per_gpu": cfg.batch_size, "gradient_accumulation_steps": cfg.grad_accum,
                "train_batch_size": cfg.batch_size * cfg.grad_accum * acc.num_processes,
                "gradient_clipping": cfg.grad_clip}
        for key, value in want.items():
            ds[key] = value if ds.get(key, "auto") == "auto" else ds[key]
            if ds[key] != value:
                raise ValueError(f"the DeepSpeed config sets {key}={ds[key]} but the recipe implies {value}; "
                                 "set it to \"auto\" in the JSON (loop.batch_size, loop.grad_accum, loop.grad_clip decide)")

    @property
    def deepspeed(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    @property
    def zero3(self) -> bool:
        return self.deepspeed and self.accelerator.state.deepspeed_plugin.zero_stage == 3

    @property
    def fsdp(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.FSDP

    @property
    def sharded(self) -> bool:
        """The frozen target is sharded over the ranks (ZeRO-3 or FSDP2): evaluation runs on every rank in lockstep."""
        return self.zero3 or self.fsdp

    def autocast(self) -> contextlib.AbstractContextManager:
        """The recipe's mixed precision around forwards. accelerate leaves its autocast off under DeepSpeed, whose
        bf16/fp16 casts the trainable weights instead: the frozen target's float32 features meet those weights under
        torch's autocast there."""
        mp = self.cfg.mixed_precision
        if self.deepspeed and mp in ("bf16", "fp16"):
            return torch.autocast(self.accelerator.device.type, {"bf16": torch.bfloat16, "fp16": torch.float16}[mp])
        return self.accelerator.autocast()

    @property
    def backend(self) -> str:
        return "deepspeed" if self.deepspeed else "fsdp2" if self.fsdp else "ddp"

    @property
    def progress(self) -> float:
        """Fraction of the run done (see `run_progress`); method schedules such as Medusa-2's head warm-up read it."""
        return run_progress(self.cfg, self.state.step, self.spent_seconds)

    def _permille(self) -> int:
        return round(1000 * self.progress)

    @property
    def unwrapped(self) -> nn.Module:
        return self.accelerator.unwrap_model(self.method)

    def _evaluation_context(self):
        """FSDP2 gathers a wrapped layer's parameters in that layer's forward, but the root's own (the target's
        embeddings and LM head, drafter heads) only in the root's forward, which evaluation bypasses: gather them."""
        return _unsharded(self.method) if self.fsdp else contextlib.nullcontext()

    def _update_best(self, metrics: dict) -> bool:
        key = self.cfg.best_metric
        if not key:
            return False
        if key not in metrics:
            raise ConfigError(f"loop.best_metric={key!r} is not among the evaluation metrics {sorted(metrics)}; "
                              "choose one of them")
        value, best = float(metrics[key]), self.state.best_value
        better = best is None or (value > best if self.cfg.best_mode == "max" else value < best)
        if better:
            self.state.best_value, self.state.evals_since_best = value, 0
        else:
            self.state.evals_since_best += 1
        return better

    # ---- the loop ----------------------------------------------------------------------------------

    def micro_batches(self):
        """Endless stream of (epoch, last in epoch, index, batch) from the saved data position on. The next batch is
        read and collated in a background thread while this one trains (an offline cache reads it from disk)."""
        acc = self.accelerator
        sampler = EpochSampler(len(self.dataset), self.cfg.batch_size, self.cfg.seed,
                               acc.process_index, acc.num_processes)

        def positions():
            epoch, start = self.state.epoch, self.state.micro_batch
            while epoch < self.cfg.max_epochs:
                for j, idx in sampler.batches(epoch, start):
                    yield epoch, j + 1 == sampler.per_epoch, j, idx
                epoch, start = epoch + 1, 0

        def read(idx: list[int]) -> dict[str, torch.Tensor]:
            return self.collate([self.dataset[i] for i in idx])

        with ThreadPoolExecutor(1, thread_name_prefix="draftsmith-prefetch") as pool:
            todo = positions()
            nxt = next(todo, None)
            pending = nxt and pool.submit(read, nxt[3])
            while nxt is not None:
                (epoch, last, j, _), batch = nxt, pending.result()
                nxt = next(todo, None)
                pending = nxt and pool.submit(read, nxt[3])
                yield epoch, last, j, {k: v.to(acc.device) for k, v in batch.items()}

    def run(self) -> LoopState:
        """Train to the end of the budget. SIGINT/SIGTERM end the current step, write a checkpoint and raise `Stopped`;
        the lock on the run directory is released however it ends. In a multi-process launch an error caused by a rank
        that failed, died or stopped answering is raised as `guard.PeerLost` naming it."""
        # under loop.max_minutes the bar counts the run's progress in permille of whichever budget binds (`progress`),
        # so its ETA is the time or step budget's, not max_steps' alone
        total, done = (1000, self._permille()) if self.cfg.max_minutes else (self.cfg.max_steps, self.state.step)
        self.bar = tqdm(total=total, initial=done, dynamic_ncols=True, leave=False,
                        bar_format="{l_bar}{bar}| {elapsed}<{remaining}{postfix}" if self.cfg.max_minutes else None,
                        disable=not self.accelerator.is_main_process)
        self.started = time.perf_counter() - self.state.wall_seconds  # for eval_share, over every launch of the run
        try:
            with guard.StopSignals(self._peer_lost) as signals:
                try:
                    return self._run(signals)
                except Exception as e:
                    if self.ranks is None:
                        raise
                    signals.ignore()  # this rank is ending: it says why before the launcher's SIGTERM can end it
                    # after a collective's error (a RuntimeError), look a few seconds for the rank that caused it
                    lost = None if isinstance(e, guard.PeerLost) else self._peer_lost(isinstance(e, RuntimeError))
                    if lost is None:
                        raise
                    raise lost from e
        finally:
            self.bar.close()
            self.lock.release()
            if self.ranks is not None:
                self.ranks.close()

    def _run(self, signals: guard.StopSignals) -> LoopState:
        cfg, acc = self.cfg, self.accelerator
        stream = self.micro_batches()
        window: dict[str, list[float]] = {}
        tokens, t0 = 0, time.perf_counter()
        self.method.train()
        while self.state.step < cfg.max_steps:
            t_step = time.perf_counter()
            logged = (self.state.step + 1) % cfg.log_every == 0 or self.state.step + 1 == cfg.max_steps
            self.unwrapped.measuring = logged
            metrics_step: dict[str, float] = {}
            losses = []
            for _ in range(cfg.grad_accum):
                try:
                    epoch, last_in_epoch, j, batch = next(stream)
                except StopIteration:
                    return self._finish("max_epochs reached")
                with acc.accumulate(self.method), self.autocast():  # syncs (and DeepSpeed steps) on the last
                    loss, metrics = self.method(batch)
                    acc.backward(loss)  # divided by grad_accum by accelerate (by DeepSpeed under DeepSpeed)
                losses.append(loss.detach())
                for k, v in metrics.items():
                    metrics_step[k] = metrics_step.get(k, 0.0) + float(v) / cfg.grad_accum
                tokens += batch["input_ids"].numel() * acc.num_processes
                self.state.epoch, self.state.micro_batch = (epoch + 1, 0) if last_in_epoch else (epoch, j + 1)
            loss = acc.reduce(torch.stack(losses).mean(), "mean")
            self._check_divergence(loss.item())
            if cfg.grad_clip > 0:
                metrics_step["grad_norm"] = float(acc.clip_grad_norm_(self.method.parameters(), cfg.grad_clip))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step += 1
            self.state.train_seconds += time.perf_counter() - t_step
            if cfg.max_minutes:
                self.spent_seconds = self._slowest_rank_seconds()
            self.scheduler.step()
            self.bar.update(self._permille() - self.bar.n if cfg.max_minutes else 1)
            self.bar.set_postfix(step=self.state.step, loss=f"{loss.item():.3f}",
                                 tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
            window.setdefault("loss", []).append(loss.item())
            for k, v in metrics_step.items():
                window.setdefault(k, []).append(v)
            if logged:
                dt = time.perf_counter() - t0
                means = torch.tensor([sum(v) / len(v) for v in window.values()], dtype=torch.float64)
                row = dict(zip(window, acc.reduce(means.to(acc.device), "mean").tolist(), strict=True))  # all ranks
                row.update(lr=self.scheduler.get_last_lr()[0], tokens_per_s=tokens / dt, epoch=self.state.epoch)
                self.log(row)
                window, tokens, t0 = {}, 0, time.perf_counter()
            if cfg.max_minutes and self.spent_seconds >= 60 * cfg.max_minutes:
                return self._finish(f"loop.max_minutes={cfg.max_minutes} of training time spent")
            if self._signalled(signals):
                name = signal.Signals(signals.received).name
                if self.saved_step != self.state.step:
                    self.save({})
                raise guard.Stopped(f"stopped by {name} at step {self.state.step}; checkpoint-{self.state.step} is saved in "
                              f"{self.run_dir}; resume by running the same command again (loop.resume=auto)",
                              128 + signals.received)
            if self.state.step % cfg.save_every == 0 or self.state.step == cfg.max_steps:
                stop = self.checkpoint()
                if stop:
                    return self._finish(f"early stop: no new best {cfg.best_metric} in "
                                        f"{cfg.early_stop_patience} evaluations")
                t0 = time.perf_counter()
        return self._finish("max_steps reached")

    def _check_divergence(self, loss: float) -> None:
        """Stop on a NaN/inf loss, or one above loop.divergence_factor x the median loss of the last
        loop.divergence_window steps (as many as there are since the start or resume; a loss that stopped the run
        never joins them), before the optimizer steps on it."""
        cfg, recent = self.cfg, self.losses[-self.cfg.divergence_window:]
        median = float(np.median(recent)) if recent else 0.0
        exploded = cfg.divergence_factor and median > 0 and loss > cfg.divergence_factor * median
        if math.isfinite(loss) and not exploded:
            self.losses = recent + [loss]
            return
        self.optimizer.zero_grad(set_to_none=True)
        why = f"{loss:.4g} > {cfg.divergence_factor:g} x the median {median:.4g} of the last {len(recent)} " \
              "steps" if math.isfinite(loss) else f"{loss}"
        raise TrainingDiverged(f"training diverged at step {self.state.step + 1}: loss {why}; {self._last_good()} "
                               "is kept. Lower loop.lr, raise loop.warmup_ratio or set loop.grad_clip (or tune "
                               "loop.divergence_factor, 0 to stop only on NaN/inf), then resume")

    def _signalled(self, signals: guard.StopSignals) -> bool:
        """Whether any rank received SIGINT/SIGTERM (all ranks agree, so they checkpoint together)."""
        if self.accelerator.num_processes == 1:
            return bool(signals.received)
        flag = torch.tensor([float(signals.received)], device=self.accelerator.device)
        signals.received = int(self.accelerator.reduce(flag, "max").item())
        return bool(signals.received)

    def _peer_lost(self, wait: bool = False) -> guard.PeerLost | None:
        """This rank's error when another failed, died or stopped answering (`Ranks.lost`); None when all live."""
        lost = self.ranks.lost(wait) if self.ranks is not None else None
        return self._lost_error(lost) if lost is not None else None

    def _lost_error(self, lost: Lost) -> guard.PeerLost:
        last = f"the last checkpoint is {checkpoint_dir(self.run_dir, self.saved_step)}" if self.saved_step >= 0 \
            else "no checkpoint was written yet"
        return guard.PeerLost(f"rank {lost.rank} {lost.how} after step {self.state.step} ({lost.seen}); {last}; "
                              "rerun the same command to resume")

    def wait_for_everyone(self) -> None:
        """Every rank here. In a launch with a store the ranks meet there, outside any collective: one may wait for
        another's longer work (rank 0 writing a checkpoint) as long as that one lives, not only
        loop.collective_timeout_minutes; raises `guard.PeerLost` if a rank failed, died or went silent that long."""
        if self.ranks is None:
            self.accelerator.wait_for_everyone()
            return
        lost = self.ranks.meet()
        if lost is not None:
            raise self._lost_error(lost)

    def _slowest_rank_seconds(self) -> float:
        """Training seconds of the slowest rank, so that every rank stops at the same step."""
        seconds = torch.tensor([self.state.train_seconds], device=self.accelerator.device)
        return float(self.accelerator.reduce(seconds, "max"))

    def checkpoint(self) -> bool:
        """Evaluate (every rank its share of the prompts, statistics gathered; in lockstep when the target is
        sharded), save, and say whether early stopping is due. The time spent here is not training time;
        `eval_share` is the evaluations' share of the run's wall time, over its launches (each counted up to its
        last checkpoint: what a resume repeats is not)."""
        metrics = {}
        if self.evaluate is not None:
            t = time.perf_counter()
            acc = self.accelerator
            self.method.eval()
            with torch.no_grad(), self.autocast(), self._evaluation_context(), \
                    sharded(Shard(acc.process_index, acc.num_processes, self.sharded, self.wait_for_everyone)):
                metrics = self.evaluate(self.unwrapped, self.state.step)  # in training's precision
            self.method.train()
            self.wait_for_everyone()
            metrics = broadcast_object_list([metrics])[0]  # rank 0's figures (per-rank timings differ)
            now = time.perf_counter()
            self.state.eval_seconds += now - t
            metrics["eval_seconds"] = now - t
            self.log({**{f"eval/{k}": v for k, v in metrics.items()},
                      "eval_share": self.state.eval_seconds / max(1e-9, now - self.started)})
        self.save(metrics, self._update_best(metrics))
        p = self.cfg.early_stop_patience
        return bool(p) and self.state.evals_since_best >= p

    def _finish(self, why: str) -> LoopState:
        if self.saved_step != self.state.step:
            self.checkpoint()
        self.bar.close()
        self.accelerator.print(f"done at step {self.state.step}: {why}")
        self.accelerator.end_training()
        return self.state

    def log(self, row: dict) -> None:
        row = {"step": self.state.step, **{k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}}
        if self.accelerator.is_main_process:
            with open(self.run_dir / METRICS, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        self.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=self.state.step)


def keep_metrics_through(path: Path, step: int) -> None:
    """Drop the lines of metrics.jsonl logged past `step`, the step a launch starts from (a resume logs again the steps
    a killed launch logged after its last checkpoint), and a line a kill left half-written; rewritten whole (temp file
    + rename), so a crash meanwhile leaves the old file. Every reader then reads each step once as it reads any JSON
    lines, where marking lines superseded would make each of them skip those."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and json.loads(line)["step"] <= step]
    if len(kept) < len(lines):
        write_atomically(path, lambda tmp: tmp.write_text("".join(kept)))


@contextlib.contextmanager
def _unsharded(root: FSDPModule):
    """Gather the FSDP2 root unit's own parameters on every rank (a collective) until the context ends; the root
    keeps them gathered through its forwards (accelerate leaves the root's reshard_after_forward off)."""
    root.unshard()
    try:
        yield
    finally:
        root.reshard()


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
