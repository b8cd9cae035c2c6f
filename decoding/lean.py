"""The target's decoder body without Hugging Face's per-forward machinery, for the decode loop on a CPU.

    forward = lean_forward(target)        # None where the architecture is not covered
    out = forward(input_ids=tokens, position_ids=pos, attention_mask=mask, cache=cache,
                  output_hidden_states=True)   # out.last_hidden_state [1, q, H], out.hidden_states

A small target's forward over a few tokens on a CPU is mostly fixed cost: its matmuls read the weights once
(memory-bound at 1-5 tokens), and the rest is Hugging Face's Python around them (the kwargs decorators of
every layer and attention, output capture, the causal-mask builder, the attention dispatch) and one op per
projection. This runs the same norms, rotary embedding and MLP activation and the same
`sdpa_attention_forward` with the same inputs in one plain loop over the layers, with q/k/v and the MLP's
gate/up each as one matmul over their weights concatenated (built when the forward is made: one decode call),
writing into the same `DynamicCache` (so `cache.keep` rolls it back as before). The result is bit-identical
(tests/test_decoding_lean.py). A projection that is not a plain `nn.Linear` (a LoRA layer) is called as a
module instead. Covered: Llama, Mistral, Qwen2 and Qwen3 with full attention in every layer (no sliding
window), sdpa attention, and no forward hooks in the body (FSDP, DeepSpeed ZeRO-3 gather their shards in
hooks); anything else keeps the model's own forward. `hidden_states` follows Hugging Face's convention:
entry i is the input to layer i, the last one the output after the final norm.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

LEAN = {"llama", "mistral", "qwen2", "qwen3"}


def _full_attention(config) -> bool:
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return False
    return getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)


def lean_forward(target) -> LeanForward | None:
    """A `LeanForward` over the target's body where it is covered (module docstring), else None."""
    config, body = target.config, target.base_model
    if config.model_type not in LEAN or not _full_attention(config) or config._attn_implementation != "sdpa":
        return None
    if not all(hasattr(body, name) for name in ("embed_tokens", "layers", "rotary_emb", "norm")):
        return None  # not the transformers layout this was read from
    if any(m._forward_pre_hooks or m._forward_hooks for m in body.modules()):
        return None
    return LeanForward(body)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Hugging Face applies it: x [b, h, q, d], cos / sin [b, 1, q, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class Fused:
    """Linear modules applied to the same input as one matmul over their concatenated weights (and biases), split
    after; modules that are not plain `nn.Linear` (LoRA layers) are run one by one."""

    def __init__(self, *modules: nn.Module):
        self.forwards = [m.forward for m in modules]
        self.weight = self.bias = None
        if all(type(m) is nn.Linear for m in modules):
            self.weight = torch.cat([m.weight for m in modules])  # [sum out, in]
            if modules[0].bias is not None:
                self.bias = torch.cat([m.bias for m in modules])
            self.sizes = [m.out_features for m in modules]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.weight is None:
            return tuple(f(x) for f in self.forwards)
        return F.linear(x, self.weight, self.bias).split(self.sizes, -1)


class LeanForward:
    """The body of a covered target (module docstring): the same keyword arguments as its `base_model`. Modules
    run through their `forward`, skipping `nn.Module.__call__` (there are no hooks to run)."""

    def __init__(self, body):
        self.body = body
        self.layers = []
        for layer in body.layers:
            a, mlp = layer.self_attn, layer.mlp
            qk_norm = (a.q_norm.forward, a.k_norm.forward) if hasattr(a, "q_norm") else None  # Qwen3
            self.layers.append((layer.input_layernorm.forward, Fused(a.q_proj, a.k_proj, a.v_proj), qk_norm, a,
                                a.o_proj.forward, layer.post_attention_layernorm.forward,
                                Fused(mlp.gate_proj, mlp.up_proj), mlp.act_fn.forward, mlp.down_proj.forward))

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, attention_mask=None,
                 output_hidden_states: bool = False, **_) -> SimpleNamespace:
        body = self.body
        h = body.embed_tokens.forward(input_ids)  # [1, q, H]
        q, past = input_ids.shape[1], cache.get_seq_length()
        if isinstance(attention_mask, dict):  # one entry per layer type: all full attention here
            attention_mask = attention_mask["full_attention"]
        if attention_mask is None and q > 1 and past:  # a chain after the prefix: causal, offset by the prefix
            attention_mask = torch.ones(q, past + q, dtype=torch.bool, device=h.device).tril(past)[None, None]
        cos, sin = (x[:, None] for x in body.rotary_emb(h, position_ids))  # [1, 1, q, d] each
        hidden = [h] if output_hidden_states else None
        for norm_1, qkv, qk_norm, a, o_proj, norm_2, gate_up, act, down_proj in self.layers:
            qs, ks, vs = (t.view(1, q, -1, a.head_dim) for t in qkv(norm_1(h)))  # [1, q, heads, d]
            if qk_norm:  # RMSNorm per head before the rotary embedding
                qs, ks = qk_norm[0](qs), qk_norm[1](ks)
            qs, ks, vs = (t.transpose(1, 2) for t in (qs, ks, vs))  # [1, heads, q, d]
            ks, vs = cache.update(_rotate(ks, cos, sin), vs, a.layer_idx)  # [1, kv_heads, past + q, d]
            o, _ = sdpa_attention_forward(a, _rotate(qs, cos, sin), ks, vs, attention_mask, scaling=a.scaling)
            h = h + o_proj(o.reshape(1, q, -1))
            g, u = gate_up(norm_2(h))
            h = h + down_proj(act(g) * u)
            if hidden is not None:
                hidden.append(h)
        h = body.norm.forward(h)
        if hidden is not None:
            hidden[-1] = h
        return SimpleNamespace(last_hidden_state=h, hidden_states=hidden)
