"""The peer trainers' input (data/peer_formats.py) and runs (train/peers.py): the files hold what draftsmith's own
cache of the same rows holds, in each peer's layout; an interrupted pass resumes; each peer's own reader, in its venv,
takes them; and (slow) each peer trains on them for a budget and its checkpoint converts with llama.cpp's converter.
The tests that run a peer skip, saying how to set it up, where its venv is absent: nothing is downloaded."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_llama_cpp import NEEDS_SOURCE, llama_style_tokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from draftsmith.data import peer_formats as pf
from draftsmith.data.dataset import DataConfig, build_dataset
from draftsmith.data.hidden_cache import CacheError, HiddenCache, write_cache
from draftsmith.data.tokenizer import CHAT_TEMPLATE
from draftsmith.models import llama_cpp
from draftsmith.models.eagle import draft_vocab
from draftsmith.models.layerskip import final_norm
from draftsmith.models.target import Target, load_target
from draftsmith.train import config as C
from draftsmith.train import peer_cpu, peers, peers_bench
from draftsmith.train.eagle import Recipe

LAYERS = [1, 2, 3]  # of the 4-layer tiny chat target
N = 64  # draft vocabulary


def needs(name: str):
    return pytest.mark.skipif(not peers.PEERS[name].ready(), reason=f"needs {name}'s venv: python -m "
                              f"draftsmith.train.peers setup {name} (~5 min, ~1.3 GiB, from PyPI)")


def test_a_setup_step_that_fails_names_itself_and_its_log_and_leaves_no_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    peer = peers.Peer("broken", "0", (("--no-index", "no-such-package==1"),))  # fails offline, at once
    with pytest.raises(RuntimeError, match=r"broken-0 failed at step 2 \(`pip install --no-index no-such-package"
                       r"==1`\); see .*broken-0\.log"):
        peers.setup(peer, log=lambda s: None)
    assert not peer.venv.exists() and not peer.ready() and "no-such-package" in peer.log.read_text()


@pytest.fixture(scope="module")
def target(tiny_chat_target) -> Target:
    return load_target(tiny_chat_target)


@pytest.fixture(scope="module")
def rows(target) -> list[dict]:
    return [dict(r) for r in build_dataset(DataConfig(max_length=160, limit=20, overlong="drop", cache=False),
                                           target.tokenizer)]


@pytest.fixture(scope="module")
def inputs(target, rows, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("peer-inputs")
    ids = draft_vocab(rows, target.config.vocab_size, N)
    pf.write_peer_inputs(target, rows, LAYERS, ids, final_norm(target.model), out, batch_size=4, log=lambda s: None)
    return out


def test_both_peers_files_hold_what_draftsmiths_own_cache_of_the_rows_holds(target, rows, inputs, tmp_path):
    write_cache(target, rows, LAYERS, tmp_path, dtype="bfloat16", batch_size=4, log=lambda s: None)
    cache = HiddenCache(tmp_path, target, LAYERS)
    m = json.loads((inputs / pf.MANIFEST).read_text())
    assert m["complete"] and m["rows"] == len(rows) and m["layers"] == LAYERS and m["dtype"] == "bfloat16"
    norm = final_norm(target.model)
    for i, (row, cached) in enumerate(zip(rows, cache, strict=True)):
        T, H = len(row["input_ids"]), target.config.hidden_size
        hs = load_file(pf.speculators_file(inputs, i))
        assert hs["token_ids"].dtype == torch.int64 and hs["token_ids"].tolist() == row["input_ids"]
        assert hs["hidden_states"].dtype == torch.bfloat16 and hs["hidden_states"].shape == (T, len(LAYERS) + 1, H)
        torch.testing.assert_close(hs["hidden_states"][:, :-1].flatten(1), cached["aux"])
        # the last slot is the last layer's output before the final norm: the norm of it is the cache's `hidden`
        torch.testing.assert_close(norm(hs["hidden_states"][:, -1].float()), cached["hidden"].float(),
                                   atol=0.05, rtol=0.05)
        sf = torch.load(pf.specforge_file(inputs, i), weights_only=True)
        assert sf["input_ids"].dtype == sf["loss_mask"].dtype == torch.int64
        assert sf["input_ids"].tolist() == row["input_ids"] and sf["loss_mask"].tolist() == row["loss_mask"]
        assert torch.equal(sf["aux_hidden_state"][0], hs["hidden_states"][:, :-1].flatten(1))  # the same forward
        assert sf["aux_hidden_state"].shape == (1, T, len(LAYERS) * H)
        assert sf["hidden_state"].dtype == torch.bfloat16 and sf["hidden_state"].shape == (1, T, H)
        torch.testing.assert_close(sf["hidden_state"][0], cached["hidden"])
    ds = datasets.load_from_disk(str(inputs / pf.SPECULATORS_DIR))  # speculators' pre-tokenised rows, torch format
    assert ds.format["type"] == "torch" and ds[0]["input_ids"].dtype == torch.int64
    assert [r.tolist() for r in ds[:]["loss_mask"]] == [r["loss_mask"] for r in rows]
    assert ds[:]["seq_len"].tolist() == [len(r["input_ids"]) for r in rows]
    ids = draft_vocab(rows, target.config.vocab_size, N)
    d2t, t2d = (np.load(inputs / pf.SPECULATORS_DIR / f"{k}-{N}.npy") for k in ("d2t", "t2d"))
    assert d2t.dtype == np.int64 and (np.arange(N) + d2t).tolist() == ids.tolist()
    assert t2d.dtype == bool and t2d.sum() == N and t2d[ids.numpy()].all()
    vocab = torch.load(inputs / pf.SPECFORGE_VOCAB, weights_only=True)
    assert torch.equal(vocab["d2t"], torch.from_numpy(d2t)) and torch.equal(vocab["t2d"], torch.from_numpy(t2d))


def test_an_interrupted_pass_writes_only_the_missing_rows_and_other_data_is_refused(target, rows, inputs, tmp_path):
    out = tmp_path / "inputs"
    ids = draft_vocab(rows, target.config.vocab_size, N)
    args = (LAYERS, ids, final_norm(target.model))
    pf.write_peer_inputs(target, rows, *args, out, batch_size=4, log=lambda s: None)
    pf.speculators_file(out, 3).unlink()  # an interruption between a row's two files, and one before a row
    pf.specforge_file(out, 7).unlink()
    forwards = []
    hook = target.model.get_decoder().register_forward_hook(lambda *a: forwards.append(1))
    try:
        pf.write_peer_inputs(target, rows, *args, out, batch_size=4, log=lambda s: None)
    finally:
        hook.remove()
    assert len(forwards) == 1  # rows 3 and 7, in one batch
    for i in (3, 7):
        assert torch.equal(load_file(pf.speculators_file(out, i))["hidden_states"],
                           load_file(pf.speculators_file(inputs, i))["hidden_states"])
    with pytest.raises(CacheError, match="another target, layers, dtype or data"):
        pf.write_peer_inputs(target, rows[:-1], *args, out, log=lambda s: None)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(CacheError, match="not the peers' input"):
        pf.write_peer_inputs(target, rows, *args, tmp_path / "other", log=lambda s: None)


@pytest.fixture(scope="module")
def prepared(tiny_chat_target, tmp_path_factory) -> tuple[Path, Recipe, Path]:
    """`peers.prepare` on a tied variant of the tiny chat target: (the input, its recipe, the target)."""
    path = tmp_path_factory.mktemp("tied-target")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_chat_target)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    cfg = C.load(Recipe, None, [f"target.path={path}", "data.max_length=160", "data.limit=20", "data.overlong=drop",
                                "data.cache=false", "data.pack=true", f"eagle.draft_vocab_size={N}"])
    out = tmp_path_factory.mktemp("prepared")
    peers.prepare(cfg, out, log=lambda s: None)
    return out, cfg, path


def test_prepare_gives_each_peer_draftsmiths_vocabulary_a_draft_config_in_its_convention_and_an_untied_head(prepared):
    out, cfg, path = prepared
    target = load_target(path)
    # draftsmith trains on the packed rows; the peers read them unpacked: the same tokens, the same vocabulary
    ids = draft_vocab(build_dataset(cfg.data, target.tokenizer), target.config.vocab_size, N)
    assert (np.arange(N) + np.load(out / pf.SPECULATORS_DIR / f"d2t-{N}.npy")).tolist() == ids.tolist()
    layers = json.loads((out / pf.MANIFEST).read_text())["layers"]
    assert layers == [1, 2, 3]  # the EAGLE default for 4 layers, as hidden_states indices (inputs to layers)
    spec = json.loads((out / pf.SPECULATORS_DIR / peers.DRAFT_CONFIG).read_text())
    sgl = json.loads((out / pf.SPECFORGE_DIR / peers.DRAFT_CONFIG).read_text())
    for c in (spec, sgl):
        assert c["num_hidden_layers"] == 1 and c["hidden_size"] == 32 and c["intermediate_size"] == 64
    assert sgl["architectures"] == ["LlamaForCausalLMEagle3"] and sgl["draft_vocab_size"] == N
    assert sgl["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang's: outputs of layers
    sf_target = out / pf.SPECFORGE_DIR / "target"
    index = json.loads((sf_target / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(load_file(path / "model.safetensors")) | {"lm_head.weight"}
    head = load_file(sf_target / index["lm_head.weight"])["lm_head.weight"]
    assert torch.equal(head, target.model.get_input_embeddings().weight)  # the tied head, written on its own


SPECULATORS_READER = """
import json, sys, numpy as np, torch
from speculators.train.data import ArrowDataset, CollateFn
from speculators.train.recovery import SampleUnavailable
from speculators.models.eagle3.data import shift_batch
from speculators.train.cli import _load_mappings
path, n = sys.argv[1], int(sys.argv[2])
train = ArrowDataset(max_len=4096, datapath=path, on_missing="raise", train_ratio=0.5, split="train")
val = ArrowDataset(max_len=4096, datapath=path, on_missing="raise", train_ratio=0.5, split="val")
items = [d[i] for d in (train, val) for i in range(len(d))]
batch = CollateFn(4096, 32, 3, preprocess=shift_batch)(items[:4])
d2t, t2d, size = _load_mappings(f"{path}/d2t-{n}.npy", f"{path}/t2d-{n}.npy", n)
print(json.dumps({"rows": len(items), "unavailable": sum(isinstance(x, SampleUnavailable) for x in items),
                  "item": {k: [list(v.shape), str(v.dtype)] for k, v in items[0].items()},
                  "batch": {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")},
                  "vocab": [size, int(t2d.sum())]}))
"""


@needs("speculators")
def test_speculators_own_reader_takes_the_rows_hidden_states_and_vocabulary(rows, inputs):
    proc = subprocess.run([str(peers.PEERS["speculators"].python), "-c", SPECULATORS_READER,
                           str(inputs / pf.SPECULATORS_DIR), str(N)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    T = len(rows[0]["input_ids"])
    assert got["rows"] == len(rows) and got["unavailable"] == 0  # token ids matched every row
    assert got["item"]["hidden_states"] == [[T, 3 * 32], "torch.bfloat16"]
    assert got["item"]["verifier_last_hidden_states"] == [[T, 32], "torch.bfloat16"]
    assert got["item"]["loss_mask"] == [[T], "torch.int64"] and got["vocab"] == [N, N]
    assert got["batch"]["hidden_states"] == [1, 4096, 96]


SPECFORGE_READER = """
import json, sys, torch
from specforge.algorithms.eagle3.data import build_offline_collator, normalize_offline_sample
from specforge.modeling.target.target_head import TargetHead
from specforge.runtime.data_plane.feature_store import load_feature_file
from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
from specforge.training.model_loading import load_draft_config_source
from specforge.training.vocab_mapping import count_effective_feature_tokens
features, sf = sys.argv[1], sys.argv[2]
refs = OfflineManifestReader(features, validate_files=True).read()
samples = [normalize_offline_sample(load_feature_file(r.feature_store_uri[len("file://"):]), 512) for r in refs]
batch = build_offline_collator()(samples[:2])
head = TargetHead.from_pretrained(f"{sf}/target")
config = load_draft_config_source(f"{sf}/draft_config.json")
vocab = torch.load(f"{sf}/vocab_mapping.pt")
print(json.dumps({"rows": len(refs), "specs": {k: [list(s.shape), s.dtype] for k, s in refs[0].feature_specs.items()},
                  "batch": {k: list(v.shape) for k, v in batch.items()},
                  "counts": {str(k): v for k, v in count_effective_feature_tokens(features).items()},
                  "head": [list(head.fc.weight.shape), float(head.fc.weight.float().sum())],
                  "draft": [type(config).__name__, config.draft_vocab_size,
                            config.eagle_config["eagle_aux_hidden_state_layer_ids"]],
                  "vocab": [int(vocab["t2d"].sum()), len(vocab["d2t"])]}))
"""


@needs("specforge")
def test_specforge_own_reader_takes_the_features_target_draft_config_and_vocabulary(prepared):
    out, cfg, path = prepared
    proc = subprocess.run([str(peers.PEERS["specforge"].python), "-c", SPECFORGE_READER,
                           str(out / pf.SPECFORGE_FEATURES), str(out / pf.SPECFORGE_DIR)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    target = load_target(path)
    rows = build_dataset(dataclasses.replace(cfg.data, pack=False), target.tokenizer)
    T = len(rows[0]["input_ids"])
    assert got["rows"] == len(rows)
    assert got["specs"] == {"input_ids": [[T], "int64"], "loss_mask": [[T], "int64"],
                            "hidden_state": [[1, T, 32], "bfloat16"], "aux_hidden_state": [[1, T, 96], "bfloat16"]}
    assert got["batch"]["hidden_state"][2] == 96 and got["batch"]["target"][2] == 32
    counts = torch.zeros(target.config.vocab_size, dtype=torch.long)
    for r in rows:  # what it counts for a vocabulary is what draftsmith counts: the loss-masked tokens
        counts += torch.bincount(torch.tensor(r["input_ids"])[torch.tensor(r["loss_mask"]).bool()],
                                 minlength=len(counts))
    assert {int(k): v for k, v in got["counts"].items()} == {i: int(c) for i, c in enumerate(counts) if c}
    embedding = target.model.get_input_embeddings().weight
    assert got["head"][0] == list(embedding.shape)
    assert got["head"][1] == pytest.approx(float(embedding.bfloat16().float().sum()), rel=1e-3)
    assert got["draft"] == ["LlamaConfig", N, [0, 1, 2]]
    assert got["vocab"] == [N, N]


@pytest.fixture(scope="module")
def llama_cpp_target(tmp_path_factory) -> Path:
    """An 8-layer Llama whose tokenizer llama.cpp's converter reads, with the reference chat template."""
    path = tmp_path_factory.mktemp("llama-cpp-target")
    tok = llama_style_tokenizer()
    tok.chat_template, tok.pad_token = CHAT_TEMPLATE, "</s>"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
@NEEDS_SOURCE
@pytest.mark.parametrize("name,peer_args", [("speculators", ["--total-seq-len", "1024"]), ("specforge", [])])
def test_a_peer_trains_for_its_budget_and_its_checkpoint_converts_with_the_layers_it_read(
        name, peer_args, llama_cpp_target, tmp_path):
    if not peers.PEERS[name].ready():
        pytest.skip(f"needs {name}'s venv: python -m draftsmith.train.peers setup {name}")
    cfg = C.load(Recipe, None, [f"target.path={llama_cpp_target}", "data.max_length=256", "data.limit=24",
                                "data.cache=false", "data.on_no_assistant=drop", "eagle.aux_layers=[2,4,5]",
                                f"eagle.draft_vocab_size={N}"])
    peers.prepare(cfg, tmp_path / "inputs", log=lambda s: None)
    r = peers.train(name, tmp_path / "inputs", tmp_path / "run", budget_s=20, peer_args=peer_args, probe_steps=5,
                    log=lambda s: None)
    assert r["steps"] == r["steps_planned"] >= 1 and r["train_seconds"] <= 1.25 * 20 + peers.STOP_GRACE_S
    events = peers.read_events(tmp_path / "run/main/events.txt")
    assert len(events.tokens) == r["steps"] and r["tokens"] == sum(events.tokens) and r["tokens_per_s"] > 0
    lengths = datasets.load_from_disk(str(tmp_path / "inputs" / pf.SPECULATORS_DIR))[:]["seq_len"].tolist()
    if name == "specforge":  # batch 1: each step trains on one conversation, every one of its tokens
        assert set(events.tokens) <= set(lengths)
    else:  # conversations packed into rows of --total-seq-len, each shifted by one: a token less each
        assert all(0 < n <= 1024 for n in events.tokens) and max(events.tokens) >= min(lengths) - 1
    assert json.loads((Path(r["export"]) / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert peers.train(name, tmp_path / "inputs", tmp_path / "run", budget_s=20) == r  # a finished run is kept
    gguf = llama_cpp.read_gguf(llama_cpp.convert(r["export"], tmp_path / "draft.gguf", "f32", llama_cpp_target))
    assert gguf["fields"]["general.architecture"] == "eagle3"
    assert gguf["fields"]["eagle3.target_layers"] == [2, 4, 5]
    assert gguf["tensors"]["d2t"] == [N] and not gguf["fields"]["eagle3.norm_before_fc"]


# ---- the side-by-side benchmark's orchestration (train/peers_bench.py), run on nothing heavy -----------------------

def test_the_plan_lists_every_phase_and_trains_all_three_on_the_same_drafter_without_running(tmp_path, capsys):
    peers_bench.main(["--plan", "--work", str(tmp_path / "w"), "--budget-minutes", "2", "--conversations", "10"])
    lines = capsys.readouterr().out.splitlines()
    phases = [line.split("]")[0][1:] for line in lines]
    assert phases == sorted(phases, key=["setup", "inputs", "train", "judge", "report"].index)
    assert len(set(phases)) == 5 and not (tmp_path / "w").exists()  # nothing run, nothing written
    step = {line.split()[1].rstrip(":"): line for line in lines}
    # the same conversations for all three: draftsmith's training refuses a cache of other data than its recipe's
    assert all("data.limit=10" in step[s] for s in ("inputs-draftsmith", "inputs-peers", "train-draftsmith"))
    assert "--budget-minutes 2 --lr 0.001" in step["train-specforge-our-lr"] and "--lr" not in step["train-specforge"]
    overrides = [t for t in shlex.split(step["train-draftsmith"].split(": ", 1)[1]) if "=" in t]
    recipe = C.load(Recipe, "recipes/eagle3/smollm2-135m.yaml", overrides)
    assert (recipe.eagle.draft_vocab_size, recipe.eagle.aux_layers, recipe.eagle.fc_norm) == (4096, [2, 15, 27], False)
    assert recipe.loop.max_minutes == 2 and recipe.offline.path == str(tmp_path / "w/inputs/cache")


def test_a_finished_step_is_never_redone_a_failed_or_loaded_one_runs_again(tmp_path, monkeypatch):
    b = peers_bench
    count, e = tmp_path / "count", tmp_path / "e"
    py = [sys.executable, "-c"]
    steps = [b.Step("a", "x", [*py, f"open({str(count)!r}, 'a').write('a')"]),
             b.Step("b", "x", [*py, "raise SystemExit(3)"]),
             b.Step("c", "x", run=lambda: {}, needs=("b",)),
             b.Step("d", "x", run=lambda: {"ran": True}),
             b.Step("f", "x", run=lambda: int("nine"))]
    said = []
    monkeypatch.setattr(b.os, "getloadavg", lambda: (0.5, 0.5, 0.5))  # a quiet machine
    state = b.run_all(steps, tmp_path / "w", cool_s=0, say=said.append)
    assert count.read_text() == "a" and state["steps"]["a"]["peak_rss_mib"] > 0 and state["steps"]["d"]["ran"]
    assert "c" not in state["steps"] and "c: skipped, b failed" in said
    assert f"b (x) failed: exited with 3; see {tmp_path / 'w/logs/b.log'}" in said
    assert "invalid literal" in (tmp_path / "w/logs/f.log").read_text()  # a step run in-process: its traceback
    # a busy machine: a step run now is kept but marked loaded; its output is removed before it runs again
    steps.append(b.Step("e", "x", run=lambda: {"output_cleared": not e.exists()}, out=e))
    e.mkdir()
    monkeypatch.setattr(b.os, "getloadavg", lambda: (2.0, 2.0, 2.0))
    said.clear()
    state = b.run_all(steps, tmp_path / "w", cool_s=0, say=said.append)
    assert count.read_text() == "a" and {"a: done earlier", "d: done earlier"} <= set(said)
    assert state["steps"]["b"]["status"] == "failed" and state["steps"]["e"]["loaded"]
    monkeypatch.setattr(b.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    b.run_all(steps, tmp_path / "w", cool_s=0, say=said.append)
    e_state = json.loads((tmp_path / "w/state.json").read_text())["steps"]["e"]  # read back from the file
    assert e_state["output_cleared"] and not e_state["loaded"] and count.read_text() == "a"


# ---- tokens seen: the shim's events, each checkpoint's tokens, the report at equal tokens -------------------------

def test_the_shims_step_lines_carry_each_steps_tokens_and_a_line_being_written_waits(tmp_path, monkeypatch):
    events = tmp_path / "events.txt"
    monkeypatch.setenv(peer_cpu.EVENTS, str(events))
    monkeypatch.setattr(peer_cpu, "pending", [0])
    peer_cpu.record("epoch_steps 9")
    peer_cpu.batch(torch.tensor([[1, 1, 0]]).sum())  # two micro-batches of one optimizer step (a 0-d tensor, an int)
    peer_cpu.batch(5)
    peer_cpu.step()
    peer_cpu.batch(4)
    peer_cpu.step()
    got = peers.read_events(events)
    assert got.tokens == [7, 4] and got.epoch_steps == 9 and len(got.steps) == 2
    assert got.steps[0] <= got.steps[1] <= time.time()
    with open(events, "a") as fh:
        fh.write("step 17")  # the shim is mid-write: the step is read once its line is whole
    assert peers.read_events(events) == got
    assert peers.tokens_until(got, got.steps[0]) == 7 and peers.tokens_until(got, got.steps[0] - 1) == 0
    assert peers.read_events(tmp_path / "none.txt") == peers.Events([], [], 0)


def saved_at(path: Path, when: float) -> Path:
    path.mkdir(parents=True)
    os.utime(path, (when, when))
    return path


def test_a_peers_checkpoints_have_the_minutes_and_tokens_of_the_steps_made_before_each_was_saved(tmp_path):
    run = tmp_path / "train/specforge"
    t0 = 1000.0
    tokens = [50, 60, 70, 80, 90]
    (run / "main").mkdir(parents=True)
    (run / "main/events.txt").write_text("".join(f"step {t0 + 30 * i} {n}\n" for i, n in enumerate(tokens)))
    ckpts = run / "main/checkpoints"
    saved_at(ckpts / f"{peers.RUN_ID}-step4", t0 + 95)  # after the 4th step (t0 + 90), before the 5th
    saved_at(ckpts / f"{peers.RUN_ID}-step2", t0 + 35)
    (ckpts / f"{peers.RUN_ID}-latest").symlink_to(f"{peers.RUN_ID}-step4")
    got = peers_bench.checkpoints_of("specforge", run, t0 - 500, tmp_path)
    assert [(c["checkpoint"], c["tokens"]) for c in got] == [(f"{peers.RUN_ID}-step2", sum(tokens[:2])),
                                                             (f"{peers.RUN_ID}-step4", sum(tokens[:4]))]
    assert [c["minutes"] for c in got] == [round(35 / 60, 1), round(95 / 60, 1)]  # from its first step


def draftsmith_checkpoint(run: Path, step: int, batch: int, max_length: int) -> None:
    ckpt = run / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": step, "train_seconds": 4.0 * step, "world_size": 1}))
    (ckpt / "config.yaml").write_text(yaml.safe_dump({"data": {"pack": True, "max_length": max_length},
                                                      "loop": {"batch_size": batch, "grad_accum": 1}}))
    (ckpt / "model").mkdir()


def test_draftsmiths_tokens_are_its_loops_positions_less_the_padding_of_its_packed_rows(tmp_path):
    work, batch, length = tmp_path, 2, 64
    cache, inputs, run = work / "inputs/cache", work / "inputs/peers", work / "train/draftsmith"
    cache.mkdir(parents=True)
    inputs.mkdir(parents=True)
    rows, tokens = 10, 576  # the same conversations: 10 packed rows of 64 positions; unpacked, 576 tokens
    (cache / "manifest.json").write_text(json.dumps({"tokens": rows * length}))
    (inputs / "manifest.json").write_text(json.dumps({"tokens": tokens}))
    for step in (5, 10):
        draftsmith_checkpoint(run, step, batch, length)  # 4 s of training a step
    r = peers_bench.draftsmith_result(run, cache, inputs)
    positions = 10 * batch * length
    assert r["positions"] == positions and r["token_share"] == tokens / (rows * length)
    assert r["tokens"] == round(positions * tokens / (rows * length)) and r["epochs"] == 2.0  # 20 rows seen of 10
    assert r["steps"] == 10 and r["tokens_per_s"] == round(r["tokens"] / 40.0, 1)
    got = peers_bench.checkpoints_of("draftsmith", run, 0.0, work)  # minutes: of training, evaluations left out
    assert [(c["checkpoint"], c["tokens"], c["minutes"]) for c in got] == [
        ("checkpoint-5", round(5 * batch * length * r["token_share"]), round(20 / 60, 1)),
        ("checkpoint-10", r["tokens"], round(40 / 60, 1))]
    assert got[0]["path"] == run / "checkpoint-5/model"
    (inputs / "manifest.json").unlink()  # without the peers' input the padding is unknown: no token count
    assert peers_bench.draftsmith_result(run, cache, inputs)["tokens"] is None


def test_the_report_names_each_trainers_checkpoint_nearest_the_largest_token_count_all_reached(tmp_path):
    w = tmp_path / "w"
    (w / "judge").mkdir(parents=True)

    def judged(name: str, checkpoints: list[tuple], at_t0: float) -> None:
        row = {"outputs": [[1]], "acceptance_length": at_t0}
        (w / "judge" / f"{name}.json").write_text(json.dumps({
            "llama_cpp": {"heldout": {"0": row, "1": row}}, "checkpoints": [
                {"checkpoint": c, "minutes": m, "tokens": t, **({"acceptance_length": a} if a else {"error": "x"})}
                for c, m, t, a in checkpoints]}))

    judged("draftsmith", [("checkpoint-10", 1.0, 9_000, 1.4), ("checkpoint-20", 2.0, 18_000, 1.6)], 1.6)
    # the checkpoint that failed to serve is no candidate, though its count is nearer
    judged("speculators", [("0", 1.5, 9_500, 1.2), ("1", 2.5, 10_400, None), ("interrupted", 3.0, 14_000, 1.3)], 1.3)
    judged("specforge", [("peer-step4", 1.0, 5_000, 1.1), ("peer-step8", 2.0, 10_500, 1.25)], 1.25)
    judged("specforge-our-lr", [], 1.3)
    (w / "state.json").write_text(json.dumps({"steps": {
        "train-specforge": {"status": "done", "result": {"steps": 8, "tokens": 10_500, "epochs": 0.5,
                                                          "train_seconds": 60.0, "tokens_per_s": 175.0}},
        "train-speculators": {"status": "failed", "error": "x"}}}))
    args = argparse.Namespace(work=w, out=tmp_path / "out/peers.json", plot=tmp_path / "out/peers.png",
                              budget_minutes=3.0)
    peers_bench.report(args)
    got = json.loads(args.out.read_text())
    assert got["at_equal_tokens"]["tokens"] == 10_500  # SpecForge's most; the others passed it
    assert {n: c["checkpoint"] for n, c in got["at_equal_tokens"]["nearest"].items()} == {
        "draftsmith": "checkpoint-10", "speculators": "0", "specforge": "peer-step8"}
    assert got["trainers"] == {"specforge": {"steps": 8, "tokens": 10_500, "epochs": 0.5, "train_seconds": 60.0,
                                             "tokens_per_s": 175.0}}
    assert got["drafters"]["specforge-our-lr"]["better_of_its_two_lrs"]
    assert "better_of_its_two_lrs" not in got["drafters"]["specforge"]
    assert args.plot.stat().st_size > 0
