"""The target every method shares: any Hugging Face causal LM, loaded frozen, with one generic tap.

No per-architecture code: the decoder stack comes from `get_decoder()` (`decoder`), the LM head from
`get_output_embeddings()`, the embedding from `get_input_embeddings()`. The tap returns the
decoder's `last_hidden_state`, which is the final hidden state *after* the final norm (checked
for Llama, GPT-2, Qwen2 and Gemma in tests/test_medusa.py: `lm_head(tap.hidden) == logits`),
and optionally `hidden_states[i]` for chosen i (0 = embedding output, i = output of layer i-1,
i.e. the input to layer i).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.data.core import DamagedFile, read_file, safetensors_damage, what_is_wrong
from draftsmith.decoding.cache import rollback_refusal
from draftsmith.models.zoo import NAMED_TARGETS, resolve_target

REFERENCE_TARGET = Path(__file__).resolve().parent / "reference-target"


@dataclass
class TapOutput:
    """hidden: the final (post-norm) hidden state [b, s, H]; layers: {i: hidden_states[i] [b, s, H]}."""

    hidden: torch.Tensor
    layers: dict[int, torch.Tensor] = field(default_factory=dict)


class Target(nn.Module):
    """A causal LM (optionally wrapped by peft) with a tokenizer and a hidden-state tap."""

    def __init__(self, model: nn.Module, tokenizer=None, path: str = "", given: str = ""):
        super().__init__()
        # path: where it loads from anywhere (absolute directory, or the hub id); given: as the user wrote it
        self.model, self.tokenizer, self.path, self.given = model, tokenizer, path, given or path

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
        out = decoder(self.model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=False, output_hidden_states=bool(layers))
        n = len(out.hidden_states) - 1 if layers else 0
        for i in layers:
            if not 0 <= i <= n:
                raise ValueError(f"layer {i} is out of range for a target with {n} layers; use 0..{n}")
        return TapOutput(out.last_hidden_state, {i: out.hidden_states[i] for i in layers})

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target's LM head on hidden states [.., H] -> [.., V] (or [.., len(rows)]: those vocabulary rows
        alone), with the config's logit soft-cap if any."""
        if rows is None:
            logits = self.lm_head(hidden)
        else:
            bias = getattr(self.lm_head, "bias", None)
            logits = F.linear(hidden, self.lm_head.weight[rows], None if bias is None else bias[rows])
        cap = getattr(self.config.get_text_config(), "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits


def decoder(model: nn.Module) -> nn.Module:
    """A causal LM's decoder stack, without its head: `get_decoder()`, or the `model` inside what that returns where
    it is the causal LM itself (Llama 4's text model, whose base_model_prefix names the multimodal checkpoint's)."""
    found = model.get_decoder()
    return found.model if found.get_output_embeddings() is not None else found


def refusal(config, entry: str) -> str:
    """Why the training entry `entry` (train/ENTRY.py: medusa, eagle3, ...) cannot run on a target of this config, in
    one line naming the target's family, the entry and the reason; '' where it can. The one list of what a family
    cannot do, asked by the runner (train/runner.py) once the target is loaded, before anything is written. Every
    method measures its drafter by speculative decoding at each checkpoint, so what the decoder cannot roll back
    (`decoding.cache.rollback_refusal`: linear-attention and state-space layers) is refused for all."""
    why = rollback_refusal(config)
    if not why:
        return ""
    family, _, reason = why.partition(": ")
    return f"{family}: {entry} cannot train on it, as {reason}"


@dataclass
class TargetConfig:
    """The `target` section of every recipe."""

    path: str = str(REFERENCE_TARGET)  # a local Hugging Face model directory, a hub id or a named real target (zoo)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False  # off unless a recipe turns it on


def target_reference(path: str | Path) -> str:
    """What loads the target from anywhere: the absolute directory if it exists here, else the hub id as given."""
    return str(Path(path).expanduser().resolve()) if Path(path).expanduser().exists() else str(path)


def target_fields(meta: dict) -> dict[str, str]:
    """The target as every drafter.json and export records it: `target` loads it from anywhere (an absolute
    directory, or the hub id), `target_as_given` is what the recipe said."""
    given = meta.get("target_as_given") or meta.get("target") or ""
    return {"target": target_reference(meta["target"]) if meta.get("target") else "", "target_as_given": given}


def check_target(path: str, key: str = "target.path") -> None:
    """Refuse, in one line, a target directory that cannot load: missing, no config.json, no weights, weights
    truncated or missing shards. A name that is not a local path is left to the hub."""
    p = Path(path).expanduser()
    if not p.exists():
        if path.startswith(("/", ".", "~")) or path.count("/") != 1:
            raise FileNotFoundError(f"{key}={path} does not exist; give a Hugging Face model directory, a hub id "
                                    f"(org/name) or a named target ({', '.join(NAMED_TARGETS)})")
        return
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{key}={path} has no config.json; give a Hugging Face model directory "
                                "(save_pretrained output)")
    index = next(iter(sorted(p.glob("*.safetensors.index.json"))), None)
    shards = sorted(set(read_file(index, "re-download or re-save the model")["weight_map"].values())) if index else \
        [f.name for f in sorted(p.glob("*.safetensors"))]
    if not shards and not any(p.glob("pytorch_model*.bin")):
        raise FileNotFoundError(f"{key}={path} holds no weights (model.safetensors or pytorch_model.bin); "
                                "copy or re-save the whole model")
    for name in shards:
        why = "is missing" if not (p / name).is_file() else safetensors_damage(p / name)
        if why:
            raise ValueError(f"{key}={path}: {name} {why}; re-download or re-save the model")


def load_target(path: str | Path = REFERENCE_TARGET, dtype: torch.dtype | str = torch.float32,
                trust_remote_code: bool = False, frozen: bool = True) -> Target:
    """Tokenizer + `AutoModelForCausalLM` from a local dir or hub id; every parameter frozen by default."""
    given, path = str(path), resolve_target(path)
    if Path(path) == REFERENCE_TARGET and not (REFERENCE_TARGET / "config.json").is_file():
        raise FileNotFoundError(f"the reference target is not built yet ({REFERENCE_TARGET}); run "
                                "`accelerate launch train/target.py` or pass target.path=<HF model>")
    check_target(path)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, pickle.UnpicklingError) as e:
        if isinstance(e, pickle.UnpicklingError) or "Weights only load failed" in str(e):
            raise DamagedFile(f"target.path={path}: its pytorch_model*.bin {what_is_wrong(e)}; use a safetensors copy of "
                              "the model (or re-save it with save_pretrained from a source you trust)") from None
        where = "the directory" if Path(path).expanduser().exists() else "a hub id (not a local directory)"
        raise ValueError(f"target.path={path} ({where}) does not load: {' '.join(str(e).split())[:300]}") from None
    model.requires_grad_(not frozen)
    if frozen:
        model.eval()
    return Target(model, tokenizer, target_reference(path), given)
