"""Suffix decoding: the trie's counts, proposals on hand-made sequences, the memory cap, and lossless decoding
on the reference target (greedy equality; its greedy tau on the held-out prompts beats no draft)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.decoding import Sampling, SuffixDecoding, load_proposer, plain_generate, speculative_generate
from draftsmith.decoding.suffix import SuffixTrie


def propose(proposer: SuffixDecoding, text: list[int]) -> list[tuple[int, int]]:
    tree = proposer.propose(torch.tensor(text), Sampling())
    return list(zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True))


def test_trie_counts_every_substring_up_to_max_depth():
    trie = SuffixTrie(max_depth=3, max_nodes=100)
    for t in [1, 2, 1, 2, 3]:
        trie.append(t)

    def count(*path):
        node = 0
        for t in path:
            node = trie.children[node][t]
        return trie.count[node]

    assert count(1) == 2 and count(2) == 2 and count(3) == 1
    assert count(1, 2) == 2 and count(2, 1) == 1 and count(2, 3) == 1 and count(1, 2, 3) == 1
    assert 4 not in trie.children[trie.children[trie.children[0][1]][2]]  # no substring longer than 3 was stored
    assert all(trie.depth[n] <= 3 for n in range(len(trie)))


def test_proposes_the_most_frequent_continuation_of_the_longest_match():
    # "5 6" was followed by 7 twice and by 9 once; the context ends in "4 5 6", which occurred once, followed by 9
    text = [5, 6, 7, 8, 5, 6, 7, 8, 4, 5, 6, 9, 1, 4, 5, 6]
    chain = SuffixDecoding(max_spec=3, min_prob=0.0)
    assert propose(chain, text) == [(9, -1), (1, 0), (4, 1)]  # the longest match wins: "4 5 6" -> 9 1 4
    chain = SuffixDecoding(max_spec=2, min_prob=0.0, max_depth=3)  # room for 2 draft tokens: match "6" only
    assert propose(chain, text) == [(7, -1), (8, 0)]  # "6" was followed by 7 twice, by 9 once; "6 7" by 8
    assert propose(SuffixDecoding(), [1, 2, 3, 4]) == []  # nothing occurred twice


def test_tree_holds_the_likely_alternatives_and_min_prob_prunes():
    text = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9, 2, 5, 6]  # after "5 6": 7 (twice) then 8 5 6, or 9 (once) then 2
    tree = propose(SuffixDecoding(max_spec=6, min_prob=0.2, max_children=2), text)
    assert tree[:4] == [(7, -1), (8, 0), (5, 1), (6, 2)]  # p = 2/3 all along the frequent branch
    assert tree[4] == (9, -1) and len(tree) == 6  # then the alternative first child, p = 1/3
    assert all(p < i for i, (_, p) in enumerate(tree))
    pruned = propose(SuffixDecoding(max_spec=6, min_prob=0.5, max_children=2), text)
    assert pruned == [(7, -1), (8, 0), (5, 1), (6, 2)]  # every other node has p = 1/3 < 0.5
    chain = propose(SuffixDecoding(max_spec=6, min_prob=0.0), text)
    assert [p for _, p in chain] == list(range(-1, len(chain) - 1))  # max_children=1: a chain


def test_memory_cap_is_honoured_and_recent_text_still_matches():
    trie = SuffixTrie(max_depth=8, max_nodes=2000)
    g = torch.Generator().manual_seed(0)
    stream = torch.randint(0, 50, (2000,), generator=g).tolist()
    peak = 0
    for t in stream:
        trie.append(t)
        peak = max(peak, len(trie))
    assert peak <= 2000
    assert len(trie.text) < 2000  # old text was dropped
    proposer = SuffixDecoding(max_spec=4, max_depth=8, max_nodes=2000, min_prob=0.0)
    text = stream + stream[-30:-20]  # the recent stretch repeats: it is still matched
    assert [t for t, _ in propose(proposer, text)][:3] == stream[-20:-17]
    assert len(proposer.trie) <= 2000


def test_load_proposer_spec():
    assert isinstance(load_proposer("suffix", None, max_spec=4), SuffixDecoding)
    with pytest.raises(ValueError, match="max_spec"):
        SuffixDecoding(max_spec=0)


def test_reference_target_greedy_equals_plain_and_drafts_are_accepted():
    from draftsmith.data.reference import load_prompts
    from draftsmith.decoding.evaluate import render_prompts
    from draftsmith.models.target import load_target

    target = load_target()
    prompts = render_prompts(target.tokenizer, load_prompts(limit=3))
    taus = []
    for x in prompts:
        for proposer in (SuffixDecoding(), SuffixDecoding(max_children=3)):
            out, stats = speculative_generate(target.model, proposer, x, 48)
            assert torch.equal(out, plain_generate(target.model, x, 48)[0])
            taus.append(stats.tau)
    assert max(taus) > 1.2  # code repeats itself: some drafts are accepted
