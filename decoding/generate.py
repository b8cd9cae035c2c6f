"""The decode loop: draft a tree, verify it in one target forward, commit, roll the cache back.

    tokens, stats = speculative_generate(target, proposer, input_ids, max_new_tokens=64)

Any Hugging Face causal LM works as the target (but one whose layers keep a recurrent state, refused in
one line: `cache.rollback_refusal`): the tree is scored through the model's normal forward with a 4-D
additive mask (a dict of masks per layer type for models with sliding-window or chunked-attention
layers) and explicit position ids; on a CPU, covered architectures run the same modules through
`lean.LeanForward`, without Hugging Face's per-forward machinery (`decoder_forward`). Batch size 1:
`generate_batch` decodes several prompts in rounds whose verifications share one target forward, each
sequence otherwise exactly as alone (one per-sequence step, `_Sequence`, serves both).

Counting (the EAGLE / Medusa / Spec-Bench convention): the prompt's last token is not prefilled
but fed as the root of the first verification, so every target forward after the prefill is a
verification that commits `accepted + 1` tokens (the +1 is the bonus token). tau = new tokens /
verification forwards; the prefill forward is counted in neither. A step cut short by EOS or
max_new_tokens counts the tokens it actually committed, so plain decoding has tau = 1 exactly.

A proposer whose draft already ran part of the target (LayerSkip's early exit) may offer the hook
`proposer.target_forward(cache) -> forward | None`, called once per sequence with the target's KV
cache: the returned forward replaces the target's forward in verification, takes the same keyword
arguments and returns `last_hidden_state` (after the final norm; architectures in PLAIN_HEAD only),
to which the decoder applies the head (lazily on a CPU, whole on a GPU). Such a proposer may extend
the cache while drafting; `kv.keep` then rolls every layer back to the committed prefix as usual.
"""

from __future__ import annotations

import time
import weakref

import torch

from draftsmith.decoding import cache as kv
from draftsmith.decoding.lean import LeanForward, lean_forward
from draftsmith.decoding.metrics import DecodeStats
from draftsmith.decoding.proposers import NoDraft, Proposer, Verified
from draftsmith.decoding.tree import layout, tree_attention_mask
from draftsmith.decoding.verify import Sampling, verify

# Architectures whose causal-LM head is exactly lm_head (+ Gemma's final logit soft-capping), read from
# their transformers source; for these the decoder applies the head lazily. Others run their full forward.
PLAIN_HEAD = {"llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma2", "gemma3_text"}


def lazy_head(target, device: torch.device) -> bool:
    """Whether the decoder runs the target's body alone and its head lazily (`LazyLogits`): on a CPU."""
    return target.config.model_type in PLAIN_HEAD and device.type == "cpu"


def decoder_forward(target, device: torch.device, compile: bool = False):
    """What the decoder runs per forward: with a lazy head the body alone, lean where covered (decoding/lean.py;
    not under `compile`), else the model's own `base_model`; otherwise the whole model."""
    if not lazy_head(target, device):
        return target
    return (None if compile else lean_forward(target)) or target.base_model


def lm_head(target, body):
    """The head the decoder applies to the hidden states of `body` (from `decoder_forward`): the lean one's there."""
    return body.head if isinstance(body, LeanForward) else target.get_output_embeddings()


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward -> its torch.compile'd version


def compiled(forward):
    """`torch.compile(forward, dynamic=True)`, built once per module, for the verify step on accelerators.

    Dynamic shapes cover the changing number of nodes and cache length. The first calls pay the compilation
    (tens of seconds on a CPU). On a CPU it measured slower than eager in this loop (benchmarks/decode.json:
    recompilations as shapes and masks change); on a GPU it is untested.
    """
    if forward not in _COMPILED:
        _COMPILED[forward] = torch.compile(forward, dynamic=True)
    return _COMPILED[forward]


class LazyLogits:
    """Target logits over [root, nodes], rows [V] computed on first access, in blocks that double.

    A verification step only needs the rows its accept rule visits (accepted nodes + 1), and the LM
    head over a large vocabulary is a sizeable share of a small target's forward. Row by row, though,
    every row reads the whole head from memory again: a miss at row i computes rows [i, 2i + 2) in one
    matmul, so a path through rows 0..m reads the head about log2(m) times and computes at most 2m rows.
    """

    def __init__(self, target, hidden: torch.Tensor, head=None):
        self.hidden, self.head = hidden, target.get_output_embeddings() if head is None else head  # hidden [n+1, H]
        self.cap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
        self.rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def _logits(self, lo: int, hi: int) -> torch.Tensor:
        return self._apply(self.hidden[lo:hi])  # [hi-lo, V]

    def _apply(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)  # [k, V]
        return logits if self.cap is None else torch.tanh(logits / self.cap) * self.cap

    @staticmethod
    def prime(logits: list) -> None:
        """The first block of several sequences' lazy logits (rows [0, 2): what every accept rule's first access
        computes) in one matmul, so that a batch reads the head once rather than once per sequence. Other entries
        (a model's own logits) are left alone."""
        lazy = [x for x in logits if isinstance(x, LazyLogits)]
        if not lazy:
            return
        blocks = [x.hidden[:2] for x in lazy]  # [<=2, H] each
        rows = lazy[0]._apply(torch.cat(blocks) if len(blocks) > 1 else blocks[0])  # [sum, V]
        for x, part in zip(lazy, rows.split([b.shape[0] for b in blocks]), strict=True):
            x.rows.update(enumerate(part))

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.rows:
            hi = min(len(self), 2 * i + 2)
            self.rows.update(zip(range(i, hi), self._logits(i, hi), strict=True))
        return self.rows[i]

    def full(self) -> torch.Tensor:
        return self._logits(0, len(self))  # [n+1, V]


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def attention_masks(config, parents: torch.Tensor, cache_len: int, dtype: torch.dtype):
    """The tree mask in the form the model's forward takes: one tensor, or a dict per layer type (sliding-window
    layers see their window, Llama 4's chunked-attention layers their chunk). A multimodal model's text tower
    (`get_text_config()`) sets the layers."""
    config = config.get_text_config()
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return {t: tree_attention_mask(parents, cache_len, dtype, window if t == "sliding_attention" else None,
                                       config.attention_chunk_size if t == "chunked_attention" else None)
                for t in set(layer_types)}
    if window is not None and getattr(config, "use_sliding_window", True):
        return tree_attention_mask(parents, cache_len, dtype, window)
    return tree_attention_mask(parents, cache_len, dtype)


def _eos_set(target, eos_token_id) -> set[int]:
    eos = target.generation_config.eos_token_id if eos_token_id is None else eos_token_id
    return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)


@torch.no_grad()
def speculative_generate(target, proposer: Proposer, input_ids: torch.Tensor, max_new_tokens: int,
                         sampling: Sampling | None = None, rule: str = "auto", eos_token_id=None,
                         stats: DecodeStats | None = None, compile: bool = False, lockstep: bool = False
                         ) -> tuple[torch.Tensor, DecodeStats]:
    """Generate up to max_new_tokens after input_ids [1, L]; returns (tokens [1, L + new], stats).

    Stops after the first EOS exactly where plain decoding would. `eos_token_id` (int or list)
    defaults to the target's generation config. `compile` verifies through `compiled(forward)`.
    `lockstep` (every rank of a process group decodes its own prompt with a target sharded over the ranks,
    whose every forward is a collective): a rank whose sequence is finished keeps stepping, output and
    statistics frozen, until every rank's is, so that all ranks run the same sequence of forwards (as
    Hugging Face's `synced_gpus`); it needs a proposer whose forwards per step do not depend on the text.

    Per step the host sees the tree's tokens and parents (one copy each), the accepted path and the
    committed tokens; tree layouts come from the shape cache (`tree.layout`), a chain is verified
    with the model's own causal mask, and the cache rollback of a chain is a crop. On a CPU the
    target's logits are computed lazily along the accepted path (`LazyLogits`); on an accelerator
    the head runs over all rows at once and greedy acceptance reads one argmax vector.
    """
    stats = stats or DecodeStats()
    body = decoder_forward(target, input_ids.device, compile)
    seq = _Sequence(target, proposer, input_ids, max_new_tokens, sampling, rule, _eos_set(target, eos_token_id),
                    stats, body, lockstep)
    _decode([seq], body, compile, lockstep)
    return seq.done[None], stats


@torch.no_grad()
def generate_batch(target, proposers: list[Proposer], prompts: list[torch.Tensor], max_new_tokens: int,
                   samplings: list[Sampling] | None = None, rule: str = "auto", eos_token_id=None,
                   stats: DecodeStats | None = None, lockstep: bool = False) -> tuple[list[torch.Tensor], DecodeStats]:
    """`speculative_generate` of several prompts [1, L_i] at once, prompt i drafted by proposers[i] (one instance per
    sequence: proposers keep per-sequence state) with samplings[i]; returns (tokens [1, L_i + new_i] each, stats).

    In rounds: every unfinished sequence drafts (one after the other), then ONE target forward verifies all their
    trees (`LeanForward.ragged`: no padding, so each sequence's tokens and statistics are its batch-1 decode's up to
    float rounding), then each sequence verifies, commits and rolls back its own cache; the prefills are one forward
    too, and so are the head's first rows of every sequence (`LazyLogits.prime`). stats.wall_s grows by the batch's
    wall time, once. Where the target's forward cannot be shared (not covered by decoding/lean.py, an accelerator, a
    proposer with the `target_forward` hook) or must run in `lockstep` (as in `speculative_generate`: a sharded
    target) the prompts are decoded one after the other, each as `speculative_generate` would.
    """
    if len(proposers) != len(prompts) or len({id(p) for p in proposers}) != len(proposers):
        raise ValueError(f"generate_batch needs one proposer instance per prompt: got {len(proposers)} "
                         f"({len({id(p) for p in proposers})} distinct) for {len(prompts)} prompts")
    stats = stats or DecodeStats()
    samplings = samplings or [Sampling() for _ in prompts]
    body = decoder_forward(target, prompts[0].device)
    eos = _eos_set(target, eos_token_id)
    seqs = [_Sequence(target, p, x, max_new_tokens, s, rule, eos, stats, body, lockstep)
            for p, x, s in zip(proposers, prompts, samplings, strict=True)]
    if isinstance(body, LeanForward) and not lockstep and not any(hasattr(p, "target_forward") for p in proposers):
        _decode(seqs, body)
    else:
        for seq in seqs:
            _decode([seq], body, lockstep=lockstep)
    return [seq.done[None] for seq in seqs], stats


def _decode(seqs: list[_Sequence], body, compile: bool = False, lockstep: bool = False) -> None:
    """The decode loop over sequences whose forwards `body` can share (`LeanForward.ragged`) or over one sequence."""
    device = seqs[0].device
    start = _clock(device)
    prefills = [seq for seq in seqs if seq.ids.numel() > 1]
    outs = dict(zip(map(id, prefills), _forward(body, [seq.prefill() for seq in prefills]), strict=True))
    for seq in seqs:
        seq.start(outs.get(id(seq)), compile)
    while True:
        for seq in seqs:
            seq.check_done()
        finished = all(seq.done is not None for seq in seqs)
        if finished if not lockstep else _all_ranks(finished, device):
            break
        live = [seq for seq in seqs if seq.done is None or lockstep]
        queries = [seq.draft() for seq in live]
        t0 = _clock(device)
        outs = _forward(live[0].forward if len(live) == 1 else body, queries)
        logits = [seq.logits(out) for seq, out in zip(live, outs, strict=True)]
        LazyLogits.prime(logits)
        share = (_clock(device) - t0) / len(live)  # the shared forward's time, split evenly
        for seq, out, rows in zip(live, outs, logits, strict=True):
            seq.commit(out, rows, share)
    seqs[0].stats.wall_s += max(seq.end for seq in seqs) - start
    seqs[0].stats.sequences += len(seqs)


def _forward(forward, queries: list[dict]) -> list:
    """One forward over every query: the forward itself for one, `LeanForward.ragged` for several."""
    if len(queries) > 1:
        return forward.ragged(queries)
    return [forward(**q) for q in queries]


class _Sequence:
    """One sequence of the decode loop (`_decode`): its state, and each step split around the target's forward
    (`draft` returns the forward's keyword arguments, `commit` takes its output), so that one forward may verify
    several sequences' trees."""

    def __init__(self, target, proposer: Proposer, input_ids: torch.Tensor, max_new_tokens: int,
                 sampling: Sampling | None, rule: str, eos: set[int], stats: DecodeStats, body, lockstep: bool = False):
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [1, L>=1] (batch size 1), got {tuple(input_ids.shape)}")
        why = kv.rollback_refusal(target.config)
        if why:
            raise ValueError(why)
        self.target, self.proposer, self.max_new_tokens, self.rule, self.eos = target, proposer, max_new_tokens, rule, eos
        self.sampling, self.stats, self.forward, self.lockstep = sampling or Sampling(), stats, body, lockstep
        self.device, self.dtype, self.layers = input_ids.device, target.dtype, list(proposer.hidden_layers)
        self.head = lm_head(target, body)
        self.ids = input_ids[0]  # [t] committed tokens
        self.cache = kv.new_cache()
        self.new, self.stopped, self.done, self.end = 0, False, None, None  # done: the output once finished

    def prefill(self) -> dict:
        """The forward's arguments for the prompt but its last token (which is the first verification's root)."""
        ids = self.ids
        return dict(input_ids=ids[None, :-1], position_ids=torch.arange(ids.numel() - 1, device=self.device)[None],
                    cache=self.cache, use_cache=True, output_hidden_states=bool(self.layers))

    def start(self, prefill, compile: bool) -> None:
        """After the prefill (its output, None for a one-token prompt): the proposer's new sequence begins."""
        self.proposer.reset()
        hook = getattr(self.proposer, "target_forward", None)  # optional, see the module docstring
        self.forward = (hook(self.cache) if hook else None) or self.forward
        self.forward = compiled(self.forward) if compile else self.forward
        self.proposer.accept(self.ids, Verified(None, [], None, _hidden(prefill, self.layers)))

    def check_done(self) -> None:
        if self.done is None and (self.new >= self.max_new_tokens or self.stopped):
            self.done, self.end = self.ids, _clock(self.device)

    def draft(self) -> dict:
        """Draft a tree; the verifying forward's arguments."""
        self.budget = self.max_new_tokens - self.new if self.done is None else self.max_new_tokens  # lockstep: any
        self.cache_len = cache_len = self.cache.get_seq_length()  # before drafting, which may extend early layers
        t0 = _clock(self.device)
        self.tree = tree = self.proposer.propose(self.ids, self.sampling).truncate(self.budget - 1).to(self.device)
        self.drafter_s = _clock(self.device) - t0
        self.shape = shape = layout(tree.parents)
        return dict(  # a chain needs no tree mask: the model's causal one
            input_ids=torch.cat([self.ids[-1:], tree.tokens])[None],  # [1, n+1]: root, nodes
            position_ids=(cache_len + shape.depth)[None],  # [1, n+1]
            attention_mask=None if shape.chain else attention_masks(self.target.config, tree.parents, cache_len,
                                                                    self.dtype),
            cache=self.cache, use_cache=True, output_hidden_states=bool(self.layers))

    def logits(self, out):
        """The target's logits over [root, nodes] from the forward's output: rows [V], lazy where it has no head."""
        if getattr(out, "logits", None) is not None:
            return out.logits[0]  # [n+1, V]
        return LazyLogits(self.target, out.last_hidden_state[0], self.head)  # the body's or the hook's hidden states

    def commit(self, out, logits, forward_s: float) -> None:
        """Verify the tree against the forward's output and `logits`, commit, roll the cache back; `forward_s`: this
        sequence's share of the forward's time."""
        t1 = _clock(self.device)
        tree, shape, budget = self.tree, self.shape, self.budget
        path, bonus = verify(tree, logits, self.sampling, self.rule)
        kept = [0] + [i + 1 for i in path]  # root + accepted nodes, as offsets after cache_len
        kv.keep(self.cache, self.cache_len, kept)
        committed = tree.tokens[path].tolist() + [bonus]
        for j, tok in enumerate(committed):
            if tok in self.eos:
                committed = committed[: j + 1]
                break
        committed = committed[:budget]
        t2 = _clock(self.device)
        self.ids = torch.cat([self.ids, torch.tensor(committed, dtype=self.ids.dtype, device=self.device)])
        if self.done is None:
            self.new, self.stopped = self.new + len(committed), committed[-1] in self.eos
            offered = len(path) + int(bool(shape.kids[path[-1] + 1 if path else 0]))  # + 1 if the path went on
            self.stats.record(offered=offered, drafted=len(tree), accepted=len(path), committed=len(committed),
                              drafter_s=self.drafter_s, target_s=forward_s + t2 - t1)
        if self.stopped and not self.lockstep:
            return  # EOS: no drafting state is needed any more
        t3 = _clock(self.device)
        hidden = _hidden(out, self.layers)
        self.proposer.accept(self.ids, Verified(tree, path, logits, None if hidden is None else hidden[:, kept]))
        if self.done is None:
            self.stats.drafter_s += _clock(self.device) - t3


def _all_ranks(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on every rank of the default process group (a collective)."""
    from torch import distributed as dist

    t = torch.tensor([float(not flag)], device=device)  # [1]
    dist.all_reduce(t)
    return t.item() == 0


def _hidden(out, layers: list[int]) -> torch.Tensor | None:
    """Target hidden states [k, m, H] of the requested layers (indices into HF's hidden_states)."""
    if out is None or not layers:
        return None
    return torch.stack([out.hidden_states[i][0] for i in layers])


def plain_generate(target, input_ids: torch.Tensor, max_new_tokens: int, sampling: Sampling | None = None,
                   eos_token_id=None, stats: DecodeStats | None = None, compile: bool = False,
                   lockstep: bool = False) -> tuple[torch.Tensor, DecodeStats]:
    """The target's own decoding (one token per forward) through the same loop: the speedup baseline."""
    return speculative_generate(target, NoDraft(), input_ids, max_new_tokens, sampling, "auto", eos_token_id,
                                stats, compile, lockstep)

