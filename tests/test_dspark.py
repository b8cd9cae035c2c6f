"""DSpark (DFlash with a Markov head, dflash.markov_rank > 0): the anchor's slot drafts and each slot's logits carry the
Markov bias of the token before it, in training as the proposer computes them; lossless greedy decoding and chi-square
exactness at T=1 (also over an own draft vocabulary); one drafter forward of gamma slots per step; a short training
that drafts the target's text; the `dspark` recipe entry point; the export llama.cpp's converter reads, and (slow) the
GGUF served by llama-server leaving greedy output unchanged and accepting as our decoder does."""

from __future__ import annotations

import json

import pytest
import test_llama_cpp
import torch
import torch.nn.functional as F
from conftest import (
    REPO,
    assert_greedy_matches,
    chi2_two_tokens,
    forward_widths,
    random_row,
    recorded_outputs,
    script,
    train_steps,
)
from test_dflash import V, assert_blocks_are_what_the_proposer_computes, method, tiny
from test_llama_cpp import NEEDS_SERVER, NEEDS_SOURCE, served_as_ours

from draftsmith.decoding.generate import plain_generate, speculative_generate
from draftsmith.models import llama_cpp
from draftsmith.models import registry as R
from draftsmith.models.dflash import DFlash, DFlashConfig
from draftsmith.models.target import load_target

convertible = test_llama_cpp.target  # the fixture: a tiny target saved with a tokenizer llama.cpp converts


def test_the_anchor_slot_drafts_and_each_slot_is_biased_by_the_token_before_it():
    """Slot i of the block at anchor a drafts x_{a+1+i}, taught by the target's distribution at a+i, its logits
    lm_head(h_i) + markov_w2(markov_w1[x_{a+i}]) (teacher-forced: the data's token)."""
    m = method(block_size=3, num_layers=1, markov_rank=8)
    ids, bt = random_row(V, 12, 6)
    outs = recorded_outputs(m.drafter)
    _, metrics = m.blocks(bt, anchors=torch.tensor([[3, 6]]))
    teacher = m.target.logits(m.target.tap(ids).hidden)[0]  # [s, V]
    for i in range(3):
        ce = [-(F.softmax(teacher[a + i], -1) * F.log_softmax(
            m.target.lm_head(outs[0][j * 3 + i]) + m.drafter.markov_head(ids[0, a + i]), -1)).sum()
              for j, a in enumerate((3, 6))]
        assert metrics[f"loss_{i}"] == pytest.approx((sum(ce) / 2).item(), rel=1e-4)
    assert "loss_3" not in metrics  # block_size tokens drafted


def test_training_block_equals_what_the_proposer_computes():
    assert_blocks_are_what_the_proposer_computes(method(block_size=5, markov_rank=8))


@pytest.mark.parametrize("draft_ids", [None, torch.arange(0, V, 2)], ids=["target-head", "own-draft-vocab"])
def test_greedy_decoding_equals_the_targets_own(draft_ids):
    m = method(num_layers=1, aux_layers=[1, 2], markov_rank=8, draft_ids=draft_ids)
    assert_greedy_matches(m.target.model, m.proposer(), V, gamma=5)


@pytest.mark.parametrize("draft_ids", [None, torch.tensor([0, 2, 3, 5])], ids=["target-head", "own-draft-vocab"])
def test_sampled_output_has_the_targets_distribution(draft_ids):
    """Two tokens after a fixed prompt, drawn many times (the second from the Markov bias of the first as drawn):
    chi-square against the target's exact distribution."""
    m = method(tiny(vocab=6, layers=2), block_size=2, num_layers=1, aux_layers=[1], markov_rank=4,
               draft_ids=draft_ids)
    chi2, critical = chi2_two_tokens(m.target.model, m.proposer())
    assert chi2 < critical


def test_one_drafter_forward_of_gamma_slots_drafts_the_whole_block():
    m = method(block_size=5, markov_rank=8)
    calls = forward_widths(m.drafter)
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(3))
    _, stats = speculative_generate(m.target.model, m.proposer(), prompt, 40, eos_token_id=[])
    assert calls == [5] * stats.steps  # a block of 5 slots per verification step
    assert stats.drafted > 4 * stats.steps  # drafting 5 (the anchor's slot too), but near the end of the 40 tokens


def test_a_trained_dspark_drafts_the_targets_text():
    target = tiny(layers=4)
    target.lm_head.weight.data *= 10  # a peaked target
    torch.manual_seed(0)
    m = DFlash(target, DFlashConfig(block_size=3, num_layers=1, anchors=30, markov_rank=16), mask_token_id=1)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8] * 3])
    text, _ = plain_generate(target.model, prompt, 40, eos_token_id=[])
    bt = {"input_ids": text, "loss_mask": torch.ones_like(text), "position_ids": torch.arange(text.shape[1])[None]}
    metrics = train_steps(m, m.blocks, bt)
    assert metrics["acc_0"] > 0.75 and metrics["acc_2"] > 0.6
    spec, stats = speculative_generate(target.model, m.proposer(), prompt, 40, eos_token_id=[])
    assert torch.equal(spec, text) and stats.tau > 2, stats.tau


def test_recipe_trains_measures_tau_and_keeps_a_loadable_best(tiny_chat_target, tmp_path):
    out = tmp_path / "run"
    script("train/dspark.py").main([
        "--config", str(REPO / "recipes/dspark/tiny-code.yaml"), f"target.path={tiny_chat_target}",
        f"loop.output_dir={out}", "data.limit=40", "data.max_length=160", "data.cache=false",
        "eval.heldout_examples=8", "eval.num_prompts=1", "eval.max_new_tokens=8", "loop.batch_size=2",
        "loop.log_every=1", "loop.max_steps=2", "loop.save_every=2", "dflash.aux_layers=[1,2,3]",
        "dflash.markov_rank=8"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/tau" in r]
    assert len(evals) == 1 and evals[0]["eval/tau"] >= 1 and "eval/heldout_cond_acc_4" in evals[0]
    target = load_target(tiny_chat_target)
    proposer = R.load_proposer(str(out / "best"), target.model)
    assert proposer.gamma == 5 and proposer.drafter.markov_head is not None
    ids = target.tokenizer("def f(x):\n    return", return_tensors="pt")["input_ids"]
    spec, _ = speculative_generate(target.model, proposer, ids, 12, eos_token_id=[])
    assert torch.equal(spec, plain_generate(target.model, ids, 12, eos_token_id=[])[0])


def dspark_run(target, out, draft_ids=None, markov_rank: int = 8):
    """A random DSpark drafter (block 4: 4 tokens per forward) of `target` saved at `out`."""
    torch.manual_seed(1)
    size = 0 if draft_ids is None else draft_ids.numel()
    m = DFlash(target, DFlashConfig(block_size=4, aux_layers=[2, 4], draft_vocab_size=size, markov_rank=markov_rank),
               mask_token_id=3, draft_ids=draft_ids)
    for p in m.drafter.parameters():
        torch.nn.init.normal_(p, 0.3 if p.dim() == 1 else 0.0, 0.3)
    m.save_pretrained(out)
    return out


def test_vllm_and_sglang_formats_refuse_a_markov_head_naming_gguf(tmp_path):
    method(markov_rank=4).save_pretrained(tmp_path / "run")
    for name in ("vllm", "sglang"):
        with pytest.raises(ValueError, match="no Markov head.*--format gguf"):
            R.export(tmp_path / "run", name, tmp_path / name)
        assert not (tmp_path / name).exists()


@NEEDS_SOURCE
def test_llama_cpps_converter_reads_the_markov_head_and_draft_vocabulary(convertible, tmp_path):
    V_t = convertible.model.config.vocab_size
    ids = torch.arange(0, V_t, 2)
    gguf = llama_cpp.read_gguf(R.export(dspark_run(convertible, tmp_path / "run", ids), "gguf", tmp_path / "gguf"))
    f, tensors = gguf["fields"], gguf["tensors"]
    assert f["general.architecture"] == "dflash" and f["dflash.sample_from_anchor"] is True
    assert f["dflash.block_size"] == 4 and f["dflash.target_layers"] == [2, 4]
    assert tensors["markov_w1.weight"] == [8, V_t] and tensors["markov_w2.weight"] == [8, ids.numel()]
    assert tensors["d2t"] == [ids.numel()] and "conf_proj.weight" not in tensors  # no confidence head


@pytest.mark.slow
@NEEDS_SERVER
@pytest.mark.parametrize("kind, spec_type", [("dspark", "draft-dspark"), ("dspark-draft-vocab", "draft-dspark"),
                                             ("dflash-draft-vocab", "draft-dflash")])
def test_served_by_llama_server_greedy_output_is_unchanged_and_accepts_as_ours(kind, spec_type, convertible,
                                                                              tmp_path):
    model = llama_cpp.convert(convertible.path, tmp_path / "convertible.gguf", "f32")
    ids = None if kind == "dspark" else torch.arange(0, convertible.model.config.vocab_size, 2)
    run = dspark_run(convertible, tmp_path / "run", ids, 0 if kind.startswith("dflash") else 8)
    draft = R.export(run, "gguf", tmp_path / "gguf") / llama_cpp.GGUF_FILE
    served_as_ours(model, draft, spec_type, run, convertible.model)
