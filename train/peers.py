"""The peer trainers, speculators 0.9.0 and SpecForge 0.2.0, set up, fed and run from outside draftsmith, on a CPU.

    python -m draftsmith.train.peers setup [speculators|specforge ...]      # their venvs (~3-6 min, ~1.3 GiB each)
    python -m draftsmith.train.peers write --config recipes/eagle3/smollm2-135m.yaml --out DIR [key=value ...]
    python -m draftsmith.train.peers train speculators --inputs DIR --out RUN --budget-minutes 30 [--lr 3e-4]

`setup`: each peer in its own venv, `$DRAFTSMITH_CACHE/peers/<name>-<version>` (default ~/.cache/draftsmith/peers/),
pinned, with the CPU build of torch; `setup.json` in it, written last, lists what was installed, so a venv that has
it is complete and setting up again does nothing. The pip output goes to `<name>-<version>.log` beside it.

`write`: both peers' input from an EAGLE-3 recipe (its target, data, eagle.aux_layers, eagle.draft_vocab_size and
data.max_length): their offline features from one pass of the target (data/peer_formats.py), the same draft
vocabulary as draftsmith's, a draft config each (draftsmith's drafter shape: one layer, no EAGLE 3.1 norms) and
SpecForge's view of the target.

`train`: a peer trained on that input for a training-time budget through train/peer_cpu.py (the CPU changes, made
in memory): a short probe times its steps, the run is planned to as many steps so its own schedule anneals within
the budget, stopped there if it overruns, and its last checkpoint exported to what llama.cpp's
convert_hf_to_gguf.py reads (models/llama_cpp.py `convert`, with the target as --target-model-dir).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.data import peer_formats as pf
from draftsmith.data.core import dir_bytes, read_file
from draftsmith.data.dataset import build_dataset
from draftsmith.data.process import Child
from draftsmith.models.eagle import draft_vocab
from draftsmith.models.eagle_config import aux_layers, draft_config
from draftsmith.models.layerskip import final_norm
from draftsmith.models.target import load_target
from draftsmith.train import config as C
from draftsmith.train.eagle import Recipe
from draftsmith.train.guard import cli

TORCH = "torch==2.13.0+cpu"  # the CPU wheel: a plain `torch` resolves to the CUDA build (~3 GB of wheels)
STAMP = "setup.json"
SHIM = Path(__file__).with_name("peer_cpu.py")  # run with a peer's python; it imports the peer, not draftsmith
EVENTS = "DRAFTSMITH_PEER_EVENTS"  # the file the shim appends its step and epoch events to
DRAFT_CONFIG, RESULT, RUN_ID = "draft_config.json", "result.json", "peer"
WRITE = "python -m draftsmith.train.peers write --config RECIPE --out DIR"
SPECULATORS_TRAIN_RATIO = 0.99  # speculators' --train-data-ratio (its default 0.9 holds out a tenth)
PROBE_WARMUP = 2  # probe steps left out of its timing (first-call allocations)
STOP_GRACE_S = 150  # speculators saves its interrupted checkpoint within 120 s of SIGTERM


@dataclass(frozen=True)
class Peer:
    """A peer trainer: `steps` are pip argument lists run in order in its venv, then `uninstall` is removed."""

    name: str
    version: str
    steps: tuple[tuple[str, ...], ...]
    uninstall: tuple[str, ...] = ()

    @property
    def venv(self) -> Path:
        return peers_home() / f"{self.name}-{self.version}"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def log(self) -> Path:
        return self.venv.with_name(self.venv.name + ".log")

    def ready(self) -> bool:
        """Whether its venv is complete and was set up with these steps."""
        try:
            return json.loads((self.venv / STAMP).read_text())["steps"] == [list(s) for s in self.steps]
        except (OSError, ValueError, KeyError):
            return False


PEERS = {p.name: p for p in (
    # torchvision / torchaudio come in as speculators' requirements, PyPI's CUDA builds: torchvision breaks
    # `import transformers` ("torchvision::nms does not exist") and speculators never uses either.
    Peer("speculators", "0.9.0", ((TORCH, "speculators==0.9.0", "transformers==5.19.0", "datasets==5.1.0"),),
         ("torchvision", "torchaudio")),
    # SpecForge pins torch 2.11 and sglang 0.5.14 (~4 GB: sglang-kernel, flashinfer, ...) that its training path
    # never imports: it goes in without its requirements, beside the ones that path needs.
    Peer("specforge", "0.2.0", ((TORCH, "transformers==5.8.1", "accelerate==1.16.0", "datasets==5.2.0",
                                 "pydantic==2.14.4", "pyyaml==6.0.4"),
                                ("--no-deps", "specforge==0.2.0"))),
)}


def peers_home() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")) / "peers"


def setup(peer: Peer, log=print) -> Path:
    """Create `peer`'s venv (nothing to do when it is ready) -> its python. A step that fails raises one line naming
    it and the log; the half-built venv is removed, and the next call starts again from scratch."""
    if peer.ready():
        return peer.python
    shutil.rmtree(peer.venv, ignore_errors=True)  # a venv without its stamp: an earlier setup stopped midway
    peer.venv.parent.mkdir(parents=True, exist_ok=True)
    pip = [str(peer.python), "-m", "pip"]
    commands = [[sys.executable, "-m", "venv", str(peer.venv)],
                *([*pip, "install", *s] for s in peer.steps),
                *([[*pip, "uninstall", "-y", *peer.uninstall]] if peer.uninstall else [])]
    t0 = time.monotonic()
    with open(peer.log, "w") as out:
        for n, cmd in enumerate(commands, 1):
            log(f"{peer.venv.name}: step {n}/{len(commands)}: {' '.join(cmd[2:])}")
            print(f"$ {' '.join(cmd)}", file=out, flush=True)
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
                shutil.rmtree(peer.venv, ignore_errors=True)
                raise RuntimeError(f"setting up {peer.venv.name} failed at step {n} (`{' '.join(cmd[2:])}`); "
                                   f"see {peer.log}, then run `python -m draftsmith.train.peers setup {peer.name}` "
                                   "again")
    freeze = subprocess.run([*pip, "freeze"], capture_output=True, text=True, check=True).stdout.split()
    stamp = {"steps": [list(s) for s in peer.steps], "uninstalled": list(peer.uninstall), "packages": freeze,
             "seconds": round(time.monotonic() - t0), "bytes": dir_bytes(peer.venv)}
    pf.write_json(peer.venv / STAMP, stamp)
    log(f"{peer.venv.name}: ready in {stamp['seconds']} s, {stamp['bytes'] / 2**30:.2f} GiB")
    return peer.python


# ---- their input: one pass of the target --------------------------------------------------------------------------

def prepare(cfg: Recipe, out: str | Path, log=print) -> dict:
    """Everything both peers read, under `out`, from an EAGLE-3 recipe's target, data, layers and draft vocabulary
    size: their offline input from one pass of the target over the unpacked conversations (data/peer_formats.py), a
    draft config for each (the shape of draftsmith's drafter, the layer ids in that peer's convention) and, for
    SpecForge, the target as its loader reads it. Resumable; returns the input's manifest."""
    out = Path(out)
    target = load_target(cfg.target.path, cfg.target.dtype, cfg.target.trust_remote_code)
    text = target.config.get_text_config()
    layers = aux_layers(cfg.eagle, text.num_hidden_layers)
    rows = build_dataset(dataclasses.replace(cfg.data, pack=False), target.tokenizer)
    # the same tokens as draftsmith's own (packed) rows, so the same draft vocabulary
    ids = draft_vocab(rows, text.vocab_size, cfg.eagle.draft_vocab_size)
    meta = {"target_as_given": cfg.target.path, "max_length": cfg.data.max_length, "data": C.to_dict(cfg)["data"]}
    manifest = pf.write_peer_inputs(target, rows, layers, ids, final_norm(target.model), out, meta=meta, log=log)
    llama = draft_config(target.config, cfg.eagle, len(ids)).to_dict()
    for k in ("fc_norm", "target_hidden_size", "draft_vocab_size", "_name_or_path"):
        llama.pop(k)
    pf.write_json(out / pf.SPECULATORS_DIR / DRAFT_CONFIG, {**llama, "architectures": ["LlamaForCausalLM"]})
    # SpecForge names a layer by its output (SGLang captures at i + 1); draftsmith's ids are inputs to layers
    pf.write_json(out / pf.SPECFORGE_DIR / DRAFT_CONFIG, {
        **llama, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": len(ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]}})
    specforge_target(target, out / pf.SPECFORGE_DIR / "target")
    return manifest


def specforge_target(target, out: Path) -> None:
    """The target as SpecForge's loader reads it: its files linked, a `model.safetensors.index.json` naming every
    tensor's file (it refuses a directory without one) and `lm_head.weight` in a file of its own where the target
    ties it to the embedding (it reads the head by that name). Whole or absent (built aside, then renamed)."""
    if out.is_dir():
        return
    src = Path(target.path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        (tmp / f.name).symlink_to(f.resolve())
    index = next(iter(src.glob("*.index.json")), None)
    if index is not None:  # a sharded target: its own index, replaced by a copy that may gain the head
        weight_map = read_file(index, "re-download or re-save the target")["weight_map"]
        (tmp / index.name).unlink()
    else:
        weight_map = {}
        for f in sorted(src.glob("*.safetensors")):
            with safe_open(f, "pt") as st:
                weight_map.update(dict.fromkeys(st.keys(), f.name))
    if "lm_head.weight" not in weight_map:
        save_file({"lm_head.weight": target.lm_head.weight.detach().contiguous()}, tmp / "lm_head.safetensors")
        weight_map["lm_head.weight"] = "lm_head.safetensors"
    name = index.name if index is not None else "model.safetensors.index.json"
    (tmp / name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tmp.rename(out)


# ---- a run: planned to fill a time budget, stopped at it, its checkpoint found and exported ----------------------

class Events(NamedTuple):
    """What the shim recorded of a run: each optimizer step's unix time and tokens (the non-padding positions it
    trained on; train/peer_cpu.py says what they are for each peer), and the steps of an epoch (speculators; 0 if
    not told)."""

    steps: list[float]
    tokens: list[int]
    epoch_steps: int


def read_events(path: Path) -> Events:
    """The shim's events file (a line still being written is left for the next read)."""
    text = path.read_text() if path.is_file() else ""
    steps, tokens, epoch_steps = [], [], 0
    for line in text.splitlines()[:text.count("\n")]:
        kind, *values = line.split()
        if kind == "step":
            steps.append(float(values[0]))
            tokens.append(int(values[1]))
        else:
            epoch_steps = int(values[0])
    return Events(steps, tokens, epoch_steps)


def tokens_until(events: Events, when: float) -> int:
    """Tokens of the steps made by unix time `when`: a checkpoint's mtime gives the tokens it was trained on (both
    peers save between steps)."""
    return sum(n for t, n in zip(events.steps, events.tokens, strict=True) if t <= when)


def launch(peer: Peer, args: list[str], run: Path, budget_s: float, stop_after: int = 0) -> Events:
    """Run `peer` through the CPU shim with `args` (its output in run/log.txt) -> what it recorded. Past
    the budget (from its first step, plus a quarter and STOP_GRACE_S for validation and the last checkpoint), or once
    it made `stop_after` steps (> 0), it gets SIGTERM (both peers unwind on it; speculators saves an `interrupted`
    checkpoint), then SIGKILL after STOP_GRACE_S more. A run that fails raises its last line of output and the
    log's path."""
    events, log = run / "events.txt", run / "log.txt"
    events.unlink(missing_ok=True)
    env = {**os.environ, EVENTS: str(events), "TORCHDYNAMO_DISABLE": "1"}  # no slow CPU compiles
    with open(log, "w") as out, Child([str(peer.python), str(SHIM), peer.name, *args], stdout=out,
                                      stderr=subprocess.STDOUT, env=env, cwd=run) as proc:  # ends with draftsmith
        start, stopped = time.time(), 0.0
        while proc.poll() is None:
            time.sleep(1)
            steps = read_events(events).steps
            deadline = (steps[0] if steps else start) + 1.25 * budget_s + STOP_GRACE_S
            if not stopped and (time.time() > deadline or len(steps) >= stop_after > 0):
                proc.terminate()
                stopped = time.time()
            elif stopped and time.time() > stopped + STOP_GRACE_S:
                proc.kill()
    if proc.returncode and not stopped:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] or ["no output"]
        raise RuntimeError(f"{peer.name} exited with {proc.returncode}: {' '.join(lines[-1].split())[:300]}; "
                           f"see {log}")
    return read_events(events)


def speculators_args(inputs: Path, run: Path, steps: int, epochs: int, lr: float | None) -> list[str]:
    """`speculators train` on the input: its defaults (Muon, lr 1e-3, linear schedule with 1% warm-up over the
    planned steps, TTT 3, KL, 8192-token packed batches, bf16), the classic EAGLE-3 drafter of the draft config (no
    EAGLE 3.1 norms: --no-norm-*, full attention), and what a CPU needs."""
    m = read_file(inputs / pf.MANIFEST, f"write the peers' input again ({WRITE})")
    data = inputs / pf.SPECULATORS_DIR
    return ["--verifier-name-or-path", m["target"], "--data-path", str(data),
            "--draft-config", str(data / DRAFT_CONFIG), "--target-layer-ids", *map(str, m["layers"]),
            "--draft-vocab-size", str(m["draft_vocab_size"]),  # finds d2t-N.npy / t2d-N.npy in --data-path
            "--no-norm-before-fc", "--no-norm-output", "--no-norm-before-residual",
            # flex attention has no CPU backward; the fused loss is Triton; worker processes only copy here
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
            "--on-missing", "raise",  # every row's hidden states are written: a missing one is an error, not a
            # request to a vLLM server
            # it must hold out a validation split; the smallest keeps nearly all conversations for training (as
            # draftsmith and SpecForge train on all of them) and validation passes short
            "--train-data-ratio", str(SPECULATORS_TRAIN_RATIO),
            "--save-path", str(run / "checkpoints"), "--log-dir", str(run / "logs"),
            "--max-steps", str(steps), "--epochs", str(epochs), *(["--lr", str(lr)] if lr else [])]


def specforge_config(inputs: Path, run: Path, steps: int, epochs: int, lr: float | None, save_interval: int) -> dict:
    """`specforge train` on the input: its defaults (AdamW, lr 1e-4, cosine with 1.5% warm-up over the planned
    steps, TTT 7, batch 1, clip 0.5, bf16), the input's maximum length, what a CPU needs, and a checkpoint every
    `save_interval` steps (0: at the end only)."""
    m = read_file(inputs / pf.MANIFEST, f"write the peers' input again ({WRITE})")
    return {"model": {"target_model_path": str(inputs / pf.SPECFORGE_DIR / "target"),
                      "draft_model_config": str(inputs / pf.SPECFORGE_DIR / DRAFT_CONFIG),
                      "vocab_mapping_path": str(inputs / pf.SPECFORGE_VOCAB)},
            "data": {"hidden_states_path": str(inputs / pf.SPECFORGE_FEATURES), "max_length": m["meta"]["max_length"],
                     "dataloader_num_workers": 0},
            # flex attention has no CPU backward; one process needs no sharding
            "training": {"attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "max_steps": steps,
                         "num_epochs": epochs, "save_interval": save_interval,
                         **({"learning_rate": lr} if lr else {})},
            "output_dir": str(run / "checkpoints"), "run_id": RUN_ID}


def _launch_planned(peer: Peer, inputs: Path, run: Path, steps: int, epochs: int, lr: float | None,
                    peer_args: list[str], budget_s: float, stop_after: int = 0) -> Events:
    run.mkdir(parents=True)
    if peer.name == "speculators":
        return launch(peer, [*speculators_args(inputs, run, steps, epochs, lr), *peer_args], run, budget_s, stop_after)
    # a main run checkpoints every quarter, so that one stopped at the deadline leaves one; a probe, timed, never
    config = specforge_config(inputs, run, steps, epochs, lr, 0 if stop_after else max(1, steps // 4))
    (run / "run.yaml").write_text(yaml.safe_dump(config))
    return launch(peer, ["train", "-c", str(run / "run.yaml"), *peer_args], run, budget_s, stop_after)


def train(name: str, inputs: str | Path, run: str | Path, budget_s: float, lr: float | None = None,
          peer_args: list[str] = (), probe_steps: int = 20, log=print) -> dict:
    """Train peer `name` on `inputs` (`prepare`) for `budget_s` seconds of training: a probe of `probe_steps` steps
    measures its step time (and speculators' steps per epoch), then the run is planned to that many steps, so its
    schedule anneals within the budget, and stopped at the budget if it overruns. Its checkpoint is exported to
    run/export (`export`). `peer_args` go last on the peer's command line (speculators: flags such as
    --total-seq-len 4096; SpecForge: dotted overrides such as training.batch_size=2). A finished run
    (run/result.json) is returned as it is; an unfinished one starts again.

    Returns result.json: steps planned and done, tokens seen (the non-padding positions of the batches its steps
    trained on), epochs, training seconds (first to last step: validation passes and checkpoint saves included) and
    tokens/s over them, seconds per step of the probe, wall seconds, lr (None: the peer's default), the checkpoint
    and the export."""
    peer, inputs, run = PEERS[name], Path(inputs), Path(run)
    if (run / RESULT).is_file():
        return read_file(run / RESULT, f"delete {run} and train again")
    if not peer.ready():
        raise FileNotFoundError(f"{peer.venv.name} is not set up; run `python -m draftsmith.train.peers setup {name}`")
    rows = read_file(inputs / pf.MANIFEST, f"write the peers' input again ({WRITE})")["rows"]
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.time()
    # the probe is stopped once timed, not left to finish its epochs (speculators' would each add a step, a
    # validation pass and a checkpoint past max_steps)
    probe = _launch_planned(peer, inputs, run / "probe", probe_steps, probe_steps, lr, peer_args, budget_s,
                            probe_steps).steps
    if len(probe) < PROBE_WARMUP + 2:
        fix = "raise probe_steps" if len(probe) == probe_steps else (
            "its deadline came first: give it a longer budget, or more data or a smaller batch (--peer-arg) where an "
            "epoch is a step or two (speculators validates and saves after each)")
        raise RuntimeError(f"the {name} probe made {len(probe)} of {probe_steps} steps, too few to time; {fix} "
                           f"(see {run / 'probe' / 'log.txt'})")
    step_s = (probe[-1] - probe[PROBE_WARMUP]) / (len(probe) - 1 - PROBE_WARMUP)
    steps = max(1, int(budget_s / step_s))
    epoch_steps = read_events(run / "probe" / "events.txt").epoch_steps or rows  # SpecForge: batch 1, a row a step
    epochs = -(-steps // epoch_steps)  # exactly enough: speculators runs a step of each epoch past max_steps
    log(f"{name}: {step_s:.2f} s per step in the probe -> {steps} steps ({epochs} epochs) in {budget_s:.0f} s")
    done = _launch_planned(peer, inputs, run / "main", steps, epochs, lr, peer_args, budget_s)
    seconds = done.steps[-1] - done.steps[0] if done.steps else 0.0
    result = {"peer": name, "version": peer.version, "steps_planned": steps, "steps": len(done.steps),
              "tokens": sum(done.tokens), "epochs": round(len(done.steps) / epoch_steps, 3),
              "train_seconds": round(seconds, 1),
              # the seconds run from the first step's end to the last's: the tokens of the steps after the first
              "tokens_per_s": round(sum(done.tokens[1:]) / seconds, 1) if seconds else None,
              "probe_seconds_per_step": round(step_s, 3), "budget_seconds": budget_s,
              "wall_seconds": round(time.time() - t0, 1), "lr": lr, "peer_args": list(peer_args),
              "checkpoint": str(checkpoint(name, run / "main"))}
    result["export"] = str(export(name, inputs, Path(result["checkpoint"]), run / "export"))
    pf.write_json(run / RESULT, result)
    return result


def checkpoint(name: str, run: Path) -> Path:
    """The last checkpoint of a main run: speculators' newest epoch (or `interrupted`) directory, SpecForge's
    `<run_id>-latest`."""
    root = run / "checkpoints"
    found = [d for d in root.glob("*") if (d / "model.safetensors").is_file() and not d.is_symlink()] \
        if name == "speculators" else [root / f"{RUN_ID}-latest"] if (root / f"{RUN_ID}-latest").exists() else []
    if not found:
        raise FileNotFoundError(f"{name} left no checkpoint in {root}; see {run / 'log.txt'}")
    return max(found, key=lambda d: d.stat().st_mtime).resolve()


def export(name: str, inputs: Path, ckpt: Path, out: Path) -> Path:
    """A checkpoint as the directory llama.cpp's convert_hf_to_gguf.py reads (with --target-model-dir): speculators'
    own layout (its config names the layers as llama.cpp does, inputs to layers); SpecForge's `export --to hf` with
    the layer ids added at the top level, as inputs to layers (llama.cpp reads no other key, and would otherwise
    assume [2, L//2, L-3])."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if name == "speculators":
        tmp.mkdir(parents=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy(ckpt / f, tmp / f)
    else:
        sf = inputs / pf.SPECFORGE_DIR
        proc = subprocess.run([str(PEERS[name].python), str(SHIM), name, "export", "--to", "hf", "--checkpoint",
                               str(ckpt.resolve()), "--draft-config", str(sf / DRAFT_CONFIG), "--output-dir", str(tmp),
                               "--vocab-mapping", str(inputs / pf.SPECFORGE_VOCAB), "--embedding-source",
                               str(sf / "target")], capture_output=True, text=True)
        if proc.returncode:
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()] or ["no output"]
            raise RuntimeError(f"specforge export of {ckpt} failed: {' '.join(lines[-1].split())[:300]}")
        config = read_file(tmp / "config.json", f"export {ckpt} again")
        layers = read_file(inputs / pf.MANIFEST, f"write the peers' input again ({WRITE})")["layers"]
        pf.write_json(tmp / "config.json", {**config, "eagle_aux_hidden_state_layer_ids": layers})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("setup", help="create the peers' venvs (all of them by default)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(PEERS)}")
    p = sub.add_parser("write", help="their input from one pass of an EAGLE-3 recipe's target over its data")
    p.add_argument("--config", required=True, help="an EAGLE-3 recipe (target, data, eagle.aux_layers, "
                   "eagle.draft_vocab_size)")
    p.add_argument("--out", required=True, help="input directory (created; resumed if partial)")
    p.add_argument("overrides", nargs="*", help="dotted key=value, e.g. data.limit=100")
    p = sub.add_parser("train", help="train a peer on the input for a time budget, then export its checkpoint")
    p.add_argument("name", choices=list(PEERS))
    p.add_argument("--inputs", required=True, help="what `write` wrote")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--budget-minutes", type=float, required=True, help="training time")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the peer's own)")
    p.add_argument("--peer-arg", action="append", default=[], help="more of the peer's own command line, last "
                   "(speculators: a flag and its value as two, e.g. --peer-arg=--total-seq-len --peer-arg=4096; "
                   "SpecForge: a dotted override, e.g. --peer-arg=training.batch_size=2)")
    p.add_argument("--probe-steps", type=int, default=20, help="steps timed before the run is planned")
    args = parser.parse_args(argv)
    if args.command == "setup":
        if set(args.names) - set(PEERS):
            parser.error(f"no peer {sorted(set(args.names) - set(PEERS))}; the peers are {', '.join(PEERS)}")
        for name in args.names or PEERS:
            print(f"{name}: {setup(PEERS[name])}")
    elif args.command == "write":
        print(prepare(C.load(Recipe, args.config, args.overrides), args.out))
    else:
        print(train(args.name, args.inputs, args.out, 60 * args.budget_minutes, args.lr, args.peer_arg,
                    args.probe_steps))


if __name__ == "__main__":
    cli(main)
