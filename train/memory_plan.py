"""What one EAGLE-3 training step needs per GPU under each launcher, from the target's config alone.

    draftsmith plan --target llama-3.1-8b                          # seq 2048, batch 1: launcher x 1, 2, 4, 8 GPUs
    draftsmith plan --target gpt-oss-120b --seq 4096 --gpus 4      # the terms at 4 GPUs
    draftsmith plan --target path/to/model --json                  # a local config.json (or its directory)

No weights, no hub, no GPU: the target is built from its config on the meta device (its parameters, decoder layers and
attention implementation as transformers builds it) and the drafter by draftsmith's own EAGLE-3 construction
(models/eagle.py) on it, so both counts are the real ones. The activation terms follow the code of one step
(models/eagle.py `Eagle.ttt`, the loop's mixed precision); the launcher terms follow how accelerate, DeepSpeed and
FSDP2 hold the target and the drafter (docs/distributed.md, recipes/accelerate/). Formulas: docs/distributed.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith.models.eagle import Eagle
from draftsmith.models.eagle_config import EagleConfig
from draftsmith.models.target import Target
from draftsmith.recipes import RECIPES
from draftsmith.train.guard import cli

GiB = 2**30
GPU_SIZES = {"80 GiB": 80, "141 GiB": 141}  # H100 / A100-80G, H200
LAUNCHERS = ("single", "ddp", "zero2", "zero3", "fsdp2")
TABLE_GPUS = (1, 2, 4, 8)
MXFP4_BYTES = 17 / 32  # 4-bit values + one 8-bit (E8M0) scale per block of 32
ZERO = {stage: json.loads((RECIPES / f"accelerate/zero{stage}.json").read_text())["zero_optimization"]
        for stage in (2, 3)}  # the shipped DeepSpeed configs' bucket sizes

# The four named targets' text configs: the public config.json numbers the plan reads (hub ids in the comments).
LLAMA3 = dict(model_type="llama", num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
              torch_dtype="bfloat16", rms_norm_eps=1e-5, max_position_embeddings=131072,
              rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TARGETS: dict[str, dict] = {
    "llama-3.1-8b": dict(LLAMA3, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,  # meta-llama/Llama-3.1-8B-Instruct
                         intermediate_size=14336),
    "qwen3-30b-a3b": dict(  # Qwen/Qwen3-30B-A3B: 128 experts, 8 per token
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        vocab_size=151936, tie_word_embeddings=False, torch_dtype="bfloat16", rms_norm_eps=1e-6,
        max_position_embeddings=40960, rope_theta=1000000.0),
    "gpt-oss-120b": dict(  # openai/gpt-oss-120b: 128 experts, 4 per token; expert weights shipped in MXFP4
        model_type="gpt_oss", hidden_size=2880, num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4, vocab_size=201088,
        tie_word_embeddings=False, torch_dtype="bfloat16", rms_norm_eps=1e-5, sliding_window=128,
        max_position_embeddings=131072,
        rope_scaling={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}),
    "llama-3.3-70b": dict(LLAMA3, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,  # meta-llama/Llama-3.3-70B-Instruct
                          intermediate_size=28672),
}


def target_config(target: str):
    """A named target's config, or a local Hugging Face config (a model directory or its config.json); never the hub."""
    if target in TARGETS:
        fields = dict(TARGETS[target])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = Path(target).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--target {target}: neither a named target ({', '.join(TARGETS)}) nor a local "
                                "config.json or model directory holding one")
    return AutoConfig.from_pretrained(path)


@dataclasses.dataclass(frozen=True)
class Counts:
    """What the plan reads of the target and its drafter, counted on the meta device (bytes as stored; w = bytes per
    element of the run's dtype, MXFP4 experts at 17/32)."""

    name: str
    text: object  # the target's text config: widths, layers, heads, experts
    params: int  # the target's parameters
    weights: float  # the target's weight bytes
    layer: float  # its largest decoder layer (an FSDP2 unit: the model's _no_split_modules)
    embed: float  # input embedding
    head: float  # LM head (0 when tied to the embedding)
    module: float  # its largest single module's own parameters (what ZeRO-3 gathers at once)
    small: float  # parameters ZeRO-3 keeps whole on every rank (under stage3_param_persistence_threshold elements)
    eager: bool  # attention scores [b, heads, s, s] materialised (no SDPA kernel for this family: gpt-oss's sinks)
    drafter: int  # the drafter's trainable parameters
    drafter_frozen: float  # its frozen head (eagle.head_init=frozen: the target's rows, a buffer) in bytes
    drafter_heads: tuple[int, int]  # attention heads and head_dim of its layers
    drafter_mlp: int  # its MLP width
    n_aux: int  # captured target layers
    vocab: int
    draft_vocab: int


def count(config, eagle: EagleConfig, w: int, name: str = "") -> Counts:
    """Build the target from `config` and the drafter on it on the meta device, and count both."""
    text = config.get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if w == 2 else torch.float32)
        draft_ids = torch.arange(min(eagle.draft_vocab_size, text.vocab_size))  # capped at the target's, as in training
        method = Eagle(Target(model.requires_grad_(False)), eagle, draft_ids)
    mxfp4 = (getattr(config, "quantization_config", None) or {}).get("quant_method") == "mxfp4"

    def nbytes(module: torch.nn.Module, recurse: bool = True) -> float:
        return sum(p.numel() * (MXFP4_BYTES if mxfp4 and p.dim() == 3 else w)  # [experts, in, out]: MXFP4 blocks
                   for p in module.parameters(recurse))

    units = [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or ())]
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is None or head.weight is embed.weight
    threshold = ZERO[3]["stage3_param_persistence_threshold"]
    attn = method.drafter.midlayer.self_attn
    return Counts(
        name=name or getattr(config, "_name_or_path", "") or type(model).__name__, text=text,
        params=sum(p.numel() for p in model.parameters()), weights=nbytes(model),
        layer=max((nbytes(u) for u in units), default=nbytes(model)), embed=nbytes(embed),
        head=0.0 if tied else nbytes(head), module=max(nbytes(m, recurse=False) for m in model.modules()),
        small=sum(p.numel() * w for p in model.parameters() if p.numel() < threshold),
        eager=model.config._attn_implementation == "eager",
        drafter=sum(p.numel() for p in method.drafter.parameters() if p.requires_grad),
        drafter_frozen=sum(b.numel() * w for n, b in method.drafter.named_buffers() if n == "lm_head.weight"),
        drafter_heads=(attn.config.num_attention_heads, attn.head_dim),
        drafter_mlp=method.drafter.config.intermediate_size, n_aux=len(method.layers),
        vocab=text.vocab_size, draft_vocab=method.drafter.d2t.numel())


@dataclasses.dataclass(frozen=True)
class Setting:
    """One training step's shape: rows of `seq` tokens, every position trained (packed rows, all in the loss: the
    most a batch asks), in `dtype`: bfloat16 = target.dtype=bfloat16 with loop.mixed_precision=bf16 (as `draftsmith
    gpu-check` trains), float32 = target.dtype=float32 with loop.mixed_precision=no (the recipes' default)."""

    seq: int
    batch: int
    dtype: str
    eagle: EagleConfig

    @property
    def w(self) -> int:
        """Bytes per element of the target's weights, the drafter's (built in the target's dtype) and the autocast
        activations."""
        return 2 if self.dtype == "bfloat16" else 4


def target_forward(c: Counts, s: Setting) -> float:
    """The frozen target's no-grad forward, its largest transient: every hidden state the tap keeps
    (output_hidden_states: L + 1 of them, and the final norm's) [b, s, H], plus one decoder layer's working tensors:
    q, k, v and their rotary copies, the attention output, norms and residual, the MLP's gate, up and product (MoE:
    the router logits, the one-hot expert mask and the busiest expert taking every token, an upper bound), and with
    eager attention (no SDPA kernel) its scores [b, heads, s, s] three times (product, masked, softmax)."""
    text, T, w = c.text, s.batch * s.seq, s.w
    H, heads, kv = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    d = getattr(text, "head_dim", None) or H // heads
    hidden = (text.num_hidden_layers + 2) * T * H * w
    attention = T * (2 * (heads + 2 * kv) + heads) * d * w + (3 * s.batch * heads * s.seq**2 * w if c.eager else 0)
    mlp = 3 * T * getattr(text, "intermediate_size", 4 * H) * w  # dense: gate, up, product [b, s, I]
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or \
        getattr(text, "n_routed_experts", None)
    if experts:
        width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
        router = T * experts * w + T * text.num_experts_per_tok * (experts + 1) * 8  # logits, int64 one-hot mask
        mlp = max(mlp, router + 3 * T * width * w + T * H * w)  # + the busiest expert's gate, up, product, the sum
    return hidden + attention + mlp + 2 * T * H * w


def drafter_activations(c: Counts, s: Setting) -> float:
    """What the drafter's K unrolled steps keep for the backward (eager attention, `ttt_attention`), at every position:
    per step and layer, [b, s, H] tensors: the step's embedding, the three RMSNorms' float32 inputs and products, the
    fused [norm(e); norm(h)] input (bf16: cast once per q, k, v projection), 32 bytes per element in float32, 40 in
    bf16; the MLP's gate, activation, up and product [b, s, I]; q, the repeated keys and values and the attention
    output [b, s, heads x head_dim]; at step k the stacked later keys and values (k of each); the softmax over step 0's
    keys and the later steps' [b, heads, s, s + k] in float32 (bf16: and its bf16 copy) and the visibility mask
    [b, s, s]. Step 0 also keeps fc's output (and in bf16 its input's cast)."""
    T, H, w, K = s.batch * s.seq, c.text.hidden_size, s.w, s.eagle.ttt_steps
    heads, d = c.drafter_heads
    per_h = 40 if w == 2 else 32  # bytes per element of [b, s, H] kept per step and layer
    per_score = 6 if w == 2 else 4  # the float32 softmax (and its bf16 copy)
    total = T * H * w + (T * c.n_aux * H * w if w == 2 else 0)  # step 0: fc's output (bf16: its input's cast)
    for k in range(K):
        layer = T * (per_h * H + 4 * c.drafter_mlp * w + (4 + 2 * k) * heads * d * w)
        scores = s.batch * heads * s.seq * (s.seq + k) * per_score  # [b, heads, s, s + k]
        total += s.eagle.num_layers * (layer + scores) + s.batch * s.seq**2  # + the bool mask [b, s, s]
    return total


def teacher(c: Counts, s: Setting, offline: bool) -> float:
    """The teacher's pass (`Eagle.teacher`), before the drafter runs: the logits of one chunk of batch x
    eagle.logit_chunk positions (in the target's dtype, then float32) over the whole vocabulary (offline: the draft
    vocabulary's rows, the cache holding the rest), and p [b x s, Vd] float32 twice (its chunks and their
    concatenation)."""
    T, e = s.batch * s.seq, s.eagle
    rows = c.draft_vocab if offline else c.vocab
    return min(T, s.batch * e.logit_chunk or T) * rows * (s.w + 4) + 2 * T * c.draft_vocab * 4


def ttt_logits(c: Counts, s: Setting) -> float:
    """The draft-vocabulary distributions the loss reads, float32 [b x s, Vd]: the teacher's p, and the copy of it
    each of the K steps gathers for its positions (kept for the backward; with eagle.loss_chunk=0 also its softmax q),
    plus one chunk of eagle.loss_chunk positions' draft logits and softmax, recomputed in the backward."""
    T, Vd, K, e = s.batch * s.seq, c.draft_vocab, s.eagle.ttt_steps, s.eagle
    kept = (1 + K) * T * Vd * 4 + (K * T * Vd * 4 if e.loss_chunk == 0 else 0)
    return kept + 3 * min(T, e.loss_chunk or T) * Vd * 4


def plan(c: Counts, s: Setting, launcher: str, gpus: int, offline: bool = False) -> dict[str, float]:
    """Bytes per GPU of each term for `launcher` over `gpus` processes, and `total`.

    total = target + drafter + adamw + features + max(target_fwd, teacher, ttt_logits + activations + grads): the
    target's forward, then the teacher's pass, are over (their transients freed) before the drafter's steps begin,
    and the gradients exist from the backward to the optimizer step (the loop zeroes them to None)."""
    n, w, P, T, H = gpus, s.w, c.drafter, s.batch * s.seq, c.text.hidden_size
    if launcher == "single" and n != 1:
        raise ValueError("launcher single runs on 1 GPU; use ddp, zero2, zero3 or fsdp2 for more")
    sharded_master = 4 * P / n  # ZeRO's and FSDP2's float32 master (FSDP2: accelerate upcasts the trainable part)
    bucket = ZERO[2 if launcher == "zero2" else 3]["reduce_bucket_size"] * w
    if launcher in ("single", "ddp", "zero2"):  # the whole target on every rank
        target = c.weights
    elif launcher == "zero3":  # partitioned, but for its small parameters; gathered module by module with prefetch
        target = c.small + (c.weights - c.small) / n + c.module + ZERO[3]["stage3_prefetch_bucket_size"] * w
    else:  # fsdp2: units per decoder layer (this one and the next, prefetched), embedding, LM head (kept gathered)
        target = (c.weights - c.head) / n + c.head + max(2 * c.layer, c.embed)
    drafter, grads, adamw = {
        "single": (P * w, P * w, 2 * P * w),  # in the target's dtype: no master copy
        "ddp": (P * w, 2 * P * w, 2 * P * w),  # + the reducer's gradient buckets
        "zero2": (P * w + sharded_master, 2 * bucket + 4 * P / n, 8 * P / n),  # two reduce buckets (overlap_comm)
        "zero3": (P * w / n + sharded_master, bucket + 4 * P / n, 8 * P / n),
        "fsdp2": (P * w + sharded_master, P * w + 4 * P / n, 8 * P / n),  # the root unit stays gathered
    }[launcher]
    features = T * (c.n_aux + 1) * H * 4 + T * H * 4  # f, g upcast to float32 (Eagle.features) and the embedding
    if offline:
        features += T * (c.n_aux + 1) * H * 2  # the cached batch itself, bf16
    terms = {"target": target, "target_fwd": 0.0 if offline else target_forward(c, s), "features": features,
             "teacher": teacher(c, s, offline), "drafter": drafter + c.drafter_frozen, "grads": grads, "adamw": adamw,
             "ttt_logits": ttt_logits(c, s), "activations": drafter_activations(c, s)}
    step = terms["ttt_logits"] + terms["activations"] + grads
    terms["total"] = target + terms["drafter"] + adamw + features + max(terms["target_fwd"], terms["teacher"], step)
    return terms


def table(c: Counts, s: Setting, gpus: int) -> dict:
    """Every launcher online and offline over TABLE_GPUS (and `gpus`): the terms and total per GPU, and the fits."""
    rows = []
    for offline in (False, True):
        for launcher in LAUNCHERS:
            for n in sorted({*TABLE_GPUS, gpus}):
                if launcher == "single" and n != 1:
                    continue
                terms = plan(c, s, launcher, n, offline)
                rows.append({"launcher": launcher, "offline": offline, "gpus": n,
                             "bytes": {k: round(v) for k, v in terms.items()},
                             "fits": [size for size, gib in GPU_SIZES.items() if terms["total"] <= gib * GiB]})
    return {"target": c.name, "target_params": c.params, "drafter_params": c.drafter, "seq": s.seq, "batch": s.batch,
            "dtype": s.dtype, "ttt_steps": s.eagle.ttt_steps, "draft_vocab": c.draft_vocab, "rows": rows}


def render(result: dict, gpus: int) -> str:
    """The terms at `gpus` GPUs per launcher, then launcher x GPUs -> GiB per GPU with the GPU sizes it fits."""
    rows = result["rows"]
    names = [k for k in rows[0]["bytes"] if k != "total"] + ["total"]
    label = [f"{r['launcher']}{' offline' if r['offline'] else ''}" for r in rows]
    width = max(map(len, label)) + 2
    out = [f"EAGLE-3 on {result['target']} ({result['target_params'] / 1e9:.2f}B parameters), drafter "
           f"{result['drafter_params'] / 1e6:.0f}M trainable, seq {result['seq']} x batch {result['batch']}, "
           f"{result['dtype']}, ttt_steps {result['ttt_steps']}, draft vocab {result['draft_vocab']}", "",
           f"GiB per GPU at {gpus} GPU(s) (single: 1):",
           "".ljust(width) + "".join(f"{n:>12}" for n in names)]
    for lab, r in zip(label, rows, strict=True):
        if r["gpus"] == (1 if r["launcher"] == "single" else gpus):
            out.append(lab.ljust(width) + "".join(f"{r['bytes'][k] / GiB:>12.2f}" for k in names))
    shown = sorted({r["gpus"] for r in rows})
    out += ["", "total GiB per GPU (* fits 80 GiB, + fits 141 GiB only, - fits neither;",
            "the CUDA context and the allocator's fragmentation come on top):",
            "".ljust(width) + "".join(f"{n:>9}" for n in shown)]
    for lab in dict.fromkeys(label):
        cells = {r["gpus"]: r for lab2, r in zip(label, rows, strict=True) if lab2 == lab}
        out.append(lab.ljust(width) + "".join(  # the sizes nest: fits 80 GiB -> fits 141 GiB
            f"{cells[n]['bytes']['total'] / GiB:>8.1f}{'-+*'[len(cells[n]['fits'])]}" if n in cells else " " * 9
            for n in shown))
    return "\n".join(line.rstrip() for line in out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="draftsmith plan", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help=f"{', '.join(TARGETS)}, or a local config.json / model dir")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row (data.max_length)")
    parser.add_argument("--batch", type=int, default=1, help="rows per GPU per micro-step (loop.batch_size)")
    parser.add_argument("--gpus", type=int, default=8, help="the world size the per-term breakdown is shown at")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="bfloat16: target.dtype=bfloat16 loop.mixed_precision=bf16; float32: both off")
    parser.add_argument("--ttt-steps", type=int, default=EagleConfig.ttt_steps, help="eagle.ttt_steps")
    parser.add_argument("--draft-vocab", type=int, default=EagleConfig.draft_vocab_size, help="eagle.draft_vocab_size")
    parser.add_argument("--loss-chunk", type=int, default=None, help="eagle.loss_chunk (default: eagle.logit_chunk)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    args = parser.parse_args(argv)
    for key in ("seq", "batch", "gpus"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key} must be >= 1")
    eagle = EagleConfig(version=3, ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab, loss_chunk=args.loss_chunk)
    config = target_config(args.target)
    s = Setting(args.seq, args.batch, args.dtype, eagle)
    c = count(config, eagle, s.w, args.target)
    result = table(c, s, args.gpus)
    print(json.dumps(result, indent=1) if args.json else render(result, args.gpus))
    return result


if __name__ == "__main__":
    cli(main)
