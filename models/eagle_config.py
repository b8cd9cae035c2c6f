"""The EAGLE drafters' recipe section (`eagle.*`, models/eagle.py) and the layer config derived from the target.

"layers" are indices into Hugging Face `hidden_states` (0 = embeddings, i = the input to decoder layer i), the
EAGLE repository's convention: the default (2, L//2, L-3) are the inputs to those layers.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from transformers import LlamaConfig

from draftsmith.data.core import ConfigError


@dataclasses.dataclass
class EagleConfig:
    """The drafter and its loss (EAGLE-1: version 1, ttt_steps 1, feature_noise 0.2; EAGLE-3: version 3)."""

    version: Literal[1, 3] = 3
    aux_layers: list[int] = dataclasses.field(default_factory=list)  # EAGLE-3 hidden_states indices (< 0: from the end);
    # []: (2, L//2, L-3)
    draft_vocab_size: int = 32000  # EAGLE-3: most frequent loss-masked training tokens (capped at the target's vocab)
    ttt_steps: int = 7  # training-time-test steps K
    decay: float = 0.8  # step k weighs decay^k
    feature_noise: float = 0.0  # uniform noise on input features, (U - 0.5) * noise * 512 / seq_len (EAGLE-1: 0.2)
    feature_weight: float | None = None  # SmoothL1 on the target's next features; None: 1.0 (EAGLE-1), 0.0 (EAGLE-3)
    token_weight: float = 0.1  # EAGLE-1 soft cross-entropy weight (EAGLE-3 has only this term, weight 1)
    input_weight: float = 0.0  # EAGLE-3: SmoothL1 of each step's output on fc(g) of the next position (what step 0 reads)
    intermediate_size: int = 0  # MLP width of the layer; 0: the target's
    num_layers: int = 1  # decoder layers: the midlayer, then num_layers - 1 plain pre-norm layers (vLLM's EAGLE-3)
    num_key_value_heads: int = 0  # the layer's key/value heads (divides the target's heads); 0: the target's
    head_init: Literal["frozen", "trainable", "random"] = "frozen"  # EAGLE-3 lm_head: target rows via t2d, or random
    fuse_weight: float = 0.0  # EAGLE-3: SmoothL1 of norm(fc(g)) at t on the target's final feature f at t
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm on each captured hidden state before fc
    ttt_ramp: float = 0.0  # fraction of the run over which the unrolled steps grow from 1 to ttt_steps; 0: constant
    ttt_fraction: float = 1.0  # of the positions that train, the share steps 1.. run at (drawn per row from its tokens
    # and the run's progress, `row_uniform`: 2 processes train exactly as 1 with grad_accum 2)
    loss: Literal["kl", "tv", "lk"] = "kl"  # D per step: forward KL (soft CE), total variation, -log acceptance
    logit_chunk: int = 64  # positions per chunk of full-vocabulary logits and of the draft loss; 0: all at once
    loss_chunk: int | None = None  # positions per chunk of the draft loss (recomputed in the backward); None: logit_chunk

    def __post_init__(self):
        for ok, key, why in [
            (self.version in (1, 3), "version", "must be 1 (EAGLE-1) or 3 (EAGLE-3)"),
            (self.ttt_steps >= 1, "ttt_steps", "must be >= 1"),
            (0 < self.decay <= 1, "decay", "must be in (0, 1]"),
            (self.draft_vocab_size >= 1, "draft_vocab_size", "must be >= 1"),
            (self.feature_noise >= 0, "feature_noise", "must be >= 0"),
            (self.num_layers >= 1, "num_layers", "must be >= 1"),
            (self.num_key_value_heads >= 0, "num_key_value_heads", "must be >= 0 (0: the target's)"),
            (self.head_init in ("frozen", "trainable", "random"), "head_init", "must be frozen, trainable or random"),
            (self.version == 3 or not self.fc_norm, "fc_norm", "only EAGLE-3 fuses several layers; remove it"),
            (0 <= self.ttt_ramp <= 1, "ttt_ramp", "must be in [0, 1] (0: constant ttt_steps)"),
            (0 < self.ttt_fraction <= 1, "ttt_fraction", "must be in (0, 1] (1: every position that trains)"),
            (self.loss in ("kl", "tv", "lk"), "loss",
             "must be kl (forward KL), tv (total variation) or lk (negative log-acceptance)"),
            (self.logit_chunk >= 0, "logit_chunk", "must be >= 0 (0: the whole sequence at once)"),
            (self.loss_chunk is None or self.loss_chunk >= 0, "loss_chunk", "must be >= 0 (0: the whole sequence)"),
            (self.version == 3 or not self.aux_layers, "aux_layers", "only EAGLE-3 fuses several layers; remove it"),
            (self.feature_weight is None or self.feature_weight >= 0, "feature_weight", "must be >= 0"),
            (self.input_weight >= 0 and (self.version == 3 or not self.input_weight), "input_weight",
             "must be >= 0, and only EAGLE-3 fuses an input (EAGLE-1: feature_weight)"),
            (self.fuse_weight >= 0 and (self.version == 3 or not self.fuse_weight), "fuse_weight",
             "must be >= 0, and only EAGLE-3 fuses an input (EAGLE-1 reads the target's feature itself)"),
            (self.version == 3 or self.feature_weight != 0 or self.token_weight > 0, "feature_weight",
             "EAGLE-1 needs a positive feature_weight or token_weight"),
        ]:
            if not ok:
                raise ConfigError(f"eagle.{key}: {why}")
        if self.feature_weight is None:
            self.feature_weight = 1.0 if self.version == 1 else 0.0
        if self.loss_chunk is None:
            self.loss_chunk = self.logit_chunk


def default_aux_layers(num_layers: int) -> list[int]:
    """The EAGLE repository's choice, the inputs to layers 2, L//2 and L-3; on targets too shallow for three
    distinct such layers, the first distinct layers of 1..L-1 fill in (engines capture each layer once)."""
    ids = {min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 1)}
    fill = [i for i in range(1, num_layers) if i not in ids]
    return sorted(ids | set(fill[: max(0, 3 - len(ids))]))


def aux_layers(cfg: EagleConfig, num_layers: int) -> list[int]:
    """The hidden_states indices EAGLE-3 fuses (the recipe's, else the default); none for EAGLE-1. A negative index
    counts from the end of the num_layers + 1 hidden states, as Python does: [-4, -3, -2] are the inputs to the last
    three layers of any target."""
    if cfg.version != 3:
        return []
    return [i + num_layers + 1 if i < 0 else i for i in cfg.aux_layers] or default_aux_layers(num_layers)


def draft_rope(text) -> dict:
    """The target's rope for a drafter layer: its type, base and scaling (llama3, yarn, ...). Where the target has one
    rope per layer type (Gemma 3: another base for its sliding-window layers) the full-attention layers' one, as the
    drafter's keys span the whole context as theirs do. A partial rotary factor (Phi-3, GLM-4) is dropped: the drafter
    is a Llama layer that rotates whole heads, as the engines build it from the exported config."""
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default",
                                                      "rope_theta": getattr(text, "rope_theta", 10000.0)}
    rope = rope.get("full_attention", rope)
    return {k: v for k, v in rope.items() if k != "partial_rotary_factor"}


def draft_config(target_config, cfg: EagleConfig, draft_vocab_size: int) -> LlamaConfig:
    """A one-layer Llama config with the target's width, heads, rope, RMSNorm eps and vocabulary, read from its text
    config (a multimodal model's text tower: `get_text_config()`); what the engines instantiate.

    head_dim is the target's, except under multi-head latent attention (DeepSeek-V3: `kv_lora_rank`), whose config's
    head_dim is only the rotary part of its query/key heads: there heads x head_dim = the target's width. The MLP is
    dense with the target config's `intermediate_size` (unless eagle.intermediate_size says otherwise): on MoE
    targets the width of their dense layers where they have some (DeepSeek-V3 18432, GLM-4.5 10944, Qwen3-30B-A3B
    6144: about what their routed and shared experts run per token), else one expert's (Mixtral, gpt-oss, Llama 4),
    so that a drafter layer costs at most about one of the target's layers per token."""
    text = target_config.get_text_config()
    H, heads = text.hidden_size, text.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", 0) or getattr(text, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise ConfigError(f"eagle.num_key_value_heads={kv_heads} does not divide the target's "
                          f"{heads} attention heads; use a divisor of it (0: the target's)")
    latent = getattr(text, "kv_lora_rank", None) is not None
    config = LlamaConfig(
        hidden_size=H, intermediate_size=cfg.intermediate_size or getattr(text, "intermediate_size", 4 * H),
        num_hidden_layers=cfg.num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=H // heads if latent else getattr(text, "head_dim", None) or H // heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6), vocab_size=text.vocab_size,
        max_position_embeddings=getattr(text, "max_position_embeddings", 4096), rope_parameters=draft_rope(text),
        hidden_act="silu", tie_word_embeddings=False)
    config.draft_vocab_size, config.target_hidden_size = draft_vocab_size, H
    config.fc_norm = getattr(cfg, "fc_norm", False)  # EAGLE-3 only (DFlash builds its layers from the same config)
    config._attn_implementation = "sdpa"
    return config
