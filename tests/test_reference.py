"""The reference corpus, the target recipe end to end, and the committed reference target."""

from __future__ import annotations

import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.reference import SourceFile, chat_examples, load_prompts, stdlib_files
from draftsmith.models.target import REFERENCE_TARGET
from draftsmith.train import target as target_script

SNIPPET = '''
class Box:
    @staticmethod
    def area(w, h):
        """Area of a w x h box."""
        if w < 0:
            raise ValueError(w)
        return w * h
'''


def test_split_is_a_stable_hash_of_the_path():
    files = stdlib_files()
    heldout = [f for f in files if f.split == "heldout"]
    assert 0.02 < len(heldout) / len(files) < 0.09
    assert SourceFile("json/decoder.py", "").split == SourceFile("json/decoder.py", "other text").split
    dirs = {part for f in files for part in f.relpath.split("/")[:-1]}
    assert not any(d in ("test", "tests") or d.startswith("test") for d in dirs) and "unittest" in dirs


def test_chat_examples_pair_header_and_docstring_with_the_body():
    (ex,) = chat_examples(SourceFile("box.py", SNIPPET))
    user, assistant = ex["messages"]
    assert user["content"] == '@staticmethod\ndef area(w, h):\n    """Area of a w x h box."""'
    assert assistant["content"] == "\n    if w < 0:\n        raise ValueError(w)\n    return w * h"


def test_generation_prompt_tokenizes_as_the_training_text_does():
    """The prompt must end where training text has a token boundary (no lone newline token)."""
    from draftsmith.data.chat import tokenize_messages
    from draftsmith.data.tokenizer import train_bpe

    tok = train_bpe([f.text for f in stdlib_files()[:30]], 400)
    (ex,) = chat_examples(SourceFile("box.py", SNIPPET))
    full = tokenize_messages(tok, ex["messages"])["input_ids"]
    prompt = tok.apply_chat_template(ex["messages"][:1], add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    assert full[: len(prompt)] == list(prompt)


def test_target_recipe_runs_end_to_end(tmp_path):
    figures = target_script.main([
        "model.vocab_size=512", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.intermediate_size=64", "data.seq_len=128", "data.heldout_rows=8",
        "data.max_files=20", "loop.max_steps=2", "loop.batch_size=2", "loop.save_every=1",
        f"loop.output_dir={tmp_path / 'run'}", f"publish_to={tmp_path / 'target'}",
        f"benchmark_out={tmp_path / 'bench.json'}", f"prompts_out={tmp_path / 'prompts.jsonl'}"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    assert model.config.num_hidden_layers == 2
    assert json.loads((tmp_path / "bench.json").read_text())["heldout_loss"] == figures["heldout_loss"]
    assert "held-out loss" in (tmp_path / "target" / "README.md").read_text()
    assert len(load_prompts(tmp_path / "prompts.jsonl")) >= 200

    # A second stage continues from the published weights and counts the tokens of both stages.
    again = target_script.main([
        f"init_from={tmp_path / 'target'}", "data.seq_len=128", "data.heldout_rows=8", "data.max_files=20",
        "loop.max_steps=1", "loop.batch_size=2", f"loop.output_dir={tmp_path / 'run2'}",
        f"publish_to={tmp_path / 'target'}", f"benchmark_out={tmp_path / 'bench.json'}",
        f"prompts_out={tmp_path / 'prompts.jsonl'}"])
    stages = json.loads((tmp_path / "target" / "training.json").read_text())["stages"]
    assert len(stages) == 2 and again["tokens_seen"] == figures["tokens_seen"] + 2 * 128
    assert again["heldout_loss"] != figures["heldout_loss"]


def test_committed_reference_target_matches_its_card():
    model = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    assert 8e6 <= params <= 12e6 and cfg.num_hidden_layers >= 8
    assert cfg.num_key_value_heads < cfg.num_attention_heads and not cfg.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_TARGET)
    assert len(tokenizer) == cfg.vocab_size == 8192 and "{% generation %}" in tokenizer.chat_template
    assert len(load_prompts()) >= 200
