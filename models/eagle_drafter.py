"""The EAGLE drafter's layers (the method, its loss and training-time test: models/eagle.py).

One Llama-style decoder layer ("midlayer") autoregresses in the target's feature space; EAGLE-1 reads
fc([e(x_{t+1}); f_t]), EAGLE-3 [input_layernorm(e(x_{t+1})); hidden_norm(fc(g_t))] with g_t the target's hidden states
of three layers, and has its own norm + lm_head over a pruned draft vocabulary.

With eagle.num_layers n > 1 the midlayer's output goes through n - 1 plain pre-norm Llama layers before the head
(`DecoderLayer`, as vLLM and speculators build a multi-layer EAGLE-3 drafter); each has its own keys in the
training-time test and its own entry in the decoding KV cache.

The token embedding is the target's own module, frozen with the target (a copy would be identical).

Weights are named as SGLang / SpecForge name them (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
`t2d`; the later layers `additional_layers.*`), so exports are renames (models/eagle_export.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from draftsmith.data.core import REDO_DRAFTER, read_drafter_meta, read_file

WEIGHTS_FILE, CONFIG_FILE = "eagle.safetensors", "config.json"


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


class TTTPast:
    """One drafter layer's keys and values of each earlier training-time-test step, as `ttt_attention` appends them.
    An object, not a list: DeepSpeed ZeRO-3's module hooks rebuild every list and tuple argument of a forward, so a
    step appended to a list argument was lost and the next step read its own keys as step 0's."""

    def __init__(self):
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []


def attend(attn: LlamaAttention, x: torch.Tensor, rope: tuple, mask: torch.Tensor, cache) -> torch.Tensor:
    """A drafter layer's attention: `ttt_attention` in training-time test (cache a `TTTPast`), else over the
    decoder's KV cache with an additive mask [b, 1, q, keys]."""
    if isinstance(cache, TTTPast):
        return ttt_attention(attn, x, rope, mask, cache)
    return attn(x, position_embeddings=rope, attention_mask=mask.to(x.dtype), cache=cache)[0]


def ttt_attention(attn: LlamaAttention, x: torch.Tensor, rope: tuple, visible: torch.Tensor,
                  past: TTTPast) -> torch.Tensor:
    """The drafter's attention in training-time test at step k = len(past.steps), what decoding's cache and mask compute:
    queries x [b, m, 2H or H] read step 0's keys where visible [b, m, s], and the key of each step 1..k at their own
    position; that is one dot product per step, not the [m, m] block of which a mask would keep the diagonal.
    Appends this step's (keys, values), repeated to every head [b, heads, m, d], to past -> attention output [b, m, H]."""
    b, m, _ = x.shape
    q, key, value = (proj(x).view(b, m, -1, attn.head_dim).transpose(1, 2)
                     for proj in (attn.q_proj, attn.k_proj, attn.v_proj))  # [b, heads or kv_heads, m, d]
    q, key = apply_rotary_pos_emb(q, key, *rope)
    past.steps.append((repeat_kv(key, attn.num_key_value_groups), repeat_kv(value, attn.num_key_value_groups)))
    (k0, v0), *later = past.steps  # [b, heads, s or m, d] each
    q = q * attn.scaling
    scores = q @ k0.transpose(2, 3)  # [b, heads, m, s]; under autocast in its dtype, which q's may not be
    scores = scores.masked_fill(~visible[:, None], torch.finfo(scores.dtype).min)
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
        position_ids [b, q]; mask and cache as `MidLayer.forward` reads them -> output hidden [b, q, H]. With h
        [b, q' < q, n*H], queries q'.. read P-EAGLE's learned placeholder `mask_hidden`: read here, inside the forward,
        because ZeRO-3 gathers a module's own parameters only there (outside it has shape [0])."""
        if h.shape[1] < emb.shape[1]:
            fill = self.mask_hidden.to(h.dtype).expand(h.shape[0], emb.shape[1] - h.shape[1], -1)  # [b, q - q', n*H]
            h = torch.cat([h, fill], 1)  # [b, q, n*H]
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


def additive(visible: torch.Tensor) -> torch.Tensor:
    """Bool visibility -> additive mask (0 where visible, -inf elsewhere), same shape."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))


def load_drafter(path: str | Path, device=None, dtype=None) -> tuple[EagleDrafter, dict]:
    """A drafter checkpoint dir -> (EagleDrafter with its weights, drafter.json)."""
    path = Path(path)
    meta = read_drafter_meta(path)
    config = LlamaConfig.from_dict(read_file(path / CONFIG_FILE, REDO_DRAFTER))
    config._attn_implementation = "sdpa"
    state = read_file(path / WEIGHTS_FILE, REDO_DRAFTER)
    draft_ids = state["d2t"] + torch.arange(state["d2t"].numel())
    drafter = EagleDrafter(config, meta["version"], draft_ids, max(1, len(meta["aux_layers"])))
    if "mask_hidden" in state:  # P-EAGLE's placeholder feature (models/p_eagle.py)
        drafter.mask_hidden = nn.Parameter(torch.zeros_like(state["mask_hidden"]))
    drafter.load_state_dict(state)
    return drafter.to(device=device, dtype=dtype).eval(), meta
