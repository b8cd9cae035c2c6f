"""Medusa export formats (registered in draftsmith.models.export) and the loader of each.

medusa  the original release layout: config.json {medusa_num_heads, medusa_num_layers,
        base_model_name_or_path}; medusa_lm_head.safetensors with "{h}.{j}.linear.weight|bias"
        (ResBlock j of head h) and "{h}.{L}.weight" (its vocabulary projection).
tgi     TGI's reading of that layout: the same files; the config carries no `architectures`
        (TGI would take it for another speculator), ResBlock biases are required, and
        medusa_num_layers must be 1 (TGI's MedusaHeadV2 fallback asserts it). The loader is TGI's
        MedusaHeadV1 reading (per-head projections); the V2 fallback projects with the base LM head,
        which equals ours only for heads trained with share_lm_head.
vllm    vLLM's `model_type: medusa` draft model: config.json {num_heads, num_hidden_layers,
        hidden_size, vocab_size, truncated_vocab_size, medusa_fc_bias, original_lm_head, ...};
        model.safetensors with blocks.{h}.layers.{j}.weight|bias and lm_heads.{h}.weight
        (only lm_heads.0.weight with original_lm_head, which every head then shares).
hf      a Hugging Face model directory of the backbone (the target for Medusa-1, the LoRA-merged
        backbone for Medusa-2) loadable by AutoModelForCausalLM, its config.json extended with
        medusa_num_heads / medusa_num_layers, plus medusa_lm_head.safetensors as above.

For Medusa-2 the medusa/tgi/vllm exports also carry the merged backbone in `backbone/`, and
`base_model_name_or_path` points at it (absolute path of the final directory).
Every loader returns a `MedusaDrafter` (backbone + heads) read the way that format's engine reads it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.data.core import REDO_EXPORT, read_file
from draftsmith.models.export import Format, write_json
from draftsmith.models.medusa import MedusaDrafter, MedusaHeads, load_medusa
from draftsmith.models.target import Target, load_target

HEAD_FILE = "medusa_lm_head.safetensors"


def _medusa_tensors(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    state, L = heads.export_state(), heads.num_layers
    out = {}
    for k in range(heads.num_heads):
        for j in range(L):
            out[f"{k}.{j}.linear.weight"] = state[f"blocks.{k}.{j}.linear.weight"]
            out[f"{k}.{j}.linear.bias"] = state[f"blocks.{k}.{j}.linear.bias"]
        out[f"{k}.{L}.weight"] = state[f"proj.{k}.weight"]
    return out


def _heads_from_medusa(tensors: dict[str, torch.Tensor], K: int, L: int) -> MedusaHeads:
    state = {}
    for k in range(K):
        for j in range(L):
            state[f"blocks.{k}.{j}.linear.weight"] = tensors[f"{k}.{j}.linear.weight"]
            state[f"blocks.{k}.{j}.linear.bias"] = tensors[f"{k}.{j}.linear.bias"]
        state[f"proj.{k}.weight"] = tensors[f"{k}.{L}.weight"]
    return MedusaHeads.from_state(state, K, L)


def _base_path(drafter: MedusaDrafter, tmp: Path, final: Path) -> str:
    """Medusa-1: the target's path. Medusa-2: write the merged backbone to backbone/ and point at it."""
    if drafter.source == "medusa1":
        return drafter.target.path
    drafter.target.model.save_pretrained(tmp / "backbone")
    if drafter.target.tokenizer is not None:
        drafter.target.tokenizer.save_pretrained(tmp / "backbone")
    return str(final / "backbone")


def write_medusa(drafter_dir: Path, tmp: Path, final: Path, tgi: bool = False) -> None:
    drafter = load_medusa(drafter_dir)
    heads = drafter.heads
    if tgi and heads.num_layers != 1:
        raise ValueError(f"TGI needs medusa_num_layers == 1 (this drafter has {heads.num_layers}); "
                         "export --format medusa or vllm instead")
    base = _base_path(drafter, tmp, final)
    write_json(tmp / "config.json", {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
                                      "base_model_name_or_path": base})
    save_file(_medusa_tensors(heads), tmp / HEAD_FILE)


def _load_base(base: str, path: Path) -> Target:
    if not base:
        raise ValueError(f"{path}/config.json has no base_model_name_or_path; set it to the target model")
    return load_target(base)


def load_medusa_format(path: Path) -> MedusaDrafter:
    """The original Medusa loader's reading: per-head ResBlocks then per-head projection."""
    cfg = read_file(path / "config.json", REDO_EXPORT)
    K, L = cfg["medusa_num_heads"], cfg["medusa_num_layers"]
    heads = _heads_from_medusa(read_file(path / HEAD_FILE, REDO_EXPORT), K, L)
    target = _load_base(cfg.get("base_model_name_or_path", ""), path)
    return MedusaDrafter(target, heads.eval(), "medusa")


def load_tgi(path: Path) -> MedusaDrafter:
    """TGI's MedusaHeadV1 reading: speculator = config.json without `architectures`; biased ResBlocks
    "{h}.{j}.linear" and an unbiased projection "{h}.{L}" for each of medusa_num_heads heads."""
    cfg = read_file(path / "config.json", REDO_EXPORT)
    if "architectures" in cfg:
        raise ValueError(f"{path}/config.json has `architectures`: TGI would not read it as Medusa heads")
    tensors = read_file(path / HEAD_FILE, REDO_EXPORT)
    K, L = cfg["medusa_num_heads"], cfg["medusa_num_layers"]
    for k in range(K):
        for j in range(L):
            if f"{k}.{j}.linear.bias" not in tensors:
                raise ValueError(f"{path}: TGI loads ResBlock {k}.{j} with a bias, which is missing")
    heads = _heads_from_medusa(tensors, K, L)
    return MedusaDrafter(_load_base(cfg.get("base_model_name_or_path", ""), path), heads.eval(), "tgi")


def write_vllm(drafter_dir: Path, tmp: Path, final: Path) -> None:
    drafter = load_medusa(drafter_dir)
    heads = drafter.heads
    state = heads.export_state()
    base = _base_path(drafter, tmp, final)
    tensors = {}
    for k in range(heads.num_heads):
        for j in range(heads.num_layers):
            tensors[f"blocks.{k}.layers.{j}.weight"] = state[f"blocks.{k}.{j}.linear.weight"]
            tensors[f"blocks.{k}.layers.{j}.bias"] = state[f"blocks.{k}.{j}.linear.bias"]
        if not heads.share_lm_head or k == 0:
            tensors[f"lm_heads.{k}.weight"] = state[f"proj.{k}.weight"]
    write_json(tmp / "config.json", {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size, "truncated_vocab_size": heads.vocab_size, "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers, "max_paths": 64, "topk": 10, "medusa_fc_bias": True,
        "original_lm_head": heads.share_lm_head, "base_model_name_or_path": base})
    save_file(tensors, tmp / "model.safetensors")


def load_vllm(path: Path) -> MedusaDrafter:
    """vLLM's Medusa reading: ResidualBlock layers (bias iff medusa_fc_bias), one lm_head per head or,
    with original_lm_head, lm_heads.0 shared by all."""
    cfg = read_file(path / "config.json", REDO_EXPORT)
    if cfg.get("model_type") != "medusa":
        raise ValueError(f"{path}/config.json: model_type is {cfg.get('model_type')!r}, vLLM expects 'medusa'")
    tensors = read_file(path / "model.safetensors", REDO_EXPORT)
    K, L, V = cfg["num_heads"], cfg["num_hidden_layers"], cfg["vocab_size"]
    if cfg.get("truncated_vocab_size", V) != V:
        raise ValueError(f"{path}: truncated_vocab_size without a token_map is not supported")
    state = {}
    for k in range(K):
        for j in range(L):
            state[f"blocks.{k}.{j}.linear.weight"] = tensors[f"blocks.{k}.layers.{j}.weight"]
            bias = tensors.get(f"blocks.{k}.layers.{j}.bias") if cfg.get("medusa_fc_bias", False) else None
            state[f"blocks.{k}.{j}.linear.bias"] = bias if bias is not None else torch.zeros(cfg["hidden_size"])
        state[f"proj.{k}.weight"] = tensors["lm_heads.0.weight" if cfg.get("original_lm_head") else f"lm_heads.{k}.weight"]
    heads = MedusaHeads.from_state(state, K, L)
    return MedusaDrafter(_load_base(cfg.get("base_model_name_or_path", ""), path), heads.eval(), "vllm")


def write_hf(drafter_dir: Path, tmp: Path, final: Path) -> None:
    drafter = load_medusa(drafter_dir)
    model, heads = drafter.target.model, drafter.heads
    model.config.medusa_num_heads, model.config.medusa_num_layers = heads.num_heads, heads.num_layers
    model.save_pretrained(tmp)
    if drafter.target.tokenizer is not None:
        drafter.target.tokenizer.save_pretrained(tmp)
    save_file(_medusa_tensors(heads), tmp / HEAD_FILE)


def load_hf(path: Path) -> MedusaDrafter:
    """AutoModelForCausalLM from the directory itself, heads from medusa_lm_head.safetensors."""
    target = load_target(path)
    c = target.config
    heads = _heads_from_medusa(read_file(path / HEAD_FILE, REDO_EXPORT), c.medusa_num_heads, c.medusa_num_layers)
    return MedusaDrafter(target, heads.eval(), "hf")


FORMATS = {
    "medusa": Format(write_medusa, load_medusa_format, "original Medusa layout"),
    "tgi": Format(lambda d, t, f: write_medusa(d, t, f, tgi=True), load_tgi, "TGI Medusa speculator"),
    "vllm": Format(write_vllm, load_vllm, "vLLM model_type: medusa"),
    "hf": Format(write_hf, load_hf, "HF backbone dir + medusa_lm_head.safetensors", with_target=True),
}
