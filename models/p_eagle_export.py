"""P-EAGLE export (registered in draftsmith.models.export) and its loader.

    draftsmith export RUN --format vllm --out DIR

vllm   vLLM's parallel drafting (`--speculative-config '{"method": "eagle3", "model": DIR,
       "num_speculative_tokens": K, "parallel_drafting": true}'`, vllm/model_executor/models/llama_eagle3.py):
       the EAGLE-3 vllm layout of models/eagle_export.py (layers.0.*, fc, norm, lm_head, d2t, t2d, top-level
       eagle_aux_hidden_state_layer_ids in vLLM's convention, norm_before_residual false) plus the tensor
       `mask_hidden` [1, 3H] (vLLM copies it into its buffer of that shape, before fc, and refuses a parallel-
       drafting load without it) and the config field `ptd_token_id`, the token vLLM feeds at positions 2..K.
       The layers are written in increasing order with fc's input blocks permuted to match, so mask_hidden's
       three blocks are permuted the same way.

SGLang has no parallel-drafting EAGLE (https://github.com/sgl-project/sglang/issues/23171) and speculators
no released P-EAGLE format (speculators RFC 292), so vllm is the one format.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from draftsmith.models.eagle_drafter import EagleDrafter, load_drafter
from draftsmith.models.eagle_export import (
    VLLM_IDS,
    _eagle3,
    _eagle3_drafter,
    _llama_fields,
    _meta,
    _read,
    _write,
)
from draftsmith.models.export import Format, vllm_parallel_drafting_token_id


def write_vllm(drafter_dir: Path, tmp: Path, final: Path) -> None:
    drafter, meta = load_drafter(drafter_dir)
    layers, tensors, fields, _ = _eagle3(drafter, meta, "layers.0.")
    order = sorted(range(len(meta["aux_layers"])), key=meta["aux_layers"].__getitem__)
    tensors["mask_hidden"] = drafter.mask_hidden.detach().unflatten(1, (len(order), -1))[:, order].flatten(1)
    config = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(drafter.config, drafter.fc.weight.dtype),
              **fields, "eagle_aux_hidden_state_layer_ids": layers, "norm_before_residual": False,
              "ptd_token_id": meta["ptd_token_id"], "parallel_drafting": True}
    _write(tmp, "vllm", meta, config, tensors, layers, {"eagle_aux_hidden_state_layer_ids": VLLM_IDS})


def load_vllm(path: Path) -> tuple[EagleDrafter, dict]:
    """vLLM's reading with parallel_drafting on: the EAGLE-3 layout, mask_hidden required (viewed as [1, -1]), and
    the parallel-drafting token id in vLLM's order of config fields."""
    cfg, tensors, side = _read(path)
    if "mask_hidden" not in tensors:
        raise ValueError(f"{path}: no mask_hidden tensor; vLLM refuses a parallel-drafting EAGLE-3 without it")
    layers = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not layers:
        raise ValueError(f"{path}/config.json has no eagle_aux_hidden_state_layer_ids; vLLM would capture its default "
                         "layers, not the trained ones")
    mask_hidden = tensors.pop("mask_hidden").reshape(1, -1)
    drafter = _eagle3_drafter(cfg, tensors, layers)
    drafter.mask_hidden = nn.Parameter(mask_hidden.to(drafter.fc.weight.dtype))
    if mask_hidden.shape[1] != drafter.fc.in_features:
        raise ValueError(f"{path}: mask_hidden has {mask_hidden.shape[1]} features, fc takes {drafter.fc.in_features}")
    meta = {**_meta(3, layers, side.get("target", ""), "vllm"), "method": "p_eagle",
            "ptd_token_id": vllm_parallel_drafting_token_id(cfg)}
    return drafter, meta


FORMATS = {"vllm": Format(write_vllm, load_vllm, "P-EAGLE for vLLM (EAGLE-3 with parallel_drafting)")}
