"""The shared training loop: exact resume, atomic checkpoints, best keeping, divergence."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.models.lm import CausalLM
from draftsmith.train.config import LoopConfig
from draftsmith.train.loop import EpochSampler, Loop, TrainingDiverged, checkpoints, lr_factor, run_progress


class Recorder:
    """A dataset that records which rows are read, and can crash after a number of reads."""

    def __init__(self, n: int = 20, seq: int = 12, vocab: int = 64, crash_after: int | None = None):
        g = torch.Generator().manual_seed(0)
        self.rows = [{"input_ids": torch.randint(0, vocab, (seq,), generator=g).tolist(), "loss_mask": [1] * seq}
                     for _ in range(n)]
        self.seen: list[int] = []
        self.crash_after = crash_after

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.crash_after is not None and len(self.seen) >= self.crash_after:
            raise KeyboardInterrupt("simulated kill")
        self.seen.append(i)
        return self.rows[i]


def tiny_method(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1)
    return CausalLM(LlamaForCausalLM(cfg))


def loop_cfg(out, **kw) -> LoopConfig:
    base = dict(output_dir=str(out), max_steps=8, batch_size=3, grad_accum=2, lr=1e-2, save_every=4, keep_last=5,
                log_every=1, warmup_ratio=0.25)
    return LoopConfig(**{**base, **kw})


def final_weights(run_dir, step):
    return load_file(run_dir / f"checkpoint-{step}" / "trainable.safetensors")


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_from_a_middle_checkpoint_is_bitwise_exact(tmp_path):
    # 20 rows, 3 per micro-batch, 2 micro-batches per step: epochs end mid-step, so the data position matters.
    straight = Recorder()
    Loop(loop_cfg(tmp_path / "a"), tiny_method(), straight).run()

    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4")
    resumed = Recorder()
    Loop(loop_cfg(tmp_path / "b"), tiny_method(seed=123), resumed).run()  # other init: weights come from the checkpoint

    assert_bitwise_equal(final_weights(tmp_path / "a", 8), final_weights(tmp_path / "b", 8))
    done = 4 * 2 * 3  # rows trained before checkpoint-4; both runs also read one micro-batch ahead at the end
    assert len(straight.seen) == 8 * 2 * 3 + 3
    assert resumed.seen == straight.seen[done:], "resumed run must see exactly the examples after the checkpoint"


def test_the_next_micro_batch_is_read_in_the_background_while_this_one_trains(tmp_path):
    class Reads(Recorder):
        def __getitem__(self, i):
            threads.add(threading.current_thread().name)
            return super().__getitem__(i)

    class Waits(CausalLM):
        def forward(self, batch):  # wait (up to 10 s) for the next micro-batch's 3 rows to be read meanwhile
            deadline, want = time.monotonic() + 10, 3 * (len(read_during_step) + 2)  # rows through micro-batch j+1
            while len(data.seen) < want and time.monotonic() < deadline:
                time.sleep(0.005)
            read_during_step.append(len(data.seen) >= want)
            return super().forward(batch)

    threads: set[str] = set()
    data, read_during_step = Reads(), []
    Loop(loop_cfg(tmp_path, max_steps=2), Waits(tiny_method().model), data).run()
    assert read_during_step == [True] * 4  # 2 steps x 2 micro-batches, each while the one before trained
    assert len(data.seen) == 5 * 3 and threading.current_thread().name not in threads


def test_kill_and_resume_sees_no_example_twice(tmp_path):
    straight = Recorder()
    Loop(loop_cfg(tmp_path / "a"), tiny_method(), straight).run()

    crashing = Recorder(crash_after=31)  # dies during step 6 (rows 30-35), after checkpoint-4
    with pytest.raises(KeyboardInterrupt):
        Loop(loop_cfg(tmp_path / "b"), tiny_method(), crashing).run()
    assert [p.name for p in checkpoints(tmp_path / "b")] == ["checkpoint-4"]
    again = Recorder()
    Loop(loop_cfg(tmp_path / "b"), tiny_method(), again).run()

    assert_bitwise_equal(final_weights(tmp_path / "a", 8), final_weights(tmp_path / "b", 8))
    assert again.seen == straight.seen[4 * 2 * 3:]  # both read one micro-batch ahead at the end
    state = json.loads((tmp_path / "b" / "checkpoint-8" / "state.json").read_text())
    assert state["step"] == 8


KILLED_AFTER_STEP_6 = """
import sys, time
sys.path.insert(0, {tests!r})
from test_loop import Recorder, loop_cfg, tiny_method
from draftsmith.train.loop import Loop

class Hangs(Recorder):  # reads no further than step 6: the test kills it there, between checkpoint-4 and -8
    def __getitem__(self, i):
        if len(self.seen) == 6 * 2 * 3:
            time.sleep(600)
        return super().__getitem__(i)

Loop(loop_cfg({run!r}, tracker="tensorboard"), tiny_method(), Hangs(), evaluate=lambda m, step: {{"tau": step}}).run()
"""


def test_a_run_killed_between_checkpoints_logs_each_step_once_after_its_resume(tmp_path):
    """kill -9 after step 6 (checkpoint-4 written): the resumed run logs steps 5-8 again; metrics.jsonl keeps them
    once and equals an uninterrupted run's."""

    def logged(run):  # (step, what) per line; tokens_per_s is a timing, the rest is exact
        return [(r["step"], r.get("loss"), r.get("eval/tau")) for r in map(json.loads, open(run / "metrics.jsonl"))]

    evaluate = lambda m, step: {"tau": step}  # noqa: E731
    Loop(loop_cfg(tmp_path / "a", tracker="tensorboard"), tiny_method(), Recorder(), evaluate=evaluate).run()
    run = tmp_path / "b"
    code = KILLED_AFTER_STEP_6.format(tests=str(Path(__file__).parent), run=str(run))
    killed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or logged(run)[-1][0] < 6:
            assert killed.poll() is None and time.monotonic() < deadline, "the run to kill did not reach step 6"
            time.sleep(0.1)
    finally:
        killed.kill()
        killed.wait()
    assert [c.name for c in checkpoints(run)] == ["checkpoint-4"] and [s for s, *_ in logged(run)][-2:] == [5, 6]

    Loop(loop_cfg(run, tracker="tensorboard"), tiny_method(), Recorder(), evaluate=evaluate).run()
    assert logged(run) == logged(tmp_path / "a")
    assert [s for s, *_ in logged(run)] == [1, 2, 3, 4, 4, 5, 6, 7, 8, 8]  # a training and an evaluation line at 4, 8


def test_half_written_checkpoint_is_ignored(tmp_path):
    Loop(loop_cfg(tmp_path, max_steps=4), tiny_method(), Recorder()).run()
    (tmp_path / "checkpoint-6.tmp").mkdir()  # a crash while writing leaves only a .tmp directory
    loop = Loop(loop_cfg(tmp_path, max_steps=4), tiny_method(), Recorder())
    assert loop.state.step == 4


def test_best_checkpoint_and_early_stop(tmp_path):
    scores = iter([1.0, 3.0, 2.0, 2.5, 9.0])
    loop = Loop(loop_cfg(tmp_path, max_steps=40, save_every=2, best_metric="tau", early_stop_patience=2),
                tiny_method(), Recorder(), evaluate=lambda m, step: {"tau": next(scores)})
    state = loop.run()
    assert state.step == 8, "two evaluations without a new best stop the run"
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["step"] == 4 and best["tau"] == 3.0
    assert (tmp_path / "best" / "model.safetensors").is_file()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/tau"] for r in rows if "eval/tau" in r] == [1.0, 3.0, 2.0, 2.5]
    assert all(0 < r["eval_share"] < 1 for r in rows if "eval/tau" in r)  # evaluations' share of the run's time


def test_eval_share_counts_every_launch_of_a_resumed_run(tmp_path):
    def slow(m, step):
        time.sleep(0.3)
        return {"tau": 1.0}
    Loop(loop_cfg(tmp_path, max_steps=8, save_every=4), tiny_method(), Recorder(), evaluate=slow).run()
    (tmp_path / "metrics.jsonl").unlink()
    shutil.rmtree(tmp_path / "checkpoint-8")  # resumed from checkpoint-4: 0.3 s of evaluation in its wall time
    first = json.loads((tmp_path / "checkpoint-4" / "state.json").read_text())
    assert first["eval_seconds"] >= 0.3 and first["wall_seconds"] > first["eval_seconds"]
    Loop(loop_cfg(tmp_path, max_steps=6, save_every=2), tiny_method(), Recorder(),
         evaluate=lambda m, step: {"tau": 1.0}).run()
    state = json.loads((tmp_path / "checkpoint-6" / "state.json").read_text())
    assert state["eval_seconds"] >= 0.3 and state["wall_seconds"] > first["wall_seconds"]
    share = [json.loads(line)["eval_share"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "eval_share" in line][-1]
    # the whole run's evaluation seconds over its wall time: this launch's own evaluation took almost none
    assert share == pytest.approx(state["eval_seconds"] / state["wall_seconds"], rel=0.05)


class Diverging(CausalLM):
    def forward(self, batch):
        loss, metrics = super().forward(batch)
        return (loss * float("nan") if self.calls_left == 0 else loss), metrics

    def __call__(self, batch):
        self.calls_left -= 1
        return super().__call__(batch)


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    method = tiny_method()
    method.__class__ = Diverging
    method.calls_left = 2 * 5  # micro-batches until the NaN: step 5 diverges
    with pytest.raises(TrainingDiverged, match="step 5.*checkpoint-4"):
        Loop(loop_cfg(tmp_path), method, Recorder()).run()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")] == ["checkpoint-4"]
    assert load_file(tmp_path / "checkpoint-4" / "trainable.safetensors")


def test_resume_refuses_a_checkpoint_of_another_method(tmp_path):
    Loop(loop_cfg(tmp_path, max_steps=4), tiny_method(), Recorder()).run()
    other = tiny_method()
    other.model.lm_head.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="cannot resume .*another model shape .*tensors differ"):
        Loop(loop_cfg(tmp_path, max_steps=4), other, Recorder())


def test_init_from_starts_from_a_checkpoints_weights_with_a_fresh_optimizer_and_yields_to_a_resume(tmp_path):
    Loop(loop_cfg(tmp_path / "a", max_steps=4), tiny_method(), Recorder()).run()
    trained = final_weights(tmp_path / "a", 4)
    init = str(tmp_path / "a" / "checkpoint-4")
    b = Loop(loop_cfg(tmp_path / "b", max_steps=4, init_from=init), tiny_method(seed=123), Recorder())
    assert_bitwise_equal({n: p.detach() for n, p in b.unwrapped.named_parameters()}, trained)
    assert b.state.step == 0 and not b.optimizer.state_dict()["state"]  # a fresh optimizer and schedule
    b.run()
    assert not torch.equal(final_weights(tmp_path / "b", 4)["model.lm_head.weight"], trained["model.lm_head.weight"])
    again = Loop(loop_cfg(tmp_path / "b", max_steps=8, init_from=init), tiny_method(seed=123), Recorder())
    assert again.state.step == 4  # its own checkpoint resumes; init_from is not applied over it
    assert_bitwise_equal({n: p.detach() for n, p in again.unwrapped.named_parameters()},
                         final_weights(tmp_path / "b", 4))


def test_init_from_refuses_what_is_not_a_checkpoint_of_this_method(tmp_path):
    Loop(loop_cfg(tmp_path / "a", max_steps=4), tiny_method(), Recorder()).run()
    with pytest.raises(ValueError, match=r"loop.init_from=.*nowhere: not a directory; pass loop.init_from= a "):
        Loop(loop_cfg(tmp_path / "b", init_from=str(tmp_path / "nowhere")), tiny_method(), Recorder())
    other = tiny_method()
    other.model.lm_head.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="cannot start from .*another model shape .*tensors differ.*without loop.init_from"):
        Loop(loop_cfg(tmp_path / "c", init_from=str(tmp_path / "a" / "checkpoint-4")), other, Recorder())
    assert not [p for run in ("b", "c") for p in (tmp_path / run).iterdir()]  # nothing written, the lock released


def test_frozen_parameters_are_not_checkpointed(tmp_path):
    method = tiny_method()
    for p in method.model.model.parameters():
        p.requires_grad_(False)
    Loop(loop_cfg(tmp_path, max_steps=4), method, Recorder()).run()
    assert set(final_weights(tmp_path, 4)) == {"model.lm_head.weight"}


def test_sampler_shards_one_global_batch_across_ranks():
    one = [idx for _, idx in EpochSampler(24, 4, seed=3).batches(0, 0)]
    ranks = [[idx for _, idx in EpochSampler(24, 2, seed=3, rank=r, world=2).batches(0, 0)] for r in range(2)]
    assert [a + b for a, b in zip(*ranks, strict=True)] == one


def test_tensorboard_tracker_writes_events(tmp_path):
    Loop(loop_cfg(tmp_path, max_steps=2, save_every=2, tracker="tensorboard"), tiny_method(), Recorder()).run()
    assert list(tmp_path.rglob("events.out.tfevents.*"))
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "command.txt").is_file()


def test_missing_tracker_package_is_a_clear_error(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match="pip install wandb, or set loop.tracker=none"):
        Loop(loop_cfg(tmp_path, tracker="wandb"), tiny_method(), Recorder())


def test_time_budget_stops_training_and_checkpoints(tmp_path):
    # a budget far below one step's time: the loop stops after its first step and still saves it
    state = Loop(loop_cfg(tmp_path, max_minutes=1e-9), tiny_method(), Recorder()).run()
    assert state.step == 1 and state.train_seconds > 0
    assert checkpoints(tmp_path)[-1].name == "checkpoint-1"
    assert json.loads((tmp_path / "checkpoint-1" / "state.json").read_text())["train_seconds"] > 0


def test_schedule_runs_over_whichever_budget_binds(tmp_path):
    by_steps = loop_cfg(tmp_path, max_steps=100, warmup_ratio=0.1, schedule="cosine")
    assert lr_factor(by_steps, 0) == pytest.approx(0.1) and lr_factor(by_steps, 9) == pytest.approx(1.0)
    assert lr_factor(by_steps, 55) == pytest.approx(0.5) and lr_factor(by_steps, 100) == pytest.approx(0.0)
    # a time budget that binds first: warm-up and decay follow the training seconds, not the far step limit
    by_time = loop_cfg(tmp_path, max_steps=10**6, max_minutes=10, warmup_ratio=0.1, schedule="linear")
    assert lr_factor(by_time, 5, seconds=30) == pytest.approx(0.5)  # 5% of 600 s: half way through warm-up
    assert lr_factor(by_time, 50, seconds=330) == pytest.approx(0.5)  # 55%: half way through the decay
    assert lr_factor(by_time, 90, seconds=600) == pytest.approx(0.0)
    assert run_progress(by_time, 10**6 // 2, seconds=60) == pytest.approx(0.5)  # steps further along than time


def test_time_budgeted_run_decays_its_learning_rate(tmp_path):
    # a run stopped by loop.max_minutes ends its schedule there: the LR has decayed to 0 at the last step, where a
    # schedule over the (far) step limit would still be at its peak
    cfg = loop_cfg(tmp_path, max_steps=10**6, max_minutes=0.05, warmup_ratio=0.0, schedule="linear", save_every=10**6)
    loop = Loop(cfg, tiny_method(), Recorder())
    loop.run()
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    assert lrs[-1] == 0.0 and lrs == sorted(lrs, reverse=True)
    # the progress bar follows the budget that bound (time), not the far step limit: full at the end
    assert loop.state.step < 10**3 and loop.bar.n == loop.bar.total == 1000


def test_the_loop_hands_its_progress_to_a_method_that_declares_one(tmp_path):
    method = tiny_method()
    method.progress = lambda: -1.0  # a method's schedule reads this; the loop replaces it with its own progress
    loop = Loop(loop_cfg(tmp_path, max_steps=8), method, Recorder())
    assert method.progress() == 0.0
    loop.run()
    assert method.progress() == 1.0


def test_the_loop_tells_a_method_that_declares_measuring_which_steps_it_logs(tmp_path):
    class Measured(CausalLM):
        def forward(self, batch):
            self.seen.append(self.measuring)
            return super().forward(batch)

    method = Measured(tiny_method().model)
    method.measuring, method.seen = True, []
    loop = Loop(loop_cfg(tmp_path, max_steps=7, log_every=3, grad_accum=1), method, Recorder())
    loop.run()
    assert method.seen == [False, False, True, False, False, True, True]  # steps 3, 6 and the last are logged
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [3, 6, 7]


def test_loops_in_one_process_may_choose_other_precisions(tmp_path):
    """accelerate keeps one state per process and refuses another mixed precision once set; a Loop after one under
    bf16 autocast (a notebook, a sweep in one process) trains in fp32 as asked, then bf16 again."""
    for i, precision in enumerate(("bf16", "no", "bf16")):
        loop = Loop(loop_cfg(tmp_path / str(i), max_steps=2, mixed_precision=precision), tiny_method(), Recorder())
        assert loop.accelerator.mixed_precision == precision
        loop.run()


def test_a_module_that_does_not_meet_the_method_contract_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="Linear does not meet the method contract .* lacks progress, measuring"):
        Loop(loop_cfg(tmp_path), nn.Linear(2, 2), Recorder())
