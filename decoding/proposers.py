"""Proposers: the drafting half of speculative decoding, one per drafter family.

The protocol (every drafter, trained or not, implements it and plugs into the same verifier):

    class MyProposer(Proposer):
        hidden_layers = (-1,)          # target hidden_states indices it wants (HF `output_hidden_states`
                                       # order: 0 = embeddings, i = after layer i, -1 = after the final norm)
        def reset(self): ...           # a new sequence starts
        def propose(self, ids, sampling) -> DraftTree: ...
        def accept(self, ids, verified): ...

- `propose(ids, sampling)`: ids [t] are all committed tokens; the last one, ids[-1], is the root
  of the tree (not yet in the target's cache). Return a `DraftTree` below it; a sampling drafter
  warps its logits with `verify.warp(logits, sampling)` and records, per node, the q it drew the
  node from (siblings drawn without replacement record the renormalised q).
- `accept(ids, verified)`: called once after the prefill (verified.tree is None) and after every
  verification, with ids = the committed tokens now. `verified.hidden` [k, m, H] holds the target's
  hidden states at `hidden_layers` for the m tokens the target just processed and kept: the prompt
  but its last token after the prefill, the root and the accepted path after a verification. Row j
  is the state at ids[t - 1 - m + j]: the last committed token (the bonus) has no state yet.
  `verified.logits[i]` is the target's logits row [V] at [root, nodes][i] (rows are computed on
  first access) and `verified.path` holds the accepted node indices.
- `catch_up(ids)` (optional): the drafter's work on the tokens committed since its last draft, which `propose`
  also does first; a wrapper that may skip drafting (decoding/adaptive.py) calls it before a draft, to time it.

How the trained drafters use it: Medusa takes hidden[-1, -1] (last hidden state, after the final norm,
at the last accepted position) and proposes its static tree below the bonus token. EAGLE-1/3 record the
features of all m newly committed positions (one layer or several concatenated) and, at the next draft,
extend their own KV cache with them in one forward, then draft a chain or (EAGLE-2) a dynamic tree.
Early exit (LayerSkip) drafts with the target's first E layers straight into the target's own KV cache
and, through the optional `target_forward(cache)` hook (see decoding/generate.py), verifies with only
layers [E:] for the tokens it already ran (the exit-query cache).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.core import DRAFTER_FILE
from draftsmith.decoding import cache as kv
from draftsmith.decoding.lean import lean_forward
from draftsmith.decoding.tree import DraftTree
from draftsmith.decoding.verify import Sampling, sample, warp


@dataclass
class Verified:
    """What the verifier tells the proposer after a forward (see the module docstring)."""

    tree: DraftTree | None  # None after the prefill
    path: list[int]  # accepted node indices, root to leaf
    logits: object | None  # target logits over [root, nodes]: logits[i] is row i [V] (computed on access)
    hidden: torch.Tensor | None  # [k, m, H] target hidden states of the m tokens just cached


class Proposer:
    """Base proposer: override `propose`; `reset` and `accept` are optional."""

    hidden_layers: tuple[int, ...] = ()

    def reset(self) -> None:
        """Forget the previous sequence."""

    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        raise NotImplementedError

    def accept(self, ids: torch.Tensor, verified: Verified) -> None:
        """Observe the verification result."""


class NoDraft(Proposer):
    """Drafts nothing: each step is one plain decoding step (the baseline)."""

    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        return DraftTree.empty(ids.device)


class DraftModel(Proposer):
    """A separate, smaller causal LM with the target's tokenizer drafts a chain of gamma tokens.

    It keeps its own KV cache; before drafting, the cache is cropped to the longest prefix it shares
    with the committed tokens (the drafter's rollback), and only the rest is fed.
    """

    def __init__(self, model, vocab_size: int, gamma: int = 5):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.model, self.vocab_size, self.gamma = model, vocab_size, gamma
        self.reset()

    @classmethod
    def from_pretrained(cls, path: str | Path, target, target_tokenizer=None, gamma: int = 5) -> DraftModel:
        """Load a draft model directory; its tokenizer must be the target's."""
        if target_tokenizer is not None and (Path(path) / "tokenizer_config.json").exists():
            check_same_tokenizer(AutoTokenizer.from_pretrained(path), target_tokenizer, str(path))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device).eval()
        return cls(model, target.config.get_text_config().vocab_size, gamma)

    def reset(self) -> None:
        self.cache = kv.new_cache()
        self.cached = torch.zeros(0, dtype=torch.long)  # tokens whose KV the draft cache holds
        self.lean = lean_forward(self.model) if self.model.device.type == "cpu" else None  # decoding/lean.py

    def _logits(self, feed: torch.Tensor) -> torch.Tensor:
        if self.lean is None:
            logits = self.model(input_ids=feed[None], cache=self.cache, use_cache=True).logits[0, -1]  # [V']
        else:  # the body, then the head over the last position only
            past = self.cache.get_seq_length()
            pos = torch.arange(past, past + feed.numel(), device=feed.device)[None]  # [1, f]
            h = self.lean(input_ids=feed[None], position_ids=pos, cache=self.cache).last_hidden_state[0, -1]  # [H]
            logits = self.lean.head(h[None])[0]  # [V']
        V = self.vocab_size
        if logits.numel() >= V:
            return logits[:V]
        return torch.cat([logits, logits.new_full((V - logits.numel(),), float("-inf"))])  # [V]

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        n = min(self.cached.numel(), ids.numel() - 1)
        same = (self.cached[:n].to(ids.device) == ids[:n]).tolist() + [False]
        common = same.index(False)
        kv.crop(self.cache, common)
        feed = ids[common:]  # [>= 1] committed tokens not yet in the draft cache
        tokens, qs = [], []
        for _ in range(self.gamma):
            x = draw(self._logits(feed), sampling, qs)
            tokens.append(x)
            feed = torch.tensor([x], device=ids.device)
        self.cached = torch.cat([ids.cpu(), torch.tensor(tokens[:-1], dtype=torch.long)])
        return DraftTree.chain(torch.tensor(tokens, device=ids.device), torch.stack(qs) if qs else None)


def draw(logits: torch.Tensor, sampling: Sampling, qs: list[torch.Tensor]) -> int:
    """The next drafted token from logits [V]: the argmax when greedy, else a sample from the warped q, which
    is appended to `qs` (the per-node q the exact verifier needs)."""
    if sampling.greedy:
        return int(logits.argmax())
    qs.append(warp(logits, sampling))  # [V]
    return sample(qs[-1], sampling.generator)


def truncated_copy(target, layers: int) -> torch.nn.Module:
    """The target cut after its first `layers` decoder layers (final norm and LM head kept).

    Built through the target's own class from its config with fewer layers (in its text config: a multimodal
    model keeps its other towers), so it runs the normal Hugging Face forward with its own KV cache; every weight is
    the target's own Parameter (shared, not copied), so it follows the target while that trains (LayerSkip) and
    costs no memory.
    """
    L = target.config.get_text_config().num_hidden_layers
    if not 1 <= layers < L:
        raise ValueError(f"exit layer {layers} must be in 1..{L - 1} for a {L}-layer target")
    config = copy.deepcopy(target.config)
    text = config.get_text_config()
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:layers]
    draft = type(target)(config)
    missing, _ = draft.load_state_dict(target.state_dict(keep_vars=True), strict=False, assign=True)
    if missing:
        raise ValueError(f"truncated copy: weights missing from the target: {missing[:3]}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.to(target.device).eval()


def check_same_tokenizer(draft_tok, target_tok, where: str) -> None:
    """A draft model must use the target's tokenizer token for token."""
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise ValueError(f"{where}: the draft model's tokenizer differs from the target's; a draft model must "
                         "share the target tokenizer (train it with the target's tokenizer)")


class PromptLookup(Proposer):
    """Prompt lookup decoding: find the last n-gram earlier in the context, propose what followed it.

    Same rule as transformers' `prompt_lookup_num_tokens`: n from max_ngram_size down to 1, first
    (leftmost) match with a continuation, up to num_pred_tokens tokens.
    """

    def __init__(self, num_pred_tokens: int = 10, max_ngram_size: int = 2):
        self.num_pred_tokens, self.max_ngram_size = num_pred_tokens, max_ngram_size

    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        t = ids.numel()
        for n in range(min(self.max_ngram_size, t - 1), 0, -1):
            windows = ids.unfold(0, n, 1)  # [t-n+1, n]
            for start in ((windows == ids[-n:]).all(1).nonzero().flatten() + n).tolist():
                end = min(start + self.num_pred_tokens, t)
                if start < end:
                    return DraftTree.chain(ids[start:end])
        return DraftTree.empty(ids.device)


class Lookahead(Proposer):
    """Lookahead decoding (Fu et al. 2024), greedy drafts: a Jacobi window plus an n-gram pool.

    Each step drafts the Jacobi window (W guessed tokens after the root) as one branch and up to G
    pooled n-grams that start with the root as others, all verified in the same forward. The
    target's argmax at every window node is the window's next Jacobi iterate, and the n-grams
    (window tokens x_{i-N+2..i}, target argmax after x_i) enter the pool. This is the one-level form
    of the lookahead branch: the window is fed once per step rather than as N-1 stacked levels.
    """

    def __init__(self, window: int = 7, ngram: int = 5, guesses: int = 7):
        if window < 1 or ngram < 2 or guesses < 0:
            raise ValueError("lookahead needs window >= 1, ngram >= 2, guesses >= 0")
        self.W, self.N, self.G = window, ngram, guesses
        self.reset()

    def reset(self) -> None:
        self.window: list[int] = []
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> continuations, newest first

    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        if not self.window:  # start from the context's own tokens
            self.window = (ids.tolist() * self.W)[-self.W:]
        self.root = int(ids[-1])
        paths = [self.window] + [list(g) for g in self.pool.get(self.root, [])[: self.G]]
        return DraftTree.from_paths(paths, ids.device)[0]

    def accept(self, ids: torch.Tensor, verified: Verified) -> None:
        if verified.tree is None:
            return
        tree, logits = verified.tree, verified.logits
        x, out, node = [self.root], [int(logits[0].argmax())], -1  # out[i]: target's next token after x[0..i]
        for tok in self.window:
            match = [c for c in tree.children(node) if int(tree.tokens[c]) == tok]
            if not match:
                break
            node = match[0]
            x.append(tok)
            out.append(int(logits[node + 1].argmax()))
        for i in range(self.N - 2, len(x)):
            gram = x[i - self.N + 2: i + 1] + [out[i]]
            bucket = self.pool.setdefault(gram[0], [])
            if tuple(gram[1:]) in bucket:
                bucket.remove(tuple(gram[1:]))
            bucket.insert(0, tuple(gram[1:]))
            del bucket[4 * self.G:]
        m = len(verified.path) + 1  # tokens committed: out[m] guesses the first position after them
        self.window = (out[m:] + self.window)[: self.W]


def load_proposer(spec: str, target, tokenizer=None, **kwargs) -> Proposer:
    """A proposer from a command-line spec: `ngram`, `suffix`, `lookahead`, `none`, `draft:DIR`, or the directory
    of a Hugging Face causal LM (used as a draft model). A trained drafter's directory (with drafter.json) is a
    method's plug-in: `draftsmith.models.registry.load_proposer` loads it and hands every other spec here.
    """
    if spec in ("ngram", "prompt_lookup"):
        return PromptLookup(**kwargs)
    if spec == "suffix":
        from draftsmith.decoding.suffix import SuffixDecoding

        return SuffixDecoding(**kwargs)
    if spec == "lookahead":
        return Lookahead(**kwargs)
    if spec == "none":
        return NoDraft()
    path = Path(spec.removeprefix("draft:"))
    if not path.is_dir():
        raise ValueError(f"drafter {spec!r}: not 'ngram', 'suffix', 'lookahead', 'none', 'draft:DIR' or an existing directory")
    if (path / DRAFTER_FILE).exists() and not spec.startswith("draft:"):
        raise ValueError(f"drafter {spec!r} is a trained drafter (drafter.json): load it with "
                         "draftsmith.models.registry.load_proposer")
    if (path / "config.json").exists():
        return DraftModel.from_pretrained(path, target, tokenizer, **kwargs)
    raise ValueError(f"drafter {spec!r}: the directory has neither drafter.json nor a model config.json")
