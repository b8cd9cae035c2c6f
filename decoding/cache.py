"""KV-cache rollback after verification, for Hugging Face `DynamicCache` (transformers v5).

After a verifying forward the cache holds the committed prefix followed by [root, nodes]. Only the
root and the accepted path stay: for a chain that is a prefix of the new entries (a crop), for a
tree an index-select. The decoder always builds its caches as `DynamicCache()` without a config,
so every layer is a full `DynamicLayer`, also on models with sliding-window layers (Gemma, Mistral)
or attention chunks (Llama 4): the window or chunk is applied by the attention mask instead (see
`tree.tree_attention_mask`), which keeps rollback exact where a truncated sliding-window cache could
not be rolled back. Models with layers that keep a recurrent state instead of keys and values (linear
attention, state-space layers) are refused: `rollback_refusal`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache() -> DynamicCache:
    """A cache of full layers that the decoder can roll back."""
    return DynamicCache()


def rollback_refusal(config) -> str:
    """Why the decoder cannot roll back a model of this config, in one line naming its family; '' where it can.

    Layers whose cache is a recurrent state rather than keys and values (linear attention: Qwen3-Next's Gated
    DeltaNet; state-space layers), as transformers' own cache for the config holds them, cannot be cropped back to
    the accepted tokens, and a token tree cannot be verified through them (the state mixes sibling nodes).
    """
    kinds = {type(layer).__name__ for layer in DynamicCache(config=config).layers}
    recurrent = sorted(kinds - {"DynamicLayer", "DynamicSlidingWindowLayer"})
    if not recurrent:
        return ""
    return (f"{config.model_type}: its linear attention or state-space layers ({', '.join(recurrent)}) keep a "
            "recurrent state that speculative decoding cannot roll back to the accepted tokens, nor verify a token "
            "tree through; pick a target whose layers all cache keys and values (transformers' own generate decodes "
            "it without a drafter)")


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(f"cannot roll back a {type(layer).__name__}; build the cache with "
                            "draftsmith.decoding.cache.new_cache() (plain DynamicLayer per layer)")
    return cache.layers


def keep(cache: DynamicCache, start: int, kept: torch.Tensor | list[int]) -> None:
    """Keep cache positions [0, start) and then start + kept (ascending); drop everything after.

    A contiguous `kept` = [0, 1, ..., k-1] (every chain) is a crop: a view, nothing copied. Otherwise
    only the k kept entries move, into [start, start + k) in place, and the rest is cropped; the
    prefix [0, start) is never copied.
    """
    kept = kept.tolist() if isinstance(kept, torch.Tensor) else list(kept)
    k = len(kept)
    contiguous = kept == list(range(k))
    idx = None
    for layer in _layers(cache):
        if not layer.is_initialized:
            continue
        if not contiguous:
            if idx is None:
                idx = torch.tensor(kept, device=layer.keys.device) + start  # [k]
            layer.keys[..., start:start + k, :] = layer.keys.index_select(-2, idx)  # [b, h, k, d]
            layer.values[..., start:start + k, :] = layer.values.index_select(-2, idx)
        layer.crop(start + k - layer.get_seq_length())  # minus the entries to drop


def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions."""
    for layer in _layers(cache):
        if layer.is_initialized and layer.get_seq_length() > length:
            layer.crop(length - layer.get_seq_length())
