"""The target every method shares: any Hugging Face causal LM, loaded frozen, with one generic tap.

No per-architecture code: the decoder stack comes from `get_decoder()`, the LM head from
`get_output_embeddings()`, the embedding from `get_input_embeddings()`. The tap returns the
decoder's `last_hidden_state`, which is the final hidden state *after* the final norm (checked
for Llama, GPT-2, Qwen2 and Gemma in tests/test_medusa.py: `lm_head(tap.hidden) == logits`),
and optionally `hidden_states[i]` for chosen i (0 = embedding output, i = output of layer i-1,
i.e. the input to layer i).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.models.zoo import resolve_target

REFERENCE_TARGET = Path(__file__).resolve().parent / "reference-target"


@dataclass
class TapOutput:
    """hidden: the final (post-norm) hidden state [b, s, H]; layers: {i: hidden_states[i] [b, s, H]}."""

    hidden: torch.Tensor
    layers: dict[int, torch.Tensor] = field(default_factory=dict)


class Target(nn.Module):
    """A causal LM (optionally wrapped by peft) with a tokenizer and a hidden-state tap."""

    def __init__(self, model: nn.Module, tokenizer=None, path: str = ""):
        super().__init__()
        self.model, self.tokenizer, self.path = model, tokenizer, path

    @property
    def config(self):
        return self.model.config

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embed(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def tap(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None, layers: tuple[int, ...] = ()) -> TapOutput:
        """One decoder forward (no LM head, no cache) -> final hidden state and chosen layers."""
        out = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids, use_cache=False,
                                       output_hidden_states=bool(layers))
        n = len(out.hidden_states) - 1 if layers else 0
        for i in layers:
            if not 0 <= i <= n:
                raise ValueError(f"layer {i} is out of range for a target with {n} layers; use 0..{n}")
        return TapOutput(out.last_hidden_state, {i: out.hidden_states[i] for i in layers})

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on hidden states [.., H] -> [.., V], with the config's logit soft-cap if any."""
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits


@dataclass
class TargetConfig:
    """The `target` section of every recipe."""

    path: str = str(REFERENCE_TARGET)  # a local Hugging Face model directory, a hub id or a named real target (zoo)
    dtype: str = "float32"
    trust_remote_code: bool = False  # off unless a recipe turns it on


def load_target(path: str | Path = REFERENCE_TARGET, dtype: torch.dtype | str = torch.float32,
                trust_remote_code: bool = False, frozen: bool = True) -> Target:
    """Tokenizer + `AutoModelForCausalLM` from a local dir or hub id; every parameter frozen by default."""
    path = resolve_target(path)
    if Path(path) == REFERENCE_TARGET and not (REFERENCE_TARGET / "config.json").is_file():
        raise FileNotFoundError(f"the reference target is not built yet ({REFERENCE_TARGET}); run "
                                "`accelerate launch train/target.py` or pass target.path=<HF model>")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    model.requires_grad_(not frozen)
    if frozen:
        model.eval()
    return Target(model, tokenizer, path)
