"""LayerSkip (Elhoushi et al. 2024): early-exit loss, its curricula, and layer dropout.

The target is trained so that its own first E layers, followed by the final norm and LM head,
make a good drafter for the remaining layers (self-speculative decoding).

Loss (paper Eq. 5-7): L = CE(final) + e_scale * sum_l w_l(t) * CE(lm_head(norm(h_l))) over the
early layers l < L enabled at step t by the curriculum, with w_l proportional to a per-layer
scale (uniform: 1, linear: l, sum: 1 + ... + l, sqrt: sqrt(l), inverse: 1/l) normalised over the
enabled layers. Layer dropout skips layer l for whole samples with p_l = p_max * (2^(l/(L-1)) - 1)
(deeper layers are dropped more often; layer 0 never).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from draftsmith.decoding.proposers import DraftModel, truncated_copy
from draftsmith.models.lm import masked_ce
from draftsmith.train.config import ConfigError

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

    def __init__(self, kind: str, num_layers: int, rotation: int = 2, total_steps: int = 1):
        self.kind, self.L, self.R, self.total = kind, num_layers, rotation, max(1, total_steps)
        self.step = 0

    def enabled(self) -> list[int]:
        """Early layers (1-based, < L) whose exit is trained at the current step."""
        early = range(1, self.L)
        if self.kind == "rotational":
            return [l for l in early if (l + self.step) % self.R == 0]
        if self.kind == "gradual":
            return [l for l in early if self.step / self.total >= 0.5 * (self.L - l) / self.L]
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
    n = model.config.num_hidden_layers
    for module in model.get_decoder().modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"cannot find the {n} decoder layers of {type(model).__name__}")


def final_norm(model: nn.Module) -> nn.Module:
    """The norm the decoder applies after its last layer (a direct child whose class is a norm)."""
    layers = decoder_layers(model)
    norms = [m for m in model.get_decoder().children() if "norm" in type(m).__name__.lower() and m is not layers]
    if len(norms) != 1:
        raise ValueError(f"cannot find the final norm of {type(model).__name__} (candidates: {len(norms)})")
    return norms[0]


class LayerDropout:
    """Forward hooks that make layer l the identity for whole samples with probability p_l (training only)."""

    def __init__(self, model: nn.Module, p_max: float):
        self.rates = dropout_rates(model.config.num_hidden_layers, p_max)
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


class LayerSkip(nn.Module):
    """The training method: final loss + curriculum-gated, scaled early-exit losses."""

    def __init__(self, model: nn.Module, tokenizer, cfg: LayerSkipConfig, total_steps: int):
        super().__init__()
        self.cfg, self.tokenizer = cfg, tokenizer
        if cfg.lora:
            from peft import LoraConfig, get_peft_model
            model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                                     target_modules=cfg.lora_targets))
        self.model = model
        base = self.base
        self.L = base.config.num_hidden_layers
        self.norm, self.lm_head = final_norm(base), base.get_output_embeddings()
        self.curriculum = Curriculum(cfg.curriculum, self.L, cfg.rotation, total_steps)
        self.dropout = LayerDropout(base, cfg.dropout_max) if cfg.dropout_max > 0 else None

    @property
    def base(self) -> nn.Module:
        """The Hugging Face model (under the peft wrapper when LoRA is on)."""
        return self.model.get_base_model() if self.cfg.lora else self.model

    def exit_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head (+ the config's logit soft-cap) on an intermediate state [b, s, H] -> [b, s, V]."""
        logits = self.lm_head(self.norm(hidden))
        cap = getattr(self.base.config, "final_logit_softcapping", None)
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

    def plain_model(self) -> nn.Module:
        """The model as a plain Hugging Face model: with LoRA, a merged copy (training keeps its adapters)."""
        return copy.deepcopy(self.model).merge_and_unload() if self.cfg.lora else self.model

    def save_pretrained(self, out: Path) -> None:
        """A plain Hugging Face model directory, usable with assistant_early_exit."""
        self.plain_model().save_pretrained(out)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out)


class EarlyExit(DraftModel):
    """Self-speculation: the target's first E layers + final norm + LM head draft a chain of gamma tokens.

    The draft shares every weight with the target and keeps its own cache of the first E layers;
    tokens it drafted and the target accepted keep their cached keys and values, so only the
    bonus token is fed again. (The verifying forward still recomputes layers [:E] for the drafted
    tokens: the paper's exit-query cache, which skips that, needs a split forward.)
    """

    def __init__(self, target: nn.Module, exit_layer: int, gamma: int = 4):
        super().__init__(truncated_copy(target, exit_layer), target.config.vocab_size, gamma)
        self.exit_layer = exit_layer


def load_proposer(path: str | Path, target: nn.Module, exit_layer: int | None = None, gamma: int = 4) -> EarlyExit:
    """The early-exit proposer for a LayerSkip export (`drafter.json` names its exit layer)."""
    import json

    info = json.loads((Path(path) / "drafter.json").read_text())
    return EarlyExit(target, exit_layer or info["exit_layer"], gamma)
