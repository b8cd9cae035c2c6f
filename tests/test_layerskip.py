"""LayerSkip: early-exit loss, curricula, layer dropout, the early-exit proposers and their decoding.

Self-speculation with the exit-query cache must give the target's own greedy tokens on every supported
architecture and on the reference target, reuse the draft's work (layers [:E] see each token once),
keep the shared KV cache equal to a fresh forward's after every rejection, and sample exactly (chi-square).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as T
from safetensors.torch import load_file
from test_decoding_verify import chi2_critical
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from draftsmith.data.reference import load_prompts
from draftsmith.decoding import Sampling, generate, speculative_generate
from draftsmith.decoding import cache as kv
from draftsmith.decoding.evaluate import render_prompts
from draftsmith.decoding.proposers import truncated_copy
from draftsmith.models.layerskip import (
    Curriculum,
    EarlyExit,
    EarlyExitDraft,
    LayerDropout,
    LayerSkip,
    LayerSkipConfig,
    decoder_layers,
    dropout_rates,
    early_exit,
    final_norm,
)
from draftsmith.models.lm import masked_ce
from draftsmith.models.target import REFERENCE_TARGET
from draftsmith.train.config import LoopConfig
from draftsmith.train.layerskip import record_exit_layer
from draftsmith.train.loop import Loop


def llama(layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2)
TINY = {  # sliding windows of 4 keep the window in play over a 20-token generation
    "llama": llama,
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4,
                                                     max_window_layers=2)).eval(),
    "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON, head_dim=8)).eval(),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**COMMON, sliding_window=4)).eval(),
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**COMMON, head_dim=8, sliding_window=4)).eval(),
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=4)).eval(),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, bos_token_id=0,
                                               eos_token_id=1)).eval(),
}


@pytest.mark.parametrize("arch", sorted(TINY))
def test_truncated_copy_is_the_first_layers_with_norm_and_head_sharing_weights(arch):
    model = TINY[arch]()
    draft = truncated_copy(model, 2)
    ids = torch.randint(0, 64, (1, 9))
    hidden = model(ids, output_hidden_states=True).hidden_states[2]  # output of layer 2
    expected = model.get_output_embeddings()(final_norm(model)(hidden))
    cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma-2
    torch.testing.assert_close(draft(ids).logits, torch.tanh(expected / cap) * cap if cap else expected)
    assert draft.get_output_embeddings().weight is model.get_output_embeddings().weight
    assert len(decoder_layers(draft)) == 2


def test_exit_layer_out_of_range_is_a_clear_error():
    with pytest.raises(ValueError, match="exit layer 4 must be in 1..3"):
        truncated_copy(llama(), 4)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_self_speculative_greedy_equals_target_greedy(arch):
    torch.manual_seed(0)
    model = TINY[arch]()
    prompt = torch.randint(2, 64, (1, 6))
    expected = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    for E in (1, 2, 3):
        if arch == "gpt2":  # no split forward: the truncated copy with its own cache, said by a warning
            with pytest.warns(UserWarning, match="no split forward for 'gpt2'"):
                proposer = early_exit(model, E, gamma=3)
            assert isinstance(proposer, EarlyExitDraft)
        else:
            proposer = early_exit(model, E, gamma=3)
            assert isinstance(proposer, EarlyExit)
        got, stats = speculative_generate(model, proposer, prompt, 20, eos_token_id=[])
        assert torch.equal(got, expected), f"{arch} E={E}"
        assert stats.tau >= 1.0


def test_unsupported_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="no split forward for model_type 'gpt2'.*use EarlyExitDraft"):
        EarlyExit(TINY["gpt2"](), 2)
    with pytest.raises(ValueError, match="exit layer 4 must be in 1..3"):
        EarlyExit(llama(), 4)


class Checked(EarlyExit):
    """Records how many tokens each split run feeds, and after every verification compares the shared
    KV cache (every layer) with a fresh forward over the committed tokens. `corrupt` replaces the second
    drafted token at every other step, so verification sees a chain that departs from what the draft fed."""

    def __init__(self, target, exit_layer, gamma, corrupt=False):
        super().__init__(target, exit_layer, gamma)
        self.target, self.corrupt, self.runs, self.steps = target, corrupt, [], 0
        run = self.split.run
        self.split.run = lambda hidden, layers, cache: (self.runs.append((layers.start, hidden.shape[1])),
                                                        run(hidden, layers, cache))[1]

    def propose(self, ids, sampling):
        tree = super().propose(ids, sampling)
        self.steps += 1
        if self.corrupt and self.steps % 2 and len(tree) > 1:
            tree.tokens[1] = (tree.tokens[1] + 1) % 64
        return tree

    def accept(self, ids, verified):
        if verified.tree is None:
            return
        fresh = self.target(input_ids=ids[None, :-1], cache=kv.new_cache(), use_cache=True).cache  # full layers
        assert len(self.cache.layers) == len(fresh.layers)
        for mine, ref in zip(self.cache.layers, fresh.layers, strict=True):
            torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("corrupt", [False, True], ids=["drafted", "corrupted"])
def test_exit_query_cache_reuses_the_draft_and_rolls_back_after_rejections(arch, corrupt):
    torch.manual_seed(0)
    model = TINY[arch]()
    prompt = torch.randint(2, 64, (1, 5))
    expected = model.generate(prompt, max_new_tokens=60, do_sample=False, eos_token_id=None, pad_token_id=0)
    proposer = Checked(model, 2, gamma=3, corrupt=corrupt)
    with torch.no_grad():
        got, stats = speculative_generate(model, proposer, prompt, 60, eos_token_id=[])
    assert torch.equal(got, expected)
    assert 0 < stats.accepted < stats.drafted, "both acceptances and rejections must happen"
    early = [s for start, s in proposer.runs if start == 0]  # tokens through layers [:E] per run
    late = [s for start, s in proposer.runs if start == 2]  # tokens through layers [E:]: one run per verification
    assert len(late) == stats.steps and sum(late) == stats.steps + stats.drafted
    if not corrupt:  # one token per run: gamma drafting runs, and the last drafted token of a full chain
        assert set(early) == {1} and len(early) == sum(3 + (n == 4) for n in late)
    else:  # a corrupted chain recomputes [:E] from its first corrupted token (node 1) on
        assert max(early) == 2


def test_exit_query_cache_verifies_with_the_full_head_as_on_a_gpu(monkeypatch):
    """On a GPU the decoder runs the target's whole forward (no lazy head); the hook's hidden states still get
    the head (the first GPU run failed here: 'BaseModelOutputWithPast' object has no attribute 'logits')."""
    monkeypatch.setattr(generate, "lazy_head", lambda target, device: False)
    torch.manual_seed(0)
    model = TINY["gemma3"]()  # soft-capped logits
    prompt = torch.randint(2, 64, (1, 5))
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        got, stats = speculative_generate(model, EarlyExit(model, 2, gamma=3), prompt, 40, eos_token_id=[])
    assert torch.equal(got, expected) and stats.accepted > 0

def test_exact_sampling_with_the_exit_query_cache_follows_the_target_distribution():
    """Chi-square over the first two sampled tokens (both the bonus and depth-2 acceptance are exercised)
    on a tiny model whose exit-1 distribution q differs clearly from the target's p."""
    V, trials = 5, 1500
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3 if "lm_head" in name else 1.0)
    x = torch.tensor([[1, 4, 2]])
    proposer, g = EarlyExit(model, 1, gamma=2), torch.Generator().manual_seed(0)
    counts = torch.zeros(V, V)
    with torch.no_grad():
        for _ in range(trials):
            out, _ = speculative_generate(model, proposer, x, 3, Sampling(1.0, generator=g), eos_token_id=[])
            counts[out[0, 3], out[0, 4]] += 1
        exact, draft = torch.zeros(V, V), torch.zeros(V, V)  # joint of (x1, x2) under p and under q
        for x1 in range(V):
            out = model(torch.cat([x, torch.tensor([[x1]])], 1), output_hidden_states=True)
            exit_probs = model.lm_head(model.model.norm(out.hidden_states[1][0])).softmax(-1)  # [4, V]
            exact[x1] = out.logits[0, -2].softmax(-1)[x1] * out.logits[0, -1].softmax(-1)
            draft[x1] = exit_probs[-2, x1] * exit_probs[-1]
    small = exact * trials < 5  # cells expected to hold fewer than 5 samples are pooled into one

    def chi2(probs: torch.Tensor) -> float:
        observed = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([probs[~small], probs[small].sum()[None]]) * trials
        return float(((observed - expected) ** 2 / expected).sum())

    critical = chi2_critical(int((~small).sum()))  # kept cells + the pooled one, minus 1
    assert chi2(exact) < critical
    assert chi2(draft) > 3 * critical, "the test must tell the target's distribution from the draft's"


def test_exit_query_cache_greedy_equals_the_reference_targets_own_on_heldout_prompts():
    target = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET).eval()
    prompts = render_prompts(AutoTokenizer.from_pretrained(REFERENCE_TARGET), load_prompts(limit=4))
    with torch.no_grad():
        for x in prompts:
            expected = target.generate(x, max_new_tokens=24, do_sample=False)
            for E in (2, 4, 6):
                got, _ = speculative_generate(target, EarlyExit(target, E, gamma=4), x, 24)
                assert torch.equal(got, expected), f"E={E}"


def test_export_is_a_plain_model_that_transformers_self_speculates_with(tmp_path, monkeypatch):
    """The exported directory loads with transformers alone; its generation config makes `generate` draft
    with the recorded exit layer (EarlyExitCandidateGenerator runs), and the tokens equal plain greedy."""
    from transformers.generation.candidate_generator import EarlyExitCandidateGenerator

    method = LayerSkip(llama(), None, LayerSkipConfig(dropout_max=0.0))
    method.save_pretrained(tmp_path)
    record_exit_layer(tmp_path, {1: 1.4, 2: 1.9, 3: 1.7})
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert model.generation_config.assistant_early_exit == 2
    drafted = []
    get_candidates = EarlyExitCandidateGenerator.get_candidates
    monkeypatch.setattr(EarlyExitCandidateGenerator, "get_candidates",
                        lambda self, *a, **kw: drafted.append(self.assistant_early_exit) or get_candidates(self, *a, **kw))
    x = torch.randint(2, 64, (1, 6))
    with torch.no_grad():
        got = model.generate(x, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
        plain = model.generate(x, generation_config=GenerationConfig(max_new_tokens=20, do_sample=False,
                                                                   eos_token_id=None, pad_token_id=0))
    assert drafted and set(drafted) == {2}
    assert torch.equal(got, plain)


def test_early_exit_loss_is_final_plus_scaled_exits():
    model = llama()
    cfg = LayerSkipConfig(scale="linear", curriculum="none", dropout_max=0.0, e_scale=0.5)
    method = LayerSkip(model, None, cfg).eval()
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
    grad = Curriculum("gradual", num_layers=8)
    grad.progress = lambda: 0.0
    assert grad.enabled() == []
    grad.progress = lambda: 0.25  # 0.25 >= 0.5 * (8 - l) / 8  <=>  l >= 4
    assert grad.enabled() == [4, 5, 6, 7]
    grad.progress = lambda: 1.0
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
    straight = LayerSkip(llama(), None, ls_cfg)
    Loop(LoopConfig(**{**cfg, "output_dir": str(tmp_path / "a")}), straight, rows).run()
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    resumed = LayerSkip(llama(seed=1), None, ls_cfg)
    Loop(LoopConfig(**{**cfg, "output_dir": str(tmp_path / "b")}), resumed, rows).run()
    assert resumed.curriculum.step == straight.curriculum.step == 4
    a = load_file(tmp_path / "a" / "checkpoint-4" / "trainable.safetensors")
    b = load_file(tmp_path / "b" / "checkpoint-4" / "trainable.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_export_is_a_merged_plain_model(tmp_path):
    model = llama()
    method = LayerSkip(model, None, LayerSkipConfig(lora=True, lora_r=4, dropout_max=0.0))
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

    from draftsmith.models.registry import load_proposer
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
