"""The memory plan (`draftsmith plan`, train/memory_plan.py) against what one real EAGLE-3 training step holds.

The step runs on CPU on tiny targets built in code. CPU memory is not tracked by torch's allocator, so `LiveBytes`
counts it itself: every tensor storage an operation makes (forward, backward and optimizer step, seen below autograd
by a TorchDispatchMode) is added at its creation and removed when its storage is freed (a weakref finalizer on the
storage, which torch keeps as one Python object for the storage's life), on top of the storages that exist when the
step starts (weights, buffers, AdamW states, the batch). The peak of that sum is what a caching GPU allocator would
have to hold at least; the plan is asserted within 30% (plus 256 KiB) of it.
"""

from __future__ import annotations

import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig, Qwen3MoeConfig

from draftsmith.models.eagle import Eagle
from draftsmith.models.eagle_config import EagleConfig
from draftsmith.models.target import Target
from draftsmith.train import cli
from draftsmith.train import memory_plan as M

TOLERANCE, SLACK = 0.3, 256 * 1024


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive now (`now`) and at most (`peak`) while the mode is active."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, int] = {}  # storage address -> bytes
        self.now = self.peak = 0
        for t in existing:
            self.add(t)

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key and key not in self.live:  # a view of a storage already counted adds nothing
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self.free, key)

    def free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


def tiny_config(family: str, layers: int, hidden: int, vocab: int):
    """A tiny target of `family` (llama, qwen3_moe, gpt_oss): 4 heads, 2 key/value heads; MoE: 4 experts, 2 a token."""
    base = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, tie_word_embeddings=False,
                bos_token_id=None, eos_token_id=None)
    if family == "llama":
        return LlamaConfig(**base)
    if family == "gpt_oss":  # eager attention with sinks, 3-D expert weights
        return GptOssConfig(**{**base, "intermediate_size": hidden // 2}, num_local_experts=4, num_experts_per_tok=2)
    return Qwen3MoeConfig(**base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)


def measured_step(config, eagle: EagleConfig, seq: int, batch: int, dtype: str) -> int:
    """Peak live bytes of the second of two EAGLE-3 training steps (AdamW states exist by then, as in every later
    step), the tiny target in `dtype` under the loop's autocast for it. The target's LM head is zero outside the draft
    vocabulary (the first Vd ids), so its argmax always lies inside and every position trains, as the plan assumes (a
    real draft vocabulary, the most frequent tokens, holds nearly all of a target's argmaxes)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval().requires_grad_(False)
    Vd = eagle.draft_vocab_size
    model.get_output_embeddings().weight[Vd:] = 0
    method = Eagle(Target(model), eagle, torch.arange(Vd)).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    optimizer = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=1e-3)
    rows = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "position_ids": torch.arange(seq).expand(batch, seq)}

    def step():
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bfloat16"):
            loss, _ = method(rows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    with LiveBytes([*method.parameters(), *method.buffers(), *states, *rows.values()]) as live:
        step()
    return live.peak


# drafter-bound: the TTT steps' attention, activations and logits dominate; target-bound: a deep, narrow target's
# forward (every hidden state the tap keeps) does
CASES = {"drafter-bound": dict(layers=4, hidden=64, vocab=4096, seq=128, batch=2, ttt_steps=3, draft_vocab=1024),
         "target-bound": dict(layers=64, hidden=32, vocab=512, seq=32, batch=16, ttt_steps=1, draft_vocab=64)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("case", CASES)
def test_the_plan_is_within_30_percent_of_a_measured_step(case, family, dtype):
    k = CASES[case]
    config = tiny_config(family, k["layers"], k["hidden"], k["vocab"])
    eagle = EagleConfig(version=3, ttt_steps=k["ttt_steps"], draft_vocab_size=k["draft_vocab"])
    setting = M.Setting(k["seq"], k["batch"], dtype, eagle)
    terms = M.plan(M.count(config, eagle, setting.w), setting, "single", 1)
    phases = {"target_fwd": terms["target_fwd"], "teacher": terms["teacher"],
              "step": terms["ttt_logits"] + terms["activations"] + terms["grads"]}
    assert max(phases, key=phases.get) == ("target_fwd" if case == "target-bound" else "step")  # the phase checked
    measured = measured_step(config, eagle, k["seq"], k["batch"], dtype)
    assert abs(terms["total"] - measured) <= TOLERANCE * measured + SLACK, (terms, measured)


@pytest.mark.parametrize("name", M.TARGETS)
def test_the_named_targets_plan_and_more_gpus_never_need_more_per_gpu(name, capsys):
    result = cli.run(["plan", "--target", name, "--json"])
    assert json.loads(capsys.readouterr().out) == result
    assert result["target_params"] > 7e9 and 0 < result["drafter_params"] < result["target_params"] / 10
    for launcher in M.LAUNCHERS:
        for offline in (False, True):
            rows = [r["bytes"] for r in sorted(result["rows"], key=lambda r: r["gpus"])
                    if r["launcher"] == launcher and r["offline"] == offline]
            assert len(rows) == (1 if launcher == "single" else len(M.TABLE_GPUS))
            assert all(row["target_fwd"] == 0 if offline else row["target_fwd"] > 0 for row in rows)
            for fewer, more in zip(rows, rows[1:], strict=False):
                assert all(more[t] <= fewer[t] for t in fewer), (launcher, offline, fewer, more)


def test_only_zero3_and_fsdp2_divide_the_target():
    result = M.main(["--target", "llama-3.3-70b", "--json"])
    by = {(r["launcher"], r["gpus"]): r["bytes"]["target"] for r in result["rows"] if not r["offline"]}
    assert by[("ddp", 8)] == by[("ddp", 1)] == by[("zero2", 8)] == by[("single", 1)] > 130 * 2**30  # 70.6B in bf16
    assert by[("fsdp2", 8)] < by[("ddp", 8)] / 6 and by[("zero3", 8)] < by[("ddp", 8)] / 6


def test_gpt_oss_experts_count_in_mxfp4():
    c = M.count(M.target_config("gpt-oss-120b"), EagleConfig(version=3), 2)
    assert 116e9 < c.params < 118e9 and c.eager  # no SDPA kernel takes gpt-oss's attention sinks
    assert 60 * 2**30 < c.weights < 70 * 2**30  # experts at 4.25 bits, the rest bf16; all bf16 would be ~218 GiB


def test_a_local_config_counts_the_real_parameters_and_a_bad_target_fails_in_one_line(tmp_path, capsys):
    config = tiny_config("qwen3_moe", 4, 64, 512)
    config.save_pretrained(tmp_path)
    real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert M.main(["--target", str(tmp_path / "config.json"), "--json"])["target_params"] == real
    M.main(["--target", str(tmp_path), "--seq", "64", "--gpus", "4"])
    assert "GiB per GPU at 4 GPU(s)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--target", str(tmp_path / "missing")])
    assert "neither a named target" in str(e.value.code) and "\n" not in str(e.value.code)
