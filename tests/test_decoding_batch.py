"""Several prompts decoded together (`generate_batch`): the same tokens as decoding each alone and as the target's
own greedy decoding, for chains and EAGLE-2 trees, prompts of different lengths finishing at different rounds; the
same pooled statistics at T=0; the target's distribution at T=1 (chi-square); one target forward per round; the
serial fallback where the forward cannot be shared; and evaluate(batch=...) reporting the batch-1 figures."""

from __future__ import annotations

import pytest
import torch
from conftest import chi2_two_tokens
from test_decoding_adaptive import build
from test_eagle import method

from draftsmith.decoding import DraftModel, NoDraft, PromptLookup, Sampling, speculative_generate
from draftsmith.decoding.evaluate import evaluate
from draftsmith.decoding.generate import generate_batch
from draftsmith.decoding.lean import LeanForward
from draftsmith.decoding.metrics import DecodeStats

V, NEW = 96, 20
KEYS = ("sequences", "steps", "new_tokens", "drafted", "accepted", "reached", "passed", "lengths")


def prompts(vocab: int = V) -> list[torch.Tensor]:
    """Different lengths, one of a single token (no prefill), some repetitive (long drafts accepted)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (9, 1, 4, 13, 6):
        x = torch.randint(0, vocab, (n,), generator=g)
        out.append((torch.cat([x, x]) if n in (9, 13) else x)[None])
    return out


def counts(stats: DecodeStats) -> dict:
    return {k: getattr(stats, k) for k in KEYS}


def ragged_widths(monkeypatch, target) -> list[int]:
    """A list that receives the number of sequences of every forward of the target's `LeanForward` from now on."""
    widths: list[int] = []
    ragged = LeanForward.ragged

    def counted(self, queries):
        if self.body is target.base_model:  # not a draft model's own lean forward
            widths.append(len(queries))
        return ragged(self, queries)
    monkeypatch.setattr(LeanForward, "ragged", counted)
    return widths


def setup(name: str):
    """(target, a function making a fresh proposer)."""
    if name in ("draft_model", "gemma3_draft_model", "prompt_lookup"):
        arch = "gemma3" if name.startswith("gemma3") else "llama"  # Gemma-3: sliding-window layers, window 8
        draft = build(arch, seed=1)
        return build(arch), (lambda: PromptLookup(4)) if name == "prompt_lookup" else (lambda: DraftModel(draft, V, 3))
    m = method(3) if name == "eagle2_tree" else method(1)
    kw = dict(mode="tree", top_k=3, depth=4, total_tokens=10) if name == "eagle2_tree" else dict(gamma=4)
    return m.target.model, lambda: m.proposer(**kw)


@pytest.mark.parametrize("name", ["draft_model", "gemma3_draft_model", "prompt_lookup", "eagle2_tree", "eagle_chain"])
def test_batched_tokens_and_statistics_equal_the_serial_ones_and_the_targets(name, monkeypatch):
    target, fresh = setup(name)
    xs = prompts()
    ref = [target.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, x.shape[1]:] for x in xs]
    eos = int(ref[2][5])  # prompt 2 stops early at this token, other prompts wherever they produce it
    serial = [DecodeStats() for _ in xs]
    alone = [speculative_generate(target, fresh(), x, NEW, eos_token_id=eos, stats=s)[0]
             for x, s in zip(xs, serial, strict=True)]
    widths = ragged_widths(monkeypatch, target)
    batched, stats = generate_batch(target, [fresh() for _ in xs], xs, NEW, eos_token_id=eos)
    for x, r, a, b in zip(xs, ref, alone, batched, strict=True):
        stop = int((r == eos).nonzero()[0, 0]) + 1 if (r == eos).any() else NEW
        assert torch.equal(a, b) and torch.equal(b[0], torch.cat([x[0], r[:stop]])), name
    assert len({s.steps for s in serial}) > 1  # the sequences finish at different rounds
    pooled = DecodeStats()
    for s in serial:
        pooled.merge(s)
    assert counts(stats) == counts(pooled) and stats.steps > 0
    assert widths == [len(xs) - 1] + [  # one prefill forward for the prompts longer than a token, then per round
        sum(s.steps > r for s in serial) for r in range(max(s.steps for s in serial))]  # the unfinished ones


def test_the_forward_is_not_shared_where_the_target_is_not_lean(monkeypatch):
    target, draft = build("gemma2"), build("gemma2", seed=1)
    xs = prompts()
    widths = ragged_widths(monkeypatch, target)
    batched, stats = generate_batch(target, [DraftModel(draft, V, 3) for _ in xs], xs, NEW)
    assert not widths and stats.sequences == len(xs)
    for x, b in zip(xs, batched, strict=True):
        assert torch.equal(b, target.generate(x, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False))


def test_one_proposer_per_sequence_is_required():
    target, p = build(), PromptLookup()
    with pytest.raises(ValueError, match="one proposer instance per prompt"):
        generate_batch(target, [p, p], prompts()[:2], 4)
    with pytest.raises(ValueError, match="function making a fresh proposer"):
        evaluate(target, p, prompts(), 4, batch=2)


def test_sampled_batched_output_has_the_targets_distribution():
    target, draft = build(vocab=6), build(seed=1, vocab=6)
    chi2, critical = chi2_two_tokens(target, lambda: DraftModel(draft, 6, gamma=3), batch=10)
    assert chi2 < critical


def test_evaluate_in_batches_reports_the_batch_1_figures(monkeypatch):
    target, draft = build(), build(seed=1)
    keys = ("tau", "acceptance_by_position", "accept_length_histogram", "target_forwards", "new_tokens",
            "greedy_matches_target")
    one = evaluate(target, DraftModel(draft, V, 3), prompts(), NEW, check_greedy=True)
    widths = ragged_widths(monkeypatch, target)
    three = evaluate(target, lambda: DraftModel(draft, V, 3), prompts(), NEW, check_greedy=True, batch=3)
    assert {k: three[k] for k in keys} == {k: one[k] for k in keys} and three["greedy_matches_target"]
    assert max(widths) == 3 and three["settings"]["batch"] == 3 and three["speedup"] > 0


def test_plain_decoding_in_a_batch_is_the_targets():
    target, xs = build(), prompts()
    outs, stats = generate_batch(target, [NoDraft() for _ in xs], xs, NEW,
                                 [Sampling(1.0, generator=torch.Generator().manual_seed(i)) for i in range(len(xs))])
    assert stats.tau == 1 and stats.new_tokens == NEW * len(xs)
    alone = [speculative_generate(target, NoDraft(), x, NEW, Sampling(1.0, generator=torch.Generator().manual_seed(i)))[0]
             for i, x in enumerate(xs)]
    assert all(torch.equal(a, b) for a, b in zip(alone, outs, strict=True))  # each sequence keeps its own draws
