"""The evaluator, the per-checkpoint evaluator and `draftsmith evaluate` on a tiny model with a real tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.data.tokenizer import END, train_bpe
from draftsmith.decoding import PromptLookup
from draftsmith.decoding.evaluate import make_checkpoint_evaluator, render_prompts
from draftsmith.train import evaluate as evaluate_command

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
PROMPTS = [{"messages": [{"role": "user", "content": "def add(a, b):"}]}, {"prompt": "for i in range(10):\n"}]


def save_model(path: Path, tokenizer, layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                                         eos_token_id=[tokenizer.convert_tokens_to_ids(END)]))
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    tokenizer = train_bpe(TEXTS, 300)
    target = save_model(root / "target", tokenizer, 2, 0)
    save_model(root / "draft", tokenizer, 1, 1)
    other = train_bpe([t.upper() for t in TEXTS], 300)
    save_model(root / "alien", other, 1, 1)
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root, tokenizer, target


def run_script(*argv: str) -> dict:
    return evaluate_command.main(list(argv))


def test_render_prompts_uses_the_chat_template_for_messages(tiny):
    _, tokenizer, _ = tiny
    chat, raw = render_prompts(tokenizer, PROMPTS)
    rendered = tokenizer.apply_chat_template(PROMPTS[0]["messages"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(chat[0]) == rendered and rendered.rstrip("\n").endswith("<|assistant|>")
    assert tokenizer.decode(raw[0]) == PROMPTS[1]["prompt"]
    with pytest.raises(ValueError, match="'messages'"):
        render_prompts(tokenizer, [{"text": "x"}])
    parts = [{"role": "user", "content": [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]}]
    assert torch.equal(render_prompts(tokenizer, [{"messages": parts}])[0], chat)
    with pytest.raises(ValueError, match=r"prompt 0: turn 0 \(user\) has content null, not text"):
        render_prompts(tokenizer, [{"messages": [{"role": "user", "content": None}]}])


@pytest.mark.parametrize("drafter", ["ngram", "lookahead", "draft"])
def test_evaluate_script_writes_the_promised_fields(tiny, drafter):
    root, _, _ = tiny
    spec = f"draft:{root / 'draft'}" if drafter == "draft" else drafter
    out = root / f"{drafter}.json"
    results = run_script("--target", str(root / "target"), "--drafter", spec, "--prompts", str(root / "prompts.jsonl"),
                         "--max-new-tokens", "16", "--temperatures", "0", "1", "--gamma", "3", "--out", str(out))
    saved = json.loads(out.read_text())
    assert saved["tau"] == results["tau"] >= 1
    assert saved["greedy_matches_target"] is True  # checked token by token at temperature 0
    assert saved["by_temperature"]["1"]["greedy_matches_target"] is None  # not checkable when sampling
    for key in ("acceptance_by_position", "speedup", "accept_length_histogram", "target_forwards",
                "drafted_tokens", "accepted_tokens", "drafter_s", "target_s"):
        assert key in saved
    assert saved["settings"]["drafter"] == spec and saved["settings"]["temperatures"] == [0.0, 1.0]
    assert sum(saved["accept_length_histogram"].values()) == saved["target_forwards"]


def test_a_draft_model_with_another_tokenizer_is_refused(tiny):
    root, _, _ = tiny
    with pytest.raises(ValueError, match="share the target tokenizer"):
        run_script("--target", str(root / "target"), "--drafter", f"draft:{root / 'alien'}", "--prompts",
                   str(root / "prompts.jsonl"), "--out", str(root / "x.json"))


class NgramMethod(nn.Module):
    """Stands in for a trained method: the evaluator only calls `proposer(target)`."""

    def proposer(self, target):
        return PromptLookup()


def test_checkpoint_evaluator_returns_flat_metrics_with_tau(tiny):
    _, tokenizer, target = tiny
    fn = make_checkpoint_evaluator(target, tokenizer, PROMPTS, max_new_tokens=12, temperatures=(0.0, 1.0),
                                   num_prompts=2, check_greedy=True)
    method = NgramMethod().train()
    metrics = fn(method, 10)
    assert method.training  # restored
    assert metrics["tau"] == metrics["tau_t0"] >= 1 and "tau_t1" in metrics
    assert metrics["eval_prompts"] == 2 and metrics["greedy_matches_target"] == 1.0
    assert all(isinstance(v, float | int) for v in metrics.values())
    assert fn(method, 20)["tau"] == metrics["tau"]  # greedy: same drafter, same prompts, same tau


def test_verify_cost_curve_and_the_speedup_model_that_prices_it(tiny):
    from draftsmith.decoding import cost

    curve = cost.verify_cost_curve(tiny[2], ks=(1, 2, 4), context=16, repeats=2)
    assert sorted(curve) == [1, 2, 4] and all(s > 0 for s in curve.values())
    rel = cost.relative(curve)
    assert rel[1] == 1.0
    rows = []  # the head's rows per timed forward: the decoder's lazy head on a CPU, not all k rows
    hook = tiny[2].get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    cost.verify_cost_curve(tiny[2], ks=(1, 8), context=16, repeats=1)
    hook.remove()
    assert sorted(set(rows)) == [1, 2]  # rows [0, min(k, 2)) per forward; the context computes no logits at all
    rel = {1: 1.0, 2: 1.2, 4: 2.0, 8: 3.0}
    assert cost.verify_cost(rel, 3) == pytest.approx(1.6) and cost.verify_cost(rel, 16) == pytest.approx(5.0)
    # alpha 0.5, gamma 3: 1.875 tokens per step; a step costs v(4) = 2 plus 3 drafts at c = 0.1.
    assert cost.predicted_speedup(0.5, 0.1, 3, rel) == pytest.approx(1.875 / 2.3)
    assert cost.predicted_speedup(0.5, 0.1, 3) == pytest.approx(1.875 / 1.3)  # the GPU model: v = 1
    assert cost.expected_tokens(1.0, 3) == 4
