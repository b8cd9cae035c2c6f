"""decoding/lean.py: the lean body gives the model's own hidden states and cache over a prefill, a chain after it,
a tree with its mask and a single token, to float32 rounding (its matmuls read transposed weights: the same
arithmetic in another order below 4 rows); it covers exactly the architectures it claims, and is rebuilt when the
weights change."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from draftsmith.decoding import cache as kv
from draftsmith.decoding.generate import attention_masks
from draftsmith.decoding.lean import lean_forward
from tests.test_decoding_generate import COMMON, CONFIGS, build

COVERED = ["llama", "qwen2_full", "qwen3", "mistral_full", "gemma3"]


@pytest.mark.parametrize("arch", COVERED)
def test_lean_body_equals_the_models_own(arch):
    model = build(arch)
    if arch == "qwen2_full":  # random biases, so that leaving one out would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if arch == "gemma3":  # its norms scale by 1 + weight, zero at init: random ones, so that w for 1 + w would show
        for module in model.modules():
            if type(module).__name__ == "Gemma3RMSNorm":
                torch.nn.init.normal_(module.weight, std=0.5)
    lean = lean_forward(model)
    assert lean is not None
    ids = torch.randint(0, COMMON["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(0))
    parents = torch.tensor([-1, 0, 0, 1])  # a tree under the root: nodes 0 and 1 are siblings
    steps = [(ids[:, :12], None), (ids[:, 12:15], None), (ids[:, 15:20], "tree"), (ids[:, 19:20], None)]
    caches, outs = {}, {}
    with torch.no_grad():
        for name, forward in (("hf", model.base_model), ("lean", lean)):
            cache, outs[name] = kv.new_cache(), []
            for x, tree in steps:
                past = cache.get_seq_length()
                depth = torch.tensor([0, 1, 1, 2, 3]) if tree else torch.arange(x.shape[1])
                mask = attention_masks(model.config, parents, past, model.dtype) if tree else None
                out = forward(input_ids=x, position_ids=(past + depth)[None], attention_mask=mask, cache=cache,
                              use_cache=True, output_hidden_states=True)
                outs[name].append([out.last_hidden_state, *out.hidden_states])
                if tree:
                    kv.keep(cache, past, [0, 2, 4])  # root, node 1, node 3 (a path through the tree)
            caches[name] = cache
    for a, b in zip(outs["hf"], outs["lean"], strict=True):
        assert len(a) == len(b) == COMMON["num_hidden_layers"] + 2
        for x, y in zip(a, b, strict=True):
            assert close(x, y)
    for a, b in zip(caches["hf"].layers, caches["lean"].layers, strict=True):
        assert close(a.keys, b.keys) and close(a.values, b.values)


def close(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal to float32 rounding: a wrong bias, rotation or mask is off by far more."""
    return x.shape == y.shape and torch.allclose(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", sorted(set(CONFIGS) - set(COVERED)))
def test_other_architectures_keep_their_own_forward(arch):
    """Sliding-window layers without Gemma-3's layer types (Mistral, Qwen2 with a window), Gemma-2's soft-caps,
    GPT-2's layout."""
    assert lean_forward(build(arch)) is None


def test_eager_attention_keeps_its_own_forward():
    assert lean_forward(T.LlamaForCausalLM(T.LlamaConfig(**COMMON, attn_implementation="eager"))) is None


def test_hidden_state_capture_keeps_it_and_other_hooks_do_not():
    """transformers installs output-capture hooks at the first forward with output_hidden_states (EAGLE's feature
    extraction in training runs one before every checkpoint evaluation); they leave the lean body usable, and any
    other hook (FSDP's, ZeRO-3's parameter gathering) still turns it off."""
    model = build("llama")
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert any(m._forward_hooks for m in model.modules())
    assert lean_forward(model) is not None
    model.model.layers[0].register_forward_pre_hook(lambda module, args: None)
    assert lean_forward(model) is None


def test_lora_adapters_stay_active():
    """Medusa-2 verifies with its LoRA-adapted backbone (`medusa.verifier_model`): the lean body calls the adapted
    modules, so it equals the adapted model's own body."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(build("llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # B starts at zero: make the adapters change the output
    model = peft.get_base_model()
    ids = torch.randint(0, COMMON["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf, lean = (f(input_ids=ids, position_ids=torch.arange(9)[None], cache=kv.new_cache(), use_cache=True)
                    for f in (model.base_model, lean_forward(model)))
        plain = build("llama").base_model(input_ids=ids, use_cache=False)
    assert close(hf.last_hidden_state, lean.last_hidden_state)
    assert not close(plain.last_hidden_state, lean.last_hidden_state)


def test_the_lean_head_equals_the_models_and_a_changed_weight_rebuilds_it():
    model = build("llama")
    h = torch.randn(3, COMMON["hidden_size"], generator=torch.Generator().manual_seed(2))  # [3, H]
    lean = lean_forward(model)
    assert lean_forward(model) is lean  # built once
    assert close(lean.head(h), model.get_output_embeddings()(h))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2)  # in place, as an optimizer step
    rebuilt = lean_forward(model)
    assert rebuilt is not lean and close(rebuilt.head(h), model.get_output_embeddings()(h))
