"""Shared fixtures and helpers: a tiny chat target saved like any Hugging Face model; entry scripts by name; the
drafter tests' random drafters, short training runs and chi-square test of sampled output."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.data.reference import stdlib_files
from draftsmith.data.tokenizer import train_bpe
from draftsmith.train.entries import TRAIN

REPO = Path(__file__).resolve().parent.parent


def script(rel: str):
    """A training entry script (train/METHOD.py) as the module `draftsmith train METHOD` runs."""
    return TRAIN[Path(rel).stem]


@pytest.fixture(scope="session")
def tiny_chat_target(tmp_path_factory) -> Path:
    """A 4-layer Llama with a real byte-level BPE tokenizer and the reference chat template."""
    out = tmp_path_factory.mktemp("tiny-chat-target")
    tok = train_bpe([f.text for f in stdlib_files()[:6]], 300)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                         bos_token_id=None, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def randomise(module: torch.nn.Module) -> None:
    """Random, non-trivial weights for a drafter (norm weights away from 1)."""
    for p in module.parameters():
        torch.nn.init.normal_(p, 0.3 if p.dim() == 1 else 0.0, 0.3)


def random_row(vocab: int, length: int, seed: int) -> tuple[torch.Tensor, dict]:
    """Random token ids [1, length] and the one-sequence batch over them (every position in the loss)."""
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    return ids, {"input_ids": ids, "loss_mask": torch.ones_like(ids), "position_ids": torch.arange(length)[None]}


def recorded_outputs(module: torch.nn.Module) -> list[torch.Tensor]:
    """A list that receives out[0] of every forward of `module` from now on (batch row 0)."""
    outs: list[torch.Tensor] = []
    module.register_forward_hook(lambda mod, args, out: outs.append(out[0]))
    return outs


def assert_greedy_matches(model, proposer, vocab: int, gamma: int) -> None:
    """24 speculative greedy tokens after a random 7-token prompt equal the model's own, with every step after the
    first few drafting `gamma` tokens."""
    from draftsmith.decoding.generate import plain_generate, speculative_generate

    prompt = torch.randint(0, vocab, (1, 7), generator=torch.Generator().manual_seed(1))
    spec, stats = speculative_generate(model, proposer, prompt, 24, eos_token_id=[])
    plain, _ = plain_generate(model, prompt, 24, eos_token_id=[])
    assert torch.equal(spec, plain) and stats.new_tokens == 24 and stats.drafted >= gamma * (stats.steps - 4)


def forward_widths(module: torch.nn.Module) -> list[int]:
    """A list that receives the sequence length (out.shape[1]) of every forward of `module` from now on."""
    widths: list[int] = []
    module.register_forward_hook(lambda mod, args, out: widths.append(out.shape[1]))
    return widths


def train_steps(method: torch.nn.Module, loss_fn, batch: dict, steps: int = 200, lr: float = 3e-3) -> dict:
    """`steps` AdamW steps on loss_fn(batch) -> (loss, metrics) over the trainable parameters; the last metrics."""
    opt = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=lr)
    method.train()
    for _ in range(steps):
        loss, metrics = loss_fn(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    method.eval()
    return metrics


def chi2_two_tokens(model, proposer, trials: int = 1500, batch: int = 1, prompt: torch.Tensor | None = None,
                    top_k: int = 0) -> tuple[float, float]:
    """Sample two tokens after a fixed prompt [1, L] (default [[1, 4, 2]]) `trials` times through speculative
    decoding at T=1: the chi-square statistic of their counts against the target's exact joint distribution, and
    its 1e-3 critical value. With `batch` > 1, `proposer` makes a fresh proposer and `batch` samples are decoded
    together (`generate_batch`). With `top_k`, each token is drawn from the target's top k (`Sampling.top_k`): the
    statistic runs over the k * k pairs that can occur, and a pair that cannot must never be drawn."""
    from draftsmith.decoding.generate import generate_batch, speculative_generate
    from draftsmith.decoding.verify import Sampling, warp

    vocab = model.config.get_text_config().vocab_size
    prompt = torch.tensor([[1, 4, 2]]) if prompt is None else prompt
    n = prompt.shape[1]
    with torch.no_grad():
        p1 = warp(model(prompt).logits[0, -1], Sampling(1.0, top_k))  # [v]
        both = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], 1)  # [v, n + 1]
        p2 = warp(model(both).logits[:, -1], Sampling(1.0, top_k))  # [v, v]
    expected = (p1[:, None] * p2).flatten() * trials  # [v*v]
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(vocab * vocab)
    for _ in range(trials // batch):
        sampling = Sampling(temperature=1.0, top_k=top_k, generator=g)
        outs = [speculative_generate(model, proposer, prompt, 2, sampling, eos_token_id=[])[0]] if batch == 1 else \
            generate_batch(model, [proposer() for _ in range(batch)], [prompt] * batch, 2, [sampling] * batch,
                           eos_token_id=[])[0]
        for out in outs:
            counts[out[0, n] * vocab + out[0, n + 1]] += 1
    possible = expected > 0
    assert counts[~possible].sum() == 0, "drew a pair the target cannot draw"
    dof = int(possible.sum()) - 1
    stat = float(((counts - expected)[possible] ** 2 / expected[possible]).sum())
    return stat, dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
