"""Draft-model distillation: losses against hand computation, masks, the three draft constructions, the
tokenizer check, on-policy sequences, the recipe end to end, and the export used by transformers' own
assisted generation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.reference import stdlib_files
from draftsmith.data.tokenizer import train_bpe
from draftsmith.decoding import speculative_generate
from draftsmith.decoding.cost import alpha_from_tau, predicted_speedup
from draftsmith.decoding.proposers import DraftModel, truncated_copy
from draftsmith.models.distill import (
    Distill,
    DistillConfig,
    build_draft,
    distill_loss,
    divergence,
    prompts_of,
    sample_on_policy,
)
from draftsmith.models.lm import masked_ce
from draftsmith.models.registry import export, load, load_proposer
from draftsmith.models.target import load_target
from draftsmith.train import regenerate
from draftsmith.train.config import ConfigError

REPO = Path(__file__).resolve().parent.parent
P = [0.5, 0.3, 0.1, 0.1]
Q = [0.25, 0.25, 0.25, 0.25]


def kl(a: list[float], b: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True) if x > 0)


def logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_losses_equal_hand_computation():
    p, q = logits(P), logits(Q)
    assert divergence(p, q, "fkl").item() == pytest.approx(kl(P, Q), rel=1e-5)
    assert divergence(p, q, "rkl").item() == pytest.approx(kl(Q, P), rel=1e-5)
    assert divergence(p, q, "tvd").item() == pytest.approx(0.5 * sum(abs(x - y) for x, y in zip(P, Q, strict=True)))
    for beta in (0.5, 0.2):
        m = [beta * x + (1 - beta) * y for x, y in zip(P, Q, strict=True)]
        expected = beta * kl(P, m) + (1 - beta) * kl(Q, m)
        assert divergence(p, q, "jsd", beta).item() == pytest.approx(expected, rel=1e-5)
    assert divergence(p, q, "fkl").item() != pytest.approx(divergence(p, q, "rkl").item(), rel=1e-2)


def test_jsd_beta_limits_are_forward_and_reverse_kl():
    p, q = logits(P), logits(Q)
    assert divergence(p, q, "jsd", 0.0).item() == pytest.approx(kl(P, Q), rel=1e-5)
    assert divergence(p, q, "jsd", 1.0).item() == pytest.approx(kl(Q, P), rel=1e-5)
    eps = 1e-3  # JSD(beta) / beta -> KL(p || q) and JSD(beta) / (1 - beta) -> KL(q || p): the endpoints are limits
    assert divergence(p, q, "jsd", eps).item() / eps == pytest.approx(kl(P, Q), rel=1e-2)
    assert divergence(p, q, "jsd", 1 - eps).item() / eps == pytest.approx(kl(Q, P), rel=1e-2)


def test_temperature_divides_both_logits():
    torch.manual_seed(0)
    p, q = torch.randn(3, 16), torch.randn(3, 16)
    for kind in ("fkl", "rkl", "jsd", "tvd"):
        torch.testing.assert_close(divergence(2 * p, 2 * q, kind, temperature=2.0), divergence(p, q, kind))
        assert not torch.allclose(divergence(p, q, kind, temperature=2.0), divergence(p, q, kind))


@pytest.mark.parametrize("loss", ["ce", "fkl", "rkl", "jsd", "tvd"])
def test_loss_covers_assistant_tokens_only(loss):
    torch.manual_seed(0)
    b, s, V = 2, 7, 11
    p, q = torch.randn(b, s, V), torch.randn(b, s, V, requires_grad=True)
    ids = torch.randint(0, V, (b, s))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0]])  # token t trained: predicted at t - 1
    cfg = DistillConfig(loss=loss, beta=0.3)
    value = distill_loss(p, q, ids, mask, cfg)
    value.backward()
    trained = mask[:, 1:].bool()  # [b, s-1]: positions whose next token is trained
    assert q.grad[:, :-1][~trained].abs().sum() == 0 and q.grad[:, -1].abs().sum() == 0
    assert q.grad[:, :-1][trained].abs().sum(-1).min() > 0
    if loss == "ce":
        torch.testing.assert_close(value, masked_ce(q, ids, mask))
    else:
        expected = divergence(p[:, :-1][trained], q[:, :-1][trained], loss, 0.3).mean()
        torch.testing.assert_close(value, expected)


def test_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"distill.beta: must be in \[0, 1\]"):
        DistillConfig(beta=1.5)
    with pytest.raises(ConfigError, match="distill.regenerated: sequences=mixed needs"):
        DistillConfig(sequences="mixed")
    with pytest.raises(ConfigError, match="distill.checkpoint: init=checkpoint needs"):
        DistillConfig(init="checkpoint")
    with pytest.raises(ConfigError, match="distill.lmbda"):
        DistillConfig(lmbda=-0.1)


def test_truncated_draft_is_an_independent_trainable_copy(tiny_chat_target):
    target = load_target(tiny_chat_target)
    draft = build_draft(target, DistillConfig(init="truncate", layers=2))
    ids = torch.randint(0, target.config.vocab_size, (1, 9))
    torch.testing.assert_close(draft(ids).logits, truncated_copy(target.model, 2)(ids).logits)
    before = {n: p.clone() for n, p in target.model.named_parameters()}
    target_ptrs = {p.data_ptr() for p in target.model.parameters()}
    assert all(p.requires_grad and p.data_ptr() not in target_ptrs for p in draft.parameters())
    torch.optim.SGD(draft.parameters(), lr=1.0).zero_grad()
    draft(ids).logits.sum().backward()
    torch.optim.SGD(draft.parameters(), lr=1.0).step()
    assert all(torch.equal(before[n], p) for n, p in target.model.named_parameters()), "the target must not move"
    assert not torch.allclose(draft(ids).logits, truncated_copy(target.model, 2)(ids).logits)


def test_draft_from_a_narrower_config(tiny_chat_target):
    target = load_target(tiny_chat_target)
    draft = build_draft(target, DistillConfig(init="config", layers=1, hidden_size=16, num_attention_heads=2))
    c = draft.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (1, 16, 2,
                                                                                                            2, 8)
    assert c.intermediate_size == 32 and c.vocab_size == target.config.vocab_size
    assert type(draft) is type(target.model)
    assert draft(torch.randint(0, c.vocab_size, (2, 5))).logits.shape == (2, 5, c.vocab_size)
    with pytest.raises(ConfigError, match="distill.hidden_size: 18 is not divisible by 4"):
        build_draft(target, DistillConfig(init="config", hidden_size=18))


def test_draft_from_a_checkpoint_and_the_tokenizer_check(tiny_chat_target, tmp_path):
    target = load_target(tiny_chat_target)
    small = build_draft(target, DistillConfig(init="config", layers=1, hidden_size=16, num_attention_heads=2))
    small.save_pretrained(tmp_path / "good")
    target.tokenizer.save_pretrained(tmp_path / "good")
    draft = build_draft(target, DistillConfig(init="checkpoint", checkpoint=str(tmp_path / "good")))
    assert all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), small.state_dict().values(), strict=True))

    small.save_pretrained(tmp_path / "other")
    train_bpe([f.text for f in stdlib_files()[6:9]], 300).save_pretrained(tmp_path / "other")  # another vocabulary
    with pytest.raises(ValueError, match="tokenizer differs from the target's"):
        build_draft(target, DistillConfig(init="checkpoint", checkpoint=str(tmp_path / "other")))
    small.save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match="has no tokenizer"):
        build_draft(target, DistillConfig(init="checkpoint", checkpoint=str(tmp_path / "bare")))

    from draftsmith.train import distill as script  # the entry script fails before any run dir

    with pytest.raises(ValueError, match="tokenizer differs"):
        script.main(["--config", str(REPO / "recipes/distill/tiny-code.yaml"), f"target.path={tiny_chat_target}",
                     "distill.init=checkpoint", f"distill.checkpoint={tmp_path / 'other'}",
                     f"loop.output_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_on_policy_schedule_and_sampled_batches(tiny_chat_target):
    target = load_target(tiny_chat_target)
    cfg = DistillConfig(lmbda=0.25, on_policy_prompts=2, on_policy_tokens=5, loss="rkl")
    method = Distill(target, build_draft(target, cfg), cfg)
    due = []
    for _ in range(8):
        due.append(method.on_policy_due())
        method.steps += 1
    assert due == [False, False, False, True] * 2  # exactly a fraction lambda of the steps

    V = target.config.vocab_size
    ids = torch.randint(5, V, (3, 12))
    mask = torch.zeros(3, 12, dtype=torch.long)
    mask[0, 4:], mask[1, 7:], mask[2, 2:] = 1, 1, 1
    batch = {"input_ids": ids, "loss_mask": mask}
    prompts = prompts_of(batch, 2)
    assert [p.tolist() for p in prompts] == [ids[0, :4].tolist(), ids[1, :7].tolist()]
    torch.manual_seed(0)
    out = sample_on_policy(method.draft, prompts, 5, 1.0, eos=[], pad_id=0)
    assert out["input_ids"].shape == (2, 12)  # longest prompt (7) + 5 sampled tokens
    assert out["input_ids"][0, :4].tolist() == ids[0, :4].tolist() and out["input_ids"][1, :7].tolist() == ids[1, :7].tolist()
    assert out["loss_mask"].tolist() == [[0] * 4 + [1] * 5 + [0] * 3, [0] * 7 + [1] * 5]
    assert out["attention_mask"].tolist() == [[1] * 9 + [0] * 3, [1] * 12]
    stop = sample_on_policy(method.draft, prompts, 5, 1.0, eos=list(range(V)), pad_id=0)  # every token is an EOS
    assert stop["loss_mask"].sum(1).tolist() == [1, 1] and stop["input_ids"].shape == (2, 8)

    method.train()
    method.steps = 3  # the next step is on-policy
    loss, metrics = method(batch)
    assert metrics["on_policy"] == 1.0 and metrics["trained_tokens"] == 10 and loss.requires_grad
    loss, metrics = method(batch)
    assert metrics["on_policy"] == 0.0 and metrics["trained_tokens"] == float(mask[:, 1:].sum())
    assert 0 <= metrics["alpha_t1"] <= 1 and method.extra_state() == {"steps": 5}


def _run(tiny_chat_target, out: Path, *extra: str):
    from draftsmith.train import distill as script

    return script.main(["--config", str(REPO / "recipes/distill/tiny-code.yaml"), f"target.path={tiny_chat_target}",
                        f"loop.output_dir={out}", "loop.max_steps=4", "loop.save_every=2", "loop.batch_size=2",
                        "loop.log_every=1", "data.limit=24", "data.max_length=256", "data.cache=false",
                        "data.on_no_assistant=drop", "data.overlong=truncate", "eval.num_prompts=2",
                        "eval.max_new_tokens=8", *extra])


def test_recipe_trains_on_and_off_policy_measures_tau_and_keeps_a_loadable_best(tiny_chat_target, tmp_path):
    loop = _run(tiny_chat_target, tmp_path, "distill.loss=tvd", "distill.lmbda=0.5", "distill.on_policy_tokens=6",
                "eval.temperatures=[0.0, 1.0]")
    assert loop.state.step == 4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "on_policy" in r]
    assert [r["on_policy"] for r in steps] == [0, 1, 0, 1]
    evals = [r for r in rows if "eval/tau" in r]
    assert len(evals) == 2 and all(r["eval/tau"] >= 1 and r["eval/tau_t1"] >= 1 for r in evals)
    best = tmp_path / "best"
    assert json.loads((best / "drafter.json").read_text())["method"] == "distill"
    assert json.loads((best / "best.json").read_text())["tau"] == pytest.approx(max(r["eval/tau"] for r in evals), abs=1e-5)

    target = AutoModelForCausalLM.from_pretrained(tiny_chat_target).eval()
    tok = AutoTokenizer.from_pretrained(tiny_chat_target)
    for proposer in (load_proposer(str(best), target), load_proposer(f"draft:{best}", target, tok, gamma=4)):
        assert isinstance(proposer, DraftModel) and proposer.gamma == 4
        x = torch.randint(5, target.config.vocab_size, (1, 6))
        got, _ = speculative_generate(target, proposer, x, 16)
        assert torch.equal(got, target.generate(x, max_new_tokens=16, do_sample=False))


def test_regenerated_and_mixed_sequences(tiny_chat_target, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}(x):"},
                                                     {"role": "assistant", "content": "    return x"}]}) + "\n"
                            for i in range(6)))
    regenerated = tmp_path / "regen.jsonl"
    regenerate.main(["--target", str(tiny_chat_target), "--data", str(data), "--out", str(regenerated),
                     "--max-new-tokens", "8", "--batch-size", "3"])
    from draftsmith.train import distill as script

    cfg_args = ["--config", str(REPO / "recipes/distill/tiny-code.yaml"), f"target.path={tiny_chat_target}",
                "data.limit=24", "data.cache=false", "data.on_no_assistant=drop", "data.pack=false",
                f"distill.regenerated={regenerated}"]
    cfg = script.C.from_command_line(script.Recipe, "", cfg_args + ["distill.sequences=mixed"], None)
    tok = AutoTokenizer.from_pretrained(tiny_chat_target)
    fixed = script.build_sequences(script.C.from_command_line(script.Recipe, "", cfg_args, None), tok)
    mixed = script.build_sequences(cfg, tok)
    assert len(mixed) == len(fixed) + 6
    regen_rows = mixed.select(range(len(fixed), len(mixed)))
    replies = [json.loads(line)["messages"][1]["content"] for line in regenerated.read_text().splitlines()]
    assert tok.decode([t for t, m in zip(regen_rows[0]["input_ids"], regen_rows[0]["loss_mask"], strict=True)
                       if m]).startswith(replies[0])
    loop = _run(tiny_chat_target, tmp_path / "run", "distill.sequences=regenerated", f"distill.regenerated={regenerated}",
                "data.pack=false", "loop.max_steps=2", "distill.loss=ce")
    assert loop.state.step == 2


def test_export_loads_in_transformers_and_assisted_generation_equals_greedy(tiny_chat_target, tmp_path):
    target = load_target(tiny_chat_target)
    cfg = DistillConfig(init="truncate", layers=2, gamma=3)
    method = Distill(target, build_draft(target, cfg), cfg)
    with torch.no_grad():  # a draft that differs from the target's first layers, so some drafts are rejected
        for p in method.draft.parameters():
            p.add_(0.02 * torch.randn_like(p))
    method.save_pretrained(tmp_path / "drafter")
    out = export(tmp_path / "drafter", "hf", tmp_path / "export")
    assert not (out / "drafter.json").exists() and (out / "tokenizer_config.json").is_file()
    draft = load("distill", "hf", out)
    state = method.draft.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in draft.state_dict().items())
    assert draft.generation_config.num_assistant_tokens == 3
    with pytest.raises(FileExistsError):
        export(tmp_path / "drafter", "vllm", out)

    model, tok = target.model, target.tokenizer
    for text in ["def add(a, b):", "class Stack:\n    def push(self, x):"]:
        x = tok(text, return_tensors="pt")["input_ids"]
        greedy = model.generate(x, max_new_tokens=24, do_sample=False)
        assisted = model.generate(x, max_new_tokens=24, do_sample=False, assistant_model=draft)
        assert torch.equal(assisted, greedy)
    x = tok("def add(a, b):", return_tensors="pt")["input_ids"]
    ours, stats = speculative_generate(model, DraftModel.from_pretrained(out, model, tok, gamma=3), x, 24)
    assert torch.equal(ours, model.generate(x, max_new_tokens=24, do_sample=False)) and stats.drafted > 0


def test_bench_alpha_and_predicted_speedup():
    for alpha in (0.0, 0.3, 0.8):
        tau = sum(alpha ** k for k in range(5))  # expected tokens per step at gamma 4 with i.i.d. acceptance alpha
        assert alpha_from_tau(tau, 4) == pytest.approx(alpha, abs=1e-6)
        assert predicted_speedup(alpha, 0.0, 4) == pytest.approx(tau)
    assert predicted_speedup(0.8, 0.25, 4) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 2.0))
