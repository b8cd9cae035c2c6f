"""P-EAGLE and DFlash exports (models/p_eagle_export.py, models/dflash_export.py): round trips that draft the same
tokens, the config fields as vLLM reads them (layer ids, the parallel-drafting token, mask_hidden), and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_eagle_export
import torch
from conftest import randomise
from safetensors.torch import load_file, save_file
from test_eagle_export import H, L, V

from draftsmith.decoding.proposers import Verified
from draftsmith.decoding.verify import Sampling
from draftsmith.models import export as E
from draftsmith.models import registry as R
from draftsmith.models.dflash import DFlash, DFlashConfig, DFlashProposer
from draftsmith.models.eagle_config import EagleConfig
from draftsmith.models.p_eagle import PEagle, PEagleProposer
from draftsmith.models.target import Target

target = test_eagle_export.target  # the fixture: a 6-layer Llama saved to disk (the exporters read its config)


def block(proposer, target: Target, seed: int = 3) -> tuple[list[int], torch.Tensor]:
    """The greedy block drafted after the target's features of a fixed prompt, and the drafter's last output."""
    prompt = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(seed))
    outs = []
    hook = proposer.drafter.register_forward_hook(lambda mod, args, out: outs.append(out))
    with torch.no_grad():
        hs = target.model(prompt[None, :-1], output_hidden_states=True).hidden_states
    proposer.accept(prompt, Verified(None, [], None, torch.stack([hs[i][0] for i in proposer.hidden_layers])))
    tokens = proposer.propose(prompt, Sampling()).tokens.tolist()
    hook.remove()
    return tokens, outs[-1]


# ---- P-EAGLE ----------------------------------------------------------------------------------------------

def p_eagle_dir(target: Target, out: Path, aux_layers=(4, 1, 3)) -> Path:
    m = PEagle(target, EagleConfig(version=3, ttt_steps=4, aux_layers=list(aux_layers)), torch.arange(0, V, 2),
               ptd_token_id=7)
    torch.manual_seed(1)
    randomise(m.drafter)
    m.save_pretrained(out)
    return out


def test_p_eagle_round_trip_drafts_the_same_block(target, tmp_path):
    src = p_eagle_dir(target, tmp_path / "run")
    R.export(src, "vllm", tmp_path / "vllm")
    drafter, meta = R.load("p_eagle", "vllm", tmp_path / "vllm")
    assert meta["aux_layers"] == [1, 3, 4] and meta["ptd_token_id"] == 7 and meta["method"] == "p_eagle"
    from draftsmith.models.p_eagle import load_proposer

    original = load_proposer(src, target.model, gamma=4)
    served = PEagleProposer(drafter, target.embed, target.lm_head, meta["aux_layers"], meta["ptd_token_id"], gamma=4)
    (a, out_a), (b, out_b) = block(original, target), block(served, target)
    assert a == b and len(a) == 4
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)  # mask_hidden permuted with fc's blocks


def test_p_eagle_vllm_config_and_tensors(target, tmp_path):
    R.export(p_eagle_dir(target, tmp_path / "run"), "vllm", tmp_path / "vllm")
    cfg = json.loads((tmp_path / "vllm" / "config.json").read_text())
    tensors = load_file(tmp_path / "vllm" / "model.safetensors")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["norm_before_residual"] is False and cfg["ptd_token_id"] == 7
    assert E.vllm_parallel_drafting_token_id(cfg) == 7  # what vLLM feeds at positions 2..K
    assert tensors["mask_hidden"].shape == (1, 3 * H) and tensors["fc.weight"].shape == (H, 3 * H)
    assert "layers.0.self_attn.q_proj.weight" in tensors and "embed_tokens.weight" not in tensors
    del tensors["mask_hidden"]  # vLLM refuses a parallel-drafting load without it
    save_file(tensors, tmp_path / "vllm" / "model.safetensors")
    with pytest.raises(ValueError, match="mask_hidden"):
        R.load("p_eagle", "vllm", tmp_path / "vllm")


def test_parallel_drafting_token_is_read_in_vllms_order():
    read = E.vllm_parallel_drafting_token_id
    assert read({"ptd_token_id": 5, "pard_token": 6}) == 6
    assert read({"ptd_token_id": 5, "mask_token_id": 4, "dflash_config": {"mask_token_id": 3}}) == 3
    assert read({"ptd_token_id": 0}) == 0
    with pytest.raises(ValueError, match="refuses"):
        read({"dflash_config": {}})


# ---- DFlash -----------------------------------------------------------------------------------------------

def dflash_dir(target: Target, out: Path, aux_layers=(4, 1, 3)) -> Path:
    m = DFlash(target, DFlashConfig(block_size=5, num_layers=2, aux_layers=list(aux_layers)), mask_token_id=9)
    torch.manual_seed(1)
    randomise(m.drafter)
    m.save_pretrained(out)
    return out


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_dflash_round_trip_drafts_the_same_block(fmt, target, tmp_path):
    src = dflash_dir(target, tmp_path / "run")
    R.export(src, fmt, tmp_path / fmt)
    drafter, meta = R.load("dflash", fmt, tmp_path / fmt)
    assert meta["aux_layers"] == [1, 3, 4] and meta["mask_token_id"] == 9 and meta["block_size"] == 5
    from draftsmith.models.dflash import load_proposer

    original = load_proposer(src, target.model)
    served = DFlashProposer(drafter, target.embed, target.lm_head, meta["aux_layers"], meta["mask_token_id"], 4)
    (a, out_a), (b, out_b) = block(original, target), block(served, target)
    assert a == b and len(a) == 4
    torch.testing.assert_close(out_a, out_b, atol=1e-5, rtol=1e-5)  # fc's blocks permuted into layer order


def test_dflash_config_as_the_engines_read_it(target, tmp_path):
    R.export(dflash_dir(target, tmp_path / "run"), "vllm", tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["num_hidden_layers"] == 2 and cfg["block_size"] == 5
    assert cfg["dflash_config"] == {"mask_token_id": 9, "target_layer_ids": [0, 2, 3]}  # layer outputs
    assert cfg["rope_theta"] == 500000.0 and cfg["num_target_layers"] == L
    from draftsmith.models.dflash_export import engine_layers

    assert engine_layers(cfg) == [1, 3, 4]  # vLLM adds 1: the inputs to layers 1, 3, 4 = the trained features
    assert E.vllm_parallel_drafting_token_id(cfg) == 9
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert tensors["fc.weight"].shape == (H, 3 * H) and "layers.1.self_attn.k_norm.weight" in tensors
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in tensors)  # the target's are shared
    cfg["dflash_config"]["causal"] = True
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="causal"):
        R.load("dflash", "vllm", tmp_path / "out")


def test_dflash_layers_no_engine_can_capture_are_refused(target, tmp_path):
    with pytest.raises(ValueError, match="1..5"):
        R.export(dflash_dir(target, tmp_path / "run", aux_layers=(2, L)), "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()
