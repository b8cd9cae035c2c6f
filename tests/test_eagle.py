"""EAGLE-1 / EAGLE-3: the training-time test sees what serving sees, losses and masks, the draft vocabulary,
lossless decoding (chain and EAGLE-2 tree), checkpoints and the recipe entry points."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import chi2_two_tokens, randomise, script, train_steps
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.data.core import collate
from draftsmith.decoding import cache as kv
from draftsmith.decoding.generate import plain_generate, speculative_generate
from draftsmith.decoding.proposers import Verified
from draftsmith.decoding.tree import DraftTree
from draftsmith.decoding.verify import Sampling, accept_exact
from draftsmith.models.eagle import Eagle, ForwardKL, draft_vocab, later_positions, load_eagle
from draftsmith.models.eagle_config import EagleConfig, aux_layers, default_aux_layers
from draftsmith.models.eagle_drafter import TTTPast, additive, ttt_attention
from draftsmith.models.eagle_proposer import EagleProposer
from draftsmith.models.registry import load_proposer as decoder_load_proposer
from draftsmith.models.target import Target, load_target
from draftsmith.train import config as C
from draftsmith.train.config import ConfigError

V = 96


def tiny_target(vocab: int = V, layers: int = 4, seed: int = 0) -> Target:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None))
    return Target(model.eval().requires_grad_(False), None, "tiny")


def method(version: int, ttt_steps: int = 3, draft_ids=None, target=None, seed: int = 1, **kw) -> Eagle:
    target = target or tiny_target()
    torch.manual_seed(seed)
    m = Eagle(target, EagleConfig(version=version, ttt_steps=ttt_steps, **kw), draft_ids)
    randomise(m.drafter)
    return m.eval()


def batch(b: int = 2, s: int = 12, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, s), generator=g)
    return {"input_ids": ids, "loss_mask": torch.ones(b, s, dtype=torch.long),
            "position_ids": torch.arange(s).expand(b, s)}


@pytest.mark.parametrize("version,kw", [(1, {}), (3, {}), (3, {"aux_layers": [2], "fuse_weight": 1.0}),
                                        (3, {"num_layers": 2})])
def test_training_time_test_step_k_equals_what_the_proposer_computes(version, kw):
    """Step k's output at position t is the drafter output decoding computes after feeding the target features
    of positions 0..t and then its own outputs for k drafted tokens (here the data tokens). A single captured layer
    is H wide: fc applies to neither (as in the engines), also when a regression reads the fused input."""
    m = method(version, ttt_steps=4, **kw)
    bt = batch(b=1, s=10)
    outs = []
    m.drafter.register_forward_hook(lambda mod, args, out: outs.append(out[0]))
    m.ttt(bt)
    ids = bt["input_ids"][0]
    f, g = m.features(bt)  # [1, s, H], [1, s, n*H]
    for t in (2, 5):
        p = m.proposer()
        p.reset()
        # the proposer's cache after committing ids[: t + 2]: entries (feature at p, token p+1) for p = 0..t
        hidden = g[0, : t + 1].reshape(t + 1, len(p.hidden_layers), -1).permute(1, 0, 2)  # [k, t+1, H]
        p.accept(ids[: t + 2], Verified(None, [], None, hidden))
        # float32 through 1 + k random layers, summed in another order: agreement to ~1e-4 of outputs of O(1)
        torch.testing.assert_close(p.last, outs[0][t], atol=5e-4, rtol=5e-4)
        h = p.last
        for k in range(1, 4):  # draft step k feeds token x_{t+1+k} with the previous output, at position t+k
            visible = torch.ones(1, p.n + k, dtype=torch.bool)
            h = p._step(ids[t + 1 + k: t + 2 + k], h[None], torch.tensor([t + k]), visible)[0]
            torch.testing.assert_close(h, outs[k][t], atol=5e-4, rtol=5e-4)


@pytest.mark.parametrize("version,mode", [(1, "chain"), (3, "tree")])
def test_entries_of_steps_that_drafted_nothing_are_fed_at_the_next_draft_in_one_forward(version, mode):
    """Steps that draft nothing (adaptive gamma's depth 0) leave the drafter alone; the next draft's catch_up feeds
    every entry committed since in one forward, to the state and the draft that feeding them step by step gives."""
    m = method(version, draft_ids=torch.arange(0, V, 3) if version == 3 else None)
    bt = batch(b=1, s=12)
    ids, (_, g) = bt["input_ids"][0], m.features(bt)
    eager, lazy = (m.proposer(mode=mode, gamma=3, top_k=2, depth=3, total_tokens=6) for _ in range(2))
    hidden = g[0, :11].reshape(11, len(eager.hidden_layers), -1).permute(1, 0, 2)  # [k, 11, H]: positions 0..10
    step = DraftTree.empty()  # what the verifier passes after a step (None after the prefill)
    for a, b in [(0, 5), (5, 7), (7, 8), (8, 11)]:  # the prefill's 5 entries, then steps committing 2, 1, 3
        seen = Verified(None if a == 0 else step, [], None, hidden[:, a:b])
        eager.accept(ids[: b + 1], seen)
        drafts = [eager.propose(ids[: b + 1], Sampling())]  # drafts (and grows its cache past the committed entries)
        lazy.accept(ids[: b + 1], seen)
    assert lazy.n == 5 and len(lazy.pending) == 3  # the prompt's entries are fed at once, the steps' are not
    drafts.append(lazy.propose(ids, Sampling()))
    assert lazy.n == eager.n == 11 and not lazy.pending
    torch.testing.assert_close(lazy.last, eager.last, atol=1e-5, rtol=1e-5)
    assert torch.equal(drafts[0].tokens, drafts[1].tokens) and torch.equal(drafts[0].parents, drafts[1].parents)
    lazy.accept(ids, Verified(step, [], None, hidden[:, 8:]))  # entries already fed: not after a verification
    with pytest.raises(RuntimeError, match="accept was not called after every verification"):
        lazy.catch_up(ids)


def test_packed_rows_do_not_leak_across_examples():
    m = method(3)
    bt = batch(b=1, s=12)
    packed = {**bt, "position_ids": torch.cat([torch.arange(5), torch.arange(7)])[None]}
    alone = {k: v[:, 5:] for k, v in bt.items()}
    alone["position_ids"] = torch.arange(7)[None]
    outs = []
    m.drafter.register_forward_hook(lambda mod, args, out: outs.append(out[0]))
    m.ttt(packed)
    m.ttt(alone)
    # the online tap is block-diagonal too, so the second example's step-k outputs agree position by position
    for k in range(3):
        torch.testing.assert_close(outs[k][5:12 - k - 1], outs[3 + k][: 7 - k - 1], atol=1e-5, rtol=1e-5)


def test_eagle3_loss_is_soft_cross_entropy_on_the_draft_vocab_with_out_of_vocab_argmax_masked():
    target = tiny_target()
    bt = batch(b=1, s=8)
    draft_ids = torch.arange(0, V, 2)  # even tokens only
    m = method(3, ttt_steps=1, draft_ids=draft_ids, target=target)
    loss, metrics = m.ttt(bt)
    f, g = m.features(bt)
    logits = target.logits(f)[0]  # [s, V]
    out = m.drafter(target.embed(bt["input_ids"][:, 1:]), g[:, :-1], bt["position_ids"][:, :-1],
                    torch.zeros(1, 1, 7, 7).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf")),
                    None)
    draft = m.drafter.logits(out, target.lm_head)[0]  # [7, Vd]
    total, n = 0.0, 0
    for t in range(6):  # query t is trained on the target's distribution at t+1 (predicting x_{t+2})
        p = logits[t + 1]
        if int(p.argmax()) % 2:
            continue
        total += -(torch.softmax(p[draft_ids], -1) * torch.log_softmax(draft[t], -1)).sum()
        n += 1
    assert n > 0
    torch.testing.assert_close(loss, total / n, atol=1e-5, rtol=1e-5)
    assert metrics["loss_0"] == pytest.approx(loss.item(), rel=1e-5)


def test_eagle1_loss_combines_feature_regression_and_soft_cross_entropy():
    target = tiny_target()
    m = method(1, ttt_steps=1, target=target, feature_weight=1.0, token_weight=0.1)
    bt = batch(b=1, s=8)
    loss, _ = m.ttt(bt)
    f, _ = m.features(bt)
    mask = torch.zeros(1, 1, 7, 7).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    out = m.drafter(target.embed(bt["input_ids"][:, 1:]), f[:, :-1], bt["position_ids"][:, :-1], mask, None)[0]
    l1 = torch.nn.functional.smooth_l1_loss(out[:6], f[0, 1:7], reduction="none").mean(-1)
    ce = -(torch.softmax(target.logits(f[0, 1:7]), -1) * torch.log_softmax(target.logits(out[:6]), -1)).sum(-1)
    torch.testing.assert_close(loss, (l1 + 0.1 * ce).mean(), atol=1e-5, rtol=1e-5)


def test_eagle3_feature_weight_adds_smooth_l1_of_the_normed_output_against_the_next_features():
    """eagle.feature_weight on EAGLE-3: + w * SmoothL1(norm(h), f_{t+1}) over every valid position (the soft CE keeps
    its draft-vocabulary mask); EAGLE-3's default is 0, EAGLE-1's 1."""
    target = tiny_target()
    bt = batch(b=1, s=8)
    draft_ids = torch.arange(0, V, 2)
    plain = method(3, ttt_steps=1, draft_ids=draft_ids, target=target)
    fw = method(3, ttt_steps=1, draft_ids=draft_ids, target=target, feature_weight=0.5)
    assert plain.cfg.feature_weight == 0.0 and method(1, ttt_steps=1, target=target).cfg.feature_weight == 1.0
    f, g = fw.features(bt)
    mask = torch.zeros(1, 1, 7, 7).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    out = fw.drafter(target.embed(bt["input_ids"][:, 1:]), g[:, :-1], bt["position_ids"][:, :-1], mask, None)[0]
    l1 = torch.nn.functional.smooth_l1_loss(fw.drafter.norm(out[:6]), f[0, 1:7], reduction="none").mean(-1)
    plain.drafter.load_state_dict(fw.drafter.state_dict())
    torch.testing.assert_close(fw.ttt(bt)[0], plain.ttt(bt)[0] + 0.5 * l1.mean(), atol=1e-5, rtol=1e-5)


def test_eagle3_input_weight_regresses_each_output_on_what_step_0_reads_one_position_on():
    """eagle.input_weight: + w * SmoothL1(h_t, fc(g_{t+1})) at the trained positions: the output the next unrolled
    step reads in place of the fused input, against that input. EAGLE-1 has no fused input."""
    target = tiny_target()
    bt = batch(b=1, s=8)
    draft_ids = torch.arange(0, V, 2)
    plain = method(3, ttt_steps=1, draft_ids=draft_ids, target=target, fc_norm=True)
    iw = method(3, ttt_steps=1, draft_ids=draft_ids, target=target, fc_norm=True, input_weight=0.5)
    f, g = iw.features(bt)
    mask = torch.zeros(1, 1, 7, 7).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    out = iw.drafter(target.embed(bt["input_ids"][:, 1:]), g[:, :-1], bt["position_ids"][:, :-1], mask, None)[0]
    fused = iw.drafter.fuse(g)[0]  # [8, H]
    kept = [t for t in range(6) if int(target.logits(f)[0, t + 1].argmax()) % 2 == 0]
    l1 = torch.nn.functional.smooth_l1_loss(out[kept], fused[[t + 1 for t in kept]], reduction="none").mean(-1)
    plain.drafter.load_state_dict(iw.drafter.state_dict())
    torch.testing.assert_close(iw.ttt(bt)[0], plain.ttt(bt)[0] + 0.5 * l1.mean(), atol=1e-5, rtol=1e-5)
    assert len(kept) > 0 and l1.mean() > 0
    with pytest.raises(ConfigError, match="input_weight"):
        EagleConfig(version=1, input_weight=1.0)


def test_eagle3_fuse_weight_regresses_the_fused_input_through_the_norm_on_the_target_feature():
    """eagle.fuse_weight: + w * SmoothL1(norm(fc(g_t)), f_t) at the positions whose step 0 trains (the next token
    loss-masked): the input step 0 reads, seen through the drafter's norm, against the target's final feature at
    the same position, which the feature regression makes the later steps' inputs (the drafter's own outputs)
    approach. EAGLE-1 reads f itself."""
    target = tiny_target()
    bt = batch(b=1, s=8)
    bt["loss_mask"][:, :3] = 0  # a prompt: positions 0 and 1 have no step-0 token to learn
    draft_ids = torch.arange(V)
    plain = method(3, ttt_steps=1, draft_ids=draft_ids, target=target, fc_norm=True, input_weight=0.5)
    fw = method(3, ttt_steps=1, draft_ids=draft_ids, target=target, fc_norm=True, input_weight=0.5, fuse_weight=2.0)
    plain.drafter.load_state_dict(fw.drafter.state_dict())
    f, g = fw.features(bt)
    l1 = torch.nn.functional.smooth_l1_loss(fw.drafter.norm(fw.drafter.fuse(g)), f, reduction="none").mean(-1)[0]
    torch.testing.assert_close(fw.ttt(bt)[0], plain.ttt(bt)[0] + 2.0 * l1[2:7].mean(), atol=1e-5, rtol=1e-5)
    assert l1[2:7].mean() > 0
    with pytest.raises(ConfigError, match="fuse_weight"):
        EagleConfig(version=1, fuse_weight=1.0)


@pytest.mark.parametrize("loss", ["tv", "lk"])
def test_eagle3_acceptance_losses_by_hand(loss):
    """Over the positions whose next token lies in the draft vocabulary (the KL's mask), q the draft softmax, p the
    target's softmax renormalised on the draft vocabulary: loss=tv is 1/2 sum |p - q| (1 - TV = acceptance at T=1
    against p); loss=lk is -log sum_v min(P_v, q_v) with P the target's whole distribution (LK's negative
    log-acceptance). The acceptance metric counts every trained position."""
    target = tiny_target()
    bt = batch(b=1, s=8)
    draft_ids = torch.arange(0, V, 2)
    kl = method(3, ttt_steps=1, draft_ids=draft_ids, target=target)
    m = method(3, ttt_steps=1, draft_ids=draft_ids, target=target, loss=loss)
    f, g = m.features(bt)
    logits = target.logits(f)[0]  # [s, V]
    mask = torch.zeros(1, 1, 7, 7).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    out = m.drafter(target.embed(bt["input_ids"][:, 1:]), g[:, :-1], bt["position_ids"][:, :-1], mask, None)
    q = torch.softmax(m.drafter.logits(out, target.lm_head)[0], -1)  # [7, Vd]
    kept = [t for t in range(6) if int(logits[t + 1].argmax()) % 2 == 0]
    accept = [torch.minimum(torch.softmax(logits[t + 1], -1)[draft_ids], q[t]).sum() for t in range(6)]
    if loss == "tv":
        want = sum(0.5 * (torch.softmax(logits[t + 1][draft_ids], -1) - q[t]).abs().sum() for t in kept) / len(kept)
    else:
        want = sum(-accept[t].log() for t in kept) / len(kept)
    value, metrics = m.ttt(bt)
    torch.testing.assert_close(value, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(kl.ttt(bt)[0], want)
    assert metrics["accept_0"] == pytest.approx(float(sum(accept) / 6), abs=1e-5)


@pytest.mark.parametrize("version", [1, 3])
def test_accept_is_the_temperature_1_acceptance_against_the_whole_vocabulary(version):
    """accept_0 = mean over valid positions of sum_v min(p_v, q_v), p the target's softmax over its whole vocabulary
    (not renormalised to the draft vocabulary), q the drafter's; EAGLE-1 (q over the whole vocabulary): 1 - TV."""
    target = tiny_target()
    bt = batch(b=1, s=8)
    m = method(version, ttt_steps=1, draft_ids=torch.arange(0, V, 2), target=target)
    f, g = m.features(bt)
    p = torch.softmax(target.logits(f)[0], -1)  # [s, V]
    mask = torch.zeros(1, 1, 7, 7).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    out = m.drafter(target.embed(bt["input_ids"][:, 1:]), g[:, :-1], bt["position_ids"][:, :-1], mask, None)
    q = torch.softmax(m.drafter.logits(out, target.lm_head)[0], -1)  # [7, Vd]
    ids = m.drafter.draft_ids
    want = sum(torch.minimum(p[t + 1][ids], q[t]).sum() for t in range(6)) / 6
    if version == 1:
        torch.testing.assert_close(want, 1 - 0.5 * sum((p[t + 1] - q[t]).abs().sum() for t in range(6)) / 6)
    else:  # bounded by the draft vocabulary's mass, unlike the same against p renormalised to the draft vocabulary
        assert want <= sum(p[t + 1][ids].sum() for t in range(6)) / 6 + 1e-6
        renormalised = sum(torch.minimum(torch.softmax(p[t + 1][ids].log(), -1), q[t]).sum() for t in range(6)) / 6
        assert renormalised > want + 0.2
    assert m.ttt(bt)[1]["accept_0"] == pytest.approx(want.item(), abs=1e-5)


@pytest.mark.parametrize("head_init", ["frozen", "trainable", "random"])
def test_eagle3_head_starts_from_the_targets_rows_picked_by_t2d(head_init):
    """frozen / trainable: lm_head row i is the target's head row of draft token i (t2d); frozen gets no gradient.
    The embedding is the target's and gets none either."""
    target = tiny_target()
    draft_ids = torch.tensor([3, 7, 8, 20, 41, 95])
    m = Eagle(target, EagleConfig(version=3, ttt_steps=2, head_init=head_init), draft_ids)
    head = m.drafter.lm_head.weight
    rows = target.lm_head.weight[m.drafter.t2d]  # the target's rows of the draft vocabulary, in id order
    assert torch.equal(head, rows) == (head_init != "random")
    m.train()
    m(batch())[0].backward()
    assert (head.grad is None) == (head_init == "frozen") and head.requires_grad == (head_init != "frozen")
    assert m.drafter.fc.weight.grad is not None and target.embed.weight.grad is None



def test_fc_norm_normalises_each_captured_layer_before_fc():
    """EAGLE 3.1: with fc_norm, scaling one captured layer's features leaves the drafter's output unchanged (RMSNorm
    per layer); without it, the output changes."""
    bt = batch(b=1, s=8)
    mask = torch.zeros(1, 1, 8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    for fc_norm in (True, False):
        m = method(3, fc_norm=fc_norm)
        g = m.features(bt)[1] * 100  # [1, s, 3H], well above the norms' eps
        scaled = torch.cat([g[..., :32] * 7.0, g[..., 32:]], -1)
        emb = m.target.embed(bt["input_ids"])
        a, b = (m.drafter(emb, x, bt["position_ids"], mask, None) for x in (g, scaled))
        assert torch.allclose(a, b, atol=1e-5) == fc_norm
    assert len(m.drafter.state_dict()) + 3 == len(method(3, fc_norm=True).drafter.state_dict())


def test_ttt_fraction_runs_the_later_steps_at_a_random_share_of_the_trained_positions(monkeypatch):
    """ttt_fraction: steps 1.. run (and train) at a random subset of the positions that train, with the outputs the
    full run gives there; step 0 is unchanged, and evaluation runs every position. Each row's subset follows from its
    tokens and the run's progress alone: the same in another batch order or padding (so 2 processes train as 1 with
    grad_accum 2), another at the next step."""
    import draftsmith.models.eagle as E
    chosen = []
    monkeypatch.setattr(E, "later_positions", lambda needed: chosen.append(later_positions(needed)) or chosen[-1])
    runs = []
    for fraction in (1.0, 0.3):
        m = method(3, ttt_steps=3, draft_ids=torch.arange(V), input_weight=1.0, ttt_fraction=fraction).train()
        outs = []
        m.drafter.register_forward_hook(lambda mod, args, out, outs=outs: outs.append(out))
        runs.append((m.ttt(batch(b=2, s=40))[1], outs, chosen[-1]))
    (full, full_outs, (t_all, keep_all)), (part, part_outs, (t, keep)) = runs
    assert full["loss_0"] == pytest.approx(part["loss_0"]) and part["loss_1"] != pytest.approx(full["loss_1"])
    assert 0.1 < keep.sum() / keep_all.sum() < 0.5
    for r in range(2):
        at = {int(u): i for i, u in enumerate(t_all[r][keep_all[r]])}  # position -> its index in the full run
        for i in keep[r].nonzero().flatten().tolist():
            for k in (1, 2):
                torch.testing.assert_close(part_outs[k][r, i], full_outs[k][r, at[int(t[r, i])]], atol=1e-5, rtol=1e-5)

    def subsets(bt: dict) -> list[set[int]]:
        m.ttt(bt)
        return [set(tr[kr].tolist()) for tr, kr in zip(*chosen[-1], strict=True)]
    bt = batch(b=2, s=40)
    longer = batch(b=1, s=48, seed=1)  # a longer row first, the two padded after it
    padded = {k: torch.cat([longer[k], torch.nn.functional.pad(bt[k], (0, 8))]) for k in bt}
    padded["attention_mask"] = (torch.arange(48) < torch.tensor([[48], [40], [40]])).long()
    first = subsets(bt)
    assert subsets({k: v.flip(0) for k, v in bt.items()}) == first[::-1] and subsets(padded)[1:] == first
    m.progress = lambda: 0.5
    assert subsets(bt) != first
    chosen.clear()
    m.eval().ttt(batch(b=2, s=40))
    assert not chosen  # evaluation: every position
    with pytest.raises(ConfigError, match="ttt_fraction"):
        EagleConfig(ttt_fraction=0.0)


def test_ttt_ramp_grows_the_unrolled_steps_from_1_to_ttt_steps():
    m = method(3, ttt_steps=5, ttt_ramp=0.5).train()
    lengths = []
    for progress in (0.0, 0.1, 0.25, 0.49, 0.5, 0.9):
        m.progress = lambda progress=progress: progress
        lengths.append(m.ttt_length())
    assert lengths == [1, 1, 3, 4, 5, 5]
    m.progress = lambda: 0.25
    assert {k for k in m(batch())[1] if k.startswith("loss_")} == {"loss_0", "loss_1", "loss_2"}
    assert len([k for k in m.eval().ttt(batch())[1] if k.startswith("loss_")]) == 5  # evaluation: all steps
    assert method(3, ttt_steps=5).ttt_length() == 5  # constant by default


@pytest.mark.parametrize("version,loss", [(3, "kl"), (3, "tv"), (3, "lk"), (1, "kl")])
@pytest.mark.parametrize("logit_chunk,loss_chunk", [(5, None), (5, 0), (0, 4)])
def test_chunked_logits_give_the_same_loss_and_gradients(version, loss, logit_chunk, loss_chunk):
    """Chunks of 5 or 4 positions (not dividing the sequence) for the teacher's logits and/or the draft loss against
    the whole sequence at once: same loss, metrics, gradients."""
    results = []
    for chunks in ({"logit_chunk": 0}, {"logit_chunk": logit_chunk, "loss_chunk": loss_chunk}):
        m = method(version, ttt_steps=3, draft_ids=torch.arange(0, V, 3), loss=loss, **chunks).train()
        value, metrics = m.ttt(batch(b=2, s=13))
        value.backward()
        results.append((value, metrics, {n: p.grad for n, p in m.drafter.named_parameters() if p.requires_grad}))
    (a, ma, ga), (b, mb, gb) = results
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert ma.keys() == mb.keys() and all(ma[k] == pytest.approx(mb[k], abs=1e-5) for k in ma)
    assert ga.keys() == gb.keys()
    for n in ga:
        scale = float(ga[n].abs().max())  # gradients up to ~10 here; float32 sums in another order (recomputed
        assert float((ga[n] - gb[n]).abs().max()) <= 2e-3 * max(1.0, scale), n  # chunks) agree to ~1e-3 of that


@pytest.mark.parametrize("version", [1, 3])
def test_training_runs_the_head_at_the_trained_positions_alone_with_the_same_loss(version):
    """Training gathers the positions the loss trains (a prompt, a packed row's seam, a target argmax outside the
    draft vocabulary are not) before the head, and runs the steps after step 0 at the positions a later step trains
    (rows of unequal counts padded); evaluation runs everything everywhere and masks: the same loss and gradients."""
    bt = batch(b=2, s=13)
    bt["loss_mask"][:, :4] = 0  # a prompt
    bt["loss_mask"][1, 7:10] = 0  # a longer one in the second sequence of row 1
    bt["position_ids"] = torch.cat([torch.arange(6), torch.arange(7)]).expand(2, 13)  # two packed sequences a row
    results = []
    for mode in ("train", "eval"):
        m = getattr(method(version, ttt_steps=3, draft_ids=torch.arange(0, V, 3)), mode)()
        value, _ = m.ttt(bt, 3)
        value.backward()
        results.append((value, {n: p.grad for n, p in m.drafter.named_parameters() if p.requires_grad}))
    (a, ga), (b, gb) = results
    assert a.item() > 0
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert ga.keys() == gb.keys()
    for n in ga:  # float32 sums in another order: as in the chunked-logits test
        assert float((ga[n] - gb[n]).abs().max()) <= 2e-3 * max(1.0, float(ga[n].abs().max())), n


def test_ttt_attention_is_the_cached_attention_with_an_identity_block_per_later_step():
    """Step k's queries at positions t read step 0's keys causally and their own position's key of each step 1..k:
    ttt_attention scores those as one dot product per step, to the output of the layer's attention over a cache of
    every step's keys under the mask of identity blocks (GQA here: 4 heads on 2 KV heads)."""
    m = method(3)
    d, attn = m.drafter, m.drafter.midlayer.self_attn
    b, s, n = 2, 9, 4
    g = torch.Generator().manual_seed(0)
    seq = torch.tensor([[0] * 5 + [1] * 4, [0] * 9])  # [b, s] row 0 packs two sequences
    causal = (seq[:, :, None] == seq[:, None, :]) & torch.ones(s, s, dtype=torch.bool).tril()  # [b, s, s]
    t = torch.stack([torch.randperm(s, generator=g)[:n].sort().values for _ in range(b)])  # [b, n] later steps' queries
    past, cache = TTTPast(), kv.new_cache()
    for k in range(3):
        q_at = torch.arange(s).expand(b, s) if k == 0 else t  # [b, m]
        x = torch.randn(b, q_at.shape[1], attn.q_proj.in_features, generator=g)  # [b, m, 2H]
        rope = d.rotary(x, q_at + k)
        visible = causal.gather(1, q_at[..., None].expand(-1, -1, s))  # [b, m, s]
        mask = torch.cat([visible] + [torch.eye(n, dtype=torch.bool).expand(b, n, n)] * k, -1)  # [b, m, s + k n]
        want = attn(x, position_embeddings=rope, attention_mask=additive(mask)[:, None], cache=cache)[0]
        torch.testing.assert_close(ttt_attention(attn, x, rope, visible, past), want, atol=1e-5, rtol=1e-5)


def rebuilt(x):
    """What DeepSpeed ZeRO-3's forward hooks hand a module: every list and tuple argument a new one."""
    return type(x)(rebuilt(y) for y in x) if isinstance(x, (list, tuple)) else x


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_training_time_test_survives_hooks_that_rebuild_list_arguments(training):
    """Under ZeRO-3 every module's forward gets its list arguments rebuilt; the keys of earlier steps must still
    reach the later ones (they were lost, and the later steps' shorter queries failed against step 0's mask)."""
    m = method(3, ttt_steps=3)
    m.train(training)
    bt = batch(b=2, s=13)
    bt["loss_mask"][:, :5] = 0  # later steps run on fewer positions than step 0 in training
    want = m.ttt(bt)
    for module in m.drafter.modules():
        module.register_forward_pre_hook(lambda mod, args: rebuilt(args))
    got = m.ttt(bt)
    torch.testing.assert_close(got[0], want[0])
    assert got[1] == want[1]


@pytest.mark.parametrize("loss", ["kl", "lk"])
def test_steps_that_are_not_measuring_skip_the_acceptance_metrics_with_the_same_loss(loss):
    """The loop logs the metrics of some steps alone; a training step that is not `measuring` returns loss_k alone,
    with the same loss and gradients (lk's loss reads the acceptance it then does not report)."""
    bt = batch(b=2, s=13)
    results = []
    for measuring in (True, False):
        m = method(3, ttt_steps=3, draft_ids=torch.arange(0, V, 3), loss=loss).train()
        m.measuring = measuring
        value, metrics = m.ttt(bt, 3)
        value.backward()
        results.append((value, metrics, [p.grad for p in m.drafter.parameters() if p.requires_grad]))
    (a, ma, ga), (b, mb, gb) = results
    assert {"acc_2", "cond_acc_2", "accept_2"} <= ma.keys() and sorted(mb) == ["loss_0", "loss_1", "loss_2"]
    assert a.item() > 0 and torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))


def test_forward_kl_has_log_softmax_value_and_gradient():
    """The fused loss against -sum p log_softmax(z) under autograd, including a row with no teacher mass (an
    untrained position): value, q and the gradient."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 11, generator=g, dtype=torch.double, requires_grad=True)
    p = torch.softmax(torch.randn(2, 3, 11, generator=g, dtype=torch.double), -1)
    p[1, 2] = 0
    w = torch.randn(2, 3, generator=g, dtype=torch.double)  # an upstream gradient that is not all ones
    d, q = ForwardKL.apply(z, p)
    (grad,) = torch.autograd.grad((d * w).sum(), z)
    ref = -(p * torch.log_softmax(z, -1)).sum(-1)
    (ref_grad,) = torch.autograd.grad((ref * w).sum(), z)
    torch.testing.assert_close(d, ref)
    torch.testing.assert_close(q, torch.softmax(z, -1).detach())
    torch.testing.assert_close(grad, ref_grad)
    assert not q.requires_grad


def test_loss_mask_selects_the_predicted_tokens():
    m = method(3, ttt_steps=2)
    bt = batch(b=1, s=10)
    masked = {**bt, "loss_mask": torch.zeros_like(bt["loss_mask"])}
    assert m.ttt(masked)[0].item() == 0.0
    only = {**bt, "loss_mask": torch.zeros_like(bt["loss_mask"])}
    only["loss_mask"][0, 6] = 1  # token 6 is predicted by step 0 at t=4 and step 1 at t=3
    _, metrics = m.ttt(only)
    assert metrics["loss_0"] > 0 and metrics["loss_1"] > 0


def test_conditional_acceptance_conditions_on_accepted_greedy_prefixes():
    """Draft logits forced right or wrong at known positions: acc_k counts every valid position, cond_acc_1 only
    those where step 0 was right and the data token fed to step 1 is the target's greedy token."""
    m = method(3, ttt_steps=2)
    s = 16
    prompts = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([plain_generate(m.target.model, p[None], s - 4, eos_token_id=[])[0] for p in prompts])  # [2, s]
    ids[0, 11] = (ids[0, 11] + 1) % V  # one fed token that is not the target's greedy choice
    bt = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "position_ids": torch.arange(s).expand(2, s)}
    with torch.no_grad():
        greedy = m.target.logits(m.features(bt)[0]).argmax(-1)  # [b, s] the target's next token at each position
    g = torch.Generator().manual_seed(2)
    right = [torch.rand(2, s, generator=g) < 0.6 for _ in range(2)]  # step k drafts correctly where right[k]
    calls = []

    def forced(out, head):  # step k at query t is judged against the target's greedy token at t + 1 + k
        k = len(calls)
        calls.append(k)
        want = torch.cat([greedy[:, 1 + k:], greedy.new_zeros(2, 1 + k)], 1)  # [b, s]
        token = torch.where(right[k], want, (want + 1) % V)
        return (torch.nn.functional.one_hot(token, V).float() * 10).reshape(*out.shape[:-1], V)  # every position, in order

    m.drafter.logits = forced
    _, metrics = m.eval().ttt(bt)  # evaluation: the head runs at every position (training: at the trained ones)
    t = torch.arange(s)
    for k in range(2):
        valid = (t + k + 2 < s).expand(2, s)  # the label token x_{t+k+2} exists
        assert metrics[f"acc_{k}"] == pytest.approx(right[k][valid].float().mean().item(), abs=1e-6)
    fed = torch.zeros(2, s, dtype=torch.bool)
    fed[:, : s - 2] = ids[:, 2:] == greedy[:, 1:-1]  # step 1 reads x_{t+2}: the greedy token after t+1?
    cond = (t + 3 < s).expand(2, s) & right[0] & fed
    assert cond.sum() > 3
    assert metrics["cond_acc_1"] == pytest.approx(right[1][cond].float().mean().item(), abs=1e-6)
    assert metrics["cond_acc_0"] == metrics["acc_0"]


def test_draft_vocab_is_the_most_frequent_masked_tokens_and_d2t_t2d_agree():
    rows = [{"input_ids": [5, 5, 5, 7, 7, 9, 1], "loss_mask": [0, 1, 1, 1, 1, 1, 0]},
            {"input_ids": [3, 3, 3, 3], "loss_mask": [0, 0, 0, 1]}]
    ids = draft_vocab(rows, 12, 3)
    assert ids.tolist() == [3, 5, 7]  # 5 x2, 7 x2, then 3 and 9 tie at 1: the lower id wins; sorted by id
    m = method(3, draft_ids=ids, target=tiny_target(vocab=V))
    d = m.drafter
    assert d.d2t.dtype == torch.int64 and d.t2d.dtype == torch.bool
    assert (torch.arange(3) + d.d2t).tolist() == [3, 5, 7] and d.t2d.nonzero().flatten().tolist() == [3, 5, 7]


def test_default_aux_layers_follow_the_eagle_repository():
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(8) == [2, 4, 5]
    assert default_aux_layers(6) == [1, 2, 3] and default_aux_layers(4) == [1, 2, 3]
    last_three = EagleConfig(aux_layers=[-4, -3, -2])  # as Python indexes the L + 1 hidden states
    assert aux_layers(last_three, 8) == [5, 6, 7] and aux_layers(last_three, 4) == [1, 2, 3]
    assert Eagle(tiny_target(layers=4), last_three).layers == [1, 2, 3]
    with pytest.raises(ConfigError, match="aux_layers"):
        Eagle(tiny_target(layers=4), EagleConfig(aux_layers=[-6, 1, 2]))
    with pytest.raises(ConfigError, match="repeats"):
        Eagle(tiny_target(layers=4), EagleConfig(aux_layers=[1, 1, 2]))
    with pytest.raises(ConfigError, match="aux_layers"):
        Eagle(tiny_target(layers=4), EagleConfig(aux_layers=[1, 9]))
    with pytest.raises(ConfigError, match="only EAGLE-3"):
        EagleConfig(version=1, aux_layers=[1])


@pytest.mark.parametrize("version,mode,layers", [(1, "chain", 1), (3, "chain", 1), (1, "tree", 1), (3, "tree", 1),
                                                 (3, "chain", 2), (3, "tree", 2)])
def test_greedy_decoding_equals_the_targets_own(version, mode, layers):
    m = method(version, draft_ids=torch.arange(0, V, 3) if version == 3 else None, num_layers=layers)
    prompt = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(1))
    p = m.proposer(mode=mode, gamma=4, top_k=3, depth=3, total_tokens=10)
    spec, stats = speculative_generate(m.target.model, p, prompt, 24, eos_token_id=[])
    plain, _ = plain_generate(m.target.model, prompt, 24, eos_token_id=[])
    assert torch.equal(spec, plain) and stats.new_tokens == 24


def test_a_trained_drafter_is_accepted_in_chain_and_tree():
    """A drafter trained on the target's own greedy text drafts it: chain and tree both reach tau > 3."""
    target = tiny_target(seed=2)
    target.lm_head.weight.data *= 10  # a peaked target, as trained ones are
    m = Eagle(target, EagleConfig(version=3, ttt_steps=2, head_init="random"), None)  # the whole drafter learns
    prompt = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8] * 3])
    with torch.no_grad():
        text, _ = plain_generate(target.model, prompt, 40, eos_token_id=[])
    bt = {"input_ids": text, "loss_mask": torch.ones_like(text), "position_ids": torch.arange(text.shape[1])[None]}
    metrics = train_steps(m, m.ttt, bt)
    assert metrics["acc_0"] > 0.9 and metrics["cond_acc_1"] > 0.9
    for mode in ("chain", "tree"):
        spec, stats = speculative_generate(target.model, m.proposer(mode=mode, gamma=4, top_k=2, depth=4,
                                                                    total_tokens=8), prompt, 40, eos_token_id=[])
        assert torch.equal(spec, text) and stats.tau > 3, (mode, stats.tau)


def first_draft(m: Eagle, p: EagleProposer) -> DraftTree:
    """p's greedy draft after a fixed 6-token prompt, its features from m's target."""
    prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = m.target.model(prompt[None, :-1], output_hidden_states=True)
    p.reset()
    p.accept(prompt, Verified(None, [], None, torch.stack([out.hidden_states[i][0] for i in p.hidden_layers])))
    return p.propose(prompt, Sampling())


def test_tree_keeps_the_best_total_tokens_nodes_closed_under_ancestors():
    m = method(3)
    p = m.proposer(mode="tree", top_k=4, depth=4, total_tokens=12)
    tree = first_draft(m, p)
    assert len(tree) == 12 and tree.depth.max() >= 2
    assert (tree.parents < torch.arange(12)).all()
    assert p.cache.get_seq_length() > p.n  # drafted entries sit in the cache until the next accept crops them


@pytest.mark.parametrize("layers", [1, 2])
def test_the_greedy_tree_holds_the_chains_draft_however_unsure_q_is(layers):
    """An untrained drafter's q is near uniform, so its best 6 nodes are all within depth 2; the tree still holds
    the chain proposer's 4 tokens as a path, so a greedy tree accepts at least what a chain as deep would."""
    m = method(3, draft_ids=torch.arange(0, V, 3), num_layers=layers)
    chain = first_draft(m, m.proposer(mode="chain", gamma=4))
    tree = first_draft(m, m.proposer(mode="tree", top_k=4, depth=4, total_tokens=6))
    assert len(tree) == 6 and tree.depth.max() == 4
    node = -1
    for x in chain.tokens.tolist():  # down the tree along the chain's tokens (next() fails where a child is missing)
        node = next(i for i in tree.children(node) if tree.tokens[i] == x)


def test_a_sampled_tree_draws_in_the_draft_vocabulary_and_records_each_q_over_the_targets():
    """Sampling a tree works in the draft vocabulary; each kept node's q is a distribution over the target's
    vocabulary, zero outside the draft's, with the node's token in its support."""
    draft_ids = torch.tensor([0, 2, 3, 5])
    m = method(3, target=tiny_target(vocab=6, layers=2), draft_ids=draft_ids)
    p = m.proposer(mode="tree", top_k=3, depth=3, total_tokens=8)
    prompt = torch.tensor([[1, 4, 2, 3]])
    p.reset()
    with torch.no_grad():
        out = m.target.model(prompt[:, :-1], output_hidden_states=True)
    p.accept(prompt[0], Verified(None, [], None, torch.stack([out.hidden_states[i][0] for i in p.hidden_layers])))
    tree = p.propose(prompt[0], Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0)))
    assert tree.q.shape == (len(tree), 6) and torch.allclose(tree.q.sum(-1), torch.ones(len(tree)))
    outside = torch.ones(6, dtype=torch.bool)
    outside[draft_ids] = False
    assert (tree.q[:, outside] == 0).all() and (tree.q[torch.arange(len(tree)), tree.tokens] > 0).all()
    for c in range(len(tree)):  # siblings keep their draw order; a later one's q has the earlier draws removed
        for e in range(c):
            if tree.parents[e] == tree.parents[c]:
                assert tree.q[c, tree.tokens[e]] == 0 and tree.q[e, tree.tokens[c]] > 0


def test_a_sampled_tree_is_shaped_by_each_draws_chance_of_acceptance():
    """At T=1 the j-th draw at a node is the accepted child with chance prod_{i<j} (1 - a_i) a_j, a_j learnt
    from the verifications: with a_0 high a budget of `depth` nodes buys the chain of first draws, with a_0 low
    the root's draws; and the verifications teach a_0."""
    target = tiny_target(seed=2)
    target.lm_head.weight.data *= 10  # a peaked target
    m = method(3, target=target)
    m.drafter.lm_head.weight.data.zero_()  # a uniform q
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = m.target.model(prompt[:, :-1], output_hidden_states=True)
    sampling = Sampling(temperature=1.0, generator=torch.Generator().manual_seed(0))

    def tree(first: list[float] | None = None) -> list[int]:
        p = m.proposer(mode="tree", top_k=3, depth=4, total_tokens=4)
        p.draws[0] = first or p.draws[0]
        p.accept(prompt[0], Verified(None, [], None, torch.stack([out.hidden_states[i][0] for i in p.hidden_layers])))
        parents = p.propose(prompt[0], sampling).parents.tolist()
        assert parents == p.shape()  # the shape is drawn in full (q has every token)
        return parents
    assert tree() == [-1, 0, 1, 2]  # a_j 0.7 before any verification: 0.7^4 > 0.3 * 0.7
    assert tree([0.01, 1.0]).count(-1) == 3  # a_0 0.01: the root's draws first
    p = m.proposer(mode="tree", top_k=3, depth=4, total_tokens=8)
    speculative_generate(target.model, p, prompt, 24, sampling, eos_token_id=[])
    assert p.draws[0][1] > 10 and p.draws[0][0] / p.draws[0][1] < 0.6  # uniform q on a peaked p: below 0.7
    assert p.draws[1][1] > 4  # a second draw is tested after each rejected first one


def test_a_sampled_tree_keeps_the_targets_distribution_where_a_q_scored_one_did_not():
    """The first token out of a sampled tree, drawn many times from a fixed q against a fixed p: chi-square
    against p. Scoring a later draw by its own q (EAGLE-2's way) kept the root's
    second draw when it was the likelier of the two tokens left and dropped it when it was the rarer one; that
    skewed the output (token 0 came out at 0.20 against p's 0.32, chi-square 125 over 2,000 draws here)."""
    q, p = torch.tensor([0.031, 0.07, 0.899]), torch.tensor([0.316, 0.674, 0.01])
    drafter = SimpleNamespace(draft_ids=torch.arange(3), t2d=torch.ones(3, dtype=torch.bool))
    proposer = EagleProposer(drafter, None, None, (), mode="tree", top_k=2, depth=2, total_tokens=3)
    proposer._step = lambda tokens, h, positions, visible: torch.zeros(tokens.numel(), 4)  # noqa: ARG005
    proposer._draft_logits = lambda h: q.log().expand(h.shape[0], 3)
    proposer.last, proposer.n = torch.zeros(4), 5
    g = torch.Generator().manual_seed(0)
    counts, trials, widths = torch.zeros(3), 2000, set()
    for _ in range(trials):
        tree = proposer.propose(torch.zeros(6, dtype=torch.long), Sampling(temperature=1.0, generator=g))
        widths.add(tree.parents.tolist().count(-1))
        path, bonus = accept_exact(tree, p.expand(len(tree) + 1, 3), g)
        counts[int(tree.tokens[path[0]]) if path else bonus] += 1
    assert float(((counts - p * trials) ** 2 / (p * trials)).sum()) < 13.8  # chi-square, 2 dof, 1e-3
    assert widths == {2}  # the root's two draws every time (the shape does not depend on what was drawn)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampled_output_has_the_targets_distribution(mode):
    """Two tokens after a fixed prompt, drawn many times: chi-square against the target's exact distribution."""
    m = method(3, target=tiny_target(vocab=6, layers=2), draft_ids=torch.tensor([0, 2, 3, 5]))
    m.drafter.lm_head.weight.data *= 4  # a peaked q: a second sibling's renormalised q differs a lot from q
    chi2, critical = chi2_two_tokens(m.target.model, m.proposer(mode=mode, gamma=2, top_k=3, depth=2, total_tokens=6))
    assert chi2 < critical


@pytest.mark.parametrize("version,kw", [(1, {}), (3, {}), (3, {"num_key_value_heads": 4}), (3, {"num_layers": 2})],
                         ids=["eagle1", "eagle3", "eagle3-kv4", "eagle3-2-layers"])
def test_checkpoint_round_trip_and_decoder_loading(tmp_path, version, kw):
    m = method(version, draft_ids=torch.arange(10, 60) if version == 3 else None, **kw)
    m.save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "drafter.json").read_text())
    assert meta["method"] == "eagle" and meta["version"] == version
    back = load_eagle(tmp_path, m.target)
    assert back.drafter.config.num_key_value_heads == kw.get("num_key_value_heads", 2)  # 2: the target's
    assert back.drafter.config.num_hidden_layers == len(back.drafter.additional_layers) + 1 == kw.get("num_layers", 1)
    for k, v in m.drafter.state_dict().items():
        assert torch.equal(v, back.drafter.state_dict()[k]), k
    proposer = decoder_load_proposer(str(tmp_path), m.target.model, gamma=3)
    assert isinstance(proposer, EagleProposer) and proposer.hidden_layers == tuple(m.layers or (-1,))
    prompt = torch.randint(0, V, (1, 5))
    spec, _ = speculative_generate(m.target.model, proposer, prompt, 10, eos_token_id=[])
    assert torch.equal(spec, plain_generate(m.target.model, prompt, 10, eos_token_id=[])[0])


def test_key_value_heads_that_do_not_divide_the_targets_heads_are_refused():
    with pytest.raises(ConfigError, match=r"num_key_value_heads=3 does not divide the target's 4 attention heads"):
        method(3, num_key_value_heads=3)


# ---- the recipes ------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent




def run_recipe(entry: str, recipe: str, target: Path, out: Path, *extra: str):
    return script(entry).main(["--config", str(REPO / recipe), f"target.path={target}", f"loop.output_dir={out}",
                               "data.limit=40", "data.max_length=160", "data.cache=false", "eval.heldout_examples=12",
                               "eval.num_prompts=2", "eval.max_new_tokens=8", "loop.batch_size=2", "loop.log_every=1",
                               "loop.max_steps=4", "loop.save_every=2", "loop.lr=3e-3", *extra])


@pytest.mark.parametrize("version,draft_ids", [(1, None), (3, torch.arange(0, V, 3))])
def test_heldout_metrics_from_kept_target_features_equal_those_from_target_forwards(version, draft_ids):
    """The checkpoint evaluation runs the target over the held-out rows once (`heldout_batches`); every later
    evaluation's metrics equal those of running the target again."""
    entry, m = script("train/eagle.py"), method(version, 3, draft_ids)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, V, (n,), generator=g).tolist(), "loss_mask": [0] * 3 + [1] * (n - 3)}
            for n in (14, 9, 12, 7, 10)]  # ragged: padded batches
    online = entry.heldout_metrics(m, [collate(rows[i: i + 2]) for i in range(0, len(rows), 2)], 4)
    batches = entry.heldout_batches(m, rows, batch_size=2)
    assert {"hidden", "aux", "log_z", "greedy"} & set(batches[0]) == ({"hidden"} if version == 1 else
                                                                       {"hidden", "aux", "log_z", "greedy"})
    kept = entry.heldout_metrics(m, batches, 4)
    assert kept.keys() == online.keys() and "heldout_cond_acc_3" in kept
    assert kept == pytest.approx(online, abs=1e-5)


def test_shipped_recipes_parse():
    entry = script("train/eagle.py")
    assert C.load(entry.Recipe, REPO / "recipes/eagle/tiny-code.yaml").eagle.version == 1
    cfg = C.load(entry.Recipe, REPO / "recipes/eagle3/tiny-code.yaml")
    assert cfg.eagle.version == 3 and cfg.eagle.ttt_steps == 5 and cfg.loop.best_metric == "tau"
    with pytest.raises(C.ConfigError, match="did you mean"):
        C.load(entry.Recipe, REPO / "recipes/eagle3/tiny-code.yaml", ["eagle.ttt_step=3"])


@pytest.mark.parametrize("entry,recipe,mode", [("train/eagle.py", "recipes/eagle/tiny-code.yaml", "chain"),
                                               ("train/eagle3.py", "recipes/eagle3/tiny-code.yaml", "tree")])
def test_recipe_trains_measures_tau_and_keeps_a_loadable_best(entry, recipe, mode, tiny_chat_target, tmp_path):
    run_recipe(entry, recipe, tiny_chat_target, tmp_path / "run", f"eval.mode={mode}", "eagle.ttt_steps=3",
               "eagle.draft_vocab_size=200")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/tau" in r]
    assert len(evals) == 2 and all(r["eval/tau"] >= 1 and "eval/heldout_cond_acc_2" in r for r in evals)
    assert all(1 <= r["eval/expected_tau"] <= 6 and "eval/heldout_cond_acc_4" in r for r in evals)  # gamma 5 steps
    best = tmp_path / "run" / "best"
    assert json.loads((best / "best.json").read_text())["tau"] == pytest.approx(max(r["eval/tau"] for r in evals),
                                                                      abs=1e-6)  # metrics.jsonl rounds to 6 places
    target = load_target(tiny_chat_target)
    proposer = decoder_load_proposer(str(best), target.model, mode=mode)
    ids = target.tokenizer("def f(x):\n    return", return_tensors="pt")["input_ids"]
    spec, _ = speculative_generate(target.model, proposer, ids, 12, eos_token_id=[])
    assert torch.equal(spec, plain_generate(target.model, ids, 12, eos_token_id=[])[0])


def test_a_run_started_from_another_keeps_its_draft_vocabulary(tiny_chat_target, tmp_path):
    """loop.init_from fine-tunes a trained EAGLE-3 drafter on other data: the head's rows stay the checkpoint's draft
    vocabulary, not the one the new data would pick."""
    quiet = ["eval.num_prompts=0", "loop.best_metric=", "eagle.ttt_steps=2", "eagle.draft_vocab_size=200",
             "loop.max_steps=2"]
    run_recipe("train/eagle3.py", "recipes/eagle3/tiny-code.yaml", tiny_chat_target, tmp_path / "a", *quiet)
    run_recipe("train/eagle3.py", "recipes/eagle3/tiny-code.yaml", tiny_chat_target, tmp_path / "fresh", *quiet,
               "data.limit=6")
    init = tmp_path / "a" / "checkpoint-2"
    run_recipe("train/eagle3.py", "recipes/eagle3/tiny-code.yaml", tiny_chat_target, tmp_path / "b", *quiet,
               "data.limit=6", f"loop.init_from={init}")

    def vocab(run):
        return json.loads((run / "checkpoint-2" / "state.json").read_text())["method"]["draft_ids"]
    assert vocab(tmp_path / "b") == vocab(tmp_path / "a") != vocab(tmp_path / "fresh")
    with pytest.raises(C.ConfigError, match=r"has a draft vocabulary of 200 tokens; set eagle.draft_vocab_size=200"):
        run_recipe("train/eagle3.py", "recipes/eagle3/tiny-code.yaml", tiny_chat_target, tmp_path / "c", *quiet,
                   f"loop.init_from={init}", "eagle.draft_vocab_size=100")


@pytest.mark.parametrize("layers", [[2], [1, 2, 3]])
def test_a_training_step_runs_under_bf16_autocast(layers):
    """The loop's bf16 autocast: the masked scores take the fill value of their own (autocast) dtype, which q's
    (float32 after RoPE) is not."""
    m = method(3, aux_layers=layers).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = m(batch())
    loss.backward()
    assert torch.isfinite(loss) and sum(p.grad.abs().sum() for p in m.drafter.parameters() if p.grad is not None) > 0
