"""EAGLE-1 (Li et al. 2024, arXiv 2401.15077) and EAGLE-3 (Li et al. 2025, arXiv 2503.01840) drafters.

One Llama-style decoder layer ("midlayer") autoregresses in the target's feature space, with the
target's own (frozen) token embedding; both versions share the layer, the training-time-test loop
and the proposer, and differ in what goes in and comes out:

    EAGLE-1:  x_t = fc([e(x_{t+1}); f_t])  -> layer (no input norm) -> f^_{t+1}; logits = target lm_head(f^)
              L = w_feat * SmoothL1(f^_{t+1}, f_{t+1}) + w_tok * CE(softmax(lm_head(f_{t+1})), lm_head(f^))
    EAGLE-3:  g_t = fc([a_t; b_t; c_t])  (target hidden states of three layers, 3H -> H, no bias;
              EAGLE 3.1's fc_norm: fc([n_a(a_t); n_b(b_t); n_c(c_t)]), one RMSNorm per layer)
              layer input [input_layernorm(e(x_{t+1})); hidden_norm(g_t)] (2H), residual g_t
              -> h_{t+1}; logits = lm_head(norm(h)) over a pruned draft vocabulary; lm_head starts from the
              target's head rows picked by t2d (frozen or trained; speculators), or random (SpecForge)
              L = sum_k decay^k D(p_k, q_k), p_k = softmax(target logits restricted to the draft vocab),
              D = forward KL (soft CE; EAGLE), total variation (1 - TV(p, q) is the T=1 acceptance
              probability, DistillSpec) or LK's negative log-acceptance -log sum min(p, q) (Samarin et al. 2026,
              arXiv 2602.23881: TV's gradient scaled by 1/acceptance); optionally
              + w_feat * SmoothL1(norm(h_{t+1+k}), f_{t+1+k}), EAGLE-1's feature regression on what the head
              reads (eagle.feature_weight, 0 by default for EAGLE-3);
              optionally + w_in * SmoothL1(h_{t+1+k}, sg(g'_{t+1+k})), g' = fc(..) the fused input step 0 reads:
              each output regressed on what step 0 reads one position on, the input the next step takes it for
              (eagle.input_weight; EAGLE-1's regression carried into EAGLE-3's own input space)

With eagle.num_layers n > 1 the midlayer's output goes through n - 1 plain pre-norm Llama layers before the head
(`DecoderLayer`, as vLLM and speculators build a multi-layer EAGLE-3 drafter); each has its own keys in the
training-time test and its own entry in the decoding KV cache.

f_t is the target's last hidden state after its final norm (the tap's `hidden`); "layers" are
indices into Hugging Face `hidden_states` (0 = embeddings, i = the input to decoder layer i), the
EAGLE repository's convention: the default (2, L//2, L-3) are the inputs to those layers.

Training-time test (EAGLE-3; also available to EAGLE-1): step k = 0..K-1 feeds the layer its own
step-(k-1) output in place of the target feature, with the ground-truth token x_{t+1+k}, at rope
position pos_t + k; its queries see the step-0 keys causally and the keys of steps 1..k at the same
position only (what the drafter's KV cache holds while drafting token k+1 at serving time). K may
grow from 1 to ttt_steps over the first `ttt_ramp` of the run (Loop.progress).

Cost: in training the draft head and loss run only at the positions the loss trains, gathered (a prompt's
are not), and the teacher's full-vocabulary head only where a step learns the next token; the forward KL is one fused
function (`ForwardKL`). Step 0's layer runs at every position, as attention needs; a later step's query reads the
step-0 keys and its own position's later steps alone, so steps 1..K-1 run only at the positions one of them trains
(or, with `ttt_fraction`, at a random share of those, drawn per row and batch), and score the later steps' keys as
one dot product each (`ttt_attention`: eager attention, which on CPU in bf16 is also faster than SDPA's kernel).

Memory: the target's full-vocabulary logits exist only for `logit_chunk` positions at a time (kept:
their argmax and the draft-vocabulary softmax), and the draft head and loss run per chunk of `loss_chunk`
positions (default: the same) under activation checkpointing, so peak memory grows with the draft vocabulary,
not the target's; `loss_chunk` 0 keeps a small draft vocabulary's logits instead of recomputing them. Attention
scores [b, heads, m, s] exist per unrolled step (eager attention; no fused kernel takes the later steps' keys).

The token embedding is the target's own module, frozen with the target (a copy would be identical).

Weights are named as SGLang / SpecForge name them (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`; the later layers `additional_layers.*`), so exports are renames (models/eagle_export.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from draftsmith.data.core import ConfigError, read_drafter_meta, write_drafter_meta
from draftsmith.decoding import cache as kv
from draftsmith.decoding.bench import Drafting
from draftsmith.decoding.proposers import Proposer, Verified, draw
from draftsmith.decoding.tree import DraftTree, layout
from draftsmith.decoding.verify import Sampling, warp
from draftsmith.models.layerskip import final_norm
from draftsmith.models.lm import masked_mean
from draftsmith.models.target import Target, load_target, target_fields

WEIGHTS_FILE, CONFIG_FILE = "eagle.safetensors", "config.json"
ALPHA_PRIOR, ALPHA_PRIOR_N = 0.7, 4  # sampled trees: each draw's acceptance before any verification, its weight


@dataclasses.dataclass
class EagleConfig:
    """The drafter and its loss (EAGLE-1: version 1, ttt_steps 1, feature_noise 0.2; EAGLE-3: version 3)."""

    version: Literal[1, 3] = 3
    aux_layers: list[int] = dataclasses.field(default_factory=list)  # EAGLE-3 hidden_states indices (< 0: from the end);
    # []: (2, L//2, L-3)
    draft_vocab_size: int = 32000  # EAGLE-3: most frequent loss-masked training tokens (capped at the target's vocab)
    ttt_steps: int = 7  # training-time-test steps K
    decay: float = 0.8  # step k weighs decay^k
    feature_noise: float = 0.0  # uniform noise on input features, (U - 0.5) * noise * 512 / seq_len (EAGLE-1: 0.2)
    feature_weight: float | None = None  # SmoothL1 on the target's next features; None: 1.0 (EAGLE-1), 0.0 (EAGLE-3)
    token_weight: float = 0.1  # EAGLE-1 soft cross-entropy weight (EAGLE-3 has only this term, weight 1)
    input_weight: float = 0.0  # EAGLE-3: SmoothL1 of each step's output on fc(g) of the next position (what step 0 reads)
    intermediate_size: int = 0  # MLP width of the layer; 0: the target's
    num_layers: int = 1  # decoder layers: the midlayer, then num_layers - 1 plain pre-norm layers (vLLM's EAGLE-3)
    num_key_value_heads: int = 0  # the layer's key/value heads (divides the target's heads); 0: the target's
    head_init: Literal["frozen", "trainable", "random"] = "frozen"  # EAGLE-3 lm_head: target rows via t2d, or random
    norm_init: Literal["ones", "target"] = "ones"  # EAGLE-3 norm before lm_head: ones, or the target's final norm scale
    fuse_weight: float = 0.0  # EAGLE-3: SmoothL1 of norm(fc(g)) at t on the target's final feature f at t
    head_steps: int = 0  # EAGLE-3: the draft loss at the first head_steps unrolled steps only, regressions alone after
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm on each captured hidden state before fc
    ttt_ramp: float = 0.0  # fraction of the run over which the unrolled steps grow from 1 to ttt_steps; 0: constant
    ttt_fraction: float = 1.0  # of the positions that train, the share steps 1.. run at (drawn per row from its tokens
    # and the run's progress, `row_uniform`: 2 processes train exactly as 1 with grad_accum 2)
    loss: Literal["kl", "tv", "lk"] = "kl"  # D per step: forward KL (soft CE), total variation, -log acceptance
    logit_chunk: int = 64  # positions per chunk of full-vocabulary logits and of the draft loss; 0: all at once
    loss_chunk: int | None = None  # positions per chunk of the draft loss (recomputed in the backward); None: logit_chunk

    def __post_init__(self):
        for ok, key, why in [
            (self.version in (1, 3), "version", "must be 1 (EAGLE-1) or 3 (EAGLE-3)"),
            (self.ttt_steps >= 1, "ttt_steps", "must be >= 1"),
            (0 < self.decay <= 1, "decay", "must be in (0, 1]"),
            (self.draft_vocab_size >= 1, "draft_vocab_size", "must be >= 1"),
            (self.feature_noise >= 0, "feature_noise", "must be >= 0"),
            (self.num_layers >= 1, "num_layers", "must be >= 1"),
            (self.num_key_value_heads >= 0, "num_key_value_heads", "must be >= 0 (0: the target's)"),
            (self.head_init in ("frozen", "trainable", "random"), "head_init", "must be frozen, trainable or random"),
            (self.norm_init in ("ones", "target"), "norm_init", "must be ones or target"),
            (self.head_steps >= 0 and (self.head_steps == 0 or self.feature_weight or self.input_weight), "head_steps",
             "must be >= 0, and later steps without the draft loss need feature_weight or input_weight"),
            (self.version == 3 or not self.fc_norm, "fc_norm", "only EAGLE-3 fuses several layers; remove it"),
            (0 <= self.ttt_ramp <= 1, "ttt_ramp", "must be in [0, 1] (0: constant ttt_steps)"),
            (0 < self.ttt_fraction <= 1, "ttt_fraction", "must be in (0, 1] (1: every position that trains)"),
            (self.loss in ("kl", "tv", "lk"), "loss",
             "must be kl (forward KL), tv (total variation) or lk (negative log-acceptance)"),
            (self.logit_chunk >= 0, "logit_chunk", "must be >= 0 (0: the whole sequence at once)"),
            (self.loss_chunk is None or self.loss_chunk >= 0, "loss_chunk", "must be >= 0 (0: the whole sequence)"),
            (self.version == 3 or not self.aux_layers, "aux_layers", "only EAGLE-3 fuses several layers; remove it"),
            (self.feature_weight is None or self.feature_weight >= 0, "feature_weight", "must be >= 0"),
            (self.input_weight >= 0 and (self.version == 3 or not self.input_weight), "input_weight",
             "must be >= 0, and only EAGLE-3 fuses an input (EAGLE-1: feature_weight)"),
            (self.fuse_weight >= 0 and (self.version == 3 or not self.fuse_weight), "fuse_weight",
             "must be >= 0, and only EAGLE-3 fuses an input (EAGLE-1 reads the target's feature itself)"),
            (self.version == 3 or self.feature_weight != 0 or self.token_weight > 0, "feature_weight",
             "EAGLE-1 needs a positive feature_weight or token_weight"),
        ]:
            if not ok:
                raise ConfigError(f"eagle.{key}: {why}")
        if self.feature_weight is None:
            self.feature_weight = 1.0 if self.version == 1 else 0.0
        if self.loss_chunk is None:
            self.loss_chunk = self.logit_chunk


def default_aux_layers(num_layers: int) -> list[int]:
    """The EAGLE repository's choice, the inputs to layers 2, L//2 and L-3; on targets too shallow for three
    distinct such layers, the first distinct layers of 1..L-1 fill in (engines capture each layer once)."""
    ids = {min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 1)}
    fill = [i for i in range(1, num_layers) if i not in ids]
    return sorted(ids | set(fill[: max(0, 3 - len(ids))]))


def aux_layers(cfg: EagleConfig, num_layers: int) -> list[int]:
    """The hidden_states indices EAGLE-3 fuses (the recipe's, else the default); none for EAGLE-1. A negative index
    counts from the end of the num_layers + 1 hidden states, as Python does: [-4, -3, -2] are the inputs to the last
    three layers of any target."""
    if cfg.version != 3:
        return []
    return [i + num_layers + 1 if i < 0 else i for i in cfg.aux_layers] or default_aux_layers(num_layers)


def draft_config(target_config, cfg: EagleConfig, draft_vocab_size: int) -> LlamaConfig:
    """A one-layer Llama config with the target's width, heads and rope (what the engines instantiate)."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    H = text.hidden_size
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default",
                                                      "rope_theta": getattr(text, "rope_theta", 10000.0)}
    kv_heads = getattr(cfg, "num_key_value_heads", 0) or getattr(text, "num_key_value_heads", None) \
        or text.num_attention_heads
    if text.num_attention_heads % kv_heads:
        raise ConfigError(f"eagle.num_key_value_heads={kv_heads} does not divide the target's "
                          f"{text.num_attention_heads} attention heads; use a divisor of it (0: the target's)")
    config = LlamaConfig(
        hidden_size=H, intermediate_size=cfg.intermediate_size or getattr(text, "intermediate_size", 4 * H),
        num_hidden_layers=cfg.num_layers, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=kv_heads,
        head_dim=getattr(text, "head_dim", None) or H // text.num_attention_heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6), vocab_size=text.vocab_size,
        max_position_embeddings=getattr(text, "max_position_embeddings", 4096), rope_parameters=dict(rope),
        hidden_act="silu", tie_word_embeddings=False)
    config.draft_vocab_size, config.target_hidden_size = draft_vocab_size, H
    config.fc_norm = getattr(cfg, "fc_norm", False)  # EAGLE-3 only (DFlash builds its layers from the same config)
    config._attn_implementation = "sdpa"
    return config


class MidLayer(nn.Module):
    """The drafter's decoder layer; EAGLE-3's q/k/v read [norm(embedding); norm(hidden)] (2H)."""

    def __init__(self, config: LlamaConfig, version: int):
        super().__init__()
        H = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        if version == 3:
            heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
            self.self_attn.q_proj = nn.Linear(2 * H, heads * d, bias=False)
            self.self_attn.k_proj = nn.Linear(2 * H, kv_heads * d, bias=False)
            self.self_attn.v_proj = nn.Linear(2 * H, kv_heads * d, bias=False)
            self.input_layernorm = LlamaRMSNorm(H, config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(H, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.version = version

    def forward(self, emb: torch.Tensor, h: torch.Tensor, rope: tuple, mask: torch.Tensor, cache) -> torch.Tensor:
        """emb, h [b, q, H] (EAGLE-1: h is already fc([emb; f])) -> [b, q, H]. Decoding: cache the decoder's KV cache,
        mask [b, 1, q, keys] additive; training-time test: cache the list of the earlier steps' keys and values,
        mask [b, q, s] bool over step 0's keys (`ttt_attention`)."""
        x = h if self.version == 1 else torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)  # [b, q, 2H]
        h = h + attend(self.self_attn, x, rope, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderLayer(nn.Module):
    """A drafter layer after the midlayer: a plain pre-norm Llama layer on the previous layer's output (vLLM's
    layers 1.. of a multi-layer EAGLE-3 drafter: input_layernorm over the residual stream, attention, MLP). Not a
    subclass of transformers' LlamaDecoderLayer, whose instances FSDP2 would wrap as units of a Llama target's."""

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        H = config.hidden_size
        self.input_layernorm = LlamaRMSNorm(H, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx=layer_idx)  # its own entry of the decoding KV cache
        self.post_attention_layernorm = LlamaRMSNorm(H, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h: torch.Tensor, rope: tuple, mask: torch.Tensor, cache) -> torch.Tensor:
        """h [b, q, H] -> [b, q, H]; mask and cache as `MidLayer.forward` reads them."""
        h = h + attend(self.self_attn, self.input_layernorm(h), rope, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def attend(attn: LlamaAttention, x: torch.Tensor, rope: tuple, mask: torch.Tensor, cache) -> torch.Tensor:
    """A drafter layer's attention: `ttt_attention` in training-time test (cache the list of the earlier steps' keys
    and values), else over the decoder's KV cache with an additive mask [b, 1, q, keys]."""
    if isinstance(cache, list):
        return ttt_attention(attn, x, rope, mask, cache)
    return attn(x, position_embeddings=rope, attention_mask=mask.to(x.dtype), cache=cache)[0]


def ttt_attention(attn: LlamaAttention, x: torch.Tensor, rope: tuple, visible: torch.Tensor,
                  past: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The drafter's attention in training-time test at step k = len(past), what decoding's cache and mask compute:
    queries x [b, m, 2H or H] read step 0's keys where visible [b, m, s], and the key of each step 1..k at their own
    position; that is one dot product per step, not the [m, m] block of which a mask would keep the diagonal.
    Appends this step's (keys, values), repeated to every head [b, heads, m, d], to past -> attention output [b, m, H]."""
    b, m, _ = x.shape
    q, key, value = (proj(x).view(b, m, -1, attn.head_dim).transpose(1, 2)
                     for proj in (attn.q_proj, attn.k_proj, attn.v_proj))  # [b, heads or kv_heads, m, d]
    q, key = apply_rotary_pos_emb(q, key, *rope)
    past.append((repeat_kv(key, attn.num_key_value_groups), repeat_kv(value, attn.num_key_value_groups)))
    (k0, v0), *later = past  # [b, heads, s or m, d] each
    q = q * attn.scaling
    scores = (q @ k0.transpose(2, 3)).masked_fill(~visible[:, None], torch.finfo(q.dtype).min)  # [b, heads, m, s]
    s = scores.shape[-1]
    if later:
        k_later, v_later = (torch.stack(x, 3) for x in zip(*later, strict=True))  # [b, heads, m, k, d] each
        scores = torch.cat([scores, (q[..., None, :] * k_later).sum(-1)], -1)  # [b, heads, m, s + k]
    w = F.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
    out = w[..., :s] @ v0  # [b, heads, m, d]
    if later:
        out = out + (w[..., s:, None] * v_later).sum(3)
    return attn.o_proj(out.transpose(1, 2).reshape(b, m, -1))


class EagleDrafter(nn.Module):
    """The trainable drafter: fc, midlayer (+ additional_layers), and for EAGLE-3 norm + lm_head over the draft
    vocabulary.

    `d2t` [Vd] int64 (target id = i + d2t[i]) and `t2d` [V] bool are buffers fixed before training.
    """

    def __init__(self, config: LlamaConfig, version: int, draft_ids: torch.Tensor, n_features: int = 1):
        super().__init__()
        H = config.hidden_size
        self.config, self.version = config, version
        if version == 1:
            self.fc = nn.Linear(2 * H, H, bias=True)
        else:
            self.fc = nn.Linear(n_features * H, H, bias=False)
            self.fc_norm = nn.ModuleList(LlamaRMSNorm(H, config.rms_norm_eps) for _ in range(n_features)) \
                if getattr(config, "fc_norm", False) else None
            self.norm = LlamaRMSNorm(H, config.rms_norm_eps)
            self.lm_head = nn.Linear(H, draft_ids.numel(), bias=False)
        self.midlayer = MidLayer(config, version)
        self.additional_layers = nn.ModuleList(DecoderLayer(config, i) for i in range(1, config.num_hidden_layers))
        self.rotary = LlamaRotaryEmbedding(config)
        draft_ids = draft_ids.long()
        self.register_buffer("d2t", draft_ids - torch.arange(draft_ids.numel()))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("t2d", t2d)

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)  # [Vd] target ids

    def forward(self, emb: torch.Tensor, h: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                cache) -> torch.Tensor:
        """One drafter step. emb [b, q, H]; h [b, q, H or n*H] (target features, or the drafter's own output);
        position_ids [b, q]; mask and cache as `MidLayer.forward` reads them -> output hidden [b, q, H]."""
        h = self.fc(torch.cat([emb, h], -1)) if self.version == 1 else self.fuse(h)  # [b, q, H]
        rope = self.rotary(h, position_ids)
        caches = cache if isinstance(cache, list) else [cache] * self.config.num_hidden_layers  # TTT: one per layer
        h = self.midlayer(emb, h, rope, mask, caches[0])
        for layer, c in zip(self.additional_layers, caches[1:], strict=True):
            h = layer(h, rope, mask, c)
        return h

    def fuse(self, g: torch.Tensor) -> torch.Tensor:
        """EAGLE-3's fused input: target features g [.., n*H] -> fc([n_a(a); n_b(b); n_c(c)]) [.., H]. An input
        H wide (the drafter's own output, or a single layer's features) passes unchanged, as the engines (vLLM,
        SGLang) apply fc only to a wider one; training and decoding both read it through here."""
        if g.shape[-1] == self.config.hidden_size:
            return g
        return self.fc(self.fc_input(g))

    def fc_input(self, g: torch.Tensor) -> torch.Tensor:
        """What fc reads of target features g [.., n*H]: each captured layer through its fc_norm (EAGLE 3.1), or g."""
        if self.fc_norm is None:
            return g
        return torch.cat([norm(x) for norm, x in zip(self.fc_norm, g.chunk(len(self.fc_norm), -1), strict=True)], -1)

    def logits(self, out: torch.Tensor, target_head: nn.Module) -> torch.Tensor:
        """Draft logits [.., Vd]: EAGLE-3's own head on norm(out), EAGLE-1 the target's head on out (Vd = V)."""
        return target_head(out) if self.version == 1 else self.lm_head(self.norm(out))


def draft_vocab(dataset, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent loss-masked tokens of `dataset` (rows with input_ids, loss_mask), sorted by id.

    Ties and unused slots are filled by the lowest ids, so the result is deterministic.
    """
    size = min(size, vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(len(dataset)):
        row = dataset[i]
        ids = torch.as_tensor(row["input_ids"])
        counts += torch.bincount(ids[torch.as_tensor(row["loss_mask"]).bool()], minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(order[:size]))


class ForwardKL(torch.autograd.Function):
    """(-sum_v p_v log q_v [..], q [.., V]) with q = softmax(z), z [.., V] the draft logits, p [.., V] the teacher.

    The same value and gradient, dz = (q sum_v p_v - p) per unit of loss, as log_softmax + sum under autograd, which
    keeps log q and recomputes its exp in the backward: here one [.., V] buffer, q, is made and kept, and is also
    what the acceptance metric reads (on CPU, passes over fresh [.., V] buffers dominate an EAGLE-3 step)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lse = z.logsumexp(-1, keepdim=True)  # [.., 1]
        q = (z - lse).exp_()  # [.., V]
        p_sum = p.sum(-1, keepdim=True)  # [.., 1] (1, or 0 at an untrained row)
        ctx.save_for_backward(q, p, p_sum)
        ctx.mark_non_differentiable(q)
        return (lse * p_sum).squeeze(-1) - (p * z).sum(-1), q

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        q, p, p_sum = ctx.saved_tensors
        return (q * p_sum).sub_(p).mul_(grad[..., None]), None


def additive(visible: torch.Tensor) -> torch.Tensor:
    """Bool visibility -> additive mask (0 where visible, -inf elsewhere), same shape."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))


def take(x: torch.Tensor, t: torch.Tensor, n: int = 0, fill=0) -> torch.Tensor:
    """x [b, s, ...] at positions t + n, t [b, m] -> [b, m, ...]; past the end: fill."""
    i = (t + n).view(*t.shape, *[1] * (x.dim() - 2))  # [b, m, 1...]
    got = x.gather(1, i.clamp(max=x.shape[1] - 1).expand(*t.shape, *x.shape[2:]))
    return got.masked_fill(i >= x.shape[1], fill)


def later_positions(needed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """needed [b, s] (a later unrolled step has a token to learn there) -> (t [b, m] the positions the steps after
    step 0 run at, keep [b, m] which of them train): each row's needed positions in order, padded to the longest
    row's count with positions that train nothing."""
    order = (~needed).long().argsort(dim=1, stable=True)  # [b, s] needed positions first
    t = order[:, :max(int(needed.sum(1).max()), 1)]  # [b, m]
    return t, needed.gather(1, t)


def row_uniform(ids: torch.Tensor, real: torch.Tensor | None, salt: str) -> torch.Tensor:
    """ids [b, s], real [b, s] (its non-padding positions; None: all) -> u [b, s] uniform in [0, 1), each row's from a
    generator seeded by its real tokens and `salt` alone: a row draws the same in whichever process, micro-batch or
    padding it lands."""
    u = torch.ones(ids.shape)  # [b, s] padding: never drawn
    for r, row in enumerate(ids.cpu() if real is None else [x[m.bool()] for x, m in zip(ids.cpu(), real.cpu(), strict=True)]):
        seed = hashlib.blake2b(row.numpy().tobytes() + salt.encode(), digest_size=8).digest()
        u[r, :len(row)] = torch.rand(len(row), generator=torch.Generator().manual_seed(int.from_bytes(seed, "little")))
    return u.to(ids.device)


def final_norm_scale(target: Target) -> torch.Tensor:
    """[H] the per-dimension scale of the target's final RMSNorm (Gemma's 1 + w included): the norm applied to a
    vector of ones, whose RMS is 1. With it and the target's head rows, EAGLE-3's norm and head start as the
    target's own."""
    norm = final_norm(target.model)
    if getattr(norm, "bias", None) is not None:
        raise ConfigError(f"eagle.norm_init=target: the target's final norm ({type(norm).__name__}) is not an RMSNorm; "
                          "use ones")
    H = target.config.get_text_config().hidden_size
    with torch.no_grad():
        return norm(torch.ones(1, H, dtype=target.lm_head.weight.dtype, device=target.lm_head.weight.device))[0]


class Eagle(nn.Module):
    """The training method: a frozen target (online) or its cached features (offline) + an EagleDrafter."""

    def __init__(self, target: Target, cfg: EagleConfig, draft_ids: torch.Tensor | None = None):
        super().__init__()
        self.target, self.cfg = target, cfg
        L = target.config.get_text_config().num_hidden_layers
        V = target.config.get_text_config().vocab_size
        self.layers = aux_layers(cfg, L)
        if self.layers:
            bad = [i for i in self.layers if not 0 <= i <= L]
            if bad:
                raise ConfigError(f"eagle.aux_layers: {bad} out of range for a {L}-layer target; use 0..{L} "
                                  f"(or -{L + 1}..-1 from the end)")
            if len(set(self.layers)) != len(self.layers):
                raise ConfigError(f"eagle.aux_layers: {self.layers} repeats a layer; list distinct layers")
        draft_ids = torch.arange(V) if draft_ids is None or cfg.version == 1 else draft_ids
        config = draft_config(target.config, cfg, draft_ids.numel())
        self.drafter = EagleDrafter(config, cfg.version, draft_ids, max(1, len(self.layers))).to(target.lm_head.weight)
        if cfg.version == 3 and cfg.head_init != "random":  # the target's head rows of the draft vocabulary
            rows = target.lm_head.weight.detach()[self.drafter.draft_ids].clone()  # [Vd, H]
            head = self.drafter.lm_head
            if cfg.head_init == "frozen":  # a buffer: no gradient, and whole on every rank under FSDP2 for exports
                del head.weight
                head.register_buffer("weight", rows)
            else:
                head.weight.data.copy_(rows)
        if cfg.version == 3 and cfg.norm_init == "target":
            self.drafter.norm.weight.data.copy_(final_norm_scale(target))
        self.progress: Callable[[], float] = lambda: 1.0  # fraction of training done; the loop sets it
        self.measuring = True  # the acceptance metrics in training; the loop sets it on the steps it logs alone

    # ---- features ----------------------------------------------------------------------------------

    def features(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(f [b, s, H] final post-norm hidden states, g [b, s, n*H] step-0 input features), from the batch's
        cached `hidden` / `aux` (offline) or a forward of the frozen target (online)."""
        if "hidden" in batch:
            f = batch["hidden"].float()
            return f, (batch["aux"].float() if self.cfg.version == 3 else f)
        with torch.no_grad():
            tap = self.target.tap(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"),
                                  tuple(self.layers))
        f = tap.hidden.float()
        return f, (torch.cat([tap.layers[i] for i in self.layers], -1).float() if self.layers else f)

    # ---- training-time test --------------------------------------------------------------------------

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        return self.ttt(batch)

    def ttt_length(self) -> int:
        """Steps to unroll now: eagle.ttt_steps, or with eagle.ttt_ramp, 1 growing linearly to ttt_steps by that
        fraction of the run."""
        K, ramp = self.cfg.ttt_steps, self.cfg.ttt_ramp
        return min(K, 1 + int(self.progress() / ramp * (K - 1))) if ramp else K

    def chunks(self, *xs: torch.Tensor, n: int | None = None) -> zip:
        """The tensors [b, s, ...] cut into n (default eagle.logit_chunk; 0: all) positions along the sequence."""
        n = (self.cfg.logit_chunk if n is None else n) or xs[0].shape[1]
        return zip(*(x.split(n, 1) for x in xs), strict=True)

    @torch.no_grad()
    def teacher(self, f: torch.Tensor, cached: tuple[torch.Tensor, torch.Tensor] | None = None, batch: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """f [b, s, H] -> (p [b, s, Vd] the target's softmax renormalised over the draft vocabulary, mass [b, s] the
        target's probability on the draft vocabulary, greedy [b, s] its argmax over the whole vocabulary);
        full-vocabulary logits [b, batch x logit_chunk, V] exist for one chunk at a time (f [1, n, H] gathered from a
        batch of `batch` rows: the peak of that batch's chunk). With `cached` (EAGLE-3 from a hidden-state cache:
        log_z, greedy [b, s], the whole vocabulary's log-normaliser and argmax) the head runs over a pruned draft
        vocabulary's rows only. A draft vocabulary that is the whole vocabulary (EAGLE-1's) has mass 1."""
        pruned = self.cfg.version == 3 and self.drafter.d2t.numel() < self.drafter.t2d.numel()
        rows = self.drafter.draft_ids if pruned and cached is not None else None
        ps, masses, greedy = [], [], []
        for x, *known in self.chunks(f, *(cached if rows is not None else ()), n=batch * self.cfg.logit_chunk):
            logits = self.target.logits(x.to(self.target.lm_head.weight.dtype), rows).float()  # [b, c, V or Vd]
            if rows is None:
                known = [logits.logsumexp(-1) if pruned else None, logits.argmax(-1)]  # [b, c] each
                logits = logits[..., self.drafter.draft_ids] if pruned else logits  # [b, c, Vd]
            log_z, top = known
            greedy.append(top.long())
            masses.append((logits.logsumexp(-1) - log_z).exp().clamp(max=1.0) if pruned
                          else torch.ones_like(top, dtype=logits.dtype))
            ps.append(F.softmax(logits, -1))
        return torch.cat(ps, 1), torch.cat(masses, 1), torch.cat(greedy, 1)

    def divergence(self, out: torch.Tensor, p: torch.Tensor, mass: torch.Tensor, measure: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """out [b, c, H], p [b, c, Vd], mass [b, c] -> (D(p, q) [b, c], the draft's top-1 [b, c] in draft ids,
        accept [b, c]; both None unless `measure`), q the drafter's softmax. kl: -sum p log q (forward KL up to p's
        entropy); tv: 1/2 sum |p - q| = 1 - sum min(p, q); lk: -log accept. accept = sum_v min(mass p_v, q_v): the probability that exact
        verification at temperature 1 accepts a token drawn from q, against the target's whole-vocabulary
        distribution."""
        z = self.drafter.logits(out, self.target.lm_head).float()  # [b, c, Vd]
        if self.cfg.loss == "kl":
            d, q = ForwardKL.apply(z, p)  # [b, c], [b, c, Vd]
        else:
            q = F.softmax(z, -1)
        if measure or self.cfg.loss == "lk":
            accept = torch.minimum(p * mass[..., None], q if self.cfg.loss == "lk" else q.detach()).sum(-1)  # [b, c]
        if self.cfg.loss == "tv":
            d = 0.5 * (p - q).abs().sum(-1)
        elif self.cfg.loss == "lk":
            d = -accept.clamp_min(1e-6).log()
        return (d, z.argmax(-1), accept.detach()) if measure else (d, None, None)

    def chunked_divergence(self, out: torch.Tensor, p: torch.Tensor, mass: torch.Tensor, measure: bool
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`divergence` over chunks of eagle.loss_chunk positions, each recomputed in the backward (activation
        checkpointing), so that draft logits [b, chunk, Vd] exist for one chunk at a time; with 0, at once and kept."""
        n = self.cfg.loss_chunk
        recompute = n and torch.is_grad_enabled()
        parts = [checkpoint(self.divergence, o, q, m, measure, use_reentrant=False) if recompute
                 else self.divergence(o, q, m, measure) for o, q, m in self.chunks(out, p, mass, n=n)]
        return tuple(None if x[0] is None else torch.cat(x, 1) for x in zip(*parts, strict=True))

    def ttt(self, batch: dict, steps: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The training-time test unrolled `steps` times (default: `ttt_length()` in training, eagle.ttt_steps in
        evaluation, which may unroll further than training did); returns the weighted loss and per-step metrics:
        loss_k, acc_k (draft top-1 = target top-1) and cond_acc_k, the acceptance decoding sees: the
        same, among positions whose steps 0..k-1 were all accepted and fed the target's greedy tokens; and
        accept_k, the expected acceptance at temperature 1 of step k along the row (`divergence`). In training the
        head and the loss run at the trained positions alone (about half of a chat batch's), and the metrics count
        those; in evaluation, every position. Training steps that are not `measuring` return loss_k alone (the
        acceptance metrics cost a tenth of a 5-step EAGLE-3 step on CPU)."""
        cfg, d = self.cfg, self.drafter
        ids = batch["input_ids"]  # [b, s]
        b, s = ids.shape
        pos = batch.get("position_ids")
        pos = torch.arange(s, device=ids.device).expand(b, s) if pos is None else pos
        seq = (pos == 0).long().cumsum(1)  # [b, s] sequence id within a packed row
        if "attention_mask" in batch:
            seq = seq.masked_fill(batch["attention_mask"] == 0, -1)
        f, g = self.features(batch)  # [b, s, H], [b, s, n*H]
        K = steps or (self.ttt_length() if self.training else cfg.ttt_steps)
        measure = self.measuring or not self.training
        t = torch.arange(s, device=ids.device).expand(b, s)  # [b, m] the positions this step's queries run at
        keep = torch.ones_like(ids, dtype=torch.bool)  # [b, m] those of them that train

        def valid_at(t: torch.Tensor, j: int) -> torch.Tensor:
            """[b, m]: position t's step j - 1 has a target token to learn, x_{t+j+1} in t's sequence and loss-masked."""
            return (take(seq, t, j + 1, -2) == take(seq, t)) & take(batch["loss_mask"], t, j + 1).bool()
        # the teacher runs where a step learns the next token (in training; everywhere in evaluation); row[u] is
        # position u's row of its outputs
        first = valid_at(t, 0)  # [b, s] the positions whose step 0 trains
        need = first if self.training else torch.ones_like(keep)  # [b, s]
        row = need.flatten().cumsum(0).view(b, s) - 1  # [b, s]
        cached = (batch["log_z"][need][None], batch["greedy"][need][None]) if "log_z" in batch else None  # offline
        target_p, mass, top_n = (x[0] for x in self.teacher(f[need][None], cached, b))  # [n, Vd], [n], [n]
        greedy = torch.zeros_like(ids).masked_scatter(need, top_n)  # [b, s] the target's next token
        with torch.no_grad():
            emb = self.target.embed(ids).float()  # [b, s, H]
        if self.training and cfg.feature_noise:
            g = g + (torch.rand_like(g) - 0.5) * cfg.feature_noise * 512 / s
        same = (seq[:, :, None] == seq[:, None, :]) & (seq[:, :, None] >= 0)  # [b, s, s]
        causal = same & torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        past: list[list] = [[] for _ in range(cfg.num_layers)]  # per layer, each step's keys and values
        h, on_path, total = g, torch.ones_like(ids, dtype=torch.bool), 0.0
        if cfg.input_weight or cfg.fuse_weight:  # step 0 reads fc(g), which the regressions below read too
            h = d.fuse(g)  # [b, s, H]
            fused = h.detach()
        if cfg.fuse_weight:  # step 0's input through the norm, against the feature the later steps' inputs approach
            l1 = F.smooth_l1_loss(d.norm(h), f, reduction="none").mean(-1)  # [b, s]
            total = total + cfg.fuse_weight * masked_mean(l1, first)  # 0 on a batch with nothing to train
        metrics: dict[str, float] = {}
        for k in range(K):
            j = 1 + k  # query t reads token x_{t+j} and is trained on the target's distribution at t+j
            if k == 1 and self.training:  # later steps run where one trains (a query reads step-0 keys and its own)
                needed = torch.stack([valid_at(t, i) for i in range(2, K + 1)]).any(0)  # [b, s]
                if cfg.ttt_fraction < 1:  # an unbiased sample of them: each later step's mean loss is unchanged
                    u = row_uniform(ids, batch.get("attention_mask"), f"{self.progress():.12f}")  # [b, s]
                    needed = needed & (u < cfg.ttt_fraction)
                t, keep = later_positions(needed)
                h, on_path = take(h, t), take(on_path, t)  # [b, m, H], [b, m]
            m = t.shape[1]
            visible = causal.gather(1, t[..., None].expand(b, m, s))  # [b, m, s] step 0's keys each query reads
            out = d(*self.step_input(k, take(emb, t, j), h), take(pos, t) + k, visible, past)  # [b, m, H]
            valid = valid_at(t, j) & keep  # [b, m]
            target_next = take(greedy, t, j)  # [b, m]
            trained = valid & d.t2d[target_next]  # a target argmax outside the draft vocabulary is not trained
            rows = trained if self.training else torch.ones_like(valid)  # [b, m] where the head and loss run
            bi, ti = rows.nonzero(as_tuple=True)  # [N] each
            tj = (t[bi, ti] + j).clamp(max=s - 1)  # [N] past the end: never trained
            head = not (self.training and cfg.head_steps and k >= cfg.head_steps)  # the draft loss at this step
            step_loss = out.new_zeros(())
            if head:
                div, top, accept = (x if x is None else x[0] for x in self.chunked_divergence(
                    out[bi, ti][None], target_p[row[bi, tj]][None], mass[row[bi, tj]][None], measure))  # [N] each
                step_loss = masked_mean(div, trained[bi, ti]) * (cfg.token_weight if cfg.version == 1 else 1.0)
            if cfg.feature_weight:  # the features the head reads, against the target's own (EAGLE-1's regression)
                read = out if cfg.version == 1 else d.norm(out)  # [b, m, H]
                l1 = F.smooth_l1_loss(read, take(f, t, j), reduction="none").mean(-1)  # [b, m]
                step_loss = step_loss + cfg.feature_weight * masked_mean(l1, valid)
            if cfg.input_weight:  # the output step k + 1 reads, against what step 0 reads at t + j
                l1 = F.smooth_l1_loss(out[bi, ti], fused[bi, tj], reduction="none").mean(-1)  # [N]
                step_loss = step_loss + cfg.input_weight * masked_mean(l1, trained[bi, ti])
            total = total + cfg.decay ** k * step_loss
            metrics[f"loss_{k}"] = step_loss.item()
            if head and measure:  # the acceptance metrics read the draft logits
                ok = torch.zeros_like(valid).index_put((bi, ti), d.draft_ids[top] == target_next[bi, ti])  # [b, m]
                counted = valid & rows  # [b, m] the positions the metrics count
                metrics[f"acc_{k}"] = masked_mean(ok.float(), counted).item()
                metrics[f"cond_acc_{k}"] = masked_mean(ok.float(), counted & on_path).item()
                metrics[f"accept_{k}"] = masked_mean(accept, counted[bi, ti]).item()
                on_path = on_path & ok & (take(ids, t, j + 1) == target_next)  # next step fed what decoding would feed
            h = out
        return total, metrics

    def step_input(self, k: int, emb: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What TTT step k feeds the drafter: the embedding of x_{t+1+k} [b, s, H] and, after step 0, the drafter's
        own previous output h [b, s, H] (P-EAGLE feeds placeholders instead, models/p_eagle.py)."""
        return emb, h

    # ---- decoding and checkpoints ---------------------------------------------------------------------

    def proposer(self, target=None, **kwargs) -> EagleProposer:
        """A proposer over the current drafter (chain by default; mode='tree' for EAGLE-2 dynamic trees)."""
        return EagleProposer(self.drafter, self.target.embed, self.target.lm_head, self.layers, **kwargs)

    def extra_state(self) -> dict:
        return {"draft_ids": self.drafter.draft_ids.tolist()}

    def load_extra_state(self, state: dict) -> None:
        if state["draft_ids"] != self.drafter.draft_ids.tolist():
            raise ValueError("the checkpoint's draft vocabulary differs from the one built from this data; "
                             "resume with the same data and eagle.draft_vocab_size")

    def save_pretrained(self, out: str | Path) -> None:
        """drafter.json (method, version, layers, target), config.json (the layer's Llama config) and
        eagle.safetensors (SGLang names; no embedding, the target's is used)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.drafter.state_dict().items()}, out / WEIGHTS_FILE)
        (out / CONFIG_FILE).write_text(self.drafter.config.to_json_string())
        write_drafter_meta(out, "eagle", version=self.cfg.version, aux_layers=self.layers,
                           aux_layers_convention="hidden_states index: the input to decoder layer i (EAGLE repository)",
                           ttt_steps=self.cfg.ttt_steps,
                           **target_fields({"target": self.target.path, "target_as_given": self.target.given}))


def load_drafter(path: str | Path, device=None, dtype=None) -> tuple[EagleDrafter, dict]:
    """A drafter checkpoint dir -> (EagleDrafter with its weights, drafter.json)."""
    path = Path(path)
    meta = read_drafter_meta(path)
    config = LlamaConfig.from_json_file(path / CONFIG_FILE)
    config._attn_implementation = "sdpa"
    state = load_file(path / WEIGHTS_FILE)
    draft_ids = state["d2t"] + torch.arange(state["d2t"].numel())
    drafter = EagleDrafter(config, meta["version"], draft_ids, max(1, len(meta["aux_layers"])))
    if "mask_hidden" in state:  # P-EAGLE's placeholder feature (models/p_eagle.py)
        drafter.mask_hidden = nn.Parameter(torch.zeros_like(state["mask_hidden"]))
    drafter.load_state_dict(state)
    return drafter.to(device=device, dtype=dtype).eval(), meta


def load_proposer(path: str | Path, target, **kwargs) -> EagleProposer:
    """The plug-in's proposer loader (models/registry.py) for an EAGLE drafter dir."""
    target = target if isinstance(target, Target) else Target(target, None, "")
    drafter, meta = load_drafter(path, target.lm_head.weight.device, target.lm_head.weight.dtype)
    return EagleProposer(drafter, target.embed, target.lm_head, meta["aux_layers"], **kwargs)


def load_eagle(path: str | Path, target: Target | None = None) -> Eagle:
    """A trained Eagle method from a drafter dir (its target loaded from drafter.json unless given)."""
    drafter, meta = load_drafter(path)
    target = target or load_target(meta["target"])
    cfg = EagleConfig(version=meta["version"], aux_layers=meta["aux_layers"], ttt_steps=meta["ttt_steps"],
                      draft_vocab_size=drafter.d2t.numel(), intermediate_size=drafter.config.intermediate_size,
                      num_key_value_heads=drafter.config.num_key_value_heads,
                      fc_norm=getattr(drafter.config, "fc_norm", False),
                      num_layers=drafter.config.num_hidden_layers)
    method = Eagle(target, cfg, drafter.draft_ids)
    method.drafter.load_state_dict(drafter.state_dict())
    return method


class EagleProposer(Proposer):
    """EAGLE drafting on the shared verifier: feature-space autoregression with the drafter's own KV cache.

    Before each draft (`catch_up`) the cache is cut back to the committed positions and extended with the
    target's features of the tokens committed since the last draft (entry p holds feature f_p with token
    x_{p+1}, at rope position p), so drafting always restarts from the target's own hidden states. Then:
    - chain: gamma tokens, each fed back with the drafter's output hidden state;
    - tree, greedy (EAGLE-2's dynamic tree): `depth` rounds; each round expands the `top_k` best frontier nodes
      by their `top_k` children, scored by the cumulative log draft probability q, the greedy chain's tip always
      among them. The tree is the greedy chain (each node's top-1 child from the root: the chain proposer's own
      draft, `depth` deep) and the best other nodes over all depths up to `total_tokens` (ancestors score at
      least as high as descendants, so it is closed). EAGLE-2 keeps the best nodes alone and drops the chain's
      deep tokens wherever q is unsure early: its greedy tree accepted less than a chain as deep (README).
    - tree, sampling: a shape fixed before anything is drawn, then filled level by level with draws without
      replacement (each node records the q it was drawn from, for the exact verifier). The j-th draw at a node is
      the child the verifier accepts with chance prod_{i<j} (1 - a_i) a_j, a_j the rate at which a j-th draw was
      accepted once tested, learnt from the verifications so far; a node is reached with the product of the
      chances along its path, and the `total_tokens` likeliest nodes within `depth` levels, closed under
      ancestors and earlier draws, form the shape. The shape must not depend on the drawn tokens: a draw kept
      or dropped for its own q (as EAGLE-2's scores would) skews which tokens the verifier lets out
      (tests/test_eagle.py, `test_a_sampled_tree_keeps_the_targets_distribution_where_a_q_scored_one_did_not`).
    """

    def __init__(self, drafter: EagleDrafter, embed: nn.Module, target_head: nn.Module, layers,
                 mode: Literal["chain", "tree"] = "chain", gamma: int = 5, top_k: int = 8, depth: int = 5,
                 total_tokens: int = 32):
        if mode not in ("chain", "tree") or min(gamma, top_k, depth, total_tokens) < 1:
            raise ValueError("EAGLE proposer: mode must be chain or tree and gamma, top_k, depth, total_tokens >= 1")
        self.drafter, self.embed, self.head = drafter, embed, target_head
        self.hidden_layers = tuple(layers) or (-1,)
        self.mode, self.gamma, self.top_k, self.depth, self.total_tokens = mode, gamma, top_k, depth, total_tokens
        self.draws = [[ALPHA_PRIOR * ALPHA_PRIOR_N, ALPHA_PRIOR_N] for _ in range(top_k)]  # sampled trees: per draw
        # index j at a node, [accepted, tested]
        self.reset()

    def reset(self) -> None:
        self.cache, self.n, self.last = kv.new_cache(), 0, None  # committed entries, output at the last one [H]
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tokens [m], features [m, k*H]) not yet fed

    def _step(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
              ) -> torch.Tensor:
        """Feed q entries: tokens [q], h [q, D], positions [q], visible [q, cache + q] bool -> outputs [q, H]."""
        emb = self.embed(tokens[None]).to(h.dtype)  # [1, q, H]
        return self.drafter(emb, h[None], positions[None], additive(visible)[None, None], self.cache)[0]

    @torch.no_grad()
    def accept(self, ids: torch.Tensor, verified: Verified) -> None:
        """Records the committed entries; `catch_up` feeds them when the next draft needs them, so a step that
        drafts nothing (adaptive gamma's depth 0) costs no drafter forward, and several such steps cost one. The
        prompt's entries are fed at once (a cost per sequence, not per draft)."""
        if verified.hidden is None:
            return
        tree = verified.tree
        if tree is not None and tree.q is not None and self.mode == "tree":  # a_j: each tested draw, accepted or not
            for node, taken in zip([-1, *verified.path], [*verified.path, None], strict=True):
                for j, child in enumerate(tree.children(node)):  # tested in draw order until one is accepted
                    self.draws[j][1] += 1
                    if child == taken:
                        self.draws[j][0] += 1
                        break
        k, m, H = verified.hidden.shape
        feats = verified.hidden.permute(1, 0, 2).reshape(m, k * H).to(self.drafter.fc.weight.dtype)  # [m, k*H]
        self.pending.append((ids[ids.numel() - m:], feats))
        if verified.tree is None:
            self.catch_up(ids)

    def take_pending(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The recorded entries at once: tokens [M], features [M, k*H], rope positions [M] (n .. t - 2); the cache
        is cut back to the committed entries first (dropping the last draft's)."""
        kv.crop(self.cache, self.n)
        tokens, feats = (torch.cat(x) for x in zip(*self.pending, strict=True))
        self.pending = []
        if self.n + tokens.numel() != ids.numel() - 1:
            raise RuntimeError("EAGLE proposer: accept was not called after every verification")
        return tokens, feats, torch.arange(self.n, self.n + tokens.numel(), device=ids.device)

    @torch.no_grad()
    def catch_up(self, ids: torch.Tensor) -> None:
        """Feeds the entries recorded since the last draft in one forward (entry p: feature f_p, token x_{p+1})."""
        if not self.pending:
            return
        tokens, feats, positions = self.take_pending(ids)
        m = tokens.numel()
        visible = torch.ones(m, self.n + m, dtype=torch.bool, device=ids.device).tril(self.n)
        out = self._step(tokens, feats, positions, visible)  # [m, H]
        self.n, self.last = self.n + m, out[-1]

    def _draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.drafter.logits(out, self.head).float()  # [.., Vd]

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        self.catch_up(ids)
        if self.last is None:
            return DraftTree.empty(ids.device)
        return self._chain(ids, sampling) if self.mode == "chain" else self._tree(ids, sampling)

    def _over_target(self, qs: list[torch.Tensor]) -> torch.Tensor:
        """Draft-vocabulary distributions [Vd] each -> one [n, V] over the target's vocabulary, zero elsewhere.
        Drafting warps and samples the draft logits alone: the same as over the target's vocabulary with every
        other token at -inf, without a [V]-sized tensor per drafted token."""
        q = qs[0].new_zeros(len(qs), self.drafter.t2d.numel())
        q[:, self.drafter.draft_ids] = torch.stack(qs)
        return q

    def _chain(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        draft_ids = self.drafter.draft_ids  # [Vd]
        h, tokens, qs = self.last, [], []
        for i in range(self.gamma):
            x = int(draft_ids[draw(self._draft_logits(h), sampling, qs)])  # qs gets the [Vd] q when sampling
            tokens.append(x)
            if i + 1 < self.gamma:
                visible = torch.ones(1, self.n + i + 1, dtype=torch.bool, device=ids.device)
                pos = torch.tensor([self.n + i], device=ids.device)
                h = self._step(torch.tensor([x], device=ids.device), h[None], pos, visible)[0]
        return DraftTree.chain(torch.tensor(tokens, device=ids.device), self._over_target(qs) if qs else None)

    def _feed(self, nodes: list[int], level: int, tokens: list[int], parents: list[int], slot: dict[int, int],
              out_of: dict[int, torch.Tensor]) -> None:
        """Feeds tree nodes at depth `level` to the drafter in one forward, each after the committed entries and
        its ancestors' cache entries; records each node's cache entry (`slot`) and output [H] (`out_of`)."""
        dev, start = self.last.device, self.n + len(slot)
        visible = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool, device=dev)
        visible[:, : self.n] = True
        for r, i in enumerate(nodes):
            slot[i] = start + r
            a = parents[i]
            while a >= 0:
                visible[r, slot[a]] = True
                a = parents[a]
            visible[r, slot[i]] = True
        h_in = torch.stack([out_of[parents[i]] if parents[i] >= 0 else self.last for i in nodes])  # [F, H]
        pos = torch.full((len(nodes),), self.n + level - 1, device=dev)
        outs = self._step(torch.tensor([tokens[i] for i in nodes], device=dev), h_in, pos, visible)  # [F, H]
        for r, i in enumerate(nodes):
            out_of[i] = outs[r]

    def _tree(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        """EAGLE-2 (greedy), the greedy chain kept: expand the chain's tip and the top_k - 1 best other frontier
        nodes per round; keep the chain and the best nodes up to total_tokens, ordered by depth. Sampling:
        `_sampled_tree`."""
        if not sampling.greedy:
            return self._sampled_tree(ids, sampling)
        draft_ids, K = self.drafter.draft_ids, self.top_k  # [Vd]
        tokens, parents, scores, depth = [], [], [], []  # per node
        out_of: dict[int, torch.Tensor] = {}  # node -> drafter output after feeding it [H]
        slot: dict[int, int] = {}  # node -> its entry in the drafter cache

        def expand(h: torch.Tensor, froms: list[int]) -> list[int]:
            """The top_k children of `froms` (outputs h [F, H]) by log q -> indices of the new candidate nodes."""
            top = F.log_softmax(self._draft_logits(h), -1).topk(min(K, draft_ids.numel()), -1)  # [F, k] each
            new = []
            for parent, values, picks in zip(froms, top.values.tolist(), top.indices.tolist(), strict=True):
                for lq, x in zip(values, picks, strict=True):
                    new.append(len(tokens))
                    tokens.append(int(draft_ids[x]))
                    parents.append(parent)
                    scores.append(lq + (scores[parent] if parent >= 0 else 0.0))
                    depth.append(1 + (depth[parent] if parent >= 0 else 0))
            return new

        frontier = expand(self.last[None], [-1])
        chain = [frontier[0]]  # the greedy chain, each node its parent's top-1 child: the chain proposer's draft
        for level in range(1, self.depth):
            frontier = [chain[-1], *sorted((i for i in frontier if i != chain[-1]), key=lambda i: -scores[i])[:K - 1]]
            self._feed(frontier, level, tokens, parents, slot, out_of)
            frontier = expand(torch.stack([out_of[i] for i in frontier]), frontier)
            chain.append(frontier[0])  # the chain's tip is expanded first
        keep = chain[: self.total_tokens]
        best = sorted(range(len(tokens)), key=lambda i: (-scores[i], depth[i]))  # closed under ancestors, any prefix
        keep += [i for i in best if i not in chain][: self.total_tokens - len(keep)]
        return kept_tree(sorted(keep, key=lambda i: (depth[i], i)), tokens, parents, ids.device)

    def shape(self) -> list[int]:
        """The sampled tree's shape from the learnt draw chances alone (the class docstring): parents per node,
        -1 for the root's, parents before children, by depth, a node's children in draw order."""
        chance, left = [], 1.0  # chance[j]: the j-th draw is the accepted child; non-increasing in j
        for accepted, tested in self.draws:
            a = accepted / tested
            chance.append(min(left * a, chance[-1] if chance else 1.0))
            left *= 1 - a
        log_c = [math.log(c) for c in chance]  # each a_j lies strictly within (0, 1) (ALPHA_PRIOR)
        # best first: a popped node (parent, j) offers its next sibling and its first child, neither likelier than
        # it, so the pops are the likeliest nodes, closed under ancestors and earlier draws
        heap, nodes = [(-log_c[0], 1, 0, -1, 0)], []  # (-log reach, depth, tie-break, parent, j); nodes: (parent, depth)
        while heap and len(nodes) < self.total_tokens:
            score, d, _, parent, j = heapq.heappop(heap)
            nodes.append((parent, d))
            if j + 1 < len(log_c):
                heapq.heappush(heap, (score - log_c[j + 1] + log_c[j], d, len(nodes), parent, j + 1))
            if d < self.depth:
                heapq.heappush(heap, (score - log_c[0], d + 1, len(nodes), len(nodes) - 1, 0))
        order = sorted(range(len(nodes)), key=lambda i: (nodes[i][1], i))  # by depth, draw order kept
        index = {old: new for new, old in enumerate(order)}
        return [index[nodes[i][0]] if nodes[i][0] >= 0 else -1 for i in order]

    def _sampled_tree(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        """`shape()` filled level by level: each parent's children are its first draws without replacement from
        its warped q (fewer where q has fewer tokens: the missing draws' subtrees are dropped)."""
        draft_ids, parents = self.drafter.draft_ids, self.shape()  # [Vd]
        lay = layout(parents)
        n, levels = len(parents), lay.depth[1:].tolist()
        tokens, qs, alive = [0] * n, [None] * n, [False] * n
        out_of: dict[int, torch.Tensor] = {}  # node -> drafter output after feeding it [H]
        slot: dict[int, int] = {}  # node -> its entry in the drafter cache
        for level in range(1, max(levels, default=0) + 1):
            froms = sorted({parents[i] for i in range(n) if levels[i] == level and (parents[i] < 0 or alive[parents[i]])})
            if level > 1:
                self._feed(froms, level - 1, tokens, parents, slot, out_of)
            h = torch.stack([out_of[a] if a >= 0 else self.last for a in froms])  # [F, H]
            for a, q in zip(froms, warp(self._draft_logits(h), sampling), strict=True):  # [Vd] per parent
                kids = lay.kids[a + 1]  # in draw order
                k = min(len(kids), int((q > 0).sum()))
                # k sequential draws without replacement, each from q renormalised over what is left (multinomial
                # without replacement draws exactly so, in this order); draw j's q has draws 0..j-1 zeroed
                picks = torch.multinomial(q, k, replacement=False, generator=sampling.generator)  # [k]
                drawn = F.one_hot(picks, q.numel()).to(q.dtype)  # [k, Vd]
                left = q * (1 - (drawn.cumsum(0) - drawn))  # [k, Vd]
                for i, x, q_node in zip(kids, picks.tolist(), left / left.sum(-1, keepdim=True), strict=False):
                    tokens[i], qs[i], alive[i] = int(draft_ids[x]), q_node, True
        keep = [i for i in range(n) if alive[i]]
        return kept_tree(keep, tokens, parents, ids.device, self._over_target([qs[i] for i in keep]))


def kept_tree(keep: list[int], tokens: list[int], parents: list[int], device, q: torch.Tensor | None = None
              ) -> DraftTree:
    """The nodes `keep` (a list closed under parents, parents first) of a candidate tree, renumbered."""
    index = {old: new for new, old in enumerate(keep)}
    return DraftTree(torch.tensor([tokens[i] for i in keep], device=device),
                     torch.tensor([index[parents[i]] if parents[i] >= 0 else -1 for i in keep], device=device), q)


def variants(drafter_dir: Path, target: nn.Module) -> dict[str, Drafting]:
    """The leaderboard's ways to decode with an EAGLE drafter (on the target's embedding and LM head): a chain, and
    the EAGLE-2 tree at scripts/bench_eagle.py's CPU size (top 8 per node, 5 rounds, 24 nodes kept)."""
    first = load_proposer(drafter_dir, target)
    runs = [first.drafter, first.embed, first.head]

    def proposer(**kwargs) -> EagleProposer:
        return EagleProposer(first.drafter, first.embed, first.head, first.hidden_layers, **kwargs)
    return {"chain": Drafting(target, lambda g: proposer(mode="chain", gamma=g), runs, gamma=5),
            "tree": Drafting(target, lambda g: proposer(mode="tree", top_k=8, depth=5, total_tokens=24), runs)}
