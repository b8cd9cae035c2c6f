"""llama.cpp (models/llama_cpp.py): a tiny target and tiny drafters through llama.cpp's own converter, the GGUF reading
the layers the drafter was trained on, the refusals, and (slow) serving each kind llama.cpp serves (EAGLE-3, a draft
model, DFlash) through llama-server: greedy output equal to the target's alone, acceptance length equal to our
decoder's tau. Skipped, saying why, where llama.cpp is absent: nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from draftsmith.decoding.generate import speculative_generate
from draftsmith.decoding.metrics import DecodeStats
from draftsmith.decoding.verify import Sampling
from draftsmith.models import llama_cpp
from draftsmith.models import registry as R
from draftsmith.models.dflash import DFlash, DFlashConfig
from draftsmith.models.distill import Distill, DistillConfig, build_draft
from draftsmith.models.eagle import Eagle
from draftsmith.models.eagle_config import EagleConfig
from draftsmith.models.target import Target

NEEDS_SOURCE = pytest.mark.skipif(
    llama_cpp.source() is None,
    reason=f"needs a llama.cpp source tree (convert_hf_to_gguf.py + gguf-py): `draftsmith llama-cpp --build` or "
           f"{llama_cpp.ENV}=DIR")
NEEDS_SERVER = pytest.mark.skipif(
    llama_cpp.source() is None or llama_cpp.binary("llama-server") is None,
    reason=f"needs llama.cpp's source and llama-server: `draftsmith llama-cpp --build` or {llama_cpp.ENV}=DIR")
AUX = [4, 1, 3]  # trained out of layer order, so the export must reorder them (and fc's blocks with them)


def llama_style_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-fallback BPE in the Llama-2 layout (byte tokens, '▁' for spaces), which llama.cpp's converter reads
    without a registered pre-tokenizer; ~300 tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for ch in "▁abcdefghijklmnopqrstuvwxyz":
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Target:
    """A 6-layer Llama with a peaked head, saved with its tokenizer."""
    path = tmp_path_factory.mktemp("target")
    tok = llama_style_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
    model.lm_head.weight.data *= 8
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return Target(model.eval().requires_grad_(False), tok, str(path))


def drafter_dir(target: Target, out: Path, **kw) -> Path:
    torch.manual_seed(1)
    cfg = {"version": 3, "ttt_steps": 3, "aux_layers": AUX, **kw}
    vocab = target.model.config.get_text_config().vocab_size
    m = Eagle(target, EagleConfig(**cfg), torch.arange(0, vocab, 2) if cfg["version"] == 3 else None)
    for p in m.drafter.parameters():
        torch.nn.init.normal_(p, 0.3 if p.dim() == 1 else 0.0, 0.3)
    m.save_pretrained(out)
    return out


@NEEDS_SOURCE
def test_the_eagle3_gguf_reads_the_trained_layers_with_fc_blocks_in_the_same_order(target, tmp_path):
    out = R.export(drafter_dir(target, tmp_path / "run"), "gguf", tmp_path / "gguf")
    gguf = llama_cpp.read_gguf(out)
    arch = gguf["fields"]["general.architecture"]
    assert arch == "eagle3"
    # llama.cpp captures the INPUT to layer i for each id (common/speculative.cpp, embd_layer_inp), which is the
    # hidden_states index the drafter was trained on: the ids must be the trained ones, in fc's block order
    assert gguf["fields"][f"{arch}.target_layers"] == sorted(AUX)
    g = llama_cpp.gguf_py()
    fc = next(t for t in g.GGUFReader(out / llama_cpp.GGUF_FILE).tensors
              if t.name == g.TENSOR_NAMES[g.MODEL_TENSOR.FC] + ".weight")
    trained = load_file(tmp_path / "run" / "eagle.safetensors")["fc.weight"]  # [H, 3H], blocks in AUX's order
    blocks = trained.unflatten(1, (3, -1))  # [H, 3, H]
    served = torch.from_numpy(np.array(fc.data)).reshape(trained.shape).unflatten(1, (3, -1))
    for k, layer in enumerate(sorted(AUX)):  # slot k of the GGUF's fc reads layer target_layers[k]
        torch.testing.assert_close(served[:, k], blocks[:, AUX.index(layer)])
    side = json.loads((out / "draftsmith_export.json").read_text())
    assert side["format"] == "gguf" and side["method"] == "eagle"


@NEEDS_SOURCE
def test_a_dflash_gguf_reads_the_trained_layers_and_block_size(target, tmp_path):
    DFlash(target, DFlashConfig(block_size=4, num_layers=1, aux_layers=[4, 2]), mask_token_id=3).save_pretrained(
        tmp_path / "run")
    gguf = llama_cpp.read_gguf(R.export(tmp_path / "run", "gguf", tmp_path / "gguf"))
    assert gguf["fields"]["general.architecture"] == "dflash"
    assert gguf["fields"]["dflash.target_layers"] == [2, 4]  # inputs to layers 2 and 4, as trained (sorted)
    assert gguf["fields"]["dflash.block_size"] == 4


@NEEDS_SOURCE
def test_a_tiny_target_converts_in_f32_and_f16(target, tmp_path):
    for outtype in ("f32", "f16"):
        f = llama_cpp.convert(target.path, tmp_path / f"t-{outtype}.gguf", outtype)
        gguf = llama_cpp.read_gguf(f)
        assert gguf["fields"]["general.architecture"] == "llama"
        assert gguf["fields"]["llama.block_count"] == 6
        assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("kw, match", [({"num_layers": 2}, "one drafter layer"), ({"fc_norm": True}, "per fused layer"),
                                       ({"version": 1, "aux_layers": []}, "EAGLE-3")])
def test_what_llama_cpp_cannot_serve_is_refused_in_one_line_naming_the_format_that_can(kw, match, target, tmp_path):
    with pytest.raises(ValueError, match=match) as e:
        R.export(drafter_dir(target, tmp_path / "run", **kw), "gguf", tmp_path / "gguf")
    assert "\n" not in str(e.value) and "--format" in str(e.value)
    assert not (tmp_path / "gguf").exists()


def test_without_llama_cpp_the_gguf_export_says_how_to_get_it(target, tmp_path, monkeypatch):
    monkeypatch.setenv(llama_cpp.ENV, str(tmp_path / "nowhere"))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(FileNotFoundError, match="draftsmith llama-cpp --build"):
        R.export(drafter_dir(target, tmp_path / "run"), "gguf", tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


def served_drafter(kind: str, target: Target, out: Path) -> Path:
    """A tiny drafter of each kind llama.cpp serves: EAGLE-3 (random), a draft model (the target's first 2 layers),
    DFlash (random)."""
    if kind == "eagle3":
        return drafter_dir(target, out)
    torch.manual_seed(1)
    if kind == "distill":
        cfg = DistillConfig(layers=2, gamma=3)
        Distill(target, build_draft(target, cfg), cfg).save_pretrained(out)
    else:
        DFlash(target, DFlashConfig(block_size=4, aux_layers=[2, 4]), mask_token_id=3).save_pretrained(out)
    return out


@pytest.mark.slow
@NEEDS_SERVER
@pytest.mark.parametrize("kind, spec_type", [("eagle3", "draft-eagle3"), ("distill", "draft-simple"),
                                             ("dflash", "draft-dflash")])
def test_served_by_llama_server_each_drafter_leaves_greedy_output_unchanged_and_accepts_as_ours(
        kind, spec_type, target, tmp_path):
    model = llama_cpp.convert(target.path, tmp_path / "target.gguf", "f32")
    run = served_drafter(kind, target, tmp_path / "run")
    draft = R.export(run, "gguf", tmp_path / "gguf") / llama_cpp.GGUF_FILE
    served_as_ours(model, draft, spec_type, run, target.model)


def served_as_ours(model: Path, draft: Path, spec_type: str, run: Path, target_model) -> None:
    """Serve `draft` beside the target GGUF `model` on 4 random prompts: greedy output equals the target's alone, the
    drafter is used, and llama.cpp's acceptance length (1 + accepted / drafting steps) is our tau within 5%, same
    drafter (`run`) and draft length."""
    prompts = [[1, *torch.randint(3, 280, (12,), generator=torch.Generator().manual_seed(i)).tolist()]
               for i in range(4)]
    with llama_cpp.Server(model, threads=2, ctx=256) as plain:
        want = [plain.complete(p, 24, temperature=0.0)["tokens"] for p in prompts]
    with llama_cpp.Server(model, ["--spec-type", spec_type, "-md", str(draft), "--spec-draft-n-max", "3"],
                          threads=2, ctx=256) as spec:
        runs = [spec.complete(p, 24, temperature=0.0) for p in prompts]
    assert [r["tokens"] for r in runs] == want
    steps = sum(r["verify_steps"] for r in runs)
    assert steps > 0  # the drafter was used
    stats, proposer = DecodeStats(), R.load_proposer(str(run), target_model, gamma=3)
    for p in prompts:
        speculative_generate(target_model, proposer, torch.tensor([p]), 24, Sampling(0.0), stats=stats)
    assert 1 + sum(r["accepted"] for r in runs) / steps == pytest.approx(stats.tau, rel=0.05)
