"""EAGLE exports (models/eagle_export.py): the round trip of every format, the layer ids as each engine reads
them, the config keys and tensors each engine requires, atomic no-clobber writes, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.decoding.generate import plain_generate, speculative_generate
from draftsmith.decoding.proposers import Verified
from draftsmith.decoding.verify import Sampling
from draftsmith.models import registry as R
from draftsmith.models.eagle import Eagle
from draftsmith.models.eagle_config import EagleConfig
from draftsmith.models.eagle_drafter import EagleDrafter, additive, load_drafter
from draftsmith.models.eagle_proposer import EagleProposer
from draftsmith.models.target import Target
from draftsmith.train import export as export_command

REPO = Path(__file__).resolve().parent.parent
V, L, H = 96, 6, 32
THETA = 500000.0  # not the default, so a lost rope_theta changes the outputs
EAGLE3 = ["sglang", "vllm", "speculators"]
DRAFT_IDS = torch.arange(0, V, 2)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Target:
    """A 6-layer Llama saved to disk (the exporters read the target's config: layer count, architectures)."""
    path = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                         bos_token_id=None, eos_token_id=None,
                                         rope_parameters={"rope_type": "default", "rope_theta": THETA}))
    model.lm_head.weight.data *= 5  # a peaked target, so drafts are not all ties
    model.save_pretrained(path)
    return Target(model.eval().requires_grad_(False), None, str(path))


def drafter_dir(target: Target, out: Path, version: int = 3, aux_layers=(4, 1, 3), **kw) -> Path:
    """A random, non-trivial drafter checkpoint (norm weights away from 1, a non-zero EAGLE-1 fc bias); kw: more
    EagleConfig fields."""
    torch.manual_seed(1)
    m = Eagle(target, EagleConfig(version=version, ttt_steps=3, aux_layers=list(aux_layers) if version == 3 else [],
                                  **kw), DRAFT_IDS if version == 3 else None)
    for p in m.drafter.parameters():
        torch.nn.init.normal_(p, 0.3 if p.dim() == 1 else 0.0, 0.3)
    m.save_pretrained(out)
    return out


def hidden_states(target: Target, seed: int = 0) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return ids, target.model(ids, output_hidden_states=True).hidden_states  # L + 1 of [1, s, H]


def draft_logits(drafter: EagleDrafter, target: Target, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """One drafter step over a causal prefix: tokens ids[1:] with features feats[:, :-1] -> logits [1, s-1, Vd]."""
    s = ids.shape[1] - 1
    mask = additive(torch.ones(s, s, dtype=torch.bool).tril())[None, None]
    with torch.no_grad():
        out = drafter(target.embed(ids[:, 1:]), feats[:, :-1], torch.arange(s)[None], mask, None)
        return drafter.logits(out, target.lm_head)


def features(hs, layers: list[int]) -> torch.Tensor:
    return torch.cat([hs[j] for j in layers], -1) if layers else hs[-1]


def proposals(drafter: EagleDrafter, layers: list[int], target: Target, mode: str) -> tuple[list, list]:
    """The draft tree after the target's features of a fixed prompt."""
    p = EagleProposer(drafter, target.embed, target.lm_head, layers, mode=mode, gamma=4, top_k=3, depth=3,
                      total_tokens=8)
    prompt = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hs = target.model(prompt[None, :-1], output_hidden_states=True).hidden_states
    p.accept(prompt, Verified(None, [], None, torch.stack([hs[i][0] for i in p.hidden_layers])))
    tree = p.propose(prompt, Sampling())
    return tree.tokens.tolist(), tree.parents.tolist()


# ---- round trips ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,version", [("sglang", 3), ("vllm", 3), ("speculators", 3), ("vllm", 1)])
def test_round_trip_gives_identical_tensors_drafts_and_decoding(fmt, version, target, tmp_path):
    src = drafter_dir(target, tmp_path / "drafter", version, aux_layers=(1, 3, 4))
    out = export_command.main([str(src), "--format", fmt, "--out", str(tmp_path / fmt)])
    original, meta = load_drafter(src)
    loaded, back = R.load("eagle", fmt, out)
    a, b = original.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert (back["version"], back["aux_layers"], back["target"]) == (version, meta["aux_layers"], target.path)
    ids, hs = hidden_states(target)
    assert torch.equal(draft_logits(original, target, ids, features(hs, meta["aux_layers"])),
                       draft_logits(loaded, target, ids, features(hs, back["aux_layers"])))
    for mode in ("chain", "tree"):
        assert proposals(original, meta["aux_layers"], target, mode) == proposals(loaded, back["aux_layers"], target,
                                                                                  mode)
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(5))
    proposer = EagleProposer(loaded, target.embed, target.lm_head, back["aux_layers"], gamma=3)
    spec, _ = speculative_generate(target.model, proposer, prompt, 16, eos_token_id=[])
    assert torch.equal(spec, plain_generate(target.model, prompt, 16, eos_token_id=[])[0])


@pytest.mark.parametrize("fmt", EAGLE3)
def test_layers_trained_out_of_order_are_served_in_layer_order_with_fc_permuted(fmt, target, tmp_path):
    src = drafter_dir(target, tmp_path / "drafter", aux_layers=(4, 1, 3))
    original, meta = load_drafter(src)
    loaded, back = R.load("eagle", fmt, R.export(src, fmt, tmp_path / fmt))
    assert back["aux_layers"] == [1, 3, 4]
    assert not torch.equal(loaded.fc.weight, original.fc.weight)  # the blocks really moved
    ids, hs = hidden_states(target)
    torch.testing.assert_close(draft_logits(loaded, target, ids, features(hs, [1, 3, 4])),
                               draft_logits(original, target, ids, features(hs, [4, 1, 3])))
    for mode in ("chain", "tree"):
        assert proposals(original, meta["aux_layers"], target, mode) == proposals(loaded, back["aux_layers"], target,
                                                                                  mode)


# EAGLE 3.1's per-layer norm: speculators src/speculators/models/eagle3/config.py (`fc_norm`, exclusive with
# norm_before_fc) and core.py (fc_norm = ModuleList of one RMSNorm per aux layer, applied to the chunks of the
# concatenated states before fc, weights fc_norm.{i}.weight); vLLM's speculators reader (configs/speculators/algos.py)
# copies fc_norm onto the layer's config, false when missing.
@pytest.mark.parametrize("fmt", EAGLE3)
def test_fc_norm_is_exported_as_the_engines_read_it_and_permuted_with_fc(fmt, target, tmp_path):
    src = drafter_dir(target, tmp_path / "drafter", aux_layers=(4, 1, 3), fc_norm=True)
    original, meta = load_drafter(src)
    out = R.export(src, fmt, tmp_path / fmt)
    cfg, tensors = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert cfg["fc_norm"] is True and cfg.get("norm_before_fc", False) is False
    for i, k in enumerate([1, 2, 0]):  # layers (4, 1, 3) are served as (1, 3, 4)
        assert torch.equal(tensors[f"fc_norm.{i}.weight"], original.fc_norm[k].weight)
    loaded, back = R.load("eagle", fmt, out)
    assert loaded.fc_norm is not None
    ids, hs = hidden_states(target)
    torch.testing.assert_close(draft_logits(loaded, target, ids, features(hs, back["aux_layers"])),
                               draft_logits(original, target, ids, features(hs, meta["aux_layers"])))
    without = R.load("eagle", fmt, R.export(drafter_dir(target, tmp_path / "plain"), fmt, tmp_path / f"{fmt}-plain"))[0]
    assert without.fc_norm is None


@pytest.mark.parametrize("fmt", EAGLE3)
def test_a_layer_with_its_own_key_value_heads_exports_them_in_the_layer_config(fmt, target, tmp_path):
    """eagle.num_key_value_heads=4 on a target with 2 of 4: the engines build the layer from the exported Llama
    fields (speculators: transformer_layer_config), so k_proj / v_proj [4 * head_dim, 2H] load as trained."""
    src = drafter_dir(target, tmp_path / "drafter", num_key_value_heads=4)
    original, meta = load_drafter(src)
    out = R.export(src, fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("transformer_layer_config", cfg)["num_key_value_heads"] == 4
    loaded, back = R.load("eagle", fmt, out)
    assert loaded.midlayer.self_attn.k_proj.weight.shape == (4 * original.config.head_dim, 2 * H)
    ids, hs = hidden_states(target)
    torch.testing.assert_close(draft_logits(loaded, target, ids, features(hs, back["aux_layers"])),
                               draft_logits(original, target, ids, features(hs, meta["aux_layers"])))


# ---- the layer ids as each engine reads them ------------------------------------------------------------------
# sglang python/sglang/srt/model_executor/model_runner.py reads eagle_config["eagle_aux_hidden_state_layer_ids"]
# only; set_eagle3_layers_to_capture (models/llama.py) stores [id + 1 ...]; LlamaModel.forward appends
# hidden_states + residual (the input to layer i, HF hidden_states[i]) before running layer i, for i in 0..L-1.
# vllm v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config reads the top-level
# eagle_aux_hidden_state_layer_ids, else eagle_config's; models/llama.py LlamaModel.forward appends
# hidden_states + residual before running layer idx when idx is in them. Both concatenate in layer order.

def sglang_captures(cfg: dict) -> list[int]:
    ids = {i + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]}
    return [i for i in range(L) if i in ids]


def vllm_captures(cfg: dict) -> list[int]:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return [i for i in range(L) if i in ids]


@pytest.mark.parametrize("fmt,engines", [("sglang", (sglang_captures, vllm_captures)), ("vllm", (vllm_captures,)),
                                         ("speculators", (vllm_captures,))])
def test_each_engine_captures_the_trained_layers_and_drafts_what_was_trained(fmt, engines, target, tmp_path):
    src = drafter_dir(target, tmp_path / "drafter", aux_layers=(4, 1, 3))
    original, meta = load_drafter(src)
    out = R.export(src, fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    loaded, _ = R.load("eagle", fmt, out)
    ids, hs = hidden_states(target, seed=7)
    expected = draft_logits(original, target, ids, features(hs, meta["aux_layers"]))
    for captures in engines:
        layers = captures(cfg)
        assert sorted(layers) == sorted(meta["aux_layers"]), captures.__name__
        torch.testing.assert_close(draft_logits(loaded, target, ids, torch.cat([hs[i] for i in layers], -1)), expected)
    side = json.loads((out / "draftsmith_export.json").read_text())
    assert side["aux_layers"] == [1, 3, 4] and "input to decoder layer" in side["aux_layers_convention"]
    if fmt == "sglang":
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # SGLang: outputs of layers
        assert "output of decoder layer" in side["layer_id_fields"]["eagle_config.eagle_aux_hidden_state_layer_ids"]
    assert cfg.get("eagle_aux_hidden_state_layer_ids") == [1, 3, 4]  # vLLM: inputs to layers
    assert "input to decoder layer" in side["layer_id_fields"]["eagle_aux_hidden_state_layer_ids"]


def test_the_two_conventions_really_differ(target, tmp_path):
    """SGLang reading vLLM's ids (or the reverse) would fuse the wrong layers."""
    cfg = json.loads((R.export(drafter_dir(target, tmp_path / "d"), "vllm", tmp_path / "v") / "config.json").read_text())
    assert sglang_captures({"eagle_config": cfg}) == [2, 4, 5] != vllm_captures(cfg) == [1, 3, 4]


# ---- what each engine requires of config.json and the tensors ---------------------------------------------------

LLAMA_KEYS = {"model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size",
              "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias", "mlp_bias", "torch_dtype"}
LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"]
EAGLE3_LAYER = LAYER + ["input_layernorm.weight", "hidden_norm.weight"]
KV = 2 * 8  # key/value heads x head_dim


def exported(target, tmp_path, fmt, version=3) -> tuple[dict, dict[str, torch.Tensor]]:
    out = R.export(drafter_dir(target, tmp_path / "drafter", version), fmt, tmp_path / fmt)
    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


def check_llama(cfg: dict) -> None:
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == V
    assert cfg["hidden_size"] == H and cfg["head_dim"] == 8 and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == THETA and "rope_parameters" not in cfg  # what transformers 4, SGLang, vLLM read
    assert LlamaConfig.from_dict(cfg).rope_parameters["rope_theta"] == THETA  # and transformers 5 too


def check_eagle3_tensors(tensors: dict[str, torch.Tensor], prefix: str) -> None:
    Vd = DRAFT_IDS.numel()
    assert set(tensors) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
                            *(prefix + n for n in EAGLE3_LAYER)}  # no embed_tokens: the target's is used
    shapes = {"fc.weight": (H, 3 * H), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,),
              prefix + "self_attn.q_proj.weight": (H, 2 * H), prefix + "self_attn.k_proj.weight": (KV, 2 * H),
              prefix + "self_attn.v_proj.weight": (KV, 2 * H), prefix + "self_attn.o_proj.weight": (H, H)}
    for k, shape in shapes.items():
        assert tuple(tensors[k].shape) == shape, k
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(Vd) + tensors["d2t"], DRAFT_IDS)  # target id = i + d2t[i]
    assert tensors["t2d"].nonzero().flatten().tolist() == DRAFT_IDS.tolist()


# sglang python/sglang/srt/models/llama_eagle3.py: LlamaForCausalLMEagle3 holds model.fc, model.midlayer
# (qkv_proj and gate_up_proj stacked from q/k/v and gate/up), model.norm, lm_head [draft_vocab_size, H] (the
# embedding instead when tie_word_embeddings), model.embed_tokens; load_weights tries name, then "model." + name,
# skipping names that match nothing (so a misnamed tensor would be lost silently); d2t -> hot_token_id; t2d skipped.
SGLANG_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight",
                 *(f"model.midlayer.{n}" for n in ["self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                                   "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
                                                   "input_layernorm.weight", "hidden_norm.weight",
                                                   "post_attention_layernorm.weight"])}
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
           ".up_proj": ".gate_up_proj"}


def stacked(name: str) -> str:
    for shard, param in STACKED.items():
        name = name.replace(shard, param)
    return name


def test_sglang_config_and_tensors(target, tmp_path):
    cfg, tensors = exported(target, tmp_path, "sglang")
    assert set(cfg) == LLAMA_KEYS | {"architectures", "draft_vocab_size", "target_hidden_size", "eagle_config",
                                     "eagle_aux_hidden_state_layer_ids"}
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == DRAFT_IDS.numel()
    assert cfg["target_hidden_size"] == H and "bias" not in cfg  # SGLang's fc bias comes from config.bias
    check_llama(cfg)
    check_eagle3_tensors(tensors, "midlayer.")
    names = {n if stacked(n) in SGLANG_PARAMS else "model." + stacked(n) for n in tensors if n not in ("d2t", "t2d")}
    assert names == SGLANG_PARAMS - {"model.embed_tokens.weight"}


# vllm/model_executor/models/llama_eagle3.py: Eagle3LlamaForCausalLM.load_weights skips t2d, renames d2t to
# draft_id_to_target_id and midlayer. to layers.0., prefixes "model." to all but lm_head; it holds model.fc
# [3 * target_hidden_size -> H, no bias], model.layers.0 (qkv_proj from 2H), model.norm, lm_head
# [draft_vocab_size, H], and embed_tokens (skipped when absent). Layer 0 keeps the residual before hidden_norm
# unless norm_before_residual.
VLLM_EAGLE3_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
                      *(f"model.layers.0.{stacked(n)}" for n in EAGLE3_LAYER)}


def vllm_names(tensors: dict) -> set[str]:
    renamed = {n.replace("midlayer.", "layers.0.").replace("d2t", "draft_id_to_target_id") for n in tensors
               if n != "t2d"}
    return {stacked(n) if n in ("lm_head.weight", "draft_id_to_target_id") else "model." + stacked(n)
            for n in renamed}


def test_vllm_eagle3_config_and_tensors(target, tmp_path):
    cfg, tensors = exported(target, tmp_path, "vllm")
    assert set(cfg) == LLAMA_KEYS | {"architectures", "draft_vocab_size", "target_hidden_size",
                                     "eagle_aux_hidden_state_layer_ids", "norm_before_residual"}
    # vllm/model_executor/models/registry.py maps LlamaForCausalLMEagle3 to llama_eagle3.Eagle3LlamaForCausalLM
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["norm_before_residual"] is False
    check_llama(cfg)
    check_eagle3_tensors(tensors, "layers.0.")
    assert vllm_names(tensors) == VLLM_EAGLE3_PARAMS


def test_sglang_export_loads_in_vllm_too(target, tmp_path):
    cfg, tensors = exported(target, tmp_path, "sglang")
    assert vllm_names(tensors) == VLLM_EAGLE3_PARAMS and vllm_captures(cfg) == [1, 3, 4]


# vllm/model_executor/models/llama_eagle.py: EagleLlamaForCausalLM (vLLM prefixes "Eagle" to LlamaForCausalLM for
# method eagle, vllm/transformers_utils/configs/eagle.py) holds model.fc = Linear(2H, H, bias=False) over
# cat(embeds, hidden_states), model.layers.0 (vLLM's Llama layer: q/k/v and o_proj biased when attention_bias) with
# input_layernorm replaced by Identity, no norm and no lm_head (the target's); load_weights prefixes "model." and
# skips embed_tokens. There is no fc.bias parameter to load one into.
VLLM_EAGLE1_PARAMS = {"model.fc.weight", "model.layers.0.self_attn.qkv_proj.weight",
                      "model.layers.0.self_attn.qkv_proj.bias", "model.layers.0.self_attn.o_proj.weight",
                      "model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.gate_up_proj.weight",
                      "model.layers.0.mlp.down_proj.weight", "model.layers.0.post_attention_layernorm.weight"}


def test_vllm_eagle1_config_tensors_and_the_folded_fc_bias(target, tmp_path):
    cfg, tensors = exported(target, tmp_path, "vllm", version=1)
    assert set(cfg) == LLAMA_KEYS | {"architectures"}
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["attention_bias"] is True
    check_llama(cfg)
    assert {"model." + stacked(n) for n in tensors} == VLLM_EAGLE1_PARAMS
    assert tuple(tensors["fc.weight"].shape) == (H, 2 * H) and "fc.bias" not in tensors
    # the drafter as vLLM builds it: this config (biased attention), fc without bias, these tensors
    config = LlamaConfig.from_dict(cfg)
    config._attn_implementation = "sdpa"
    as_vllm = EagleDrafter(config, 1, torch.arange(V))
    state = {n.replace("layers.0.", "midlayer."): t for n, t in tensors.items()}
    as_vllm.load_state_dict({**state, "fc.bias": torch.zeros(H), "d2t": as_vllm.d2t, "t2d": as_vllm.t2d})
    original, _ = load_drafter(tmp_path / "drafter")
    assert original.fc.bias.abs().min() > 0  # the bias being folded is real
    ids, hs = hidden_states(target)
    torch.testing.assert_close(draft_logits(as_vllm.eval(), target, ids, hs[-1]),
                               draft_logits(original, target, ids, hs[-1]), atol=1e-4, rtol=1e-4)


# vllm/transformers_utils/configs/speculators/base.py requires speculators_model_type, transformer_layer_config
# (a dict), speculators_config.proposal_methods[0].speculative_tokens and .verifier.name_or_path; algos.py
# (eagle3) copies draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids and norm_before_residual
# (true when missing) onto transformer_layer_config and loads it as Eagle3LlamaForCausalLM (tensors as above).
# speculators src/speculators/models/eagle3/config.py and config.py: the same fields, architectures
# [Eagle3Speculator], speculators_version, verifier {name_or_path, architectures}, greedy proposals.
def test_speculators_config_and_tensors(target, tmp_path):
    cfg, tensors = exported(target, tmp_path, "speculators")
    assert set(cfg) == {"architectures", "speculators_model_type", "speculators_version", "transformer_layer_config",
                        "draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm",
                        "norm_output", "eagle_aux_hidden_state_layer_ids", "speculators_config"}
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["norm_before_residual"] is False and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert (cfg["draft_vocab_size"], cfg["target_hidden_size"]) == (DRAFT_IDS.numel(), H)
    assert set(cfg["transformer_layer_config"]) == LLAMA_KEYS
    check_llama(cfg["transformer_layer_config"])
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": target.path, "architectures": ["LlamaForCausalLM"]}
    check_eagle3_tensors(tensors, "layers.0.")
    assert vllm_names(tensors) == VLLM_EAGLE3_PARAMS


def test_loaders_refuse_what_the_engine_would_misread(target, tmp_path):
    out = R.export(drafter_dir(target, tmp_path / "drafter"), "speculators", tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["norm_before_residual"]  # vLLM would read it as true
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="norm_before_residual"):
        R.load("eagle", "speculators", out)
    out = R.export(tmp_path / "drafter", "sglang", tmp_path / "sglang")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["eagle_config"]  # SGLang would capture its default layers
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eagle_config"):
        R.load("eagle", "sglang", out)


# ---- refusals and the script ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_an_eagle1_drafter_in_an_eagle3_format_names_the_format_that_works(fmt, target, tmp_path):
    src = drafter_dir(target, tmp_path / "drafter", version=1)
    with pytest.raises(ValueError, match=f"format {fmt} holds EAGLE-3 drafters and this one is EAGLE-1; use --format "
                                         "vllm$"):
        R.export(src, fmt, tmp_path / fmt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


# vllm/model_executor/models/llama_eagle3.py: LlamaModel builds config.num_hidden_layers layers; layer 0 reads
# [embeds; hidden] (qkv_proj from 2H), layers 1.. are plain (qkv_proj from H, input_layernorm adding the residual
# the layer before carries: the residual stream, as the drafter's DecoderLayer); layers.i.* loads into
# model.layers.i.*. speculators 0.9.0 (models/eagle3/core.py) builds layers 1.. of transformer_layer_config as
# transformers' LlamaDecoderLayer, the same. SGLang's later layers (BasicDecoderLayer) restart the residual from
# the previous layer's MLP output: refused.
VLLM_SECOND_LAYER = {f"model.layers.1.{stacked(n)}" for n in LAYER + ["input_layernorm.weight"]}


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_two_layer_drafter_exports_its_second_layer_as_layers_1(fmt, target, tmp_path):
    src = drafter_dir(target, tmp_path / "drafter", aux_layers=(1, 3, 4), num_layers=2)
    out = R.export(src, fmt, tmp_path / fmt)
    cfg, tensors = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
    assert cfg.get("transformer_layer_config", cfg)["num_hidden_layers"] == 2
    assert vllm_names(tensors) == VLLM_EAGLE3_PARAMS | VLLM_SECOND_LAYER
    assert tuple(tensors["layers.1.self_attn.q_proj.weight"].shape) == (H, H)  # from H, not 2H
    original, meta = load_drafter(src)
    loaded, back = R.load("eagle", fmt, out)
    a, b = original.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids, hs = hidden_states(target)
    assert torch.equal(draft_logits(original, target, ids, features(hs, [1, 3, 4])),
                       draft_logits(loaded, target, ids, features(hs, [1, 3, 4])))
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(5))
    for mode in ("chain", "tree"):
        proposer = EagleProposer(loaded, target.embed, target.lm_head, back["aux_layers"], mode=mode, gamma=3,
                                 top_k=3, depth=3, total_tokens=8)
        spec, _ = speculative_generate(target.model, proposer, prompt, 16, eos_token_id=[])
        assert torch.equal(spec, plain_generate(target.model, prompt, 16, eos_token_id=[])[0]), mode


def test_a_two_layer_drafter_is_refused_by_the_sglang_format_and_its_eagle1_export(target, tmp_path):
    src = drafter_dir(target, tmp_path / "drafter", num_layers=2)
    with pytest.raises(ValueError, match="2 layers and SGLang's layers after the first restart the residual stream.*"
                                         "export it with --format vllm or speculators$"):
        R.export(src, "sglang", tmp_path / "sglang")
    src1 = drafter_dir(target, tmp_path / "eagle1", version=1, num_layers=2)
    with pytest.raises(ValueError, match="EAGLE-1 export holds one .*eagle.num_layers=1$"):
        R.export(src1, "vllm", tmp_path / "vllm")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "eagle1"]


@pytest.mark.parametrize("aux_layers,match", [((1, 3), "three distinct"),
                                              ((1, 3, L), r"inputs to decoder layers 1\.\.5"),
                                              ((0, 3, 4), r"inputs to decoder layers 1\.\.5")])
def test_layers_no_engine_can_capture_are_refused(aux_layers, match, target, tmp_path):
    src = drafter_dir(target, tmp_path / "drafter", aux_layers=aux_layers)
    for fmt in EAGLE3:
        with pytest.raises(ValueError, match=match):
            R.export(src, fmt, tmp_path / fmt)


def test_an_unreadable_target_is_a_clear_error(target, tmp_path):
    src = drafter_dir(target, tmp_path / "drafter")
    meta = json.loads((src / "drafter.json").read_text())
    (src / "drafter.json").write_text(json.dumps({**meta, "target": str(tmp_path / "gone")}))
    with pytest.raises(ValueError, match="cannot read the config of the target"):
        R.export(src, "vllm", tmp_path / "out")


def test_script_export_is_atomic_and_never_overwrites_silently(target, tmp_path, capsys):
    run = tmp_path / "run"
    drafter_dir(target, run / "best")
    out, main = tmp_path / "out", export_command.main
    main([str(run), "--format", "sglang", "--out", str(out)])
    assert "(eagle) as sglang" in capsys.readouterr().out
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit, match="exists and is not empty; pass --overwrite"):
        main([str(run), "--format", "vllm", "--out", str(out)])
    assert (out / "model.safetensors").read_bytes() == before
    main([str(run), "--format", "vllm", "--out", str(out), "--overwrite"])
    assert json.loads((out / "draftsmith_export.json").read_text())["format"] == "vllm"
    drafter_dir(target, tmp_path / "eagle1", version=1)
    with pytest.raises(SystemExit, match="use --format vllm"):
        main([str(tmp_path / "eagle1"), "--format", "speculators", "--out", str(tmp_path / "fresh")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle1", "out", "run"]  # no fresh/, no temporary dir
