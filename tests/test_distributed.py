"""Multi-process training on one machine, launched the way users launch: `accelerate launch`.

Without GPUs accelerate forms a gloo process group when ACCELERATE_USE_CPU=true:

    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 train/medusa.py ...

A 2-process run (batch b per rank) is compared with a 1-process run of the same global batch
(batch b, grad_accum 2): both average the same two per-micro-batch mean losses, so the loss curves
and weights agree up to float summation order (tolerances below). DeepSpeed runs on CPU with one
process only (with two, accelerate and DeepSpeed disagree on the world size; the loop refuses).
FSDP2 runs on 2 CPU processes through tests/fsdp_on_cpu.py, which lifts accelerate's GPU-only gate
(torch's fully_shard itself runs with gloo).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.train.guard import write_manifest

REPO = Path(__file__).resolve().parent.parent
LOSS_RTOL = 1e-5  # loss curves, 2 processes vs 1 with the same global batch
WEIGHT_ATOL = 1e-6  # trainable weights after 4 steps
# FSDP2's EAGLE-3 against one process: up to 1.8e-4 on some CPUs (in 5-15% of the weights; 0 above 1e-6 on others),
# float32 sums in another order grown over 4 Adam steps at lr 1e-2; a sharding error moves weights by about a step
FSDP2_WEIGHT_ATOL = 1e-3

TINY = ["data.limit=48", "data.max_length=256", "data.overlong=truncate", "data.on_no_assistant=drop",
        "data.cache=false", "eval.heldout_examples=8", "eval.num_prompts=1", "eval.max_new_tokens=4",
        "loop.log_every=1", "loop.lr=1e-2", "loop.keep_last=5", "loop.max_steps=4", "loop.save_every=2"]
# recipe name -> (entry script, recipe, overrides for a tiny run); adding a recipe is one line
RECIPES = {
    "medusa1": ("train/medusa.py", "recipes/medusa/medusa1-tiny-code.yaml",
                [*TINY, "eval.tree_budget=4", "eval.tree_ranks=2"]),
    "eagle3": ("train/eagle3.py", "recipes/eagle3/tiny-code.yaml", TINY),
}
# the distilled drafter starts at the target's output (loss ~2e-4): lr 1e-2 takes its T=0 acceptance from 0.77 to
# 0.10 in one step, and the divergence stop rightly ends the run
DISTILL = [o.replace("loop.lr=1e-2", "loop.lr=1e-4") for o in TINY if "heldout" not in o]
EXIT = ["eval.exit_layers=[2]", "loop.best_metric=tau_exit2"]
OTHERS = {  # the remaining recipes; the slow matrix test runs these and RECIPES under every launcher config
    "medusa2": ("train/medusa.py", "recipes/medusa/medusa2-tiny-code.yaml",
                [*TINY, "eval.tree_budget=4", "eval.tree_ranks=2"]),
    "eagle1": ("train/eagle.py", "recipes/eagle/tiny-code.yaml", TINY),
    "distill": ("train/distill.py", "recipes/distill/tiny-code.yaml", DISTILL),
    "distill-on-policy": ("train/distill.py", "recipes/distill/on-policy-tiny-code.yaml", DISTILL),
    "layerskip": ("train/layerskip.py", "recipes/layerskip/tiny-code.yaml", [*TINY, *EXIT]),
    "p_eagle": ("train/p_eagle.py", "recipes/p_eagle/tiny-code.yaml", TINY),
    "dflash": ("train/dflash.py", "recipes/dflash/tiny-code.yaml", [*TINY, "dflash.aux_layers=[1,2,3]"]),
}
LORA = [*TINY, "layerskip.lora=true", *EXIT]
REFUSED = {  # combinations that must stop at start: name -> (entry, recipe, overrides, launcher config, message)
    "layerskip-lora-zero3": ("train/layerskip.py", "recipes/layerskip/tiny-code.yaml", LORA,
                             "recipes/accelerate/zero3.yaml", "layerskip.lora=true evaluates a merged copy"),
    "layerskip-lora-fsdp2": ("train/layerskip.py", "recipes/layerskip/tiny-code.yaml", LORA,
                             "recipes/accelerate/fsdp2.yaml", "layerskip.lora=true evaluates a merged copy"),
}
FSDP2 = "recipes/accelerate/fsdp2.yaml"


def launch_command(recipe: str, target: Path, out: Path, processes: int, *extra: str, config_file: str = "",
                   front: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that `accelerate launch` an entry script on `processes` CPU processes (gloo)
    for a tiny run; `front`: more of the launcher's options, then a shim and its arguments, before the entry script
    (`-q tests/rank_faults.py kill 1 6`)."""
    entry, yaml, overrides = {**RECIPES, **OTHERS, **{k: v[:3] for k, v in REFUSED.items()}}[recipe]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    how = ["--config_file", config_file] if config_file else ["--multi_gpu"] if processes > 1 else []
    shim = ["tests/fsdp_on_cpu.py"] if config_file == FSDP2 else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *how, "--num_processes", str(processes),
           "--main_process_port", str(port), *front, *shim, entry, "--config", yaml, f"target.path={target}",
           f"loop.output_dir={out}", *overrides, *extra]
    cpu = not config_file or config_file == FSDP2  # DeepSpeed on one CPU process needs accelerate's GPU path
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true" if cpu else "false"}


def launch(recipe: str, target: Path, out: Path, processes: int, *extra: str, config_file: str = "",
           check: bool = True) -> subprocess.CompletedProcess:
    """`accelerate launch` an entry script on `processes` CPU processes (gloo) for a tiny run."""
    cmd, env = launch_command(recipe, target, out, processes, *extra, config_file=config_file)
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check and done.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return done


def losses(run: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if key in r}


def evals(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if any(k.startswith("eval/") for k in r)}


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / f"checkpoint-{step}" / "trainable.safetensors")


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = WEIGHT_ATOL):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def resume_from(src: Path, step: int, dst: Path) -> Path:
    dst.mkdir(parents=True)
    shutil.copytree(src / f"checkpoint-{step}", dst / f"checkpoint-{step}")
    return dst


@pytest.fixture(scope="module")
def pairs(tiny_chat_target, tmp_path_factory):
    """recipe -> (1-process run with batch 2 x grad_accum 2, 2-process run with batch 2): 4 steps, checkpoints
    at 2 and 4, each pair launched once per module."""
    done: dict[str, tuple[Path, Path]] = {}

    def get(recipe: str) -> tuple[Path, Path]:
        if recipe not in done:
            tmp = tmp_path_factory.mktemp(recipe)
            launch(recipe, tiny_chat_target, tmp / "one", 1, "loop.batch_size=2", "loop.grad_accum=2")
            launch(recipe, tiny_chat_target, tmp / "two", 2, "loop.batch_size=2", "loop.grad_accum=1")
            done[recipe] = tmp / "one", tmp / "two"
        return done[recipe]
    return get


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_two_processes_match_one_process_with_the_same_global_batch(recipe, pairs):
    one, two = pairs(recipe)
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    first = losses(one, "loss_0") or a  # EAGLE's first unrolled step: its ttt_ramp unrolls more steps as it trains
    assert first[4] < first[1], "the tiny run must actually train"
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=LOSS_RTOL), step
    assert_close(weights(one, 4), weights(two, 4))


def test_evaluation_at_checkpoints_under_two_processes_finishes_once(pairs):
    _, two = pairs("medusa1")
    rows = evals(two)
    assert sorted(rows) == [2, 4], "one evaluation row per checkpoint (rank 0 logs it, the other rank waits)"
    assert all(r["eval/tau"] >= 1.0 and r["eval/eval_seconds"] > 0 for r in rows.values())
    assert (two / "best" / "best.json").is_file()
    state = json.loads((two / "checkpoint-4" / "state.json").read_text())
    assert state["world_size"] == 2 and state["train_seconds"] > 0


def test_resume_under_two_processes_is_exact(pairs, tiny_chat_target, tmp_path):
    _, two = pairs("medusa1")
    resumed = resume_from(two, 2, tmp_path / "resumed")
    launch("medusa1", tiny_chat_target, resumed, 2, "loop.batch_size=2", "loop.grad_accum=1")
    assert sorted(losses(resumed)) == [3, 4]
    for step, loss in losses(resumed).items():
        assert loss == losses(two)[step]
    assert_close(weights(resumed, 4), weights(two, 4), atol=0)


def test_resume_with_another_world_size(pairs, tiny_chat_target, tmp_path):
    """A DDP checkpoint holds the whole optimizer state: 2 processes write it, 1 process (same global batch) resumes."""
    _, two = pairs("medusa1")
    resumed = resume_from(two, 2, tmp_path / "resumed")
    done = launch("medusa1", tiny_chat_target, resumed, 1, "loop.batch_size=2", "loop.grad_accum=2")
    assert "2 processes wrote it, 1 resume it" in done.stdout
    for step, loss in losses(resumed).items():
        assert loss == pytest.approx(losses(two)[step], rel=LOSS_RTOL)
    assert_close(weights(resumed, 4), weights(two, 4))


@pytest.fixture(scope="module")
def fsdp2_runs(tiny_chat_target, tmp_path_factory):
    """recipe -> a 2-process FSDP2 run with batch 2 (the global batch of `pairs`), launched once per module."""
    done: dict[str, Path] = {}

    def get(recipe: str) -> Path:
        if recipe not in done:
            done[recipe] = tmp_path_factory.mktemp(recipe + "-fsdp2") / "run"
            launch(recipe, tiny_chat_target, done[recipe], 2, "loop.batch_size=2", "loop.grad_accum=1",
                   config_file=FSDP2)
        return done[recipe]
    return get


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fsdp2_two_processes_match_one_process(recipe, pairs, fsdp2_runs):
    """The target and the trainable part sharded over 2 processes train like 1 unsharded process, evaluate at
    every checkpoint (in lockstep) and write whole trainable weights."""
    one, _ = pairs(recipe)
    run = fsdp2_runs(recipe)
    for step, loss in losses(one).items():
        assert losses(run)[step] == pytest.approx(loss, rel=LOSS_RTOL), step
    assert_close(weights(run, 4), weights(one, 4), atol=FSDP2_WEIGHT_ATOL)
    assert sorted(evals(run)) == [2, 4] and (run / "best" / "best.json").is_file()
    state = json.loads((run / "checkpoint-4" / "state.json").read_text())
    assert state["backend"] == "fsdp2" and state["world_size"] == 2


def test_fsdp2_resumes_exactly_and_under_another_backend(pairs, fsdp2_runs, tiny_chat_target, tmp_path):
    """The optimizer state is written whole by parameter name: FSDP2 on 2 processes resumes it exactly, and one
    unsharded process resumes it too (same global batch)."""
    run = fsdp2_runs("medusa1")
    again = resume_from(run, 2, tmp_path / "fsdp2")
    launch("medusa1", tiny_chat_target, again, 2, "loop.batch_size=2", "loop.grad_accum=1", config_file=FSDP2)
    assert losses(again) == {s: v for s, v in losses(run).items() if s > 2}
    assert_close(weights(again, 4), weights(run, 4), atol=0)
    plain = resume_from(run, 2, tmp_path / "plain")
    done = launch("medusa1", tiny_chat_target, plain, 1, "loop.batch_size=2", "loop.grad_accum=2")
    assert "2 processes wrote it, 1 resume it" in done.stdout and "written under fsdp2, resumed under ddp" in done.stdout
    for step, loss in losses(plain).items():
        assert loss == pytest.approx(losses(run)[step], rel=LOSS_RTOL)
    assert_close(weights(plain, 4), weights(run, 4))


@pytest.mark.parametrize("name", ["ddp", "zero2", "zero3", "fsdp2", "multinode-zero2"])
def test_launcher_configs_load_through_accelerate(name):
    """Each config goes through `accelerate launch`'s own parsing, and its plugin is built from the environment
    the launcher would hand to the processes."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", f"recipes/accelerate/{name}.yaml", "train/medusa.py"])
    args, defaults, _ = _validate_launch_command(args)
    if name.startswith("ddp"):
        assert args.multi_gpu and not (args.use_deepspeed or args.use_fsdp)
    elif name == "fsdp2":
        with mock.patch.dict(os.environ, prepare_multi_gpu_env(args)):
            plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    else:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        _, env = prepare_deepspeed_cmd_env(args)
        with mock.patch.dict(os.environ, env):
            plugin = DeepSpeedPlugin()
        assert plugin.zero_stage == int(name.split("zero")[1][0])
        assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == "auto", "the recipe sets the batch"
        assert "optimizer" not in plugin.deepspeed_config, "the loop builds the optimizer over the trainable part"
    assert args.num_machines == (2 if name.startswith("multinode") else 1)


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_on_one_cpu_process_matches_plain_training(stage, pairs, tiny_chat_target, tmp_path):
    """DeepSpeed (one process: all the CPU allows) trains exactly like the plain loop, evaluates at checkpoints
    (ZeRO-3: in lockstep through its parameter gathering) and writes no frozen weight in its shards."""
    one, _ = pairs("medusa1")
    run = tmp_path / stage
    launch("medusa1", tiny_chat_target, run, 1, "loop.batch_size=2", "loop.grad_accum=2",
           config_file=f"recipes/accelerate/{stage}.yaml")
    for step, loss in losses(one).items():
        assert losses(run)[step] == pytest.approx(loss, rel=LOSS_RTOL), step
    assert_close(weights(run, 4), weights(one, 4))
    assert sorted(evals(run)) == [2, 4]
    for states in (run / "checkpoint-4" / "deepspeed").rglob("*model_states.pt"):
        assert set(torch.load(states, weights_only=False)["module"]) == set(weights(run, 4)), "only the trainable part"
    if stage == "zero3":
        resumed = resume_from(run, 2, tmp_path / "resumed")
        launch("medusa1", tiny_chat_target, resumed, 1, "loop.batch_size=2", "loop.grad_accum=2",
               config_file=f"recipes/accelerate/{stage}.yaml")
        assert losses(resumed) == {s: v for s, v in losses(run).items() if s > 2}
        assert_close(weights(resumed, 4), weights(run, 4), atol=0)


def test_deepspeed_checkpoint_refuses_another_world_size(tiny_chat_target, tmp_path):
    """ZeRO optimizer state is sharded by world size: a checkpoint says which world size wrote it and only that one
    resumes it (here the 1-process checkpoint is relabelled as written by 2, since CPU runs DeepSpeed on one)."""
    run = tmp_path / "run"
    launch("medusa1", tiny_chat_target, run, 1, "loop.batch_size=2", "loop.max_steps=2",
           config_file="recipes/accelerate/zero2.yaml")
    state = run / "checkpoint-2" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "world_size": 2}))
    write_manifest(state.parent)  # as 2 processes would have written it (an edited checkpoint no longer verifies)
    done = launch("medusa1", tiny_chat_target, run, 1, "loop.batch_size=2", "loop.max_steps=4",
                  config_file="recipes/accelerate/zero2.yaml", check=False)
    assert done.returncode != 0
    assert "holds DeepSpeed ZeRO shards of 2 processes, not 1; resume with 2 processes" in done.stderr


def test_deepspeed_with_two_cpu_processes_is_refused(tiny_chat_target, tmp_path):
    """On CPU accelerate sees one process while DeepSpeed joins two: the loop refuses rather than train twice."""
    done = launch("medusa1", tiny_chat_target, tmp_path / "run", 2, config_file="recipes/accelerate/zero2.yaml",
                  check=False)
    assert done.returncode != 0
    assert "2 processes were launched but accelerate sees 1" in done.stderr


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_combination_is_refused_at_start(name, tiny_chat_target, tmp_path):
    *_, config_file, message = REFUSED[name]
    processes = 2 if config_file == FSDP2 else 1  # accelerate makes one process plain, not FSDP
    done = launch(name, tiny_chat_target, tmp_path / "run", processes, config_file=config_file, check=False)
    assert done.returncode != 0 and message in done.stderr
    assert not list((tmp_path / "run").glob("checkpoint-*")), "refused before training"


@pytest.mark.slow
@pytest.mark.parametrize("config", ["ddp", "zero2", "zero3", "fsdp2"])
@pytest.mark.parametrize("recipe", [*RECIPES, *OTHERS])
def test_every_recipe_trains_evaluates_and_checkpoints_under_each_config(recipe, config, tiny_chat_target, tmp_path):
    """4 steps with checkpoints at 2 and 4: DDP and FSDP2 on 2 processes, ZeRO-2/3 on one (all the CPU allows)."""
    processes = 1 if config.startswith("zero") else 2
    run = tmp_path / "run"
    launch(recipe, tiny_chat_target, run, processes, "loop.batch_size=2",
           config_file="" if config == "ddp" else f"recipes/accelerate/{config}.yaml")
    assert sorted(losses(run)) == [1, 2, 3, 4] and sorted(evals(run)) == [2, 4]
    assert (run / "best" / "best.json").is_file() and (run / "checkpoint-4" / "trainable.safetensors").is_file()
