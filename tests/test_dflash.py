"""DFlash: training blocks see what the one-forward proposer computes, greedy equality on several architectures,
chi-square exactness at T=1, one drafter forward per step, the mask token and the anchors, an own draft vocabulary
(lossless, exported as vLLM and llama.cpp's converter read it), checkpoints and the recipe entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_llama_cpp
import torch
import transformers as T
from conftest import (
    REPO,
    assert_greedy_matches,
    chi2_two_tokens,
    forward_widths,
    random_row,
    randomise,
    recorded_outputs,
    script,
    train_steps,
)
from test_decoding_generate import CONFIGS
from test_llama_cpp import NEEDS_SOURCE
from tokenizers import Tokenizer, models

from draftsmith.decoding.generate import plain_generate, speculative_generate
from draftsmith.decoding.proposers import Verified
from draftsmith.decoding.verify import Sampling
from draftsmith.models import llama_cpp
from draftsmith.models import registry as R
from draftsmith.models.dflash import (
    DFlash,
    DFlashConfig,
    DFlashProposer,
    default_aux_layers,
    load_dflash,
    mask_token,
)
from draftsmith.models.registry import load_proposer as decoder_load_proposer
from draftsmith.models.target import Target, load_target
from draftsmith.train.config import ConfigError

convertible = test_llama_cpp.target  # the fixture: a tiny target saved with a tokenizer llama.cpp converts
V = 96


def tiny(arch: str = "llama", vocab: int = V, layers: int = 4) -> Target:
    torch.manual_seed(0)
    config = CONFIGS[arch]() if arch != "llama" else T.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=None, bos_token_id=None)
    return Target(T.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False), None, "tiny")


def method(target: Target | None = None, block_size: int = 5, num_layers: int = 2, seed: int = 1,
           draft_ids: torch.Tensor | None = None, **kw) -> DFlash:
    """A random DFlash (or with markov_rank, DSpark) drafter; `draft_ids`: its own draft vocabulary."""
    target = target or tiny()
    torch.manual_seed(seed)
    cfg = DFlashConfig(block_size=block_size, num_layers=num_layers,
                       draft_vocab_size=0 if draft_ids is None else draft_ids.numel(), **kw)
    m = DFlash(target, cfg, mask_token_id=3, draft_ids=draft_ids)
    randomise(m.drafter)
    return m.eval()


def assert_blocks_are_what_the_proposer_computes(m: DFlash) -> None:
    """The block at anchor a in training = the proposer's block after committing tokens 0..a."""
    ids, bt = random_row(V, 12, 2)
    outs = recorded_outputs(m.drafter)
    tap = m.target.tap(ids, layers=tuple(m.layers))
    for a in (1, 4, 9):
        m.blocks(bt, anchors=torch.tensor([[a]]))
        trained = outs[-1]  # [block_size, H]
        p = m.proposer()
        hidden = torch.stack([tap.layers[i][0, :a] for i in m.layers])  # [k, a, H]: positions 0..a-1
        p.accept(ids[0, : a + 1], Verified(None, [], None, hidden))
        p.propose(ids[0, : a + 1], Sampling())
        torch.testing.assert_close(outs[-1], trained, atol=1e-4, rtol=1e-4)


def test_training_block_equals_what_the_proposer_computes():
    assert_blocks_are_what_the_proposer_computes(method(block_size=5))


def test_blocks_do_not_see_later_context_or_other_sequences():
    m = method()
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(5))
    packed = {"input_ids": ids, "loss_mask": torch.ones_like(ids),
              "position_ids": torch.cat([torch.arange(5), torch.arange(7)])[None]}
    alone = {"input_ids": ids[:, 5:], "loss_mask": torch.ones_like(ids[:, 5:]), "position_ids": torch.arange(7)[None]}
    outs = recorded_outputs(m.drafter)
    changed = {**packed, "input_ids": packed["input_ids"].clone()}
    changed["input_ids"][0, 11] = (changed["input_ids"][0, 11] + 1) % V  # after the anchor's block
    earlier = {**packed, "input_ids": packed["input_ids"].clone()}
    earlier["input_ids"][0, 6] = (earlier["input_ids"][0, 6] + 1) % V  # in the anchor's context
    for bt, anchor in ((packed, 8), (alone, 3), (changed, 8), (earlier, 8)):
        m.blocks(bt, anchors=torch.tensor([[anchor]]))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)  # the first sequence is not context
    torch.testing.assert_close(outs[0], outs[2], atol=1e-5, rtol=1e-5)  # nor anything from the anchor on
    assert (outs[0] - outs[3]).abs().max() > 1e-3  # while the context before the anchor is read


def test_loss_is_the_weighted_mean_of_soft_cross_entropies_on_the_mask_slots():
    m = method(block_size=3)
    ids, bt = random_row(V, 10, 6)
    outs = recorded_outputs(m.drafter)
    loss, metrics = m.blocks(bt, anchors=torch.tensor([[3, 6]]))
    target = m.target.logits(m.target.tap(ids).hidden)[0]  # [s, V]
    total = 0.0
    for i in (1, 2):  # slot i of the block at anchor a drafts x_{a+i}: the target's distribution at a+i-1
        ce = [-(torch.softmax(target[a + i - 1], -1) * torch.log_softmax(m.target.logits(outs[0][j * 3 + i]), -1)).sum()
              for j, a in enumerate((3, 6))]
        total += 0.8 ** (i - 1) * sum(ce) / 2
        assert metrics[f"loss_{i - 1}"] == pytest.approx((sum(ce) / 2).item(), rel=1e-4)
    torch.testing.assert_close(loss, total / (1 + 0.8), atol=1e-5, rtol=1e-4)  # over the slot weights' sum


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_greedy_decoding_equals_the_targets_own(arch):
    m = method(tiny(arch), num_layers=1, aux_layers=[1, 2])
    assert_greedy_matches(m.target.model, m.proposer(gamma=4), V, gamma=4)


def test_one_drafter_forward_drafts_the_whole_block():
    m = method(block_size=6)
    calls = forward_widths(m.drafter)
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(3))
    _, stats = speculative_generate(m.target.model, m.proposer(), prompt, 20, eos_token_id=[])
    assert calls == [6] * stats.steps  # one forward of the bonus + 5 mask slots per verification step


def test_a_trained_dflash_drafts_the_targets_text():
    target = tiny(layers=4)
    target.lm_head.weight.data *= 10  # a peaked target
    torch.manual_seed(0)
    m = DFlash(target, DFlashConfig(block_size=4, num_layers=1, anchors=30), mask_token_id=0)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8] * 3])
    text, _ = plain_generate(target.model, prompt, 40, eos_token_id=[])
    bt = {"input_ids": text, "loss_mask": torch.ones_like(text), "position_ids": torch.arange(text.shape[1])[None]}
    metrics = train_steps(m, m.blocks, bt)
    assert metrics["acc_0"] > 0.75 and metrics["acc_2"] > 0.6  # drafted without the anchor's own feature
    spec, stats = speculative_generate(target.model, m.proposer(), prompt, 40, eos_token_id=[])
    assert torch.equal(spec, text) and stats.tau > 2, stats.tau


@pytest.mark.parametrize("draft_ids", [None, torch.tensor([0, 2, 3, 5])], ids=["target-head", "own-draft-vocab"])
def test_sampled_output_has_the_targets_distribution(draft_ids):
    """Two tokens after a fixed prompt, drawn many times: chi-square against the target's exact distribution (with an
    own draft vocabulary, q is zero outside it and the other tokens come from the residual)."""
    m = method(tiny(vocab=6, layers=2), block_size=3, num_layers=1, aux_layers=[1], draft_ids=draft_ids)
    chi2, critical = chi2_two_tokens(m.target.model, m.proposer())
    assert chi2 < critical


def test_the_mask_token_is_one_with_a_trained_embedding():
    """A zero (padding) row would give every mask slot the same zero query: refused, and -1 picks another token."""
    t = tiny()
    t.embed.weight.data[0] = 0
    with pytest.raises(ConfigError, match="embedding is zero"):
        DFlash(t, DFlashConfig(), mask_token_id=0)
    tok = T.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, "t5")),
                                    pad_token="t0", eos_token="t0", unk_token="t5")
    assert mask_token(Target(t.model, tok, "tiny")) == 5 and mask_token(t, 7) == 7


def test_anchors_are_trained_tokens_before_a_trained_token_and_the_others_train_nothing():
    """SpecForge's rule: anchor a where loss_mask[a] and loss_mask[a + 1] (and a has context); a row with fewer such
    positions than dflash.anchors draws others too, which add nothing to the loss."""
    m = method(block_size=3, anchors=12)
    ids, bt = random_row(V, 12, 4)
    bt["loss_mask"] = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0]])
    every, _ = m.blocks(bt)  # all 12 positions drawn
    eligible, _ = m.blocks(bt, anchors=torch.tensor([[5, 6, 7, 8, 9]]))
    torch.testing.assert_close(every, eligible)


def test_an_own_draft_vocabulary_starts_from_the_target_head_and_drafts_only_its_tokens_losslessly():
    t = tiny()
    ids = torch.arange(0, V, 3)
    fresh = DFlash(t, DFlashConfig(draft_vocab_size=ids.numel()), mask_token_id=3, draft_ids=ids)
    assert torch.equal(fresh.drafter.lm_head.weight, t.lm_head.weight[ids]) and fresh.drafter.lm_head.weight.requires_grad
    m = method(t, num_layers=1, aux_layers=[1, 2], draft_ids=ids)
    assert_greedy_matches(t.model, m.proposer(gamma=4), V, gamma=4)
    row, _ = random_row(V, 9, 2)
    tap = t.tap(row, layers=tuple(m.layers))
    p = m.proposer(gamma=4)
    p.accept(row[0], Verified(None, [], None, torch.stack([tap.layers[i][0, :-1] for i in m.layers])))
    tree = p.propose(row[0], Sampling(1.0, generator=torch.Generator().manual_seed(0)))
    assert set(tree.tokens.tolist()) <= set(ids.tolist()) and tree.q.shape == (4, V)
    assert tree.q[:, ids].sum(-1).allclose(torch.ones(4)) and not tree.q[:, 1::3].any()


def saved(t: Target, path: Path) -> Target:
    """The target written to `path`, as the exports read it (its config)."""
    t.model.save_pretrained(path)
    return Target(t.model, t.tokenizer, str(path))


def test_an_own_draft_vocabulary_exports_lm_head_and_d2t_as_vllm_reads_them(tmp_path):
    ids = torch.arange(1, V, 2)
    m = method(saved(tiny(), tmp_path / "target"), num_layers=1, aux_layers=[1, 3], draft_ids=ids)
    m.save_pretrained(tmp_path / "run")
    out = R.export(tmp_path / "run", "vllm", tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["draft_vocab_size"] == ids.numel()
    drafter, meta = R.load("dflash", "vllm", out)
    assert torch.equal(drafter.draft_ids, ids) and meta["aux_layers"] == [1, 3]
    for k, v in m.drafter.state_dict().items():
        assert torch.equal(v, drafter.state_dict()[k]), k


@NEEDS_SOURCE
def test_llama_cpps_converter_reads_an_own_draft_vocabulary_as_dflash_with_d2t(convertible, tmp_path):
    ids = torch.arange(0, convertible.model.config.vocab_size, 2)
    torch.manual_seed(1)
    DFlash(convertible, DFlashConfig(block_size=4, aux_layers=[2, 4], draft_vocab_size=ids.numel()), mask_token_id=3,
           draft_ids=ids).save_pretrained(tmp_path / "run")
    gguf = llama_cpp.read_gguf(R.export(tmp_path / "run", "gguf", tmp_path / "gguf"))
    f, tensors = gguf["fields"], gguf["tensors"]
    assert f["general.architecture"] == "dflash" and f["dflash.sample_from_anchor"] is False
    assert tensors["d2t"] == [ids.numel()] and tensors["output.weight"] == [64, ids.numel()]
    assert not any(name.startswith("markov") for name in tensors)  # no Markov head: llama.cpp picks draft-dflash


def test_checkpoint_round_trip_and_decoder_loading(tmp_path):
    m = method()
    m.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "drafter.json").read_text())
    assert meta["method"] == "dflash" and meta["mask_token_id"] == 3 and meta["block_size"] == 5
    back = load_dflash(tmp_path, m.target)
    for k, v in m.drafter.state_dict().items():
        assert torch.equal(v, back.drafter.state_dict()[k]), k
    proposer = decoder_load_proposer(str(tmp_path), m.target.model)
    assert isinstance(proposer, DFlashProposer) and proposer.gamma == 4
    prompt = torch.randint(0, V, (1, 5))
    spec, _ = speculative_generate(m.target.model, proposer, prompt, 10, eos_token_id=[])
    assert torch.equal(spec, plain_generate(m.target.model, prompt, 10, eos_token_id=[])[0])


def test_default_layers_and_config_checks():
    assert default_aux_layers(36, 1) == [19] and default_aux_layers(36, 5) == [2, 10, 18, 26, 34]  # outputs + 1
    assert default_aux_layers(8, 1) == [5]
    with pytest.raises(ConfigError, match="aux_layers"):
        DFlash(tiny(), DFlashConfig(aux_layers=[1, 1]))
    with pytest.raises(ConfigError, match="mask_token_id"):
        DFlash(tiny(), DFlashConfig(), mask_token_id=V)
    with pytest.raises(ConfigError, match="block_size"):
        DFlashConfig(block_size=1)


def test_recipe_trains_measures_tau_and_keeps_a_loadable_best(tiny_chat_target, tmp_path):
    out = tmp_path / "run"
    script("train/dflash.py").main([
        "--config", str(REPO / "recipes/dflash/tiny-code.yaml"), f"target.path={tiny_chat_target}",
        f"loop.output_dir={out}", "data.limit=40", "data.max_length=160", "data.cache=false",
        "eval.heldout_examples=12", "eval.num_prompts=2", "eval.max_new_tokens=8", "loop.batch_size=2",
        "loop.log_every=1", "loop.max_steps=4", "loop.save_every=2", "loop.lr=3e-3", "dflash.aux_layers=[1,2,3]"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/tau" in r]
    assert len(evals) == 2 and all(r["eval/tau"] >= 1 and 1 <= r["eval/expected_tau"] <= 6 for r in evals)
    assert all("eval/heldout_cond_acc_4" in r for r in evals) and any("loss_4" in r for r in rows)
    target = load_target(tiny_chat_target)
    mask = json.loads((out / "best" / "drafter.json").read_text())["mask_token_id"]
    assert mask == mask_token(target) and target.embed.weight[mask].any()  # not the pad: its row is zero here
    proposer = decoder_load_proposer(str(out / "best"), target.model)
    ids = target.tokenizer("def f(x):\n    return", return_tensors="pt")["input_ids"]
    spec, _ = speculative_generate(target.model, proposer, ids, 12, eos_token_id=[])
    assert torch.equal(spec, plain_generate(target.model, ids, 12, eos_token_id=[])[0])
