"""The target's decoder body without Hugging Face's per-forward machinery, for the decode loop on a CPU.

    forward = lean_forward(target)        # None where the architecture is not covered
    out = forward(input_ids=tokens, position_ids=pos, attention_mask=mask, cache=cache,
                  output_hidden_states=True)   # out.last_hidden_state [1, q, H], out.hidden_states

A small target's forward over a few tokens on a CPU is mostly fixed cost: its matmuls read the weights once
(memory-bound at 1-5 tokens), and the rest is Hugging Face's Python around them (the kwargs decorators of
every layer and attention, output capture, the causal-mask builder, the attention dispatch) and one op per
projection. This runs the same computation in one plain loop over the layers with fewer ops: q/k/v and the
MLP's gate/up each as one matmul over their weights concatenated, q and k rotated together, float32 RMSNorm as
`F.rms_norm`, grouped-query attention as one `scaled_dot_product_attention` with `enable_gqa` (no repeated
keys and values), writing into the same `DynamicCache` (so `cache.keep` rolls it back as before). The
projections whose output is at least as wide as their input (q/k/v, o, gate/up, and the LM head as `head`)
read transposed copies of their weights (`Fused`), which a CPU matmul over 1-3 rows reads up to twice as fast.
The result equals the model's own forward to float32 rounding (bit for bit from 4 rows where we measured;
tests/test_decoding_lean.py), the same kind of difference as between Hugging Face's forward over 1 row and
over 2. The copies (about the model's size again) are built once per model and rebuilt when a parameter
changes (an optimizer step, a loaded state dict). A projection that is not a plain `nn.Linear` (a LoRA layer)
is called as a module instead. Covered: Llama, Mistral, Qwen2 and Qwen3 with full attention in every layer (no
sliding window), Gemma-3 (its sliding-window layers masked to their window over the full cache, as the decoder's
caches hold every position; its four norms a layer, (1 + weight) RMSNorms; one rotary embedding per layer type),
sdpa attention, and no forward hooks in the model (FSDP, DeepSpeed ZeRO-3 gather their shards
in hooks) but transformers' own output capture (installed by the first forward with `output_hidden_states`, as
EAGLE's feature extraction runs; it records a module's output only inside the model's own forward); anything else
keeps the model's own forward. `hidden_states` follows Hugging Face's convention: entry i is the input to layer i,
the last one the output after the final norm.
"""

from __future__ import annotations

import itertools
import weakref
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from draftsmith.decoding.tree import tree_attention_mask

LEAN = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"}


def _covered_attention(config) -> bool:
    """Full attention in every layer; or Gemma-3's layers of two types, without soft-caps or bidirectional attention."""
    if config.model_type == "gemma3_text":
        return (config.attn_logit_softcapping is None and config.final_logit_softcapping is None
                and not config.use_bidirectional_attention)
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return False
    return getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)


def lean_forward(target) -> LeanForward | None:
    """A `LeanForward` over the target's body where it is covered (module docstring), else None; the same object
    for the same target while its parameters are unchanged."""
    config, body = target.config, target.base_model
    if config.model_type not in LEAN or not _covered_attention(config) or config._attn_implementation != "sdpa":
        return None
    if not all(hasattr(body, name) for name in ("embed_tokens", "layers", "rotary_emb", "norm")):
        return None  # not the transformers layout this was read from
    if any(_foreign(m._forward_pre_hooks) or _foreign(m._forward_hooks) for m in target.modules()):
        return None
    version = [(id(p), p._version) for p in target.parameters()]
    cached = _BUILT.get(target)
    if cached is None or cached[0] != version:
        _BUILT[target] = cached = version, LeanForward(target)
    return cached[1]


def _foreign(hooks: dict) -> bool:
    """Whether `hooks` holds any hook but transformers' output capture (module docstring)."""
    return any(getattr(h, "__module__", None) != "transformers.utils.output_capturing" for h in hooks.values())


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> (its parameters' versions, LeanForward)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Hugging Face applies it: x [..., d], cos / sin broadcast to it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _norm(module: nn.Module | None):
    """An RMSNorm's forward; `F.rms_norm` for a float32 Llama-style one or Gemma-3's, which scales by 1 + weight
    (the same result, one op); None for None."""
    if module is None or not type(module).__name__.endswith("RMSNorm") or module.weight.dtype != torch.float32:
        return None if module is None else module.forward
    shape = module.weight.shape
    if type(module).__name__ == "Gemma3RMSNorm":
        weight, eps = 1.0 + module.weight.detach(), module.eps
    else:
        weight, eps = module.weight, module.variance_epsilon
    return lambda x: F.rms_norm(x, shape, weight, eps)


class Fused:
    """Linear modules applied to the same input as one matmul over their concatenated weights (and biases), held
    transposed: on a CPU a [k, in] x [in, out] matmul with out >= in reads the weights up to twice as fast at 1-3
    rows as `F.linear`'s [out, in] (the same result at 4 rows and more, the same rounding error below). Modules
    that are not plain `nn.Linear` (LoRA layers) are run one by one and their outputs concatenated."""

    def __init__(self, *modules: nn.Module):
        self.forwards = [m.forward for m in modules]
        self.weight_t = self.bias = None
        if all(type(m) is nn.Linear for m in modules):
            self.weight_t = torch.cat([m.weight for m in modules]).t().contiguous()  # [in, sum out]
            if modules[0].bias is not None:
                self.bias = torch.cat([m.bias for m in modules])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_t is None:
            return torch.cat([f(x) for f in self.forwards], -1)
        y = x.reshape(-1, x.shape[-1])  # [k, in]
        y = y @ self.weight_t if self.bias is None else torch.addmm(self.bias, y, self.weight_t)
        return y.view(*x.shape[:-1], -1)  # [..., sum out]


class LeanForward:
    """The body of a covered target (module docstring): the same keyword arguments as its `base_model`. Modules
    run through their `forward`, skipping `nn.Module.__call__` (no hook there that this needs)."""

    def __init__(self, target):
        self.body = body = target.base_model
        self.norm, self.head = _norm(body.norm), Fused(target.get_output_embeddings())  # head: [.., H] -> [.., V]
        config = target.config
        types = getattr(config, "layer_types", None) or ["full_attention"] * len(body.layers)
        # Gemma-3: rotary embeddings per layer type (another base for sliding layers); the others have one.
        self.rope_types = sorted(set(types)) if hasattr(body.rotary_emb, "layer_types") else None
        self.windows = {t: config.sliding_window if t == "sliding_attention" else None for t in set(types)}
        self.layers = []
        for layer, layer_type in zip(body.layers, types, strict=True):
            a, mlp = layer.self_attn, layer.mlp
            qk_norm = (_norm(a.q_norm), _norm(a.k_norm)) if hasattr(a, "q_norm") else None  # Qwen3, Gemma-3
            n_q = a.config.num_attention_heads
            heads = (n_q, n_q // a.num_key_value_groups, a.head_dim)
            sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma-3: norms after attention and MLP too
            norm_2 = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            self.layers.append((layer_type, _norm(layer.input_layernorm), Fused(a.q_proj, a.k_proj, a.v_proj), heads,
                                qk_norm, a.scaling, Fused(a.o_proj),
                                _norm(layer.post_attention_layernorm if sandwich else None), _norm(norm_2),
                                Fused(mlp.gate_proj, mlp.up_proj), mlp.act_fn.forward, mlp.down_proj.forward,
                                _norm(layer.post_feedforward_layernorm if sandwich else None)))

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, attention_mask=None,
                 output_hidden_states: bool = False, **_) -> SimpleNamespace:
        return self.ragged([dict(input_ids=input_ids, position_ids=position_ids, cache=cache,
                                 attention_mask=attention_mask, output_hidden_states=output_hidden_states)])[0]

    def ragged(self, queries: list[dict]) -> list[SimpleNamespace]:
        """Several sequences' forwards as one: each query holds `__call__`'s keyword arguments for one sequence (its
        own tokens [1, q_i], positions, mask and cache). Embedding, projections, MLP and norms run once over the
        concatenated tokens [1, sum q_i, H] (the weights are read once), attention per sequence against its own
        cache; no padding, so each sequence's result is its own forward's up to float rounding. One output per
        query, as `__call__` returns it."""
        body = self.body
        sizes = [q["input_ids"].shape[1] for q in queries]
        spans = [slice(end - size, end) for size, end in zip(sizes, itertools.accumulate(sizes), strict=True)]
        h = body.embed_tokens.forward(torch.cat([q["input_ids"] for q in queries], 1))  # [1, Q, H], Q = sum q_i
        Q = h.shape[1]
        masks = {t: [_mask(q.get("attention_mask"), size, q["cache"].get_seq_length(), h.device, h.dtype, t, window)
                     for q, size in zip(queries, sizes, strict=True)]
                 for t, window in self.windows.items()}  # per layer type: (mask, causal) per sequence
        pos = torch.cat([q["position_ids"] for q in queries], 1)  # [1, Q]
        rope = ({t: body.rotary_emb(h, pos, t) for t in self.rope_types} if self.rope_types else
                dict.fromkeys(self.windows, body.rotary_emb(h, pos)))
        rope = {t: [x[:, :, None] for x in cs] for t, cs in rope.items()}  # cos, sin: [1, Q, 1, d] each
        hidden = [h] if any(q.get("output_hidden_states") for q in queries) else None
        for layer_idx, layer in enumerate(self.layers):
            (layer_type, norm_1, qkv, (n_q, n_kv, d), qk_norm, scaling, o_proj, post_attn, norm_2, gate_up, act,
             down_proj, post_mlp) = layer
            cos, sin = rope[layer_type]
            x = qkv(norm_1(h)).view(1, Q, n_q + 2 * n_kv, d)  # [1, Q, heads: q | k | v, d]
            if qk_norm:  # Qwen3, Gemma-3: RMSNorm per head before the rotary embedding
                qs, ks = (_rotate(norm(x[:, :, part]), cos, sin)
                          for norm, part in zip(qk_norm, (slice(0, n_q), slice(n_q, -n_kv)), strict=True))
            else:
                qs, ks = _rotate(x[:, :, :-n_kv], cos, sin).split((n_q, n_kv), 2)
            vs = x[:, :, -n_kv:]
            o = []
            for span, q, (mask, causal) in zip(spans, queries, masks[layer_type], strict=True):
                k_i, v_i = q["cache"].update(ks[:, span].transpose(1, 2), vs[:, span].transpose(1, 2), layer_idx)
                o.append(F.scaled_dot_product_attention(  # [1, heads, q_i, d] against [1, kv, past_i + q_i, d]
                    qs[:, span].transpose(1, 2), k_i, v_i, attn_mask=mask, scale=scaling, is_causal=causal,
                    enable_gqa=n_q != n_kv).transpose(1, 2))
            o = o_proj(torch.cat(o, 1).reshape(1, Q, -1))
            h = h + (post_attn(o) if post_attn else o)
            g, u = gate_up(norm_2(h)).chunk(2, -1)
            m = down_proj(act(g) * u)
            h = h + (post_mlp(m) if post_mlp else m)
            if hidden is not None:
                hidden.append(h)
        h = self.norm(h)
        if hidden is not None:
            hidden[-1] = h
        return [SimpleNamespace(last_hidden_state=h[:, span],
                                hidden_states=[x[:, span] for x in hidden] if q.get("output_hidden_states") else None)
                for span, q in zip(spans, queries, strict=True)]


def _mask(attention_mask, q: int, past: int, device: torch.device, dtype: torch.dtype, layer_type: str,
          window: int | None) -> tuple[torch.Tensor | None, bool]:
    """One sequence's attention mask for `scaled_dot_product_attention` in layers of `layer_type` (keys older than
    `window` positions hidden), and whether it is plain causal (a prefill)."""
    if isinstance(attention_mask, dict):  # one entry per layer type
        attention_mask = attention_mask[layer_type]
    if attention_mask is None and (q > 1 and past or window is not None and past + q > window):
        # a chain after the prefix or past the window: the root and q - 1 nodes, each the child of the one before
        attention_mask = tree_attention_mask(torch.arange(-1, q - 2, device=device), past, dtype, window)
    return attention_mask, attention_mask is None and q > 1
