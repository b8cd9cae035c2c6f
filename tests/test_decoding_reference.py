"""Greedy speculative decoding equals the reference target's own greedy decoding on 20 held-out prompts.

Needs the committed reference target (`models/reference-target`, built by train/target.py); skipped
only while it does not exist yet.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.reference import load_prompts
from draftsmith.decoding import DraftModel, Lookahead, PromptLookup, speculative_generate
from draftsmith.decoding.evaluate import render_prompts
from draftsmith.decoding.proposers import truncated_copy
from draftsmith.models.target import REFERENCE_TARGET

NEW = 32


@pytest.fixture(scope="module")
def target_and_prompts():
    target = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET).eval()
    prompts = render_prompts(AutoTokenizer.from_pretrained(REFERENCE_TARGET), load_prompts(limit=20))
    with torch.no_grad():
        refs = [target.generate(x, max_new_tokens=NEW, do_sample=False) for x in prompts]
    return target, prompts, refs


@pytest.mark.parametrize("name", ["prompt_lookup", "lookahead", "draft_model"])
def test_greedy_equals_target_generate_on_heldout_prompts(target_and_prompts, name):
    target, prompts, refs = target_and_prompts
    assert len(prompts) == 20
    proposer = {"prompt_lookup": PromptLookup, "lookahead": Lookahead,
                "draft_model": lambda: DraftModel(truncated_copy(target, 2), target.config.vocab_size, 4)}[name]()
    taus = []
    for x, ref in zip(prompts, refs, strict=True):
        out, stats = speculative_generate(target, proposer, x, NEW)
        assert torch.equal(out, ref)
        taus.append(stats.tau)
    assert min(taus) >= 1.0
