"""LayerSkip (Elhoushi et al. 2024): early-exit loss, its curricula, layer dropout, and self-speculation.

The target is trained so that its own first E layers, followed by the final norm and LM head,
make a good drafter for the remaining layers (self-speculative decoding).

Loss (paper Eq. 5-7): L = CE(final) + e_scale * sum_l w_l(t) * CE(lm_head(norm(h_l))) over the
early layers l < L enabled at step t by the curriculum, with w_l proportional to a per-layer
scale (uniform: 1, linear: l, sum: 1 + ... + l, sqrt: sqrt(l), inverse: 1/l) normalised over the
enabled layers. Layer dropout skips layer l for whole samples with p_l = p_max * (2^(l/(L-1)) - 1)
(deeper layers are dropped more often; layer 0 never).

Decoding: `EarlyExit` drafts with layers [:E] into the target's own KV cache, and verification
skips layers [:E] for every token the draft already ran through them (the exit-query cache); it
runs a Hugging Face decoder's own layers in two parts through `SplitForward`. `EarlyExitDraft` is
the plain form (a truncated copy with its own cache) for architectures the split forward does not cover.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from draftsmith.data.core import ConfigError, read_drafter_meta
from draftsmith.decoding import cache as kv
from draftsmith.decoding.bench import Drafting
from draftsmith.decoding.generate import attention_masks
from draftsmith.decoding.proposers import DraftModel, Proposer, draw, truncated_copy
from draftsmith.decoding.tree import DraftTree, position_ids
from draftsmith.decoding.verify import Sampling
from draftsmith.models.export import Format
from draftsmith.models.lm import masked_ce
from draftsmith.models.method import MethodBase
from draftsmith.models.target import decoder

SCALES = {"uniform": lambda l: 1.0, "linear": float, "sum": lambda l: l * (l + 1) / 2,
          "sqrt": math.sqrt, "inverse": lambda l: 1.0 / l}


@dataclasses.dataclass
class LayerSkipConfig:
    e_scale: float = 1.0  # weight of the early-exit loss against the final loss
    scale: Literal["uniform", "linear", "sum", "sqrt", "inverse"] = "sum"
    curriculum: Literal["none", "rotational", "gradual"] = "rotational"
    rotation: int = 2  # R: with the rotational curriculum, every R-th early layer is enabled, shifting each step
    dropout_max: float = 0.1  # p_max of the exponential layer-dropout schedule; 0 disables it
    lora: bool = False  # train LoRA adapters (peft) instead of every weight
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: list[str] = dataclasses.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def __post_init__(self):
        if self.e_scale < 0:
            raise ConfigError("layerskip.e_scale: must be >= 0")
        if self.rotation < 1:
            raise ConfigError("layerskip.rotation: must be >= 1")
        if not 0 <= self.dropout_max < 1:
            raise ConfigError("layerskip.dropout_max: must be in [0, 1)")


class Curriculum:
    """Which early layers carry the early-exit loss at each step; its state resumes exactly."""

    def __init__(self, kind: str, num_layers: int, rotation: int = 2, progress: Callable[[], float] = lambda: 1.0):
        self.kind, self.L, self.R, self.progress = kind, num_layers, rotation, progress  # progress: fraction done
        self.step = 0  # micro-batches seen

    def enabled(self) -> list[int]:
        """Early layers (1-based, < L) whose exit is trained at the current step."""
        early = range(1, self.L)
        if self.kind == "rotational":
            return [l for l in early if (l + self.step) % self.R == 0]
        if self.kind == "gradual":
            return [l for l in early if self.progress() >= 0.5 * (self.L - l) / self.L]
        return list(early)

    def advance(self) -> None:
        self.step += 1

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def dropout_rates(num_layers: int, p_max: float) -> list[float]:
    """p_l = p_max * (2^(l/(L-1)) - 1) for layers l = 0..L-1."""
    if num_layers < 2:
        return [0.0] * num_layers
    return [p_max * (2 ** (l / (num_layers - 1)) - 1) for l in range(num_layers)]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's list of layers, found generically (the ModuleList of num_hidden_layers blocks)."""
    n = model.config.get_text_config().num_hidden_layers
    for module in decoder(model).modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"cannot find the {n} decoder layers of {type(model).__name__}")


def final_norm(model: nn.Module) -> nn.Module:
    """The norm the decoder applies after its last layer (a direct child whose class is a norm)."""
    layers = decoder_layers(model)
    norms = [m for m in decoder(model).children() if "norm" in type(m).__name__.lower() and m is not layers]
    if len(norms) != 1:
        raise ValueError(f"cannot find the final norm of {type(model).__name__} (candidates: {len(norms)})")
    return norms[0]


class LayerDropout:
    """Forward hooks that make layer l the identity for whole samples with probability p_l (training only)."""

    def __init__(self, model: nn.Module, p_max: float):
        self.rates = dropout_rates(model.config.get_text_config().num_hidden_layers, p_max)
        self.handles = [layer.register_forward_hook(self._hook(p), with_kwargs=True)
                        for layer, p in zip(decoder_layers(model), self.rates, strict=True) if p > 0]

    @staticmethod
    def _hook(p: float):
        def hook(module, args, kwargs, output):
            if not module.training:
                return output
            hidden_in = args[0] if args else kwargs["hidden_states"]  # [b, s, H]
            hidden_out = output[0] if isinstance(output, tuple) else output
            drop = torch.rand(hidden_in.shape[0], device=hidden_in.device) < p  # [b]
            mixed = torch.where(drop[:, None, None], hidden_in, hidden_out)
            return (mixed, *output[1:]) if isinstance(output, tuple) else mixed
        return hook


class LayerSkip(MethodBase):
    """The training method: final loss + curriculum-gated, scaled early-exit losses."""

    def __init__(self, model: nn.Module, tokenizer, cfg: LayerSkipConfig):
        super().__init__()
        self.cfg, self.tokenizer = cfg, tokenizer
        if cfg.lora:
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                     target_modules=cfg.lora_targets))
        self.model = model
        base = self.base
        self.L = base.config.get_text_config().num_hidden_layers
        self.curriculum = Curriculum(cfg.curriculum, self.L, cfg.rotation, lambda: self.progress())
        self.dropout = LayerDropout(base, cfg.dropout_max) if cfg.dropout_max > 0 else None

    @property
    def base(self) -> nn.Module:
        """The Hugging Face model (under the peft wrapper when LoRA is on)."""
        return self.model.get_base_model() if self.cfg.lora else self.model

    @property
    def norm(self) -> nn.Module:  # properties, not attributes: a module registered twice confuses FSDP2's sharding
        return final_norm(self.base)

    @property
    def lm_head(self) -> nn.Module:
        return self.base.get_output_embeddings()

    def exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head (+ the config's logit soft-cap) on an intermediate state [b, s, H] -> [b, s, V]."""
        logits = self.lm_head(self.norm(hidden))
        cap = getattr(self.base.config.get_text_config(), "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        out = self.model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"),
                         attention_mask=batch.get("attention_mask"), use_cache=False, output_hidden_states=True)
        ids, mask = batch["input_ids"], batch["loss_mask"]
        loss = final = masked_ce(out.logits, ids, mask)
        metrics = {"loss_final": final.item()}
        enabled = self.curriculum.enabled() if self.training else list(range(1, self.L))
        if enabled and self.cfg.e_scale > 0:
            scale = SCALES[self.cfg.scale]
            total = sum(scale(l) for l in enabled)
            final_top1 = out.logits.argmax(-1)  # [b, s]
            m = mask.bool()
            for l in enabled:
                logits = self.exit_logits(out.hidden_states[l])  # output of layer l (1-based) [b, s, V]
                ce = masked_ce(logits, ids, mask)
                loss = loss + self.cfg.e_scale * scale(l) / total * ce
                metrics[f"loss_exit{l}"] = ce.item()
                metrics[f"agree_exit{l}"] = (logits.argmax(-1)[m] == final_top1[m]).float().mean().item()
        if self.training:
            self.curriculum.advance()
        return loss, metrics

    def extra_state(self) -> dict:
        """State beyond the weights that the loop checkpoints: the curriculum position."""
        return {"curriculum": self.curriculum.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.curriculum.load_state_dict(state["curriculum"])

    @property
    def sharded_refusal(self) -> str:
        """Why this run cannot use a sharded target, ZeRO-3 or FSDP2 (read by the loop at start; empty: it can)."""
        return ("layerskip.lora=true evaluates a merged copy of the model, which sharded parameters (ZeRO-3, FSDP2) "
                "cannot make; launch with recipes/accelerate/zero2.yaml or ddp.yaml, or set layerskip.lora=false"
                if self.cfg.lora else "")

    def plain_model(self) -> nn.Module:
        """The model as a plain Hugging Face model: with LoRA, a merged copy (training keeps its adapters)."""
        return copy.deepcopy(self.model).merge_and_unload() if self.cfg.lora else self.model

    def save_pretrained(self, out: Path) -> None:
        """A plain Hugging Face model directory, usable with assistant_early_exit."""
        self.plain_model().save_pretrained(out)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)


# Decoders whose forward the split forward reproduces (read from their transformers source): embed_tokens,
# rotary_emb (Gemma-3: one per layer type), layers called with (hidden, attention_mask, position_embeddings,
# position_ids, cache), masks per `config.layer_types`, final norm; all in the decoder's PLAIN_HEAD set.
SPLIT_FORWARD = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")


class SplitForward:
    """The target's decoder run in two parts over one KV cache: layers [:E] and layers [E:].

    It calls the model's own embedding, decoder layers, rotary embedding module and final norm, with
    masks in the form the model's forward takes (`decoding.generate.attention_masks`: one additive
    4-D mask, or one per layer type with the sliding window applied). Every call runs a chain: its
    tokens sit at the positions right after those cached in the first layer it runs.
    """

    def __init__(self, target: nn.Module):
        model_type = target.config.model_type
        if model_type not in SPLIT_FORWARD:
            raise ValueError(f"exit-query cache: no split forward for model_type {model_type!r} (supported: "
                             f"{', '.join(SPLIT_FORWARD)}); use EarlyExitDraft, which recomputes layers [:E]")
        self.config, self.decoder, self.layers = target.config, decoder(target), decoder_layers(target)
        self.layer_types = getattr(target.config, "layer_types", None)
        self.rope_per_type = "layer_type" in inspect.signature(self.decoder.rotary_emb.forward).parameters

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings of ids [s] (with the model's own scaling, e.g. Gemma's) -> [1, s, H]."""
        return self.decoder.embed_tokens(ids[None])

    def run(self, hidden: torch.Tensor, layers: range, cache) -> torch.Tensor:
        """Decoder layers `layers` on hidden [1, s, H]; appends the s tokens to those layers' cache."""
        start, s = cache.get_seq_length(layers.start), hidden.shape[1]
        parents = torch.arange(-1, s - 2, device=hidden.device)  # the s tokens as a chain: [root, nodes]
        masks = attention_masks(self.config, parents, start, hidden.dtype)  # [1, 1, s, start+s] (or one per type)
        positions = position_ids(parents, start)  # [1, s]
        rope = self.decoder.rotary_emb
        pe = ({t: rope(hidden, positions, t) for t in set(self.layer_types)} if self.rope_per_type
              else rope(hidden, positions))
        for i in layers:
            kind = self.layer_types[i] if self.layer_types else None
            hidden = self.layers[i](hidden, attention_mask=masks[kind] if isinstance(masks, dict) else masks,
                                    position_embeddings=pe[kind] if self.rope_per_type else pe,
                                    position_ids=positions, cache=cache, use_cache=True)  # [1, s, H]
        return hidden

    def norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder's final norm."""
        return self.decoder.norm(hidden)


class EarlyExit(Proposer):
    """Self-speculation with the exit-query cache (LayerSkip): the target's first E layers + final norm
    + LM head draft a chain of gamma tokens, and verification reuses what the draft computed.

    Drafting runs layers [:E] into the target's own KV cache, one token at a time (the root, then every
    drafted token but the last), keeping the exit layer's hidden states. Verification (`target_forward`,
    the decoder's hook) runs layers [:E] only for the tokens the draft did not feed (the last drafted
    one), continues the exit hidden states through layers [E:], and so never does the draft's work twice.
    The first E layers' KV lives once; the decoder's rollback crops every layer to the committed prefix.
    """

    def __init__(self, target: nn.Module, exit_layer: int, gamma: int = 4):
        self.split, self.L = SplitForward(target), target.config.get_text_config().num_hidden_layers
        if not 1 <= exit_layer < self.L:
            raise ValueError(f"exit layer {exit_layer} must be in 1..{self.L - 1} for a {self.L}-layer target")
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.exit_layer, self.gamma, self.cache = exit_layer, gamma, None
        self.head = target.get_output_embeddings()
        self.cap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
        self.reset()

    def reset(self) -> None:
        self.fed: list[int] = []  # tokens the draft ran through layers [:E] this step
        self.exit_hidden = None  # [1, len(fed), H] their exit-layer hidden states

    def target_forward(self, cache):
        """The decoder's hook: draft into the target's `cache` and verify with `verify_forward`."""
        self.cache = cache
        return self.verify_forward

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.split.norm(hidden))  # [V]
        return logits if self.cap is None else torch.tanh(logits / self.cap) * self.cap

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        feed, tokens, qs, hidden = ids[-1:], [], [], []
        for _ in range(self.gamma):
            hidden.append(self.split.run(self.split.embed(feed), range(self.exit_layer), self.cache))  # [1, 1, H]
            x = draw(self._logits(hidden[-1][0, -1]), sampling, qs)
            tokens.append(x)
            feed = torch.tensor([x], device=ids.device)
        self.fed, self.exit_hidden = [int(ids[-1])] + tokens[:-1], torch.cat(hidden, 1)  # [1, gamma, H]
        return DraftTree.chain(torch.tensor(tokens, device=ids.device), torch.stack(qs) if qs else None)

    def verify_forward(self, input_ids: torch.Tensor, attention_mask, cache, **kwargs) -> BaseModelOutputWithPast:
        """Verify [root, nodes] (input_ids [1, n+1], a chain: attention_mask None). The decoder's other
        arguments (position_ids, use_cache) are implied: the chain follows the committed prefix in `cache`."""
        if attention_mask is not None:
            raise ValueError("the exit-query cache verifies chains only (the decoder passes a mask for trees)")
        tokens = input_ids[0].tolist()
        k = 0  # leading tokens the draft fed: their [:E] KV is cached and their exit hidden states kept
        while k < min(len(self.fed), len(tokens)) and self.fed[k] == tokens[k]:
            k += 1
        kv.crop(cache, cache.get_seq_length(self.exit_layer) + k)  # the first k tokens' [:E] KV is the draft's
        hidden = self.exit_hidden[:, :k]  # [1, k, H] exit query cache
        if k < len(tokens):  # the last drafted token (the draft never fed it) still needs layers [:E]
            rest = self.split.run(self.split.embed(input_ids[0, k:]), range(self.exit_layer), cache)  # [1, n+1-k, H]
            hidden = torch.cat([hidden, rest], 1)  # [1, n+1, H]
        hidden = self.split.run(hidden, range(self.exit_layer, self.L), cache)  # [1, n+1, H]
        self.fed = []
        return BaseModelOutputWithPast(last_hidden_state=self.split.norm(hidden))


class EarlyExitDraft(DraftModel):
    """Self-speculation without the exit-query cache: the target's first E layers as a separate draft model.

    `truncated_copy` shares every weight with the target and keeps its own cache of the first E layers
    (accepted draft tokens keep their entries, so only the bonus token is fed again); the verifying
    forward recomputes layers [:E] for the drafted tokens. Works for any architecture `truncated_copy`
    can cut (GPT-2 too); the baseline the exit-query cache is timed against.
    """

    def __init__(self, target: nn.Module, exit_layer: int, gamma: int = 4):
        V = target.config.get_text_config().vocab_size
        super().__init__(truncated_copy(target, exit_layer), V, gamma)
        self.exit_layer = exit_layer


def early_exit(target: nn.Module, exit_layer: int, gamma: int = 4) -> EarlyExit | EarlyExitDraft:
    """EarlyExit where the split forward supports the architecture; otherwise EarlyExitDraft, with a warning."""
    if target.config.model_type in SPLIT_FORWARD:
        return EarlyExit(target, exit_layer, gamma)
    warnings.warn(f"exit-query cache: no split forward for {target.config.model_type!r}; drafting with a truncated "
                  "copy that keeps its own cache (verification recomputes layers [:E])", stacklevel=2)
    return EarlyExitDraft(target, exit_layer, gamma)


def load_proposer(path: str | Path, target: nn.Module, exit_layer: int | None = None,
                  gamma: int = 4) -> EarlyExit | EarlyExitDraft:
    """The early-exit proposer for a LayerSkip export (`drafter.json` names its exit layer)."""
    info = read_drafter_meta(path)
    return early_exit(target, exit_layer or info["exit_layer"], gamma)


# ---- export ------------------------------------------------------------------------------------------

def write_hf(drafter_dir: Path, tmp: Path, final: Path) -> None:
    """The trained target as a plain Hugging Face model directory whose generation config carries
    `assistant_early_exit` (transformers' self-speculation: `generate(..., assistant_early_exit=E)` reads it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    exit_layer = read_drafter_meta(drafter_dir)["exit_layer"]
    AutoModelForCausalLM.from_pretrained(drafter_dir).save_pretrained(tmp)
    AutoTokenizer.from_pretrained(drafter_dir).save_pretrained(tmp)
    gen = GenerationConfig.from_pretrained(drafter_dir)
    gen.assistant_early_exit = exit_layer
    gen.save_pretrained(tmp)


def load_hf(path: Path) -> tuple[nn.Module, int]:
    """(the model, its exit layer) as transformers reads the directory."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    return AutoModelForCausalLM.from_pretrained(path).eval(), GenerationConfig.from_pretrained(path).assistant_early_exit


FORMATS = {"hf": Format(write_hf, load_hf, "HF model dir with generation_config.assistant_early_exit")}


def variants(drafter_dir: Path, target: nn.Module) -> dict[str, Drafting]:
    """The leaderboard's early-exit chain: the early-exit-trained target drafts with its first exit_layer layers and
    verifies (its own trained model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(drafter_dir).eval()
    exit_layer = read_drafter_meta(drafter_dir)["exit_layer"]
    runs = [model.get_input_embeddings(), *decoder_layers(model)[:exit_layer], final_norm(model),
            model.get_output_embeddings()]
    return {"chain": Drafting(model, lambda g: load_proposer(drafter_dir, model, gamma=g), runs, gamma=4)}
