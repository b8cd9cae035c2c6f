"""EAGLE export formats (registered in draftsmith.models.export) and the loader of each.

    draftsmith export RUN --format sglang|vllm|speculators|gguf --out DIR

sglang       EAGLE-3 as SGLang and SpecForge load it (sglang python/sglang/srt/models/llama_eagle3.py):
             config.json {architectures [LlamaForCausalLMEagle3], a one-layer Llama config, vocab_size (the
             target's), draft_vocab_size, target_hidden_size, eagle_config.eagle_aux_hidden_state_layer_ids
             (SGLang's ids)}; model.safetensors with fc, midlayer.*, norm, lm_head, d2t (int64), t2d (bool) and
             no embedding (the target's is used). It also carries a top-level eagle_aux_hidden_state_layer_ids
             with vLLM's ids, which vLLM reads first and SGLang ignores, so vLLM reads this directory right too.
             One layer only: SGLang's later layers (BasicDecoderLayer) drop the residual stream they are given.
vllm         EAGLE-3: vLLM's Eagle3LlamaForCausalLM (vllm/model_executor/models/llama_eagle3.py): the same
             tensors under layers.0.*, top-level eagle_aux_hidden_state_layer_ids, norm_before_residual false;
             a drafter with eagle.num_layers > 1 has its later layers under layers.1.* .., which vLLM builds as
             plain pre-norm layers (input_layernorm over the residual stream), as the drafter computes them.
             EAGLE-1: vLLM's EagleLlamaForCausalLM (llama_eagle.py): a one-layer Llama config
             (LlamaForCausalLM), fc.weight over [embedding; feature] and layers.0.* without input_layernorm.
             vLLM builds fc without a bias, so fc's bias b is folded exactly into the attention, whose input
             is fc's output: q/k/v biases W_q b, W_k b, W_v b (attention weights sum to 1, so the value bias
             passes through to o_proj) and o_proj bias b (restoring b on the residual), with attention_bias
             true in the config (vLLM's Llama layer then biases q/k/v and o_proj).
gguf         EAGLE-3 for llama.cpp (`llama-server -md DIR/draft.gguf --spec-type draft-eagle3`): the vllm export
             converted by llama.cpp's own convert_hf_to_gguf.py (models/llama_cpp.py), which reads its top-level
             eagle_aux_hidden_state_layer_ids as the inputs to those layers, as vLLM does. One drafter layer only
             (llama.cpp's EAGLE-3 graph has one) and no per-layer fc_norm (llama.cpp, like vLLM and SGLang,
             normalises the concatenated features once: norm_before_fc).
speculators  EAGLE-3 in the speculators library's format, which vLLM reads (vllm/transformers_utils/configs/
             speculators/): speculators_model_type eagle3, architectures [Eagle3Speculator], the layer's config
             as transformer_layer_config, eagle_aux_hidden_state_layer_ids (vLLM's ids), norm_before_residual
             false (vLLM takes a missing one as true), speculators_config (greedy proposals of ttt_steps
             tokens, verifier = the target); tensors as for vllm (speculators' later layers are its plain decoder
             layers, as vLLM's).

Layer ids. The drafter records Hugging Face hidden_states indices j (the input to decoder layer j). vLLM
captures the input to layer i for each id i, so its id is j; SGLang adds 1 to each id and captures the
input to that layer, so its id is j - 1 (the output of layer j - 1). Both capture each layer once, in
increasing layer order, for an fc that takes exactly three: exports list the layers in increasing order
(permuting fc's input blocks to match) and refuse other counts, repeats and layers outside 1..L-1 (vLLM's
Llama adds a residual that does not exist before layer 0; hidden_states[L] is after the final norm, which
neither engine captures). Every export writes draftsmith_export.json: the format, the training layers and
the convention of each id field. Each loader reads a directory the way its engine does and returns
(EagleDrafter, meta) in the project's convention.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, LlamaConfig

from draftsmith.data.core import REDO_EXPORT, read_file
from draftsmith.models.eagle_drafter import EagleDrafter, load_drafter
from draftsmith.models.export import EXPORT_FILE, Format, write_json
from draftsmith.models.llama_cpp import gguf_format
from draftsmith.models.target import target_fields

SIDE_FILE, WEIGHTS_FILE = EXPORT_FILE, "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release this config was checked against (its config and model load it)
VERSIONS = {"sglang": (3,), "vllm": (1, 3), "speculators": (3,)}  # EAGLE versions each format holds
TRAINED = "hidden_states index: the input to decoder layer i (EAGLE repository)"
SGLANG_IDS = "id i = the output of decoder layer i (SGLang captures the input to layer i + 1)"
VLLM_IDS = "id i = the input to decoder layer i (vLLM captures it before running layer i)"


# ---- writers ----------------------------------------------------------------------------------------------

def _source(drafter_dir: Path, fmt: str) -> tuple[EagleDrafter, dict]:
    drafter, meta = load_drafter(drafter_dir)
    meta.update(target_fields(meta))  # what the engines load the verifier from
    if meta["version"] not in VERSIONS[fmt]:
        works = [f for f, v in VERSIONS.items() if meta["version"] in v]
        raise ValueError(f"format {fmt} holds EAGLE-{'/'.join(map(str, VERSIONS[fmt]))} drafters and this one is "
                         f"EAGLE-{meta['version']}; use --format {' or '.join(works)}")
    return drafter, meta


def _target_config(target: str):
    try:
        return AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the config of the target {target!r} (drafter.json 'target'), which the export "
                         f"needs for its layer count and architectures; make it readable there: {e}") from e


def _serving_order(drafter: EagleDrafter, layers: list[int], num_layers: int) -> tuple[list[int], dict]:
    """The aux layers in increasing order, as the engines concatenate them, and fc.weight [H, 3H] with its three
    input blocks permuted to match (and the per-layer fc_norm.{i}.weight with them, where the drafter has them)."""
    if len(layers) != 3 or len(set(layers)) != 3:
        raise ValueError(f"aux layers {layers}: SGLang and vLLM fuse exactly three distinct target layers; "
                         "retrain with three distinct eagle.aux_layers")
    bad = [j for j in layers if not 1 <= j < num_layers]
    if bad:
        raise ValueError(f"aux layers {bad}: the engines capture the inputs to decoder layers 1..{num_layers - 1} of "
                         f"this {num_layers}-layer target only; retrain with eagle.aux_layers in that range")
    order = sorted(range(3), key=layers.__getitem__)
    fc = drafter.fc.weight.detach().unflatten(1, (3, -1))[:, order].flatten(1)  # [H, 3, H] blocks reordered
    tensors = {"fc.weight": fc.contiguous()}
    if drafter.fc_norm is not None:
        tensors.update({f"fc_norm.{i}.weight": drafter.fc_norm[k].weight for i, k in enumerate(order)})
    return [layers[k] for k in order], tensors


def _llama_fields(config: LlamaConfig, dtype: torch.dtype) -> dict:
    """The Llama config the engines build the drafter's layers from. Rope goes as rope_theta +
    rope_scaling, which transformers 4 and 5 and the engines all read (transformers 5 writes rope_parameters)."""
    rope = dict(config.rope_parameters)
    theta = rope.pop("rope_theta")
    return {"model_type": "llama", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
            "max_position_embeddings": config.max_position_embeddings, "vocab_size": config.vocab_size,
            "rope_theta": theta, "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def _write(tmp: Path, fmt: str, meta: dict, config: dict, tensors: dict, layers: list[int], ids: dict) -> None:
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp / WEIGHTS_FILE)
    write_json(tmp / "config.json", config)
    write_json(tmp / SIDE_FILE, {"format": fmt, "method": meta["method"], "version": meta["version"],
                                  "target": meta["target"], "ttt_steps": meta["ttt_steps"], "aux_layers": layers,
                                  "aux_layers_convention": TRAINED, "layer_id_fields": ids})


def _eagle3(drafter: EagleDrafter, meta: dict, prefix: str):
    """(serving-order layers, tensors with the midlayer under `prefix` (and additional layer i - 1 under layers.i.),
    the EAGLE-3 config fields, target config). EAGLE 3.1's fc_norm goes as `fc_norm: true` (vLLM and SGLang read a
    missing one as false) and fc_norm.{i}.weight."""
    target = _target_config(meta["target"])
    layers, fused = _serving_order(drafter, meta["aux_layers"], target.get_text_config().num_hidden_layers)
    tensors = {_served_name(k, prefix): v for k, v in drafter.state_dict().items()} | fused
    fields = {"draft_vocab_size": drafter.d2t.numel(), "target_hidden_size": drafter.config.target_hidden_size}
    if drafter.fc_norm is not None:
        fields["fc_norm"] = True
    return layers, tensors, fields, target


def _served_name(name: str, prefix: str) -> str:
    """A drafter tensor's name in an export: midlayer.* under `prefix`, additional_layers.{i}.* as layers.{i+1}.*."""
    name = name.replace("midlayer.", prefix)
    return re.sub(r"^additional_layers\.(\d+)\.", lambda m: f"layers.{int(m[1]) + 1}.", name)


def _drafter_name(name: str) -> str:
    """An exported tensor's name in the drafter: layers.0.* as midlayer.*, layers.{i}.* as additional_layers.{i-1}.*."""
    return re.sub(r"^layers\.(\d+)\.", lambda m: "midlayer." if m[1] == "0" else f"additional_layers.{int(m[1]) - 1}.",
                  name)


def write_sglang(drafter_dir: Path, tmp: Path, final: Path) -> None:
    drafter, meta = _source(drafter_dir, "sglang")
    if drafter.config.num_hidden_layers > 1:  # python/sglang/srt/models/llama_eagle3.py, BasicDecoderLayer.forward
        raise ValueError(f"this drafter has {drafter.config.num_hidden_layers} layers and SGLang's layers after the "
                         "first restart the residual stream from the previous layer's MLP output, so it would compute "
                         "another function; export it with --format vllm or speculators")
    layers, tensors, fields, _ = _eagle3(drafter, meta, "midlayer.")
    config = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(drafter.config, drafter.fc.weight.dtype),
              **fields, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [j - 1 for j in layers]},
              "eagle_aux_hidden_state_layer_ids": layers}
    _write(tmp, "sglang", meta, config, tensors, layers, {"eagle_config.eagle_aux_hidden_state_layer_ids": SGLANG_IDS,
                                                          "eagle_aux_hidden_state_layer_ids": VLLM_IDS})


def write_vllm(drafter_dir: Path, tmp: Path, final: Path) -> None:
    drafter, meta = _source(drafter_dir, "vllm")
    if meta["version"] == 1:
        _write_vllm_eagle1(drafter, meta, tmp)
    else:
        layers, tensors, fields, _ = _eagle3(drafter, meta, "layers.0.")
        config = {"architectures": ["LlamaForCausalLMEagle3"],
                  **_llama_fields(drafter.config, drafter.fc.weight.dtype), **fields,
                  "eagle_aux_hidden_state_layer_ids": layers, "norm_before_residual": False}
        _write(tmp, "vllm", meta, config, tensors, layers, {"eagle_aux_hidden_state_layer_ids": VLLM_IDS})


def _write_vllm_eagle1(drafter: EagleDrafter, meta: dict, tmp: Path) -> None:
    if drafter.config.num_hidden_layers > 1:
        raise ValueError(f"this EAGLE-1 drafter has {drafter.config.num_hidden_layers} layers and the EAGLE-1 export "
                         "holds one (the paper's); train it with eagle.num_layers=1")
    state = {k.replace("midlayer.", "layers.0."): v for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d")}
    b = state.pop("fc.bias")  # [H]
    for p in "qkv":
        state[f"layers.0.self_attn.{p}_proj.bias"] = state[f"layers.0.self_attn.{p}_proj.weight"] @ b
    state["layers.0.self_attn.o_proj.bias"] = b
    config = {"architectures": ["LlamaForCausalLM"], **_llama_fields(drafter.config, drafter.fc.weight.dtype),
              "attention_bias": True}
    _write(tmp, "vllm", meta, config, state, [], {})


def write_speculators(drafter_dir: Path, tmp: Path, final: Path) -> None:
    drafter, meta = _source(drafter_dir, "speculators")
    layers, tensors, fields, target = _eagle3(drafter, meta, "layers.0.")
    proposal = {"proposal_type": "greedy", "speculative_tokens": meta["ttt_steps"], "verifier_accept_k": 1,
                "accept_tolerance": 0.0}
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_version": SPECULATORS_VERSION,
              "transformer_layer_config": _llama_fields(drafter.config, drafter.fc.weight.dtype),
              "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False, **fields,
              "eagle_aux_hidden_state_layer_ids": layers,
              "speculators_config": {"algorithm": "eagle3", "proposal_methods": [proposal],
                                     "default_proposal_method": "greedy",
                                     "verifier": {"name_or_path": meta["target"],
                                                  "architectures": list(target.architectures or [])}}}
    _write(tmp, "speculators", meta, config, tensors, layers, {"eagle_aux_hidden_state_layer_ids": VLLM_IDS})


# ---- loaders ----------------------------------------------------------------------------------------------

def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """config.json, the tensors and the side file (empty when absent)."""
    side = path / SIDE_FILE
    return (read_file(path / "config.json", REDO_EXPORT), read_file(path / WEIGHTS_FILE, REDO_EXPORT),
            read_file(side, REDO_EXPORT) if side.is_file() else {})


def _layer_config(fields: dict) -> LlamaConfig:
    config = LlamaConfig.from_dict(fields)
    config._attn_implementation = "sdpa"
    return config


def _eagle3_drafter(fields: dict, tensors: dict[str, torch.Tensor], layers: list[int]) -> EagleDrafter:
    """An EAGLE-3 drafter from a Llama config dict and tensors named midlayer.* or layers.0.* (and layers.i.* for the
    layers after it); t2d is rebuilt from d2t, as both engines ignore it. An embed_tokens.weight (speculators and
    SpecForge ship a copy of the target's) is not read: this drafter drafts with the target's embedding."""
    state = {_drafter_name(k): v for k, v in tensors.items() if k not in ("t2d", "embed_tokens.weight")}
    config = _layer_config(fields)
    config.draft_vocab_size = state["d2t"].numel()
    config.target_hidden_size = fields.get("target_hidden_size") or config.hidden_size
    drafter = EagleDrafter(config, 3, state["d2t"] + torch.arange(state["d2t"].numel()), len(layers))
    drafter.load_state_dict({**state, "t2d": drafter.t2d})
    return drafter.eval()


def _meta(version: int, layers: list[int], target: str, fmt: str) -> dict:
    return {"method": "eagle", "version": version, "aux_layers": layers, "target": target, "format": fmt}


def load_sglang(path: Path) -> tuple[EagleDrafter, dict]:
    """SGLang's reading: the class from architectures, lm_head = embedding when tied, and the inputs to layers
    eagle_config.eagle_aux_hidden_state_layer_ids + 1."""
    cfg, tensors, side = _read(path)
    if "LlamaForCausalLMEagle3" not in cfg.get("architectures", []):
        raise ValueError(f"{path}/config.json: SGLang loads EAGLE-3 drafters as LlamaForCausalLMEagle3, "
                         f"architectures is {cfg.get('architectures')}")
    if cfg.get("tie_word_embeddings"):
        raise ValueError(f"{path}/config.json: tie_word_embeddings would make SGLang use the embedding as lm_head; "
                         "set it to false")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ValueError(f"{path}/config.json has no eagle_config.eagle_aux_hidden_state_layer_ids; SGLang would "
                         "capture its default layers, not the trained ones")
    layers = [i + 1 for i in ids]
    return _eagle3_drafter(cfg, tensors, layers), _meta(3, layers, side.get("target", ""), "sglang")


def load_vllm(path: Path) -> tuple[EagleDrafter, dict]:
    """vLLM's reading: EAGLE-3 (an Eagle3 architecture) with the inputs to layers eagle_aux_hidden_state_layer_ids
    (top level, else eagle_config) and norm_before_residual, or EAGLE-1 (LlamaForCausalLM) with fc's bias
    unfolded from the attention biases."""
    cfg, tensors, side = _read(path)
    target = side.get("target", "")
    if not any("Eagle3" in a for a in cfg.get("architectures", [])):
        return _load_vllm_eagle1(path, cfg, tensors), _meta(1, [], target, "vllm")
    layers = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not layers:
        raise ValueError(f"{path}/config.json has no eagle_aux_hidden_state_layer_ids; vLLM would capture its default "
                         "layers, not the trained ones")
    if cfg.get("norm_before_residual", False):
        raise ValueError(f"{path}/config.json: norm_before_residual is true, but this project's drafter keeps the "
                         "residual before hidden_norm; set it to false")
    return _eagle3_drafter(cfg, tensors, layers), _meta(3, layers, target, "vllm")


def _load_vllm_eagle1(path: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> EagleDrafter:
    state = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    b = torch.zeros(cfg["hidden_size"], dtype=state["fc.weight"].dtype)  # vLLM's plain layout: no bias anywhere
    if cfg.get("attention_bias"):
        b = state.pop("midlayer.self_attn.o_proj.bias")
        for p in "qkv":
            if not torch.allclose(state.pop(f"midlayer.self_attn.{p}_proj.bias"),
                                  state[f"midlayer.self_attn.{p}_proj.weight"] @ b, rtol=1e-3, atol=1e-6):
                raise ValueError(f"{path}: {p}_proj.bias is not {p}_proj.weight @ o_proj.bias, so it is not a folded "
                                 "fc bias, which is all the project's EAGLE-1 drafter can hold")
    config = _layer_config({**cfg, "attention_bias": False})
    drafter = EagleDrafter(config, 1, torch.arange(config.vocab_size))
    drafter.load_state_dict({**state, "fc.bias": b, "d2t": drafter.d2t, "t2d": drafter.t2d})
    return drafter.eval()


def load_speculators(path: Path) -> tuple[EagleDrafter, dict]:
    """vLLM's reading of a speculators config: transformer_layer_config + the EAGLE-3 fields, norm_before_residual
    true when missing, the inputs to layers eagle_aux_hidden_state_layer_ids."""
    cfg, tensors, _ = _read(path)
    spec = cfg.get("speculators_config") or {}
    proposals, verifier = spec.get("proposal_methods") or [{}], spec.get("verifier") or {}
    if "speculative_tokens" not in proposals[0] or "name_or_path" not in verifier or "transformer_layer_config" not in cfg:
        raise ValueError(f"{path}/config.json lacks what vLLM requires of a speculators config: transformer_layer_config, "
                         "speculators_config.proposal_methods[0].speculative_tokens and .verifier.name_or_path")
    if cfg.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{path}/config.json: speculators_model_type is {cfg.get('speculators_model_type')!r}, "
                         "not 'eagle3'")
    if cfg.get("norm_before_residual", True):
        raise ValueError(f"{path}/config.json: norm_before_residual is missing or true (vLLM reads missing as true), "
                         "but this project's drafter keeps the residual before hidden_norm; set it to false")
    layers = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not layers:
        raise ValueError(f"{path}/config.json has no eagle_aux_hidden_state_layer_ids; vLLM would capture its "
                         "default layers, not the trained ones")
    if cfg.get("norm_before_fc") or cfg.get("norm_output"):
        raise ValueError(f"{path}/config.json: norm_before_fc / norm_output are set, which this project's drafter does "
                         "not implement (it has EAGLE 3.1's per-layer fc_norm only)")
    fields = {**cfg["transformer_layer_config"], "target_hidden_size": cfg.get("target_hidden_size"),
              "fc_norm": cfg.get("fc_norm", False)}
    return _eagle3_drafter(fields, tensors, layers), _meta(3, layers, verifier["name_or_path"], "speculators")


def llama_cpp_refusal(drafter_dir: Path) -> str:
    """Why llama.cpp cannot serve this drafter (naming the format that can), or ''."""
    drafter, meta = load_drafter(drafter_dir)
    if meta["version"] != 3:
        return f"llama.cpp serves EAGLE-3 drafters only and this one is EAGLE-{meta['version']}; use --format vllm"
    if drafter.config.num_hidden_layers > 1:
        return (f"llama.cpp's EAGLE-3 has one drafter layer and this drafter has {drafter.config.num_hidden_layers} "
                "(eagle.num_layers); use --format vllm or speculators, or train with eagle.num_layers=1")
    if drafter.fc_norm is not None:
        return ("this drafter has one RMSNorm per fused layer (eagle.fc_norm, EAGLE 3.1) and llama.cpp normalises the "
                "concatenated features once (norm_before_fc); use --format speculators, or train with "
                "eagle.fc_norm=false")
    return ""


VLLM = Format(write_vllm, load_vllm, "vLLM: EAGLE-3 (Eagle3LlamaForCausalLM) or EAGLE-1 (EagleLlamaForCausalLM)")
FORMATS = {
    "sglang": Format(write_sglang, load_sglang, "EAGLE-3 for SGLang / SpecForge (LlamaForCausalLMEagle3)"),
    "vllm": VLLM,
    "speculators": Format(write_speculators, load_speculators, "EAGLE-3 in vLLM's speculators format (Eagle3Speculator)"),
    "gguf": gguf_format(VLLM, "draft-eagle3", llama_cpp_refusal),
}
