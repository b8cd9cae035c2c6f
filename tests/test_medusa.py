"""Medusa-1 / Medusa-2: the generic tap, heads, losses, the recipe entry point and every export format."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import script
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from draftsmith.data.reference import stdlib_files
from draftsmith.data.tokenizer import train_bpe
from draftsmith.decoding.generate import plain_generate, speculative_generate
from draftsmith.decoding.metrics import DecodeStats
from draftsmith.decoding.proposers import Verified
from draftsmith.decoding.verify import Sampling
from draftsmith.models import export as E
from draftsmith.models import registry as R
from draftsmith.models.lm import masked_ce
from draftsmith.models.medusa import (
    Medusa,
    MedusaConfig,
    MedusaProposer,
    chain_choices,
    check_choices,
    greedy_tree,
    head_losses,
    head_warmup,
    heldout_accuracy,
    load_medusa,
    masked_kl,
    shifted_mask,
    target_passes,
)
from draftsmith.models.registry import load_proposer as decoder_load_proposer
from draftsmith.models.target import Target, load_target
from draftsmith.train import config as C
from draftsmith.train import export as export_command

REPO = Path(__file__).resolve().parent.parent




def tiny_llama(vocab: int = 96, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                        bos_token_id=None, eos_token_id=0, pad_token_id=0)).eval()


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A tiny Llama with a real BPE tokenizer and chat template, saved like any HF model."""
    out = tmp_path_factory.mktemp("tiny-target")
    tok = train_bpe([f.text for f in stdlib_files()[:2]], 300)
    model = tiny_llama(len(tok))
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_recipe(recipe: str, target: Path, out: Path, *extra: str):
    return script("train/medusa.py").main(["--config", str(REPO / "recipes/medusa" / recipe), f"target.path={target}",
                       f"loop.output_dir={out}", "data.limit=48", "eval.heldout_examples=6", "eval.num_prompts=1",
                       "eval.max_new_tokens=4", "eval.tree_budget=6", "eval.tree_ranks=3",
                       "data.max_length=128", "data.cache=false", "loop.batch_size=2", "loop.log_every=1", *extra])


@pytest.fixture(scope="module")
def medusa1_run(tiny_target_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("m1") / "run"
    run_recipe("medusa1-tiny-code.yaml", tiny_target_dir, out, "loop.max_steps=6", "loop.save_every=3",
               "loop.lr=1e-2")
    return out


@pytest.fixture(scope="module")
def medusa2_run(tiny_target_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("m2") / "run"
    run_recipe("medusa2-tiny-code.yaml", tiny_target_dir, out, "loop.max_steps=3", "loop.save_every=3",
               "medusa.lora_r=4", "medusa.lora_alpha=8", "loop.lr=1e-2")
    return out



@pytest.mark.parametrize("recipe, extra, passes", [
    ("medusa1-tiny-code.yaml", (), 1),
    ("medusa2-tiny-code.yaml", ("medusa.lora_r=4", "medusa.lora_alpha=8"), 2),
], ids=["medusa1", "medusa2"])
def test_a_frozen_target_runs_over_the_heldout_rows_once(recipe, extra, passes, tiny_target_dir, tmp_path, monkeypatch):
    """Medusa-1's target never changes, so one pass over the held-out rows serves every checkpoint's
    accuracies; Medusa-2 trains the target, so each checkpoint makes its own."""
    module, calls = script("train/medusa.py"), []
    real = module.target_passes
    monkeypatch.setattr(module, "target_passes", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_recipe(recipe, tiny_target_dir, tmp_path / "run", "loop.max_steps=2", "loop.save_every=1", *extra)
    assert len(calls) == passes

# ---- the generic target tap ---------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: tiny_llama(),
    lambda: GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)),
    lambda: Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)),
    lambda: GemmaForCausalLM(GemmaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)),
], ids=["llama", "gpt2", "qwen2", "gemma"])
def test_tap_returns_post_norm_hidden_state_without_per_architecture_code(make):
    torch.manual_seed(0)
    model = make().eval()
    target = Target(model)
    ids = torch.randint(0, 96, (2, 9))
    out = target.tap(ids, layers=(0, 1, 2))
    ref = model(ids, output_hidden_states=True)
    torch.testing.assert_close(target.logits(out.hidden), ref.logits)  # final norm already applied
    torch.testing.assert_close(out.layers[1], ref.hidden_states[1])
    assert target.embed is model.get_input_embeddings() and target.lm_head is model.get_output_embeddings()
    with pytest.raises(ValueError, match="out of range"):
        target.tap(ids, layers=(7,))


def test_load_target_is_frozen(tiny_target_dir):
    target = load_target(tiny_target_dir)
    assert not any(p.requires_grad for p in target.parameters())
    assert target.tokenizer is not None and not target.model.training


# ---- heads and losses ---------------------------------------------------------------------------------

@pytest.mark.parametrize("share", [False, True])
def test_heads_start_as_the_target_lm_head(share):
    target = Target(tiny_llama())
    method = Medusa(target, MedusaConfig(num_heads=3, num_layers=2, share_lm_head=share))
    hidden = torch.randn(2, 5, 32)
    logits = method.heads(hidden)  # [K, b, s, V]
    assert logits.shape == (3, 2, 5, 96)
    for k in range(3):
        torch.testing.assert_close(logits[k], target.logits(hidden))
    assert (method.heads.projection(0) is target.lm_head) == share
    trainable = {n for n, p in method.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("heads.") for n in trainable)
    assert any(n.startswith("heads.proj.") for n in trainable) != share


def test_shifted_mask_respects_loss_mask_and_packing():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])  # two packed examples
    # head 1 (shift 2): t -> t+2 must be trained on and in the same example
    assert shifted_mask(loss_mask, pos, 2).int().tolist() == [[1, 1, 1, 0, 0, 1]]
    assert shifted_mask(loss_mask, None, 2).int().tolist() == [[1, 1, 1, 1, 0, 1]]


def test_head_loss_ignores_masked_labels_and_counts_unmasked_ones():
    torch.manual_seed(0)
    method = Medusa(Target(tiny_llama()), MedusaConfig(num_heads=2))
    hidden = torch.randn(1, 10, 32)
    ids = torch.randint(1, 96, (1, 10))
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])
    base, _ = head_losses(method.heads, hidden, ids, mask)
    masked_changed = ids.clone()
    masked_changed[0, 3] = (ids[0, 3] + 1) % 96  # a label only masked positions would predict
    same, _ = head_losses(method.heads, hidden, masked_changed, mask)
    assert all(torch.equal(a, b) for a, b in zip(base, same, strict=True))
    trained_changed = ids.clone()
    trained_changed[0, 7] = (ids[0, 7] + 1) % 96  # predicted by head 1 at t=5 and head 2 at t=4
    diff, _ = head_losses(method.heads, hidden, trained_changed, mask)
    assert all(not torch.equal(a, b) for a, b in zip(base, diff, strict=True))


def test_medusa1_loss_weights_and_metrics():
    torch.manual_seed(0)
    method = Medusa(Target(tiny_llama()), MedusaConfig(num_heads=3, decay=0.5, topk=4))
    batch = {"input_ids": torch.randint(1, 96, (2, 12)), "loss_mask": torch.ones(2, 12, dtype=torch.long)}
    loss, metrics = method(batch)
    expected = sum(0.5 ** (k - 1) * metrics[f"head{k}_loss"] for k in (1, 2, 3))
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)
    for k in (1, 2, 3):
        assert 0 <= metrics[f"head{k}_top1"] <= metrics[f"head{k}_top4"] <= 1


def count_decoder_calls(target: Target) -> list[int]:
    calls = [0]
    target.model.get_decoder().register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("backbone,distill,forwards", [("frozen", False, 1), ("lora", False, 1), ("full", False, 1),
                                                       ("lora", True, 2)])
def test_target_runs_once_per_batch_for_all_heads(backbone, distill, forwards):
    target = Target(tiny_llama())
    method = Medusa(target, MedusaConfig(num_heads=4, backbone=backbone, self_distill=distill, lora_r=4))
    calls = count_decoder_calls(target)
    batch = {"input_ids": torch.randint(1, 96, (2, 12)), "loss_mask": torch.ones(2, 12, dtype=torch.long)}
    loss, _ = method(batch)
    loss.backward()
    assert calls[0] == forwards  # self-distillation adds exactly one adapters-disabled forward


def test_medusa1_target_gets_no_gradient_and_stays_in_eval_mode():
    target = Target(tiny_llama())
    method = Medusa(target, MedusaConfig()).train()
    assert not target.model.training
    loss, _ = method({"input_ids": torch.randint(1, 96, (1, 10)), "loss_mask": torch.ones(1, 10, dtype=torch.long)})
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None for p in method.heads.parameters())


def test_medusa2_self_distillation_is_kl_to_the_adapters_disabled_model():
    model = tiny_llama()
    original = copy.deepcopy(model)
    method = Medusa(Target(model), MedusaConfig(backbone="lora", self_distill=True, lora_r=4))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in method.target.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # move the adapted model away from the original
    ids = torch.randint(1, 96, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[:, :4] = 0
    _, metrics = method({"input_ids": ids, "loss_mask": mask})
    with torch.no_grad():
        expected = masked_kl(original(ids).logits, method.target.model(input_ids=ids).logits, mask)
    assert expected.item() > 1e-3
    assert math.isclose(metrics["lm_loss"], expected.item(), rel_tol=1e-4)


def test_medusa2_lm_loss_and_head_warmup():
    method = Medusa(Target(tiny_llama()), MedusaConfig(backbone="full", head_coeff=0.2, head_warmup="linear",
                                                       head_warmup_ratio=0.5, decay=0.8, num_heads=2))
    method.progress = lambda: 0.1
    ids = torch.randint(1, 96, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    loss, metrics = method({"input_ids": ids, "loss_mask": mask})
    lm = masked_ce(method.target.model(input_ids=ids).logits, ids, mask).item()
    assert math.isclose(metrics["lm_loss"], lm, rel_tol=1e-5)
    w = 0.2 * 0.1 / 0.5
    assert math.isclose(metrics["head_weight"], w, rel_tol=1e-6)
    assert math.isclose(loss.item(), lm + w * (metrics["head1_loss"] + 0.8 * metrics["head2_loss"]), rel_tol=1e-5)
    assert head_warmup("constant", 0.0, 1.0) == 1.0
    assert math.isclose(head_warmup("sine", 0.25, 0.5), math.sin(math.pi / 4))
    assert head_warmup("linear", 0.9, 0.5) == 1.0


def test_param_groups_give_heads_the_multiplier():
    method = Medusa(Target(tiny_llama()), MedusaConfig(backbone="lora", lora_r=4, head_lr_multiplier=4.0))
    heads, backbone = method.param_groups(1e-3)
    assert heads["lr"] == pytest.approx(4e-3) and backbone["lr"] == pytest.approx(1e-3)
    assert {id(p) for p in heads["params"]} == {id(p) for p in method.heads.parameters()}
    trainable = {id(p) for p in method.parameters() if p.requires_grad}
    assert {id(p) for g in (heads, backbone) for p in g["params"]} == trainable
    assert all("lora_" in n for n, p in method.target.named_parameters() if p.requires_grad)
    (only,) = Medusa(Target(tiny_llama()), MedusaConfig()).param_groups(1e-3)  # Medusa-1: heads only, lr as is
    assert only["lr"] == pytest.approx(1e-3)


def test_config_rejects_bad_values():
    with pytest.raises(C.ConfigError, match="self_distill"):
        MedusaConfig(backbone="full", self_distill=True)
    with pytest.raises(C.ConfigError, match="num_heads"):
        MedusaConfig(num_heads=0)


# ---- the recipe entry point ----------------------------------------------------------------------------

def test_shipped_recipes_parse():
    entry = script("train/medusa.py")
    for path in sorted((REPO / "recipes/medusa").glob("*.yaml")):
        cfg = C.load(entry.Recipe, path)
        assert cfg.loop.output_dir.startswith("runs/")
    with pytest.raises(C.ConfigError, match="did you mean"):
        C.load(entry.Recipe, REPO / "recipes/medusa/medusa1-tiny-code.yaml", ["medusa.num_head=3"])


def test_medusa1_recipe_trains_evaluates_and_keeps_best(medusa1_run):
    rows = [json.loads(line) for line in (medusa1_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval/head1_top1" in r]
    assert len(train) == 6 and len(evals) == 2
    assert all(r["eval/tau"] >= 1 and "eval/acceptance_pos1" in r for r in evals)
    assert train[-1]["head1_loss"] < train[0]["head1_loss"]  # the heads learn at lr 1e-2
    best = json.loads((medusa1_run / "best" / "best.json").read_text())
    assert best["tau"] == max(r["eval/tau"] for r in evals) and "head4_top5" in best
    drafter = load_medusa(medusa1_run / "best")
    assert drafter.heads.num_heads == 4 and drafter.source == "medusa1"
    assert drafter.choices and len(drafter.choices) <= 6  # the greedy tree measured at that checkpoint


def test_medusa2_recipe_saves_the_adapter(medusa2_run):
    assert (medusa2_run / "best" / "adapter" / "adapter_config.json").is_file()
    meta = json.loads((medusa2_run / "best" / "drafter.json").read_text())
    assert meta["method"] == "medusa" and meta["variant"] == "medusa2" and meta["medusa"]["self_distill"]
    rows = [json.loads(line) for line in (medusa2_run / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["lm_loss"]) for r in rows if "lm_loss" in r)


# ---- export round trips ----------------------------------------------------------------------------------

def same_proposals(a, b, k: int = 3):
    """Same head logits and the same top-k candidates per head on the same hidden states."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, a.heads.hidden_size)
    la, lb = a.heads(hidden), b.heads(hidden)  # [K, b, s, V]
    torch.testing.assert_close(la, lb)
    assert torch.equal(la.topk(k, -1).indices, lb.topk(k, -1).indices)


@pytest.mark.parametrize("fmt", ["medusa", "tgi", "vllm", "hf"])
def test_medusa1_export_round_trip(fmt, medusa1_run, tmp_path):
    out = export_command.main([str(medusa1_run), "--format", fmt, "--out", str(tmp_path / fmt)])
    original = load_medusa(medusa1_run / "best")
    loaded = R.load("medusa", fmt, out)
    same_proposals(original, loaded)
    ids = torch.randint(1, 100, (1, 8))
    torch.testing.assert_close(loaded.target.model(ids).logits, original.target.model(ids).logits)


@pytest.mark.parametrize("fmt", ["medusa", "vllm", "hf"])
def test_medusa2_export_carries_the_merged_backbone(fmt, medusa2_run, tmp_path):
    out = R.export(medusa2_run / "best", fmt, tmp_path / fmt)
    original = load_medusa(medusa2_run / "best")
    loaded = R.load("medusa", fmt, out)
    same_proposals(original, loaded)
    base = load_target(json.loads((medusa2_run / "best" / "drafter.json").read_text())["target"])
    ids = torch.randint(1, 100, (1, 8))
    merged = loaded.target.model(ids).logits
    torch.testing.assert_close(merged, original.target.model(ids).logits)
    assert not torch.allclose(merged, base.model(ids).logits)  # the LoRA update is really in the backbone


def test_vllm_shared_lm_head_writes_one_projection(tiny_target_dir, tmp_path):
    method = Medusa(load_target(tiny_target_dir), MedusaConfig(num_heads=3, share_lm_head=True))
    with torch.no_grad():
        for p in method.heads.blocks.parameters():
            p.normal_(0, 0.1)
    method.save_pretrained(tmp_path / "drafter")
    out = R.export(tmp_path / "drafter", "vllm", tmp_path / "vllm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["original_lm_head"] is True and cfg["model_type"] == "medusa"
    same_proposals(load_medusa(tmp_path / "drafter"), R.load("medusa", "vllm", out))


def test_export_refuses_non_empty_out_and_never_leaves_a_partial_dir(medusa1_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--overwrite"):
        R.export(medusa1_run / "best", "medusa", out)
    assert (out / "keep.txt").is_file()
    R.export(medusa1_run / "best", "medusa", out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "medusa_lm_head.safetensors").is_file()

    def broken(drafter_dir, tmp, final):
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("disk full")
    monkeypatch.setitem(R.METHODS["medusa"].formats, "medusa", E.Format(broken, lambda p: None))
    with pytest.raises(RuntimeError, match="disk full"):
        R.export(medusa1_run / "best", "medusa", tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # neither fresh/ nor a temporary dir


# ---- the proposer, its trees and the tree builder ----------------------------------------------------------

def randomised_heads(method: Medusa, seed: int = 0) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in method.heads.parameters():
            p.add_(torch.randn_like(p) * 0.3)


def test_proposer_builds_the_static_tree_from_head_ranks():
    method = Medusa(Target(tiny_llama()), MedusaConfig(num_heads=3))
    randomised_heads(method)
    choices = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    proposer = MedusaProposer(method.heads, choices)
    h = torch.randn(32)
    proposer.accept(torch.tensor([1, 2]), Verified(None, [], None, torch.randn(1, 3, 32)))
    proposer.h = h
    tree = proposer.propose(torch.tensor([1, 2]), Sampling())
    top = [method.heads.head(k, h).topk(2).indices.tolist() for k in range(3)]
    assert tree.tokens.tolist() == [top[0][0], top[0][1], top[1][0], top[1][1], top[1][0], top[2][0]]
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    chain = MedusaProposer(method.heads).propose(torch.tensor([1]), Sampling())
    assert len(chain) == 0  # no hidden state before the first verification of a one-token prompt
    with pytest.raises(ValueError, match="prefix-closed"):
        check_choices([(0,), (1, 0)], 3)


def test_greedy_tree_maximises_expected_acceptance():
    acc = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.3, 0.1]])  # [K=2, R=3]
    choices, expected = greedy_tree(acc, budget=4)
    # node values: (0,) .6, (0,0) .3, (1,) .2, (0,1) .18, (2,) .1, (1,0) .1 ...
    assert choices == [(0,), (1,), (0, 0), (0, 1)]
    assert math.isclose(expected, 1 + 0.6 + 0.3 + 0.2 + 0.18, rel_tol=1e-6)
    chain, chain_expected = greedy_tree(torch.tensor([[0.9, 0.05], [0.8, 0.1]]), budget=2)
    assert chain == chain_choices(2) and math.isclose(chain_expected, 1 + 0.9 + 0.72, rel_tol=1e-6)


def test_heldout_accuracy_matches_head_losses_and_a_direct_rank_count():
    target = Target(tiny_llama())
    method = Medusa(target, MedusaConfig(num_heads=2))
    randomised_heads(method)
    torch.manual_seed(3)
    rows = [{"input_ids": torch.randint(1, 96, (10,)).tolist(), "loss_mask": [1] * 10,
             "position_ids": list(range(10))}]
    metrics, acc = heldout_accuracy(method.heads, target_passes(target, rows), topk=3, ranks=4)  # acc [2, 4]
    ids = torch.tensor(rows[0]["input_ids"])[None]
    with torch.no_grad():
        _, expected = head_losses(method.heads, target.tap(ids).hidden, ids, torch.ones_like(ids), topk=3)
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5), key
    with torch.no_grad():
        hidden = target.tap(ids).hidden[0]  # [s, H]
        greedy = target.logits(hidden).argmax(-1)  # [s]
        for k in (1, 2):
            hits = torch.zeros(4)
            n = 10 - k - 1
            for t in range(n):
                top = method.heads.head(k - 1, hidden[t]).topk(4).indices
                hits += (top == greedy[t + k]).float()
            torch.testing.assert_close(acc[k - 1].float(), hits / n)


@pytest.mark.parametrize("sampling,rule", [(Sampling(), "auto"), (Sampling(temperature=1.0), "exact")])
def test_medusa_decoding_is_lossless(sampling, rule):
    model = tiny_llama()
    method = Medusa(Target(model), MedusaConfig(num_heads=3))
    randomised_heads(method)
    prompt = torch.randint(1, 96, (1, 6))
    choices = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]

    def run(proposer):
        if sampling.greedy:
            return proposer(sampling)
        g = torch.Generator().manual_seed(0)
        return proposer(Sampling(temperature=1.0, generator=g))
    spec = run(lambda s: speculative_generate(model, MedusaProposer(method.heads, choices), prompt, 12, s, rule,
                                              eos_token_id=[])[0])
    if sampling.greedy:
        plain = plain_generate(model, prompt, 12, eos_token_id=[])[0]
        assert torch.equal(spec, plain)
    else:
        assert spec.shape == (1, 18)  # exactness itself is the verifier's statistical test


def test_the_decoder_loads_a_medusa_checkpoint_as_a_proposer(tiny_target_dir):
    target = load_target(tiny_target_dir)
    method = Medusa(target, MedusaConfig(num_heads=2))
    out = tiny_target_dir.parent / "drafter-for-load-proposer"
    method.save_pretrained(out)
    proposer = decoder_load_proposer(str(out), target.model)
    assert isinstance(proposer, MedusaProposer) and proposer.choices == chain_choices(2)
    stats = DecodeStats()
    ids = target.tokenizer("def f(x):\n    return", return_tensors="pt")["input_ids"]
    speculative_generate(target.model, proposer, ids, 12, stats=stats, eos_token_id=[])
    assert stats.new_tokens == 12 and stats.tau >= 1
