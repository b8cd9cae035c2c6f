"""The target matrix: every model family people serve, for every method. Each family is a tiny random model that
transformers builds in code from the family's own config class; each method trains on it for a few steps through its
real entry point, decodes greedily exactly as the target alone would, and exports to every format it offers, each
loaded back by its loader. A mock proposer that drafts the target's own continuation with a token changed now and then
(accepted most of the time) decodes past every sliding window and attention chunk, through every KV rollback path
(sliding-window layers, latent attention, MoE routing), greedily and at T=1. What cannot work is refused in one line
before anything is written, each refusal a test; the drafters' fields come from each family's text config. Each
family's target (Qwen3-Next's aside) also goes through llama.cpp's converter and serves an EAGLE-3 GGUF beside it in
llama-server, or llama-server's one-line reason why it cannot is recorded.

docs/targets.md is this file's results as a table: `python scripts/target_matrix.py`.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import pytest
import torch
import transformers as T
from conftest import chi2_two_tokens, script
from test_llama_cpp import NEEDS_SERVER, drafter_dir, served_as_ours
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from draftsmith.data.core import find_drafter
from draftsmith.data.tokenizer import train_bpe
from draftsmith.decoding import DraftTree, Proposer, plain_generate, speculative_generate
from draftsmith.models import llama_cpp
from draftsmith.models import registry as R
from draftsmith.models.eagle import Eagle
from draftsmith.models.eagle_config import EagleConfig, draft_config
from draftsmith.models.medusa import Medusa, MedusaConfig
from draftsmith.models.target import Target, load_target, refusal

REPO = Path(__file__).resolve().parent.parent
V = 300  # the tokenizer's vocabulary (a byte-level BPE trained on textwrap's source)
W = 8  # sliding windows and Llama 4's attention chunks: decoding runs well past them
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
            eos_token_id=0, pad_token_id=0)
TIED = {**BASE, "tie_word_embeddings": True}
MOE = dict(num_experts_per_tok=2)
GEMMA3 = dict(**TIED, head_dim=8, sliding_window=W, sliding_window_pattern=2)  # local, global, local, global
FAMILIES = {  # name -> the family's own config, as transformers builds it
    "llama": lambda: T.LlamaConfig(**BASE, rope_parameters={  # Llama 3.1's rope scaling
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "qwen3": lambda: T.Qwen3Config(**TIED, head_dim=8),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(**BASE, head_dim=8, num_experts=4, moe_intermediate_size=16, **MOE),
    "mixtral": lambda: T.MixtralConfig(**BASE, num_local_experts=4, sliding_window=W, **MOE),
    "gpt_oss": lambda: T.GptOssConfig(**BASE, head_dim=8, num_local_experts=4, sliding_window=W, **MOE,
                                      rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                       "original_max_position_embeddings": 128}),
    "gemma3_text": lambda: T.Gemma3TextConfig(**GEMMA3),
    "gemma3": lambda: T.Gemma3Config(  # the multimodal wrapper: Gemma3ForConditionalGeneration, its text tower
        text_config=GEMMA3, vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=V - 3, eoi_token_index=V - 2, image_token_index=V - 1),
    "llama4_text": lambda: T.Llama4TextConfig(**BASE, head_dim=8, intermediate_size_mlp=64, num_local_experts=4,
                                              num_experts_per_tok=1, attention_chunk_size=W, no_rope_layer_interval=2),
    "deepseek_v3": lambda: T.DeepseekV3Config(  # multi-head latent attention; layer 0 dense, then MoE
        **{**BASE, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, **MOE),
    "qwen3_next": lambda: T.Qwen3NextConfig(  # Gated DeltaNet linear attention, full attention every 4th layer
        **BASE, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, **MOE),
    "phi3": lambda: T.Phi3Config(**BASE, sliding_window=W),
    "olmo2": lambda: T.Olmo2Config(**BASE),
    "glm4_moe": lambda: T.Glm4MoeConfig(**BASE, head_dim=8, moe_intermediate_size=16, n_routed_experts=4,
                                        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, **MOE),
}
DECODES = [f for f in FAMILIES if f != "qwen3_next"]  # qwen3_next: refused, test_a_linear_attention_target_is_refused


def build(family: str, seed: int = 0, vocab: int = V) -> torch.nn.Module:
    config = FAMILIES[family]()
    config.get_text_config().vocab_size = vocab
    torch.manual_seed(seed)
    return T.AutoModelForCausalLM.from_config(config).eval()


# ---- lossless decoding with a drafter that is mostly right --------------------------------------------------

class Oracle(Proposer):
    """Drafts `gamma` tokens of the target's own greedy continuation `ref`, with one token changed every third draft;
    as a chain, or (tree) beside a sibling branch whose first token is wrong. Accepted most of the time, so that the
    KV rollback of every step (a crop, or an index-select for the tree) decides what the next one sees."""

    def __init__(self, ref: torch.Tensor, tree: bool = False, gamma: int = 4):
        self.ref, self.tree, self.gamma, self.drafts = ref, tree, gamma, 0

    def propose(self, ids, sampling):
        draft = self.ref[ids.numel(): ids.numel() + self.gamma].clone()
        self.drafts += 1
        if self.drafts % 3 == 0 and draft.numel() > 1:
            draft[-1] = (draft[-1] + 1) % V
        if not self.tree or not draft.numel():
            return DraftTree.chain(draft)
        wrong = draft.clone()
        wrong[0] = (wrong[0] + 7) % V
        return DraftTree.from_paths([wrong.tolist(), draft.tolist()])[0]


def prompt(length: int = 6) -> torch.Tensor:
    return torch.randint(1, V, (1, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", DECODES)
def test_a_mostly_right_drafter_decodes_greedily_as_the_target_past_every_window(family):
    """24 new tokens, three times the windows and chunks; the reference is transformers' own generate (the family's
    own cache classes: sliding-window layers that drop old keys, latent attention's, MoE routing per token)."""
    model, x, new = build(family), prompt(), 3 * W
    ref = model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    for tree in (False, True):
        out, stats = speculative_generate(model, Oracle(ref[0], tree), x, new, eos_token_id=[])
        assert torch.equal(out, ref), f"{family} {'tree' if tree else 'chain'}"
        assert stats.tau > 3  # most drafts accepted whole: the rollback is exercised every step


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "llama4_text", "deepseek_v3", "gemma3"])
def test_sampling_at_t1_has_the_targets_distribution(family):
    """Two tokens sampled at T=1 (top-4, so that 16 pairs hold the mass) after a prompt longer than the window, the
    oracle drafting: the chi-square of their counts against the target's exact distribution."""
    model = build(family)
    x = prompt(2 * W)
    ref = model.generate(x, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0]
    stat, critical = chi2_two_tokens(model, Oracle(ref), trials=1200, prompt=x, top_k=4)
    assert stat < critical


def test_a_linear_attention_target_is_refused():
    """Qwen3-Next's Gated DeltaNet layers keep a recurrent state that no rollback can crop back to the accepted
    tokens, and through which a token tree cannot be verified: the decoder refuses it in one line."""
    model = build("qwen3_next")
    with pytest.raises(ValueError, match=r"^qwen3_next: .*linear attention.* cannot roll back"):
        speculative_generate(model, Oracle(torch.arange(40) % V), prompt(), 8, eos_token_id=[])


# ---- the drafters' fields ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_eagle_drafter_is_built_from_the_targets_text_config(family):
    """Width, heads, head_dim, rope (llama3 / yarn scaling; Gemma 3's full-attention base, not its sliding layers'),
    RMSNorm eps and vocabulary from the text config; the MLP dense with the target's intermediate_size (MoE: its
    dense layers' width, or one expert's: models/eagle_config.py)."""
    config = FAMILIES[family]()
    text = config.get_text_config()
    draft = draft_config(config, EagleConfig(), 64)
    heads = text.num_attention_heads
    assert (draft.hidden_size, draft.num_attention_heads, draft.num_key_value_heads, draft.vocab_size) == \
        (text.hidden_size, heads, text.num_key_value_heads, V)
    assert draft.head_dim == (text.hidden_size // heads if family == "deepseek_v3" else
                              getattr(text, "head_dim", None) or text.hidden_size // heads)
    assert draft.rms_norm_eps == text.rms_norm_eps and draft.intermediate_size == text.intermediate_size
    rope = draft.rope_parameters
    expected = {"llama": ("llama3", 500000.0), "gpt_oss": ("yarn", 150000.0), "gemma3_text": ("default", 1e6),
                "gemma3": ("default", 1e6)}  # Gemma 3: its full-attention layers' base, not the sliding ones' 1e4
    assert (rope["rope_type"], rope["rope_theta"]) == expected.get(family, ("default", rope["rope_theta"]))
    assert "partial_rotary_factor" not in rope
    if family not in expected:
        assert rope["rope_theta"] == text.rope_parameters["rope_theta"]
    if family == "llama":
        assert rope["factor"] == 8.0 and rope["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_heads_start_from_the_targets_head_tied_or_not(family):
    """EAGLE-3's head over the draft vocabulary and each Medusa head start as the target's own head rows: on a
    family whose text config ties them (Qwen3, Gemma 3), its input embedding's."""
    model = build(family)
    text = model.config.get_text_config()
    target = Target(model.requires_grad_(False), None, family)
    rows = (target.embed if text.tie_word_embeddings else target.lm_head).weight
    assert (target.lm_head.weight is target.embed.weight) == text.tie_word_embeddings
    ids = torch.arange(0, V, 5)
    eagle = Eagle(target, EagleConfig(ttt_steps=2), ids)
    assert torch.equal(eagle.drafter.lm_head.weight, rows[ids])
    medusa = Medusa(target, MedusaConfig(num_heads=2))
    assert all(torch.equal(medusa.heads.projection(k).weight, rows) for k in range(2))
    assert (medusa.heads.hidden_size, medusa.heads.vocab_size) == (text.hidden_size, V)


# ---- train, decode, export: every family x every method ----------------------------------------------------

FAST = ("eagle3", "medusa1")  # on every family in the fast suite; the other methods run with -m ""
TINY = ["data.max_length=64", "data.cache=false", "data.limit=8", "eval.heldout_examples=2", "eval.num_prompts=0",
        "loop.best_metric=", "loop.batch_size=2", "loop.max_steps=2", "loop.save_every=2", "loop.log_every=1",
        "loop.mixed_precision=no"]
SMALL = {  # each method at its smallest, on 4-layer targets
    "medusa1": ["medusa.num_heads=2"],
    "medusa2": ["medusa.num_heads=2", "medusa.lora_r=2", "medusa.lora_alpha=4"],
    "eagle1": ["eval.gamma=2"],
    "eagle3": ["eagle.ttt_steps=2", "eagle.draft_vocab_size=64", "eagle.num_layers=1", "eval.gamma=2"],
    "p_eagle": ["eagle.ttt_steps=2", "eagle.draft_vocab_size=64", "eval.gamma=2"],
    "dflash": ["dflash.aux_layers=[1,2,3]", "dflash.block_size=3", "dflash.anchors=4", "eval.gamma=2"],
    "dspark": ["dflash.aux_layers=[1,2,3]", "dflash.block_size=3", "dflash.anchors=4", "dflash.markov_rank=4",
               "eval.gamma=3"],
    "distill": ["distill.layers=1", "distill.gamma=2"],
    "layerskip": ["eval.exit_layers=[2]", "eval.gamma=2", "eval.num_prompts=1", "eval.max_new_tokens=4",
                  "loop.best_metric=tau_exit2"],  # its drafter is written to best/ alone
}
# The formats each recipe's drafters export to: its method's, but EAGLE-1's (vLLM only) and DSpark's (none but GGUF);
# llama.cpp's GGUF is the last test's (its converter needs a tokenizer it knows) and tests/test_llama_cpp.py's.
EXPORTS = {"eagle1": ["vllm"], "dspark": []}
KEYS = [r.key for r in R.RECIPES]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory) -> dict:
    """family -> a directory holding its tiny target, saved with save_pretrained beside a chat tokenizer; and the
    training conversations every run reads."""
    root = tmp_path_factory.mktemp("families")
    tokenizer = train_bpe([inspect.getsource(textwrap)], V)
    assert len(tokenizer) == V
    rows = [{"messages": [{"role": "user", "content": f"def f{i}(x):"},
                          {"role": "assistant", "content": f"\n    return x + {i} * x"}]} for i in range(8)]
    (root / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dirs = {"data": root / "chats.jsonl"}
    for family in FAMILIES:
        build(family).save_pretrained(root / family)
        tokenizer.save_pretrained(root / family)
        dirs[family] = root / family
    return dirs


def train(family_dirs: dict, family: str, key: str, out: Path):
    recipe = next(r for r in R.RECIPES if r.key == key)
    return script(recipe.entry).main([
        "--config", str(REPO / "recipes" / recipe.recipe), f"target.path={family_dirs[family]}",
        f"loop.output_dir={out}", f"data.path={family_dirs['data']}", "data.extra=[]",
        f"eval.heldout_path={family_dirs['data']}", *TINY, *SMALL[key]])


REFUSED = [(f, r.key) for f in FAMILIES for r in R.RECIPES if refusal(FAMILIES[f](), r.entry)]
MATRIX = [pytest.param(f, k, marks=() if k in FAST else pytest.mark.slow, id=f"{f}-{k}")
          for f in FAMILIES for k in KEYS if (f, k) not in REFUSED]


@pytest.mark.parametrize("family,key", MATRIX)
def test_trains_decodes_losslessly_and_exports(family, key, family_dirs, tmp_path, record_property):
    """Two steps through the recipe's entry point; then every way the method decodes (its registry variants: chain,
    tree; the model that verifies, Medusa-2's and LayerSkip's own) gives the verifier's own greedy tokens, 16 past
    the prompt; then every format exports and loads back. Each stage passed is recorded for docs/targets.md."""
    train(family_dirs, family, key, tmp_path / "run")
    record_property("trains", True)
    drafter = find_drafter(tmp_path / "run")
    method = R.drafter_method(drafter)
    target = load_target(family_dirs[family])
    x = target.tokenizer("def f(x):", return_tensors="pt")["input_ids"]
    for name, way in R.plugin(method).variants(drafter, target.model).items():
        out, _ = speculative_generate(way.verifier, way.proposer(2), x, 2 * W, eos_token_id=[])
        assert torch.equal(out, plain_generate(way.verifier, x, 2 * W, eos_token_id=[])[0]), name
    record_property("lossless", True)
    formats = EXPORTS.get(key, [f for f in R.plugin(method).formats if f != "gguf"])
    for fmt in formats:
        R.load(method, fmt, R.export(drafter, fmt, tmp_path / fmt))
    record_property("exports", " ".join(formats))


@pytest.mark.parametrize("family,key", [pytest.param(f, k, id=f"{f}-{k}") for f, k in REFUSED])
def test_what_cannot_work_is_refused_in_one_line_before_anything_is_written(family, key, family_dirs, tmp_path,
                                                                          record_property):
    entry = next(r.entry for r in R.RECIPES if r.key == key)
    with pytest.raises(ValueError, match=rf"^{family}: {entry} cannot train on it, as .+; ") as e:
        train(family_dirs, family, key, tmp_path / "run")
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()
    record_property("refused", str(e.value))


# ---- llama.cpp: every family's target as GGUF, an EAGLE-3 drafter served beside it -----------------------------

# The families whose llama.cpp graph keeps each layer's input for a drafter to read (`res->t_layer_inp[il] = inpL` in
# src/models/llama.cpp, which Mixtral's GGUF also runs, qwen3.cpp, qwen3moe.cpp, openai-moe.cpp); EAGLE-3, DFlash and
# DSpark all read the target through it (common/speculative.cpp, llama_set_embeddings_layer_inp). The other families'
# graphs (gemma3.cpp, llama4.cpp, deepseek2.cpp, phi3.cpp, olmo2.cpp, glm4-moe.cpp) keep none.
LLAMA_CPP_GRAPHS = {"llama", "qwen3", "qwen3_moe", "mixtral", "gpt_oss"}


def gpt2_tokenizer() -> T.GPT2TokenizerFast:
    """GPT-2's tokenizer rebuilt from llama.cpp's own vocabulary test file (models/ggml-vocab-gpt-2.gguf): llama.cpp's
    converter accepts a BPE tokenizer only where it recognises the pre-tokenizer (by a hash of its encoding of a fixed
    text), which no tokenizer trained here matches; with GLM's special tokens, which GLM's converter looks up by name.
    Saved with tokenizer_class GPT2Tokenizer, which Phi-3's converter asks for."""
    fields = llama_cpp.gguf_py().GGUFReader(llama_cpp.source() / "models" / "ggml-vocab-gpt-2.gguf").fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    bpe = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return T.GPT2TokenizerFast(tokenizer_object=bpe, bos_token=tokens[-1], eos_token=tokens[-1],
                               additional_special_tokens=["[gMASK]", "<|user|>", "<|observation|>"])


@pytest.mark.slow
@NEEDS_SERVER
@pytest.mark.parametrize("family", DECODES)
def test_llama_cpp_serves_an_eagle3_gguf_losslessly_where_the_targets_graph_keeps_its_layers(family, tmp_path,
                                                                                              record_property):
    """The family's tiny target (GPT-2's vocabulary; a peaked head, so that llama.cpp's argmax is transformers') through
    llama.cpp's converter, and a random EAGLE-3 drafter exported as GGUF; llama-server serves both: greedy output
    equals the target's alone and acceptance is our decoder's (tests/test_llama_cpp.py, served_as_ours). Where the
    target's graph keeps no layer inputs, llama-server aborts at the first request, and its reason is recorded."""
    tokenizer = gpt2_tokenizer()
    model = build(family, vocab=len(tokenizer)).requires_grad_(False)
    model.get_output_embeddings().weight.data *= 8
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    gguf = llama_cpp.convert(tmp_path / "target", tmp_path / "target.gguf", "f32")
    record_property("llama_cpp_arch", llama_cpp.read_gguf(gguf)["fields"]["general.architecture"])
    run = drafter_dir(Target(model, tokenizer, str(tmp_path / "target")), tmp_path / "run", aux_layers=[3, 1, 2])
    draft = R.export(run, "gguf", tmp_path / "gguf") / llama_cpp.GGUF_FILE
    if family in LLAMA_CPP_GRAPHS:
        served_as_ours(gguf, draft, "draft-eagle3", run, model)
        record_property("llama_cpp", "served losslessly")
        return
    with pytest.raises(RuntimeError, match=r"GGML_ASSERT\(t_layer_inp\[il\] != nullptr") as e:
        served_as_ours(gguf, draft, "draft-eagle3", run, model)
    record_property("llama_cpp", str(e.value).rsplit("/", 1)[-1])  # FILE.cpp:LINE: GGML_ASSERT(...) failed
