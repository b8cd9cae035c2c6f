"""Adaptive gamma: the same greedy tokens as the target for chains (knob) and trees (cut), the target's
distribution at T=1 (chi-square), and a depth that follows the drafter's acceptance."""

from __future__ import annotations

import time

import pytest
import torch
import transformers as T
from conftest import chi2_two_tokens
from test_eagle import method

from draftsmith.decoding import DraftModel, DraftTree, Lookahead, PromptLookup, Proposer, SuffixDecoding
from draftsmith.decoding.adaptive import AdaptiveGamma
from draftsmith.decoding.generate import plain_generate, speculative_generate

V, NEW = 96, 32
STEEP = {1: 1.0, 2: 1.2, 4: 1.8, 8: 3.5, 16: 7.0}  # a CPU-like verify-cost curve: long drafts must pay


def build(arch: str = "llama", seed: int = 0, vocab: int = V):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None)
    cfg = {"llama": lambda: T.LlamaConfig(**common),
           "gemma2": lambda: T.Gemma2Config(**common, head_dim=8, sliding_window=8),
           "gemma3": lambda: T.Gemma3TextConfig(**common, head_dim=8, sliding_window=8, sliding_window_pattern=2)}[arch]()
    return T.AutoModelForCausalLM.from_config(cfg).eval()


def prompt(seed: int) -> torch.Tensor:
    x = torch.randint(0, V, (10,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([x, x[:4], x])[None]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_greedy_output_is_the_targets_for_chains_and_trees(arch):
    target, draft = build(arch), build(arch, seed=1)
    x = prompt(0)
    ref = target.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    for proposer in (AdaptiveGamma(PromptLookup(), STEEP, knob="num_pred_tokens"),
                     AdaptiveGamma(DraftModel(draft, V, gamma=4), STEEP, plain_step_s=1e-3, knob="gamma"),
                     AdaptiveGamma(Lookahead(), STEEP), AdaptiveGamma(SuffixDecoding(max_children=3), STEEP)):
        for _ in range(2):  # the second sequence starts from the first one's acceptance estimates
            out, _ = speculative_generate(target, proposer, x, NEW)
            assert torch.equal(out, ref), type(proposer.proposer).__name__


@pytest.mark.parametrize("mode,knob", [("chain", "gamma"), ("tree", "depth"), ("tree", None)])
def test_eagle_chain_and_eagle2_tree_keep_the_targets_greedy_tokens(mode, knob):
    m = method(1)
    x = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    proposer = AdaptiveGamma(m.proposer(mode=mode, gamma=4, top_k=3, depth=4, total_tokens=10), STEEP,
                             plain_step_s=1e-3, knob=knob, decay=0.5)
    out, _ = speculative_generate(m.target.model, proposer, x, 24, eos_token_id=[])
    assert torch.equal(out, plain_generate(m.target.model, x, 24, eos_token_id=[])[0])


@pytest.mark.parametrize("knob", ["gamma", None], ids=["knob", "cut"])
def test_sampled_output_has_the_targets_distribution(knob):
    target, draft = build(vocab=6), build(seed=1, vocab=6)
    proposer = AdaptiveGamma(DraftModel(draft, 6, gamma=3), STEEP, knob=knob, decay=0.5)
    chi2, critical = chi2_two_tokens(target, proposer)
    assert chi2 < critical
    assert len(set(proposer.gammas)) > 1  # the length did change between steps


class Oracle(Proposer):
    """Drafts up to `gamma` tokens of the target's own continuation, the first `right` of them correct."""

    def __init__(self, continuation: torch.Tensor, right: int, gamma: int = 8):
        self.ref, self.right, self.gamma = continuation, right, gamma

    def propose(self, ids, sampling):
        draft = self.ref[ids.numel(): ids.numel() + self.gamma].clone()
        draft[self.right:] = (draft[self.right:] + 1) % V
        return DraftTree.chain(draft)


@pytest.mark.parametrize("right,expected", [(8, {8}), (0, {0, 1}), (2, {2, 3})], ids=["always", "never", "two"])
def test_depth_follows_the_acceptance(right, expected):
    """A drafter that is always right drafts the longest chain; one never right a single token, or none when its
    estimate falls below the 5% a drafted token adds to a verification; one right
    twice drafts 2, and now and then 3: the unobserved third position drifts back to its prior and is tried again."""
    target = build()
    x = prompt(4)
    ref = target.generate(x, max_new_tokens=120, min_new_tokens=120, do_sample=False)[0]
    flat = {1: 1.0, 16: 1.0 + 15 * 0.05}  # a verification costs 5% more per extra token
    proposer = AdaptiveGamma(Oracle(ref, right), flat, knob="gamma")
    out, _ = speculative_generate(target, proposer, x, 100)
    assert torch.equal(out, ref[None, : out.shape[1]])
    assert set(proposer.gammas[-6:]) <= expected, proposer.gammas


def test_positions_that_short_drafts_stop_observing_keep_their_rate():
    """Copy-like acceptance (prompt lookup's): once the first drafted token is right, the rest are. While first tokens
    are wrong the wrapper drafts short or not at all, and positions 2+ keep the rate they last showed (a prior of
    position 1's rate forgot them), so right first tokens bring back the long drafts."""
    target = build()
    x = prompt(4)
    ref = target.generate(x, max_new_tokens=150, min_new_tokens=150, do_sample=False)[0]
    flat = {1: 1.0, 16: 1.0 + 15 * 0.05}
    oracle = Oracle(ref, right=8)
    proposer = AdaptiveGamma(oracle, flat, knob="gamma")
    out, _ = speculative_generate(target, proposer, x, 50)
    oracle.right = 0
    out, _ = speculative_generate(target, proposer, out, 50)
    a = proposer.acceptance()
    assert a[0] < 0.3 and min(a[1:]) > 0.6, a
    oracle.right, start = 8, len(proposer.gammas)
    out, _ = speculative_generate(target, proposer, out, 40)
    assert torch.equal(out, ref[None, : out.shape[1]])
    assert 8 in proposer.gammas[start:], proposer.gammas[start:]


class Slow(Oracle):
    """An Oracle right on its first token whose every drafted level costs 10 ms more."""

    def propose(self, ids, sampling):
        time.sleep(0.01 * self.gamma)
        return super().propose(ids, sampling)


def test_a_drafter_that_costs_more_than_it_saves_stops_drafting_and_the_output_stays_the_targets():
    """Priced in 1 ms target forwards, a 10 ms draft level never pays for the token it saves: the wrapper drafts
    nothing for most steps (plain steps through the decoder) and tries a draft now and then."""
    target = build()
    x = prompt(4)
    ref = target.generate(x, max_new_tokens=60, min_new_tokens=60, do_sample=False)[0]
    proposer = AdaptiveGamma(Slow(ref, right=1, gamma=4), STEEP, plain_step_s=1e-3, knob="gamma")
    out, _ = speculative_generate(target, proposer, x, 60)
    assert torch.equal(out, ref[None])
    assert proposer.c() > 5
    assert proposer.gammas.count(0) > 0.7 * len(proposer.gammas) and max(proposer.gammas) >= 1, proposer.gammas


class SlowAccept(Oracle):
    """An Oracle whose accept costs 50 ms a step (like EAGLE's forward over the accepted tokens), 2 s after the
    prefill (like EAGLE's over the prompt)."""

    def __init__(self, continuation: torch.Tensor):
        super().__init__(continuation, right=8, gamma=1)

    def accept(self, ids, verified):
        time.sleep(2.0 if verified.tree is None else 0.05)


def test_the_drafting_cost_counts_the_drafters_accept_but_not_the_prefills():
    target = build()
    x = prompt(4)
    ref = target.generate(x, max_new_tokens=20, min_new_tokens=20, do_sample=False)[0]
    proposer = AdaptiveGamma(SlowAccept(ref), STEEP, plain_step_s=0.025, knob="gamma", max_gamma=1)
    speculative_generate(target, proposer, x, 12)  # 6 steps of one draft + the bonus
    # a: accept time per step in 25 ms forwards. Each step's accept sleeps 50 ms: 2, and the time Python and a loaded
    # machine add (up to 100 ms a step within the bound). Counting the prefill's 2 s would add ~9 (80 forwards decayed
    # by 0.9 over 6 steps).
    assert 2.0 <= proposer.a() < 6.0
    assert proposer.c() < 1.0  # proposing is quick: the sleep is in accept
    assert proposer.gammas == [1] * 6  # always right and cheap to propose: it drafts, though each step costs 3x


class SlowStart(Oracle):
    """An Oracle right on its first token whose every draft costs 20 ms however deep (as EAGLE's catch-up over the
    tokens committed since its last draft, or prompt lookup's search), and whose accept costs nothing."""

    def propose(self, ids, sampling):
        time.sleep(0.02)
        return super().propose(ids, sampling)


def test_a_fixed_cost_per_draft_is_priced_once_and_steps_that_draft_nothing_spare_it():
    """Drafts 1 to 4 deep cost 20 ms each, 2 forwards: the fitted line has that intercept and no slope, and most
    steps draft nothing (a one-token draft right once does not pay for 2 forwards)."""
    target = build()
    x = prompt(4)
    ref = target.generate(x, max_new_tokens=40, min_new_tokens=40, do_sample=False)[0]
    proposer = AdaptiveGamma(SlowStart(ref, right=1, gamma=4), STEEP, plain_step_s=0.01, knob="gamma")
    out, _ = speculative_generate(target, proposer, x, 40)
    assert torch.equal(out, ref[None])
    c0, c = proposer.drafting()
    assert 2.0 <= c0 + c < 4.0 and proposer.a() < 1.0
    for d in (1, 2, 3, 4, 1, 2, 3, 4):  # drafts of every depth, as adaptive explores them: the line is fitted
        proposer.fit = [s * proposer.decay + v for s, v in zip(proposer.fit, (1, d, d * d, 0.02, 0.02 * d), strict=True)]
    c0, c = proposer.drafting()
    assert c0 == pytest.approx(2.0, rel=0.1) and c == pytest.approx(0.0, abs=0.2)
    assert proposer.gammas.count(0) > 0.7 * len(proposer.gammas) and max(proposer.gammas) >= 1, proposer.gammas


class Narrow(Oracle):
    """A tree: the Oracle's path beside a wrong first token. Drafted up to 2 deep the path is right, deeper only on
    its first token, as an EAGLE-2 tree with a fixed node budget is narrower at every level the deeper it is."""

    def propose(self, ids, sampling):
        self.right = self.gamma if self.gamma <= 2 else 1
        path = super().propose(ids, sampling).tokens.tolist()
        return DraftTree.from_paths([path, [(path[0] + 1) % V]])[0]


def test_a_tree_depth_the_pooled_acceptance_overrates_is_corrected_by_what_it_measured():
    """Pooled over depths, position 2's acceptance mixes the right 2-deep trees with the wrong deeper ones, so the
    model alone keeps trying depths 3+; the measured tokens per step at each depth move it to 2."""
    target = build()
    x = prompt(4)
    ref = target.generate(x, max_new_tokens=150, min_new_tokens=150, do_sample=False)[0]
    flat = {1: 1.0, 16: 1.0 + 15 * 0.05}
    proposer = AdaptiveGamma(Narrow(ref, right=2, gamma=6), flat, knob="gamma")
    out, _ = speculative_generate(target, proposer, x, 150)
    assert torch.equal(out, ref[None, : out.shape[1]])
    late = proposer.gammas[len(proposer.gammas) // 2:]
    assert late.count(2) >= 0.7 * len(late), proposer.gammas
