"""The offline hidden-state cache: what it stores equals the tap, it refuses what it cannot hold or does not
fit, it survives interruption, and training from it gives the losses online training gives."""

from __future__ import annotations

import json
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from conftest import script
from transformers import LlamaForCausalLM

from draftsmith.data import hidden_cache as hc
from draftsmith.data.core import collate
from draftsmith.data.dataset import DataConfig, build_dataset
from draftsmith.data.hidden_cache import CacheError, HiddenCache, collate_features, write_cache
from draftsmith.models.target import Target, load_target
from draftsmith.train import cache as cache_command

REPO = Path(__file__).resolve().parent.parent
LAYERS = [1, 2, 4]




@pytest.fixture(scope="module")
def target(tiny_chat_target) -> Target:
    return load_target(tiny_chat_target)


@pytest.fixture(scope="module")
def rows(target) -> list[dict]:
    """Ragged unpacked rows (no position_ids) from the real data pipeline."""
    cfg = DataConfig(max_length=160, limit=20, overlong="drop", cache=False)
    return [dict(r) for r in build_dataset(cfg, target.tokenizer)]


def tap_row(target: Target, row: dict, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's features of one row on its own: hidden [len, H], aux [len, n*H]."""
    with torch.no_grad():
        tap = target.tap(torch.tensor([row["input_ids"]]), layers=tuple(layers))
    return tap.hidden[0], torch.cat([tap.layers[i][0] for i in layers], -1)


def test_fp32_cache_reads_back_the_tap_exactly(target, rows, tmp_path):
    m = write_cache(target, rows, LAYERS, tmp_path, shard_tokens=300, dtype="float32", batch_size=1, log=lambda s: None)
    assert len(m["shards"]) > 2 and m["complete"]
    assert m["tokens"] == sum(len(r["input_ids"]) for r in rows)
    cache = HiddenCache(tmp_path, target, LAYERS)
    assert len(cache) == len(rows)
    for row, got in zip(rows, cache, strict=True):
        hidden, aux = tap_row(target, row, LAYERS)
        assert got["input_ids"] == row["input_ids"] and got["loss_mask"] == row["loss_mask"]
        assert got["position_ids"] == list(range(len(row["input_ids"])))
        assert torch.equal(got["hidden"], hidden) and torch.equal(got["aux"], aux)
        logits = target.logits(hidden)  # [len, V]: the teacher's whole-vocabulary view, stored as two columns
        torch.testing.assert_close(got["log_z"], logits.logsumexp(-1))
        assert torch.equal(got["greedy"].long(), logits.argmax(-1))


def test_default_shards_hold_at_most_shard_bytes(target, rows, tmp_path, monkeypatch):
    per_token = (1 + len(LAYERS)) * target.config.hidden_size * 4 + 9 + 8  # float32 features + token/teacher columns
    monkeypatch.setattr(hc, "SHARD_BYTES", 300 * per_token)
    m = write_cache(target, rows, LAYERS, tmp_path, dtype="float32", log=lambda s: None)
    assert m["bytes_per_token"] == per_token and len(m["shards"]) > 2
    assert all(s["tokens"] <= 300 or s["rows"] == 1 for s in m["shards"])


def test_bf16_batched_cache_is_the_tap_within_bf16_precision(target, rows, tmp_path):
    m = write_cache(target, rows, LAYERS, tmp_path, dtype=torch.bfloat16, batch_size=4, log=lambda s: None)
    H = target.config.hidden_size
    assert m["bytes_per_token"] == (1 + len(LAYERS)) * H * 2 + 9 + 8  # features, token columns, log_z and greedy
    shard = tmp_path / m["shards"][0]["file"]
    assert shard.stat().st_size >= m["tokens"] * m["bytes_per_token"]
    cache = HiddenCache(tmp_path, target, LAYERS)
    for row, got in zip(rows, cache, strict=True):
        hidden, aux = tap_row(target, row, LAYERS)
        assert got["hidden"].dtype == torch.bfloat16 and got["aux"].shape == (len(row["input_ids"]), 3 * H)
        torch.testing.assert_close(got["hidden"].float(), hidden, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got["aux"].float(), aux, rtol=1e-2, atol=1e-2)


def test_eagle1_cache_stores_the_final_hidden_state_only(target, rows, tmp_path):
    m = write_cache(target, rows[:3], [], tmp_path, dtype="float32", log=lambda s: None)
    assert m["bytes_per_token"] == target.config.hidden_size * 4 + 9
    row = HiddenCache(tmp_path, target, [])[0]
    assert set(row) == {"input_ids", "loss_mask", "position_ids", "hidden"} and "aux" not in row


def test_collate_features_pads_like_collate(target, rows, tmp_path):
    write_cache(target, rows[:3], LAYERS, tmp_path, dtype="float32", log=lambda s: None)
    cache = HiddenCache(tmp_path)
    batch = collate_features([cache[i] for i in range(3)])
    plain = collate([{**r, "position_ids": list(range(len(r["input_ids"])))} for r in rows[:3]])
    assert set(batch) == set(plain) | {"hidden", "aux", "log_z", "greedy"}
    for k, v in plain.items():
        assert torch.equal(batch[k], v)
    b, s = plain["input_ids"].shape
    assert batch["hidden"].shape == (b, s, 32) and batch["aux"].shape == (b, s, 96)
    for i in range(3):
        n = len(rows[i]["input_ids"])
        assert torch.equal(batch["hidden"][i, :n], cache[i]["hidden"]) and not batch["hidden"][i, n:].any()
        assert torch.equal(batch["greedy"][i, :n], cache[i]["greedy"]) and batch["log_z"].shape == (b, s)


def test_refuses_when_the_disk_cannot_hold_the_cache(target, rows, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    need = sum(len(r["input_ids"]) for r in rows) * ((1 + len(LAYERS)) * 32 * 2 + 9 + 8)
    monkeypatch.setattr(hc.shutil, "disk_usage", lambda p: usage(1 << 40, 0, need + (1 << 20)))
    with pytest.raises(CacheError, match=r"not enough disk for the hidden cache: .* free at"):
        write_cache(target, rows, LAYERS, tmp_path / "c", log=lambda s: None)
    assert not any((tmp_path / "c").iterdir())
    monkeypatch.setattr(hc.shutil, "disk_usage", lambda p: usage(1 << 40, 0, 1 << 40))
    assert write_cache(target, rows, LAYERS, tmp_path / "c", log=lambda s: None)["complete"]


def test_interrupted_write_resumes_at_the_first_missing_shard(target, rows, tmp_path, monkeypatch):
    whole = write_cache(target, rows, LAYERS, tmp_path / "whole", shard_tokens=300, dtype="float32",
                        log=lambda s: None)
    real, written = hc._write_shard, []

    def crash_on_third(target, shard_rows, layers, path, dtype, batch_size):
        if len(written) == 2:
            path.with_name(path.name + ".tmp").write_bytes(b"half a shard")  # killed mid-write
            raise KeyboardInterrupt
        written.append(path.name)
        real(target, shard_rows, layers, path, dtype, batch_size)

    monkeypatch.setattr(hc, "_write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        write_cache(target, rows, LAYERS, tmp_path / "c", shard_tokens=300, dtype="float32", log=lambda s: None)
    assert sorted(p.name for p in (tmp_path / "c").glob("shard-*.safetensors")) == written
    with pytest.raises(CacheError, match=r"incomplete \(2 of \d+ shards\); rerun .* to resume"):
        HiddenCache(tmp_path / "c", target)

    resumed = []
    monkeypatch.setattr(hc, "_write_shard", lambda *a: (resumed.append(a[3].name), real(*a)))
    m = write_cache(target, rows, LAYERS, tmp_path / "c", shard_tokens=300, dtype="float32", log=lambda s: None)
    assert resumed == [s["file"] for s in whole["shards"][2:]] and m == whole
    assert not list((tmp_path / "c").glob("*.tmp"))
    a, b = HiddenCache(tmp_path / "whole"), HiddenCache(tmp_path / "c")
    assert len(b) == len(rows)
    for i in range(len(rows)):
        assert b[i]["input_ids"] == rows[i]["input_ids"]
        assert torch.equal(a[i]["hidden"], b[i]["hidden"]) and torch.equal(a[i]["aux"], b[i]["aux"])


def test_reuse_links_the_shards_an_earlier_cache_holds_and_writes_the_rest(target, rows, tmp_path, monkeypatch):
    whole = write_cache(target, rows, LAYERS, tmp_path / "whole", shard_tokens=300, dtype="float32",
                        log=lambda s: None)
    first = write_cache(target, rows[:5], LAYERS, tmp_path / "first", shard_tokens=300, dtype="float32",
                        log=lambda s: None)  # the first source alone; a second one is appended below
    common = [s for s in first["shards"] if s in whole["shards"]]
    assert 0 < len(common) < len(whole["shards"])
    edited = [dict(r) for r in rows]
    edited[0]["input_ids"] = [edited[0]["input_ids"][1], *edited[0]["input_ids"][1:]]  # shard 0: same plan, new text
    real, written = hc._write_shard, []
    monkeypatch.setattr(hc, "_write_shard", lambda *a: (written.append(a[3].name), real(*a)))
    write_cache(target, edited, LAYERS, tmp_path / "c", shard_tokens=300, dtype="float32", log=lambda s: None,
                reuse=tmp_path / "first")
    assert written == [s["file"] for s in whole["shards"] if s not in common[1:]]
    for s in common[1:]:
        assert (tmp_path / "c" / s["file"]).stat().st_ino == (tmp_path / "first" / s["file"]).stat().st_ino
    a, b = HiddenCache(tmp_path / "whole"), HiddenCache(tmp_path / "c", target, LAYERS)
    for i in range(1, len(rows)):
        assert b[i]["input_ids"] == rows[i]["input_ids"]
        assert torch.equal(a[i]["hidden"], b[i]["hidden"]) and torch.equal(a[i]["aux"], b[i]["aux"])
    assert b[0]["input_ids"] == edited[0]["input_ids"]
    with pytest.raises(CacheError, match="--reuse .* holds a cache of another target, layers or dtype"):
        write_cache(target, rows, LAYERS, tmp_path / "bf16", shard_tokens=300, log=lambda s: None,
                    reuse=tmp_path / "first")
    with pytest.raises(CacheError, match="--reuse .* is not a hidden-state cache"):
        write_cache(target, rows, LAYERS, tmp_path / "d", log=lambda s: None, reuse=tmp_path / "nothing")
    assert not (tmp_path / "bf16").exists() and not (tmp_path / "d").exists()


def test_a_cache_of_another_target_or_other_layers_is_refused(target, rows, tmp_path):
    write_cache(target, rows[:3], LAYERS, tmp_path, log=lambda s: None)
    retrained = Target(LlamaForCausalLM(target.config), None, "retrained")  # same config, other weights
    with pytest.raises(CacheError, match="written for another target .* point offline.path at it"):
        HiddenCache(tmp_path, retrained)
    with pytest.raises(CacheError, match=r"holds layers \[1, 2, 4\] but the method reads \[2, 2, 1\]"):
        HiddenCache(tmp_path, target, [2, 2, 1])
    with pytest.raises(CacheError, match="holds a cache of another target, layers"):
        write_cache(target, rows[:3], [2, 2, 1], tmp_path, log=lambda s: None)
    with pytest.raises(CacheError, match="not a hidden-state cache"):
        HiddenCache(tmp_path / "nothing")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["layers"] == LAYERS and manifest["target"] == str(target.path)


def train(*extra: str, entry: str = "train/eagle.py") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step losses (metrics.jsonl, 6 decimals) and final drafter weights of a short run of an EAGLE entry script."""
    loop = script(entry).main(list(extra))
    lines = (loop.run_dir / "metrics.jsonl").read_text().splitlines()
    return [row["loss"] for row in map(json.loads, lines) if "loss" in row], loop.unwrapped.drafter.state_dict()


@pytest.mark.parametrize("recipe", ["eagle3/tiny-code.yaml", "eagle/tiny-code.yaml", "p_eagle/tiny-code.yaml"])
def test_training_offline_gives_the_losses_of_training_online(tiny_chat_target, tmp_path, recipe):
    """Same seed, same batch order: an fp32 cache reproduces online training to the last logged digit (a bf16
    cache is off by ~3e-5 relative here, which these tolerances reject), both in fp32 (the recipes' bf16 autocast
    would round the online target's features)."""
    common = [f"target.path={tiny_chat_target}", "data.limit=40", "data.max_length=128", "data.cache=false",
              "eagle.draft_vocab_size=128", "eagle.ttt_steps=3", "eval.num_prompts=0", "eval.heldout_examples=12",
              "loop.batch_size=2", "loop.max_steps=5", "loop.save_every=5", "loop.log_every=1", "loop.best_metric=",
              "loop.lr=1e-2", "loop.mixed_precision=no"]
    config = ["--config", str(REPO / "recipes" / recipe)]
    m = cache_command.main([*config, *common, "--out", str(tmp_path / "cache"),
                                                       "--dtype", "float32", "--shard-tokens", "200"])
    assert len(m["shards"]) > 1
    # EAGLE-3's cache carries the teacher's log_z and greedy: its offline teacher runs the head over the draft rows only
    assert ("log_z" in HiddenCache(tmp_path / "cache")[0]) == (m["layers"] != [])
    entry = "train/p_eagle.py" if recipe.startswith("p_eagle") else "train/eagle.py"
    online, w_online = train(*config, *common, f"loop.output_dir={tmp_path / 'online'}", entry=entry)
    offline, w_offline = train(*config, *common, f"loop.output_dir={tmp_path / 'offline'}",
                               f"offline.path={tmp_path / 'cache'}", entry=entry)
    assert len(online) == 5 and len(set(online)) == 5
    torch.testing.assert_close(offline, online, rtol=0, atol=2e-6)
    torch.testing.assert_close(w_offline, w_online, rtol=1e-5, atol=1e-6)
    if recipe.startswith("eagle3"):  # the same cache with other layers, or for other data, is refused at start
        with pytest.raises(CacheError, match="holds layers"):
            train(*config, *common, "eagle.aux_layers=[0,1,2]", f"offline.path={tmp_path / 'cache'}",
                  f"loop.output_dir={tmp_path / 'other-layers'}")
        with pytest.raises(ValueError, match=r"other data .*`--reuse .*cache` links the shards whose tokens"):
            train(*config, *common, "data.limit=30", f"offline.path={tmp_path / 'cache'}",
                  f"loop.output_dir={tmp_path / 'other-data'}")


@pytest.mark.parametrize("draft_vocab", [0, 96])
def test_dflash_trains_from_an_eagle3_cache_as_it_trains_online(tiny_chat_target, tmp_path, draft_vocab):
    """DFlash reads an EAGLE-3 cache of its layers: the cache's aux are its fused features, its hidden the
    teacher's (with a draft vocabulary, the head over those rows alone and the cache's greedy): same seed, same
    anchors, the losses and weights of training online."""
    data = [f"target.path={tiny_chat_target}", "data.limit=40", "data.max_length=128", "data.cache=false"]
    cache_command.main(["--config", str(REPO / "recipes/eagle3/tiny-code.yaml"), *data, "eagle.aux_layers=[1,2,3]",
                        "--out", str(tmp_path / "cache"), "--dtype", "float32", "--shard-tokens", "200"])
    common = ["--config", str(REPO / "recipes/dflash/tiny-code.yaml"), *data, "dflash.aux_layers=[1,2,3]",
              f"dflash.draft_vocab_size={draft_vocab}",
              "eval.num_prompts=0", "eval.heldout_examples=12", "loop.batch_size=2", "loop.max_steps=5",
              "loop.save_every=5", "loop.log_every=1", "loop.best_metric=", "loop.lr=1e-2"]
    online, w_online = train(*common, f"loop.output_dir={tmp_path / 'online'}", entry="train/dflash.py")
    offline, w_offline = train(*common, f"loop.output_dir={tmp_path / 'offline'}", f"offline.path={tmp_path / 'cache'}",
                               entry="train/dflash.py")
    assert len(online) == 5 and len(set(online)) == 5
    torch.testing.assert_close(offline, online, rtol=0, atol=2e-6)
    torch.testing.assert_close(w_offline, w_online, rtol=1e-5, atol=1e-6)
    with pytest.raises(CacheError, match="holds layers"):
        train(*common, "dflash.aux_layers=[0,1,2]", f"offline.path={tmp_path / 'cache'}",
              f"loop.output_dir={tmp_path / 'other-layers'}", entry="train/dflash.py")
