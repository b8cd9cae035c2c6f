"""DFlash and DSpark export (registered in draftsmith.models.export) and its loader.

    draftsmith export RUN --format vllm|sglang|gguf --out DIR

DFlash: the z-lab DFlash release's layout, which vLLM (`--speculative-config '{"method": "dflash", "model": DIR,
"num_speculative_tokens": K}'`, vllm/model_executor/models/qwen3_dflash.py) and SGLang (`DFLASH`) load:
config.json {architectures [DFlashDraftModel], model_type qwen3 and its layer fields, num_hidden_layers (the
draft's), block_size, num_target_layers, dflash_config {mask_token_id, target_layer_ids}}; model.safetensors
with fc, hidden_norm, layers.{i}.self_attn.{q,k,v,o}_proj / q_norm / k_norm, layers.{i}.input_layernorm /
post_attention_layernorm / mlp.*, norm. No embed_tokens: the draft shares the target's (vLLM loads embed_tokens
only when the checkpoint has it); no lm_head either, unless the drafter has its own draft vocabulary: then
lm_head [Vd, H], d2t [Vd] int64 (target id = i + d2t[i]) and draft_vocab_size, as vLLM's DFlash loader reads them.

DSpark (a drafter with a Markov head) is written for llama.cpp only, in the DeepSeek / SpecForge layout its
converter reads (conversion/qwen.py `DSparkModel`): the same, with architectures [DSparkDraftModel],
markov_head.markov_w1 [V, r] / markov_head.markov_w2 [Vd, r], markov_head_type vanilla and sample_from_anchor
true (the anchor's slot drafts). llama.cpp's converter reads d2t only in that class, so the gguf of a DFlash with
its own draft vocabulary goes through it too, with sample_from_anchor false and no Markov head, which llama.cpp
serves as `draft-dflash` (the GGUF's d2t scatters the draft logits to the target's vocabulary).

Layer ids. dflash_config.target_layer_ids name layer outputs (0-based; the DFlash reference reads
hidden_states[i + 1]); vLLM adds 1 and captures the input to that layer, as SGLang's capture hook does. The
drafter records hidden_states indices j, so the file holds j - 1, in increasing order (fc's input blocks
permuted to match), and only layers 1..L-1 (the input to layer L does not exist). The mask token is read in
vLLM's order of fields (models/export.py); the block attention is bidirectional, which vLLM assumes unless
dflash_config.causal is set or layer_types has sliding layers, so neither is written and the loader refuses
them. draftsmith_export.json records the conventions.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, LlamaConfig

from draftsmith.data.core import REDO_EXPORT, read_file
from draftsmith.models.dflash import DFlashDrafter, load_drafter
from draftsmith.models.export import Format, vllm_parallel_drafting_token_id, write_json
from draftsmith.models.llama_cpp import gguf_format

SIDE_FILE, WEIGHTS_FILE = "draftsmith_export.json", "model.safetensors"
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size")


def write(drafter_dir: Path, tmp: Path, final: Path, llama_cpp: bool = False) -> None:
    """The layout above; `llama_cpp`: as llama.cpp's converter reads it (DSpark's class where d2t or a Markov head
    is in the file)."""
    drafter, meta = load_drafter(drafter_dir)
    markov = drafter.markov_head is not None
    if markov and not llama_cpp:
        raise ValueError("vLLM's and SGLang's DFlash loaders have no Markov head: export this DSpark drafter with "
                         "--format gguf (llama.cpp draft-dspark)")
    L = AutoConfig.from_pretrained(meta["target"]).get_text_config().num_hidden_layers
    layers = meta["aux_layers"]
    bad = [j for j in layers if not 1 <= j < L]
    if bad:
        raise ValueError(f"aux layers {bad}: the engines capture the inputs to decoder layers 1..{L - 1} of this "
                         f"{L}-layer target only; retrain with dflash.aux_layers in that range")
    order = sorted(range(len(layers)), key=layers.__getitem__)
    tensors = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    tensors["fc.weight"] = drafter.fc.weight.detach().unflatten(1, (len(layers), -1))[:, order].flatten(1).contiguous()
    c = drafter.config
    rope = dict(c.rope_parameters)
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
              **{k: getattr(c, k) for k in LAYER_FIELDS}, "num_hidden_layers": c.num_hidden_layers,
              "rope_theta": rope.pop("rope_theta"),
              "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
              "tie_word_embeddings": False, "attention_bias": False, "block_size": meta["block_size"],
              "num_target_layers": L, "torch_dtype": str(drafter.fc.weight.dtype).removeprefix("torch."),
              "dflash_config": {"mask_token_id": meta["mask_token_id"],
                                "target_layer_ids": [layers[k] - 1 for k in order]}}
    if drafter.lm_head is not None:
        config["draft_vocab_size"] = drafter.lm_head.out_features
    if markov or (llama_cpp and drafter.lm_head is not None):
        config.update(architectures=["DSparkDraftModel"], sample_from_anchor=markov, markov_head_type="vanilla")
    save_file(tensors, tmp / WEIGHTS_FILE)
    write_json(tmp / "config.json", config)
    write_json(tmp / SIDE_FILE, {"format": "dspark (llama.cpp)" if markov else "dflash (vLLM, SGLang)",
                                 "method": "dflash", "target": meta["target"],
                                 "aux_layers": [layers[k] for k in order],
                                 "aux_layers_convention": "hidden_states index: the input to decoder layer i",
                                 "layer_id_fields": {"dflash_config.target_layer_ids":
                                                     "id i = the output of decoder layer i (engines read i + 1)"}})


def engine_layers(config: dict) -> list[int]:
    """The hidden_states indices vLLM captures: top-level eagle_aux_hidden_state_layer_ids as they are, else
    dflash_config.target_layer_ids + 1 (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return list(ids)
    ids = (config.get("dflash_config") or {}).get("target_layer_ids")
    if not ids:
        raise ValueError("config.json has no dflash_config.target_layer_ids; the engine would capture its default "
                         "layers, not the trained ones")
    return [i + 1 for i in ids]


def load(path: Path) -> tuple[DFlashDrafter, dict]:
    """The engine's reading: layer ids, mask token, bidirectional block attention, then the tensors (with the
    draft vocabulary's lm_head and d2t, and a DSpark Markov head, where the file has them)."""
    cfg = read_file(path / "config.json", REDO_EXPORT)
    side = path / SIDE_FILE
    dflash = cfg.get("dflash_config") or {}
    if dflash.get("causal") or "sliding_attention" in (cfg.get("layer_types") or []) or dflash.get("use_swa"):
        raise ValueError(f"{path}/config.json makes the engine run causal or sliding-window draft attention; this "
                         "project's DFlash drafter attends to its whole block")
    layers = engine_layers(cfg)
    rope = {"rope_type": "default", **(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e6)}
    config = LlamaConfig(**{k: cfg[k] for k in LAYER_FIELDS}, num_hidden_layers=cfg["num_hidden_layers"],
                         rope_parameters=rope, tie_word_embeddings=False)
    tensors = read_file(path / WEIGHTS_FILE, REDO_EXPORT)
    if "markov_head.markov_w1.weight" in tensors:
        config.markov_rank = tensors["markov_head.markov_w1.weight"].shape[1]
    d2t = tensors.get("d2t")
    drafter = DFlashDrafter(config, len(layers), None if d2t is None else d2t + torch.arange(d2t.numel()))
    drafter.load_state_dict(tensors)
    meta = {"method": "dflash", "aux_layers": layers, "block_size": cfg["block_size"],
            "mask_token_id": vllm_parallel_drafting_token_id(cfg),
            "target": read_file(side, REDO_EXPORT)["target"] if side.is_file() else ""}
    return drafter.eval(), meta


FORMATS = {name: Format(write, load, f"DFlash for {engine} (DFlashDraftModel, dflash_config)")
           for name, engine in (("vllm", "vLLM"), ("sglang", "SGLang"))}
FORMATS["gguf"] = gguf_format(Format(functools.partial(write, llama_cpp=True), load),
                              "draft-dflash (a DSpark drafter: draft-dspark)")
