"""LayerSkip: early-exit loss, curricula, layer dropout, the early-exit draft model and its decoding."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from draftsmith.decoding import speculative_generate
from draftsmith.decoding.proposers import truncated_copy
from draftsmith.models.layerskip import (
    Curriculum,
    EarlyExit,
    LayerDropout,
    LayerSkip,
    LayerSkipConfig,
    decoder_layers,
    dropout_rates,
    final_norm,
)
from draftsmith.models.lm import masked_ce
from draftsmith.train.config import LoopConfig
from draftsmith.train.loop import Loop


def llama(layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


TINY = {
    "llama": llama,
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, bos_token_id=0,
                                               eos_token_id=1)).eval(),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, head_dim=8, sliding_window=4)).eval(),
}


@pytest.mark.parametrize("arch", sorted(TINY))
def test_truncated_copy_is_the_first_layers_with_norm_and_head_sharing_weights(arch):
    model = TINY[arch]()
    draft = truncated_copy(model, 2)
    ids = torch.randint(0, 64, (1, 9))
    hidden = model(ids, output_hidden_states=True).hidden_states[2]  # output of layer 2
    expected = model.get_output_embeddings()(final_norm(model)(hidden))
    torch.testing.assert_close(draft(ids).logits, expected)
    assert draft.get_output_embeddings().weight is model.get_output_embeddings().weight
    assert len(decoder_layers(draft)) == 2


def test_exit_layer_out_of_range_is_a_clear_error():
    with pytest.raises(ValueError, match="exit layer 4 must be in 1..3"):
        truncated_copy(llama(), 4)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_self_speculative_greedy_equals_target_greedy(arch):
    model = TINY[arch]()
    prompt = torch.randint(2, 64, (1, 6))
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    got, stats = speculative_generate(model, EarlyExit(model, 2, gamma=3), prompt, 20, eos_token_id=[])
    assert torch.equal(got, expected)
    assert stats.tau >= 1.0


def test_early_exit_loss_is_final_plus_scaled_exits():
    model = llama()
    cfg = LayerSkipConfig(scale="linear", curriculum="none", dropout_max=0.0, e_scale=0.5)
    method = LayerSkip(model, None, cfg, total_steps=10).eval()
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "loss_mask": torch.ones(2, 8, dtype=torch.long)}
    loss, metrics = method(batch)
    out = model(batch["input_ids"], output_hidden_states=True)
    exits = [masked_ce(method.exit_logits(out.hidden_states[l]), batch["input_ids"], batch["loss_mask"])
             for l in (1, 2, 3)]
    expected = masked_ce(out.logits, batch["input_ids"], batch["loss_mask"]) + 0.5 * sum(
        l / 6 * ce for l, ce in zip((1, 2, 3), exits, strict=True))
    torch.testing.assert_close(loss, expected)
    assert set(metrics) >= {"loss_final", "loss_exit1", "agree_exit3"}


def test_curricula():
    rot = Curriculum("rotational", num_layers=8, rotation=3)
    seen = []
    for _ in range(3):
        seen.append(rot.enabled())
        rot.advance()
    assert seen == [[3, 6], [2, 5], [1, 4, 7]]
    grad = Curriculum("gradual", num_layers=8, total_steps=100)
    grad.step = 0
    assert grad.enabled() == []
    grad.step = 25  # fraction 0.25 >= 0.5 * (8 - l) / 8  <=>  l >= 4
    assert grad.enabled() == [4, 5, 6, 7]
    grad.load_state_dict({"step": 100})
    assert grad.enabled() == list(range(1, 8))


def test_layer_dropout_rates_and_whole_sample_skips():
    rates = dropout_rates(5, 0.2)
    assert rates[0] == 0 and rates[-1] == pytest.approx(0.2) and rates == sorted(rates)
    model = llama()
    LayerDropout(model, 0.999)  # p = 0, 0.26, 0.59, 0.999 for layers 0..3
    skipped = {}

    def watch(i):
        def hook(module, args, kwargs, output):
            same = (output[0] if isinstance(output, tuple) else output) == (args[0] if args else kwargs["hidden_states"])
            skipped[i] = same.flatten(1).all(1).float()  # [b]: 1 where the sample went through unchanged
            assert bool((same.flatten(1).all(1) | ~same.flatten(1).any(1)).all()), "whole samples only"
        return hook

    for i, layer in enumerate(decoder_layers(model)):
        layer.register_forward_hook(watch(i), with_kwargs=True)
    ids = torch.randint(0, 64, (256, 5))
    model.train()
    model(ids)
    assert skipped[0].mean() == 0 and skipped[3].mean() > 0.95 and 0.4 < skipped[2].mean() < 0.8
    model.eval()
    model(ids)
    assert all(v.sum() == 0 for v in skipped.values()), "no dropout at evaluation"


def test_curriculum_resumes_exactly_with_the_loop(tmp_path):
    rows = [{"input_ids": torch.randint(0, 64, (8,)).tolist(), "loss_mask": [1] * 8} for _ in range(12)]
    cfg = dict(output_dir=str(tmp_path), max_steps=4, batch_size=2, save_every=2, keep_last=3, lr=1e-3)
    ls_cfg = LayerSkipConfig(curriculum="rotational", rotation=3, dropout_max=0.1)
    straight = LayerSkip(llama(), None, ls_cfg, 4)
    Loop(LoopConfig(**{**cfg, "output_dir": str(tmp_path / "a")}), straight, rows).run()
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    resumed = LayerSkip(llama(seed=1), None, ls_cfg, 4)
    Loop(LoopConfig(**{**cfg, "output_dir": str(tmp_path / "b")}), resumed, rows).run()
    assert resumed.curriculum.step == straight.curriculum.step == 4
    a = load_file(tmp_path / "a" / "checkpoint-4" / "trainable.safetensors")
    b = load_file(tmp_path / "b" / "checkpoint-4" / "trainable.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_export_is_a_merged_plain_model(tmp_path):
    model = llama()
    method = LayerSkip(model, None, LayerSkipConfig(lora=True, lora_r=4, dropout_max=0.0), 10)
    with torch.no_grad():
        for name, p in method.model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    ids = torch.randint(0, 64, (1, 7))
    expected = method.model(input_ids=ids).logits
    method.save_pretrained(tmp_path)
    exported = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(exported(ids).logits, expected, atol=1e-5, rtol=1e-4)
    assert any("lora" in n for n, _ in method.model.named_parameters()), "training model keeps its adapters"


def test_layerskip_recipe_trains_measures_tau_per_exit_and_records_the_best(tiny_chat_target, tmp_path):
    from transformers import GenerationConfig

    from draftsmith.decoding.proposers import load_proposer
    from draftsmith.train import layerskip as script

    loop = script.main(["--config", "recipes/layerskip/tiny-code.yaml", f"target.path={tiny_chat_target}",
                        f"loop.output_dir={tmp_path}", "loop.max_steps=4", "loop.save_every=2", "loop.batch_size=2",
                        "data.limit=24", "data.max_length=256", "data.cache=false", "data.on_no_assistant=drop", "data.overlong=truncate", "eval.heldout_examples=4",
                        "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.exit_layers=[1, 2]",
                        "loop.best_metric=tau_exit1"])
    assert loop.state.step == 4
    lora = script.main(["--config", "recipes/layerskip/tiny-code.yaml", f"target.path={tiny_chat_target}",
                        f"loop.output_dir={tmp_path / 'lora'}", "loop.max_steps=2", "loop.save_every=2",
                        "loop.batch_size=2", "data.limit=24", "data.max_length=256", "data.cache=false",
                        "data.on_no_assistant=drop", "data.overlong=truncate", "eval.heldout_examples=4",
                        "eval.num_prompts=2", "eval.max_new_tokens=8", "eval.exit_layers=[1]",
                        "loop.best_metric=tau_exit1", "layerskip.lora=true", "layerskip.lora_r=4"])
    assert json.loads((tmp_path / "lora" / "best" / "drafter.json").read_text())["exit_layer"] == 1
    assert lora.state.step == 2
    best = tmp_path / "best"
    info = json.loads((best / "drafter.json").read_text())
    assert info["exit_layer"] in (1, 2) and set(info["tau_by_exit"]) == {"1", "2"}
    assert GenerationConfig.from_pretrained(best).assistant_early_exit == info["exit_layer"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/tau_exit2" in r]
    assert len(evals) == 2 and all(r["eval/tau_exit1"] >= 1.0 for r in evals)
    assert "eval/heldout_agree_exit1" in evals[0] and "loss_exit1" in json.dumps(rows)
    target = LlamaForCausalLM.from_pretrained(best).eval()
    proposer = load_proposer(str(best), target)
    assert proposer.exit_layer == info["exit_layer"]
