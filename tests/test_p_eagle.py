"""P-EAGLE: the training-time test with placeholders sees what the one-forward proposer computes, greedy equality
on several architectures, chi-square exactness at T=1, one drafter forward per step, checkpoints and the recipe."""

from __future__ import annotations

import json
from pathlib import Path

import conftest as helpers
import pytest
import torch
import transformers as T
from test_decoding_generate import CONFIGS

from draftsmith.decoding.generate import plain_generate, speculative_generate
from draftsmith.decoding.proposers import Verified
from draftsmith.decoding.tree import DraftTree
from draftsmith.decoding.verify import Sampling
from draftsmith.models.eagle_config import EagleConfig
from draftsmith.models.p_eagle import PEagle, PEagleProposer
from draftsmith.models.registry import load_proposer as decoder_load_proposer
from draftsmith.models.target import Target, load_target
from draftsmith.train.config import ConfigError

V = 96
REPO = Path(__file__).resolve().parent.parent


def method(arch: str = "llama", K: int = 4, draft_ids=None, vocab: int = V, seed: int = 1, layers: int = 4) -> PEagle:
    torch.manual_seed(0)
    config = CONFIGS[arch]() if vocab == V and layers == 2 else T.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=None, bos_token_id=None)
    model = T.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    torch.manual_seed(seed)
    m = PEagle(Target(model, None, "tiny"), EagleConfig(version=3, ttt_steps=K), draft_ids, ptd_token_id=3)
    helpers.randomise(m.drafter)
    return m.eval()


def test_training_depth_k_equals_the_proposers_placeholder_k():
    """TTT step k at query t = the proposer's output at placeholder k after committing tokens 0..t+1."""
    m = method(K=4)
    ids, bt = helpers.random_row(V, 10, 2)
    outs = helpers.recorded_outputs(m.drafter)
    m.ttt(bt)
    _, g = m.features(bt)  # [1, s, 3H]
    for t in (2, 6):
        p = m.proposer(gamma=4)
        p.reset()
        hidden = g[0, : t + 1].reshape(t + 1, 3, -1).permute(1, 0, 2)  # [3, t+1, H]: entries 0..t
        p.accept(ids[0, : t + 2], Verified(None, [], None, hidden))
        p.propose(ids[0, : t + 2], Sampling())
        block = outs[-1][t:]  # [K, H]: the last entry (anchor t), then placeholders 1..3
        for k in range(4):
            torch.testing.assert_close(block[k], outs[k][t], atol=1e-4, rtol=1e-4)


def test_entries_of_steps_that_drafted_nothing_join_the_next_block():
    """Under adaptive gamma a step may draft nothing: its entries are fed with the next block, which then drafts
    what drafting at every step would have."""
    m = method(K=4)
    ids, bt = helpers.random_row(V, 12, 2)
    _, g = m.features(bt)  # [1, s, 3H]
    hidden = g[0, :11].reshape(11, 3, -1).permute(1, 0, 2)  # [3, 11, H]: entries 0..10
    eager, lazy = m.proposer(gamma=4), m.proposer(gamma=4)
    for a, b in [(0, 5), (5, 7), (7, 11)]:  # the prefill's entries, then steps committing 2 and 4
        seen = Verified(None if a == 0 else DraftTree.empty(), [], None, hidden[:, a:b])
        eager.accept(ids[0, : b + 1], seen)
        draft = eager.propose(ids[0, : b + 1], Sampling())
        lazy.accept(ids[0, : b + 1], seen)
    assert torch.equal(lazy.propose(ids[0], Sampling()).tokens, draft.tokens) and lazy.n == eager.n == 11


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_greedy_decoding_equals_the_targets_own(arch):
    m = method(arch, layers=2, draft_ids=torch.arange(0, V, 3))
    helpers.assert_greedy_matches(m.target.model, m.proposer(gamma=4), V, gamma=4)


def test_one_drafter_forward_drafts_the_whole_block():
    m = method(K=5)
    calls = helpers.forward_widths(m.drafter)
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(3))
    _, stats = speculative_generate(m.target.model, m.proposer(gamma=5), prompt, 20, eos_token_id=[])
    assert len(calls) == stats.steps  # one forward per verification step: committed entries + 4 placeholders
    assert all(n >= 5 for n in calls)


def test_a_trained_p_eagle_drafts_the_targets_text():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                             num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
                                             bos_token_id=None)).eval().requires_grad_(False)
    model.lm_head.weight.data *= 10  # a peaked target
    m = PEagle(Target(model, None, "tiny"), EagleConfig(version=3, ttt_steps=3), None, ptd_token_id=0)
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8] * 3])
    text, _ = plain_generate(model, prompt, 40, eos_token_id=[])
    bt = {"input_ids": text, "loss_mask": torch.ones_like(text), "position_ids": torch.arange(text.shape[1])[None]}
    metrics = helpers.train_steps(m, m.ttt, bt)
    assert metrics["acc_0"] > 0.9 and metrics["acc_2"] > 0.8  # depth 3 drafts blind to tokens 1..2: harder
    spec, stats = speculative_generate(model, m.proposer(gamma=3), prompt, 40, eos_token_id=[])
    assert torch.equal(spec, text) and stats.tau > 2.5


def test_sampled_output_has_the_targets_distribution():
    """Two tokens after a fixed prompt, drawn many times: chi-square against the target's exact distribution."""
    m = method(vocab=6, layers=2, draft_ids=torch.tensor([0, 2, 3, 5]))
    m.drafter.lm_head.weight.data *= 4  # a peaked q, far from p
    chi2, critical = helpers.chi2_two_tokens(m.target.model, m.proposer(gamma=2))
    assert chi2 < critical


def test_checkpoint_round_trip_and_decoder_loading(tmp_path):
    m = method(draft_ids=torch.arange(10, 60))
    m.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "drafter.json").read_text())
    assert meta["method"] == "p_eagle" and meta["ptd_token_id"] == 3 and meta["parallel_drafting"]
    proposer = decoder_load_proposer(str(tmp_path), m.target.model, gamma=3)
    assert isinstance(proposer, PEagleProposer) and torch.equal(proposer.drafter.mask_hidden, m.drafter.mask_hidden)
    prompt = torch.randint(0, V, (1, 5))
    spec, _ = speculative_generate(m.target.model, proposer, prompt, 10, eos_token_id=[])
    assert torch.equal(spec, plain_generate(m.target.model, prompt, 10, eos_token_id=[])[0])


def test_config_is_checked():
    target = method().target
    with pytest.raises(ConfigError, match="EAGLE-3"):
        PEagle(target, EagleConfig(version=1, ttt_steps=1))
    with pytest.raises(ConfigError, match="ptd_token_id"):
        PEagle(target, EagleConfig(version=3), None, ptd_token_id=V)
    with pytest.raises(ValueError, match="chain"):
        method().proposer(mode="tree")


def test_recipe_trains_measures_tau_and_keeps_a_loadable_best(tiny_chat_target, tmp_path):
    out = tmp_path / "run"
    helpers.script("train/p_eagle.py").main([
        "--config", str(REPO / "recipes/p_eagle/tiny-code.yaml"), f"target.path={tiny_chat_target}",
        f"loop.output_dir={out}", "data.limit=40", "data.max_length=160", "data.cache=false",
        "eval.heldout_examples=12", "eval.num_prompts=2", "eval.max_new_tokens=8", "loop.batch_size=2",
        "loop.log_every=1", "loop.max_steps=4", "loop.save_every=2", "loop.lr=3e-3", "eagle.ttt_steps=3",
        "eagle.draft_vocab_size=200"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/tau" in r]
    assert len(evals) == 2 and all(r["eval/tau"] >= 1 and "eval/heldout_cond_acc_4" in r for r in evals)
    assert any("loss_2" in r for r in rows)
    target = load_target(tiny_chat_target)
    meta = json.loads((out / "best" / "drafter.json").read_text())
    assert meta["ptd_token_id"] == target.tokenizer.pad_token_id
    proposer = decoder_load_proposer(str(out / "best"), target.model)
    ids = target.tokenizer("def f(x):\n    return", return_tensors="pt")["input_ids"]
    spec, _ = speculative_generate(target.model, proposer, ids, 12, eos_token_id=[])
    assert torch.equal(spec, plain_generate(target.model, ids, 12, eos_token_id=[])[0])
