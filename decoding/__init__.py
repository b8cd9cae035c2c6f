"""draftsmith.decoding: the bundled speculative decoder.

    from draftsmith.decoding import speculative_generate, PromptLookup
    tokens, stats = speculative_generate(target, PromptLookup(), input_ids, max_new_tokens=128)
    print(stats.tau, stats.acceptance_by_position())

Modules: `tree` (draft trees, tree mask, position ids), `verify` (accept rules and sampling
warps), `cache` (KV rollback), `proposers` (the proposer protocol and the untrained drafters),
`suffix` (suffix decoding), `generate` (the decode loop), `metrics` (tau and acceptance statistics),
`evaluate` (held-out evaluation and the per-checkpoint evaluator).
"""

from draftsmith.decoding.generate import plain_generate, speculative_generate
from draftsmith.decoding.metrics import DecodeStats
from draftsmith.decoding.proposers import (
           DraftModel,
           Lookahead,
           NoDraft,
           PromptLookup,
           Proposer,
           Verified,
           load_proposer,
)
from draftsmith.decoding.suffix import SuffixDecoding
from draftsmith.decoding.tree import DraftTree
from draftsmith.decoding.verify import Sampling, verify, warp

__all__ = ["speculative_generate", "plain_generate", "DecodeStats", "Proposer", "Verified", "NoDraft", "DraftModel",
           "PromptLookup", "SuffixDecoding", "Lookahead", "load_proposer", "DraftTree", "Sampling", "verify", "warp"]
