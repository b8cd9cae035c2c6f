"""Shared fixtures and helpers: a tiny chat target saved like any Hugging Face model; entry scripts as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.data.reference import stdlib_files
from draftsmith.data.tokenizer import train_bpe

REPO = Path(__file__).resolve().parent.parent


def script(rel: str):
    """Import an entry script (train/*.py, scripts/*.py, run by path) as a module: `from conftest import script`."""
    name = f"_script_{Path(rel).stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / rel)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


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
