"""The decode loop: draft a tree, verify it in one target forward, commit, roll the cache back.

    tokens, stats = speculative_generate(target, proposer, input_ids, max_new_tokens=64)

Any Hugging Face causal LM works as the target: the tree is scored through the model's normal
forward with a 4-D additive mask (a dict of masks per layer type for models with sliding-window
layers) and explicit position ids; on a CPU, covered architectures run the same modules through
`lean.LeanForward`, without Hugging Face's per-forward machinery (`decoder_forward`). Batch size 1.

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
        self.cap = getattr(target.config, "final_logit_softcapping", None)
        self.rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def _logits(self, lo: int, hi: int) -> torch.Tensor:
        logits = self.head(self.hidden[lo:hi])  # [hi-lo, V]
        return logits if self.cap is None else torch.tanh(logits / self.cap) * self.cap

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
    """The tree mask in the form the model's forward takes: one tensor, or a dict per layer type."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return {t: tree_attention_mask(parents, cache_len, dtype, window if t == "sliding_attention" else None)
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
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [1, L>=1] (batch size 1), got {tuple(input_ids.shape)}")
    sampling = sampling or Sampling()
    stats = stats or DecodeStats()
    device, dtype = input_ids.device, target.dtype
    eos, layers = _eos_set(target, eos_token_id), list(proposer.hidden_layers)
    ids = input_ids[0]  # [t] committed tokens
    start = _clock(device)
    cache = kv.new_cache()
    body = decoder_forward(target, device, compile)
    head = lm_head(target, body)
    prefill = None
    if ids.numel() > 1:
        prefill = body(input_ids=ids[None, :-1], position_ids=torch.arange(ids.numel() - 1, device=device)[None],
                       cache=cache, use_cache=True, output_hidden_states=bool(layers))
    proposer.reset()
    hook = getattr(proposer, "target_forward", None)  # optional, see the module docstring
    forward = (hook(cache) if hook else None) or body
    forward = compiled(forward) if compile else forward
    proposer.accept(ids, Verified(None, [], None, _hidden(prefill, layers)))
    new, stopped, done, end = 0, False, None, start  # done: the output once this sequence is finished
    while True:
        if done is None and (new >= max_new_tokens or stopped):
            done, end = ids, _clock(device)
        if (done is not None) if not lockstep else _all_ranks(done is not None, device):
            break
        budget = max_new_tokens - new if done is None else max_new_tokens  # a lockstep step after the end: any
        cache_len = cache.get_seq_length()  # before drafting, which may extend the early layers
        t0 = _clock(device)
        tree = proposer.propose(ids, sampling).truncate(budget - 1).to(device)
        t1 = _clock(device)
        tokens = torch.cat([ids[-1:], tree.tokens])[None]  # [1, n+1]: root, nodes
        shape = layout(tree.parents)
        out = forward(  # a chain needs no tree mask: the model's causal one
            input_ids=tokens, position_ids=(cache_len + shape.depth)[None],  # [1, n+1]
            attention_mask=None if shape.chain else attention_masks(target.config, tree.parents, cache_len, dtype),
            cache=cache, use_cache=True, output_hidden_states=bool(layers))
        logits = out.logits[0] if getattr(out, "logits", None) is not None else LazyLogits(  # [n+1, V] rows
            target, out.last_hidden_state[0], head)  # the body's or the hook's hidden states
        path, bonus = verify(tree, logits, sampling, rule)
        kept = [0] + [i + 1 for i in path]  # root + accepted nodes, as offsets after cache_len
        kv.keep(cache, cache_len, kept)
        committed = tree.tokens[path].tolist() + [bonus]
        for j, tok in enumerate(committed):
            if tok in eos:
                committed = committed[: j + 1]
                break
        committed = committed[:budget]
        t2 = _clock(device)
        ids = torch.cat([ids, torch.tensor(committed, dtype=ids.dtype, device=device)])
        if done is None:
            new, stopped = new + len(committed), committed[-1] in eos
            offered = len(path) + int(bool(shape.kids[path[-1] + 1 if path else 0]))  # + 1 if the path went on
            stats.record(offered=offered, drafted=len(tree),
                         accepted=len(path), committed=len(committed), drafter_s=t1 - t0, target_s=t2 - t1)
        if stopped and not lockstep:
            continue  # EOS: no drafting state is needed any more
        t3 = _clock(device)
        hidden = _hidden(out, layers)
        proposer.accept(ids, Verified(tree, path, logits, None if hidden is None else hidden[:, kept]))
        if done is None:
            stats.drafter_s += _clock(device) - t3
    stats.wall_s += end - start
    stats.sequences += 1
    return done[None], stats


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

