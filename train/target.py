"""Train the reference target: a small Llama on the interpreter's own standard library.

    accelerate launch train/target.py --config recipes/target/tiny-code.yaml [key=value ...]

Builds the corpus (raw files + `ast` chat examples), trains the byte-level BPE tokenizer,
trains a `LlamaForCausalLM` through the shared loop while measuring held-out loss at every
checkpoint, keeps the best checkpoint, and with `publish_to=DIR` writes it there with a model
card and `benchmarks/reference_target.json`.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from draftsmith.data.chat import tokenize_example
from draftsmith.data.core import best_record, read_file
from draftsmith.data.packing import pack
from draftsmith.data.reference import chat_examples, corpus_fingerprint, stdlib_files, write_heldout_prompts
from draftsmith.data.tokenizer import END, train_bpe
from draftsmith.models.lm import CausalLM, masked_ce
from draftsmith.models.target import check_target
from draftsmith.recipes import RECIPES
from draftsmith.train import config as C
from draftsmith.train.guard import cli
from draftsmith.train.loop import Loop, collate


@dataclasses.dataclass
class Shape:
    """Architecture of the Llama target (GQA, untied LM head)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 704
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads or self.hidden_size % self.num_heads:
            raise C.ConfigError("model: num_heads must divide hidden_size and be a multiple of num_kv_heads")


@dataclasses.dataclass
class Data:
    seq_len: int = 512
    heldout_rows: int = 256  # rows of held-out data scored at each checkpoint (0: all)
    max_files: int = 0  # train on the first N training files only (quick runs); 0: all


@dataclasses.dataclass
class Recipe:
    model: Shape = dataclasses.field(default_factory=Shape)
    data: Data = dataclasses.field(default_factory=Data)
    loop: C.LoopConfig = dataclasses.field(default_factory=C.LoopConfig)
    init_from: str = ""  # continue training a published target (its tokenizer and weights) instead of starting afresh
    publish_to: str = ""  # copy the best checkpoint here, with a model card and benchmark figures
    benchmark_out: str = "benchmarks/reference_target.json"
    prompts_out: str = "data/reference_prompts.jsonl"  # held-out chat prompts, written on publishing


def raw_rows(tokenizer, texts: list[str], seq_len: int) -> list[dict]:
    """Concatenate files (EOS between them) and cut into full rows of seq_len tokens."""
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return [{"input_ids": stream[i: i + seq_len], "loss_mask": [1] * seq_len, "position_ids": list(range(seq_len))}
            for i in range(0, len(stream) - seq_len + 1, seq_len)]


def chat_rows(tokenizer, files, seq_len: int) -> list[dict]:
    """Chat examples, tokenized with the template's assistant mask and packed into rows."""
    examples = [tokenize_example(tokenizer, ex) for f in files for ex in chat_examples(f)]
    return pack([e for e in examples if len(e["input_ids"]) <= seq_len], seq_len, tokenizer.pad_token_id)


def new_target(s: Shape, tokenizer) -> LlamaForCausalLM:
    """A freshly initialised Llama of shape `s` whose generation stops at the end of a turn."""
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=s.hidden_size, num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads, intermediate_size=s.intermediate_size,
        max_position_embeddings=s.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=[tokenizer.convert_tokens_to_ids(END), tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id))
    model.generation_config = GenerationConfig(eos_token_id=model.config.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    return model


def heldout_rows(tokenizer, files, seq_len: int, limit: int = 0) -> dict[str, list[dict]]:
    """Held-out rows by kind; with `limit`, a fixed proportionate selection of about that many."""
    held = [f for f in files if f.split == "heldout"]
    rows = {"raw": raw_rows(tokenizer, [f.text for f in held], seq_len), "chat": chat_rows(tokenizer, held, seq_len)}
    if limit:
        keep = limit / sum(map(len, rows.values()))
        rows = {k: random.Random(i).sample(v, max(1, round(keep * len(v)))) for i, (k, v) in enumerate(rows.items())}
    return rows


def build_data(cfg: Recipe):
    files = stdlib_files()
    train_files = [f for f in files if f.split == "train"][: cfg.data.max_files or None]
    if cfg.init_from:
        tokenizer = AutoTokenizer.from_pretrained(cfg.init_from)
    else:
        tokenizer = train_bpe((f.text for f in train_files), cfg.model.vocab_size)
    L = cfg.data.seq_len
    train = raw_rows(tokenizer, [f.text for f in train_files], L) + chat_rows(tokenizer, train_files, L)
    return tokenizer, files, train, heldout_rows(tokenizer, files, L, cfg.data.heldout_rows)


def heldout_loss(model, rows_by_kind: dict[str, list[dict]], batch_size: int = 16) -> dict[str, float]:
    """Held-out loss in nats per trained token, per kind and overall (token-weighted)."""
    device = next(model.parameters()).device
    totals = {}
    for kind, rows in rows_by_kind.items():
        loss_sum = tokens = 0.0
        for i in range(0, len(rows), batch_size):
            batch = {k: v.to(device) for k, v in collate(rows[i: i + batch_size]).items()}
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            n = batch["loss_mask"][:, 1:].sum().item()
            loss_sum += masked_ce(logits, batch["input_ids"], batch["loss_mask"]).item() * n
            tokens += n
        totals[kind] = (loss_sum, tokens)
    out = {f"heldout_{k}_loss": s / n for k, (s, n) in totals.items()}
    out["heldout_loss"] = sum(s for s, _ in totals.values()) / sum(n for _, n in totals.values())
    return out


def measure(model_dir: str | Path, seq_len: int = 512) -> dict:
    """Held-out loss of a published target over ALL held-out rows, and its corpus fingerprint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    files = stdlib_files()
    with torch.no_grad():
        losses = heldout_loss(model, heldout_rows(tokenizer, files, seq_len))
    return {"params": sum(p.numel() for p in model.parameters()),
            **{k: round(v, 4) for k, v in losses.items()}, **corpus_fingerprint(files)}


def publish(cfg: Recipe, run_dir: Path, train_tokens: int, tokens_per_s: float) -> dict:
    """Copy best/ to cfg.publish_to with a model card; write benchmarks/reference_target.json."""
    best = best_record(run_dir)
    dest = Path(cfg.publish_to)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(run_dir / "best", tmp)
    (tmp / "best.json").unlink()
    tokens_per_step = cfg.loop.batch_size * cfg.loop.grad_accum * cfg.data.seq_len
    prior = Path(cfg.init_from) / "training.json"
    stages = read_file(prior, "pass init_from= a target this command wrote whole")["stages"] \
        if cfg.init_from and prior.is_file() else []
    stages.append({"command": (run_dir / "command.txt").read_text().strip(), "best_step": best["step"],
                   "tokens": best["step"] * tokens_per_step, "tokens_per_s": round(tokens_per_s, 1)})
    (tmp / "training.json").write_text(json.dumps({"stages": stages}, indent=2) + "\n")
    figures = {**measure(tmp, cfg.data.seq_len), "tokens_seen": sum(st["tokens"] for st in stages),
               "best_step": best["step"], "train_tokens_per_epoch": train_tokens,
               "train_tokens_per_s": round(tokens_per_s, 1),
               "path": cfg.publish_to,
               "command": " && ".join(st["command"] for st in stages)}
    (tmp / "README.md").write_text(MODEL_CARD.format(**figures, layers=cfg.model.num_layers,
                                                     hidden=cfg.model.hidden_size, vocab=cfg.model.vocab_size))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    bench = Path(cfg.benchmark_out)
    bench.parent.mkdir(parents=True, exist_ok=True)
    bench.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


MODEL_CARD = """# draftsmith reference target

A `LlamaForCausalLM` trained from scratch on the `.py` files of CPython {python_version}'s standard
library (test folders excluded; {num_files} files, list sha256 `{file_list_sha256}`), raw files and
`ast` chat examples (user: header + docstring, assistant: body). It exists so that acceptance
lengths measured offline mean something.

| | |
|---|---|
| parameters | {params:,} ({layers} layers, hidden {hidden}, GQA, untied LM head, vocab {vocab}) |
| tokens seen | {tokens_seen:,} (best step {best_step}) |
| held-out loss | {heldout_loss} nats/token over all held-out rows (raw files {heldout_raw_loss}, chat answers {heldout_chat_loss}) |
| training throughput | {train_tokens_per_s} tokens/s |

Reproduce: `{command}`
"""


def main(argv: list[str] | None = None) -> dict | None:
    cfg = C.from_command_line(Recipe, RECIPES / "target/tiny-code.yaml", argv, __doc__)
    C.check_best_metric(cfg.loop, ["heldout_loss", "heldout_raw_loss", "heldout_chat_loss", "eval_seconds"])
    if cfg.init_from:
        check_target(cfg.init_from, "init_from")

    tokenizer, files, train, heldout = build_data(cfg)
    torch.manual_seed(cfg.loop.seed)
    model = LlamaForCausalLM.from_pretrained(cfg.init_from) if cfg.init_from else new_target(cfg.model, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target: {n_params / 1e6:.2f}M params; train rows {len(train)} x {cfg.data.seq_len}; "
          f"held-out rows {sum(map(len, heldout.values()))}")

    loop = Loop(cfg.loop, CausalLM(model, tokenizer), train,
                evaluate=lambda m, step: heldout_loss(m.model, heldout), run_config=C.to_dict(cfg))
    loop.run()
    if cfg.publish_to and loop.accelerator.is_main_process:
        rows = [json.loads(line) for line in open(loop.run_dir / "metrics.jsonl")]
        speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
        write_heldout_prompts(files, Path(cfg.prompts_out))
        figures = publish(cfg, loop.run_dir, len(train) * cfg.data.seq_len, sum(speeds) / max(1, len(speeds)))
        print(json.dumps(figures, indent=2))
        return figures
    return None


if __name__ == "__main__":
    cli(main)
