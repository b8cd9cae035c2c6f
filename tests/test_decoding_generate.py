"""The decode loop on tiny random models: greedy output equals `generate(do_sample=False)` for every
proposer and architecture, mock proposers that always / never / sometimes agree, EOS and length stops,
and the hidden states handed to proposers."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from draftsmith.decoding import (
    DraftModel,
    DraftTree,
    Lookahead,
    NoDraft,
    PromptLookup,
    Proposer,
    Sampling,
    SuffixDecoding,
    load_proposer,
    speculative_generate,
)
from draftsmith.decoding.proposers import check_same_tokenizer

V = 96
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
              pad_token_id=None)
CONFIGS = {
    "llama": lambda: T.LlamaConfig(**COMMON),
    "qwen2": lambda: T.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen2_full": lambda: T.Qwen2Config(**COMMON),  # full attention with q/k/v biases: decoding/lean.py
    "qwen3": lambda: T.Qwen3Config(**COMMON, head_dim=8),
    "mistral": lambda: T.MistralConfig(**COMMON, sliding_window=8),
    "mistral_full": lambda: T.MistralConfig(**COMMON, sliding_window=None),
    "gemma2": lambda: T.Gemma2Config(**COMMON, head_dim=8, sliding_window=8),
    "gemma3": lambda: T.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=8, sliding_window_pattern=2),
    "gpt2": lambda: T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                 eos_token_id=None, bos_token_id=None),
}
NEW = 24


def build(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    return T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()


def reference(model, x: torch.Tensor, new: int = NEW, **kw) -> torch.Tensor:
    return model.generate(x, max_new_tokens=new, do_sample=False, **kw)


def prompt(seed: int, length: int = 10) -> torch.Tensor:
    """Random tokens with a repeated stretch, so that n-gram proposers find matches."""
    x = torch.randint(0, V, (length,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([x, x[:4], x])[None]


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_greedy_equals_generate_for_every_proposer(arch):
    target = build(arch)
    draft = build(arch, seed=1)  # a different random model: it mostly disagrees, which must not matter
    x = prompt(0)
    ref = reference(target, x, min_new_tokens=NEW)
    for proposer in (NoDraft(), PromptLookup(), SuffixDecoding(), SuffixDecoding(max_children=3), Lookahead(),
                     DraftModel(draft, V, gamma=3)):
        out, stats = speculative_generate(target, proposer, x, NEW)
        assert torch.equal(out, ref), f"{arch} {type(proposer).__name__}"
        assert stats.new_tokens == NEW and stats.tau >= 1


def test_a_truncated_copy_of_the_target_drafts_well():
    target = build("llama")
    draft = build("llama")
    draft.model.layers = draft.model.layers[:1]
    x = prompt(3)
    out, stats = speculative_generate(target, DraftModel(draft, V, gamma=4), x, NEW)
    assert torch.equal(out, reference(target, x, min_new_tokens=NEW))
    assert stats.tau > 1.5 and stats.drafted <= 4 * stats.steps


class Oracle(Proposer):
    """Drafts gamma tokens of a known continuation, corrupting those at positions in `wrong_from` onwards."""

    def __init__(self, continuation: torch.Tensor, gamma: int, wrong_from: int):
        self.ref, self.gamma, self.wrong_from = continuation, gamma, wrong_from

    def propose(self, ids, sampling):
        draft = self.ref[ids.numel(): ids.numel() + self.gamma].clone()
        draft[self.wrong_from:] = (draft[self.wrong_from:] + 1) % V
        return DraftTree.chain(draft)


@pytest.mark.parametrize("wrong_from,tau,acceptance", [(4, 5.0, [1.0] * 4), (0, 1.0, [0.0]), (2, 3.0, [1.0, 1.0, 0.0])],
                         ids=["always", "never", "sometimes"])
def test_mock_proposers(wrong_from, tau, acceptance):
    target = build("llama")
    x = prompt(4)
    ref = reference(target, x, new=40, min_new_tokens=40)
    out, stats = speculative_generate(target, Oracle(ref[0], 4, wrong_from), x, int(tau) * 8)
    assert torch.equal(out, ref[:, : x.shape[1] + int(tau) * 8])
    assert stats.tau == tau and stats.steps == 8 and stats.acceptance_by_position() == acceptance
    assert stats.lengths == {int(tau): 8} and stats.accepted == (int(tau) - 1) * 8


def test_eos_stops_exactly_where_plain_decoding_stops():
    target = build("qwen3")
    x = prompt(5)
    ref = reference(target, x, min_new_tokens=NEW)[0, x.shape[1]:]
    eos = int(ref[12])
    expected = reference(target, x, eos_token_id=eos)
    assert expected.shape[1] < x.shape[1] + NEW  # the stop is real
    for proposer in (Oracle(torch.cat([x[0], ref]), 5, 5), PromptLookup(), SuffixDecoding(max_children=2), Lookahead()):
        out, _ = speculative_generate(target, proposer, x, NEW, eos_token_id=eos)
        assert torch.equal(out, expected), type(proposer).__name__
        assert int(out[0, -1]) == eos and (out[0, x.shape[1]:-1] != eos).all()


def test_sampling_path_with_top_k_1_is_greedy():
    target, draft = build("gemma2"), build("gemma2", seed=1)
    x = prompt(6)
    for rule in ("exact", "typical"):
        out, _ = speculative_generate(target, DraftModel(draft, V, gamma=3), x, NEW, Sampling(1.0, top_k=1), rule)
        assert torch.equal(out, reference(target, x, min_new_tokens=NEW)), rule


def test_sampling_is_reproducible_with_a_seeded_generator():
    target, draft = build("llama"), build("llama", seed=1)
    runs = [speculative_generate(target, DraftModel(draft, V, 3), prompt(7), NEW,
                                 Sampling(1.0, generator=torch.Generator().manual_seed(9)))[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and runs[0].shape[1] == prompt(7).shape[1] + NEW


class Recorder(Proposer):
    """Checks the protocol: hidden rows cover the tokens the target cached, in order."""

    hidden_layers = (1, -1)

    def reset(self):
        self.rows = []

    def propose(self, ids, sampling):
        return DraftTree.from_paths([[int(ids[-1])], [3, 4]])[0]

    def accept(self, ids, verified):
        self.rows.append(verified.hidden)
        assert verified.hidden.shape[1] == (ids.numel() - 1 - sum(r.shape[1] for r in self.rows[:-1]))


def test_proposers_receive_hidden_states_of_every_committed_token():
    target, rec = build("llama"), Recorder()
    out, _ = speculative_generate(target, rec, prompt(8), 12)
    hidden = torch.cat(rec.rows, 1)  # [2, T-1, H]
    with torch.no_grad():
        fresh = target(input_ids=out, output_hidden_states=True).hidden_states
    torch.testing.assert_close(hidden, torch.stack([fresh[1][0, :-1], fresh[-1][0, :-1]]), atol=1e-5, rtol=1e-4)


def test_bad_inputs_fail_clearly():
    target = build("llama")
    with pytest.raises(ValueError, match="batch size 1"):
        speculative_generate(target, NoDraft(), torch.zeros(2, 3, dtype=torch.long), 4)

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    with pytest.raises(ValueError, match="share the target tokenizer"):
        check_same_tokenizer(Tok({"a": 0}), Tok({"b": 0}), "draft")
    with pytest.raises(ValueError, match="'ngram'"):
        load_proposer("no/such/dir", target)


class Checked(Proposer):
    """Wraps a DraftModel; every proposal must equal the draft model's greedy chain computed without a cache."""

    def __init__(self, inner: DraftModel):
        self.inner, self.proposals = inner, 0

    def reset(self):
        self.inner.reset()

    def propose(self, ids, sampling):
        tree = self.inner.propose(ids, sampling)
        seq = ids.clone()
        with torch.no_grad():
            for tok in tree.tokens.tolist():
                assert tok == int(self.inner.model(input_ids=seq[None]).logits[0, -1].argmax())
                seq = torch.cat([seq, torch.tensor([tok])])
        self.proposals += 1
        return tree


def test_draft_model_cache_rollback_matches_a_fresh_forward():
    target, draft = build("llama"), build("llama", seed=1)
    checked = Checked(DraftModel(draft, V, gamma=3))
    for seed in (9, 10):  # two sequences: reset between them must clear the draft cache
        out, _ = speculative_generate(target, checked, prompt(seed), NEW)
        assert torch.equal(out, reference(target, prompt(seed), min_new_tokens=NEW))
    assert checked.proposals >= 2 * NEW // 4


@pytest.mark.slow
def test_compiled_verify_step_gives_the_same_tokens():
    """`compile=True` (torch.compile of the verify forward, dynamic shapes): same greedy tokens for chains and
    trees, and the same tokens as eager decoding at T=1 with the same seed."""
    target = build("llama")
    x = prompt(0)
    ref = reference(target, x, min_new_tokens=NEW)
    for proposer in (PromptLookup(), Lookahead()):
        out, _ = speculative_generate(target, proposer, x, NEW, compile=True)
        assert torch.equal(out, ref), type(proposer).__name__
    sampled = [speculative_generate(target, PromptLookup(), x, NEW, Sampling(1.0, generator=torch.Generator()
                                    .manual_seed(3)), compile=c)[0] for c in (False, True)]
    assert torch.equal(*sampled)
