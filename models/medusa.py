"""Medusa-1 and Medusa-2 (Cai et al. 2024, arXiv 2401.10774): K decoding heads on the target's last hidden state.

Head k (k = 1..K) reads the final hidden state h_t and predicts token t+k+1 (the target's own LM
head predicts t+1):

    p_t^(k) = softmax(W2^(k) (SiLU(W1^(k) h_t + b1^(k)) + h_t))        (paper eq. 1, one ResBlock)

W1, b1 start at zero and W2 at a copy of the target's LM head (or W2 *is* that head, with
`share_lm_head`), so at step 0 every head predicts what the target's LM head predicts.

Medusa-1 (target frozen):  L = sum_k lambda_k CE_k,  lambda_k = decay^(k-1)        (paper eq. 2)
Medusa-2 (joint training): L = L_LM + sum_k decay^(k-1) * coeff * w(progress) * CE_k  (paper eq. 3)
where w is the head-loss warmup (constant, linear or sine) and, with `self_distill`, L_LM is
KL(p_original || p_current), p_original read from the same model with its LoRA adapters disabled.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from draftsmith.data.core import (
    REDO_DRAFTER,
    ConfigError,
    collate,
    read_drafter_meta,
    read_file,
    write_drafter_meta,
)
from draftsmith.decoding.bench import Drafting
from draftsmith.decoding.proposers import Proposer, Verified
from draftsmith.decoding.tree import DraftTree
from draftsmith.decoding.verify import Sampling
from draftsmith.models.lm import masked_ce, masked_mean
from draftsmith.models.method import MethodBase
from draftsmith.models.target import Target, load_target, target_fields

HEADS_FILE = "medusa_heads.safetensors"


@dataclasses.dataclass
class MedusaConfig:
    """Medusa heads and how they are trained (`backbone: frozen` is Medusa-1, `lora`/`full` Medusa-2)."""

    num_heads: int = 4
    num_layers: int = 1  # ResBlocks per head
    share_lm_head: bool = False  # legacy Medusa: every head projects with the target's LM head itself
    decay: float = 0.8  # lambda_k = decay^(k-1)
    topk: int = 5  # top-k accuracy logged per head (top-1 is always logged)
    backbone: Literal["frozen", "lora", "full"] = "frozen"
    lora_r: int = 32
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = dataclasses.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    head_coeff: float = 0.2  # Medusa-2 weight of the head losses against the LM loss
    head_warmup: Literal["constant", "linear", "sine"] = "constant"
    head_warmup_ratio: float = 1.0  # fraction of training over which the warmup reaches 1
    head_lr_multiplier: float = 4.0  # Medusa-2: heads train at lr * this
    self_distill: bool = False  # Medusa-2: LM term = KL to the adapters-disabled model

    def __post_init__(self):
        for ok, key, why in [
            (self.num_heads >= 1, "num_heads", "must be >= 1"),
            (self.num_layers >= 0, "num_layers", "must be >= 0"),
            (0 < self.decay <= 1, "decay", "must be in (0, 1]"),
            (self.topk >= 1, "topk", "must be >= 1"),
            (self.lora_r >= 1, "lora_r", "must be >= 1"),
            (self.head_coeff > 0, "head_coeff", "must be > 0"),
            (0 < self.head_warmup_ratio <= 1, "head_warmup_ratio", "must be in (0, 1]"),
            (self.head_lr_multiplier > 0, "head_lr_multiplier", "must be > 0"),
            (not self.self_distill or self.backbone == "lora", "self_distill",
             "needs backbone=lora (the original model is the adapters-disabled one; full training would need a copy)"),
        ]:
            if not ok:
                raise ConfigError(f"medusa.{key}: {why}")


class ResBlock(nn.Module):
    """x + SiLU(W x + b), zero-initialised so that it starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads: `num_layers` ResBlocks each, then a vocabulary projection (own copy, or the shared LM head)."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int,
                 lm_head: nn.Module | None = None, share_lm_head: bool = False):
        super().__init__()
        if lm_head is not None and getattr(lm_head, "bias", None) is not None:
            raise ValueError("the target's LM head has a bias; Medusa heads (and every serving format) have none")
        if share_lm_head and lm_head is None:
            raise ValueError("share_lm_head needs the target's LM head")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.share_lm_head = num_heads, num_layers, share_lm_head
        self.blocks = nn.ModuleList(nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)])
                                    for _ in range(num_heads))
        self._shared = [lm_head] if share_lm_head else []  # a list, so the target's head is not registered twice
        self.proj = nn.ModuleList() if share_lm_head else nn.ModuleList(
            nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
        if lm_head is not None:
            with torch.no_grad():
                for p in self.proj:
                    p.weight.copy_(lm_head.weight)

    def projection(self, k: int) -> nn.Module:
        """The vocabulary projection of head k (0-based)."""
        return self._shared[0] if self.share_lm_head else self.proj[k]

    def head(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of head k (0-based): [.., H] -> [.., V]."""
        return self.projection(k)(self.blocks[k](hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """All heads: [.., H] -> [K, .., V]."""
        return torch.stack([self.head(k, hidden) for k in range(self.num_heads)])

    def export_state(self) -> dict[str, torch.Tensor]:
        """Every head's weights, projections included even when shared (what serving formats carry)."""
        out = {}
        for k in range(self.num_heads):
            for j, block in enumerate(self.blocks[k]):
                out[f"blocks.{k}.{j}.linear.weight"] = block.linear.weight.detach().cpu().contiguous()
                out[f"blocks.{k}.{j}.linear.bias"] = block.linear.bias.detach().cpu().contiguous()
            out[f"proj.{k}.weight"] = self.projection(k).weight.detach().cpu().contiguous()
        return out

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], num_heads: int, num_layers: int) -> MedusaHeads:
        """Heads with their own projections from an `export_state()`-style dict."""
        V, H = state["proj.0.weight"].shape
        heads = cls(H, V, num_heads, num_layers)
        heads.load_state_dict(state)
        return heads


def shifted_mask(loss_mask: torch.Tensor, position_ids: torch.Tensor | None, shift: int) -> torch.Tensor:
    """Positions t whose token t+shift is trained on and lies in the same packed example: [b, s-shift]."""
    mask = loss_mask[:, shift:].bool()  # [b, s-shift]
    if position_ids is not None:  # packed rows restart positions at 0 for every example
        mask &= position_ids[:, shift:] == position_ids[:, :-shift] + shift
    return mask


def head_losses(heads: MedusaHeads, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None, topk: int = 5) -> tuple[list[torch.Tensor], dict]:
    """Per-head cross-entropy (head k at t against token t+k+1) and top-1/top-k accuracy.

    hidden [b, s, H]; input_ids, loss_mask, position_ids [b, s].
    Returns ([CE_1..CE_K] scalars, metrics {head{k}_loss, head{k}_top1, head{k}_top{topk}}).
    """
    losses, metrics = [], {}
    for k in range(1, heads.num_heads + 1):
        shift = k + 1
        mask = shifted_mask(loss_mask, position_ids, shift)  # [b, s-shift]
        logits = heads.head(k - 1, hidden[:, :-shift][mask]).float()  # [n, V]
        labels = input_ids[:, shift:][mask]  # [n]
        ce = F.cross_entropy(logits, labels) if labels.numel() else logits.sum() * 0.0
        losses.append(ce)
        with torch.no_grad():
            top = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices  # [n, topk]
            hit = top == labels[:, None]
            n = max(1, labels.numel())
            metrics[f"head{k}_loss"] = ce.item()
            metrics[f"head{k}_top1"] = hit[:, 0].sum().item() / n
            if topk > 1:
                metrics[f"head{k}_top{topk}"] = hit.any(-1).sum().item() / n
    return losses, metrics


def head_warmup(kind: str, progress: float, ratio: float) -> float:
    """Medusa-2 head-loss weight schedule w(progress) in [0, 1]."""
    x = min(1.0, progress / ratio)
    return {"constant": 1.0, "linear": x, "sine": math.sin(x * math.pi / 2)}[kind]


def masked_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean KL(p || q) over positions whose predicted token has loss_mask 1. logits [b, s, V], mask [b, s]."""
    logp = F.log_softmax(p_logits[:, :-1].float(), -1)  # [b, s-1, V]
    logq = F.log_softmax(q_logits[:, :-1].float(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # [b, s-1]
    return masked_mean(kl, loss_mask[:, 1:])


class Medusa(MethodBase):
    """The Medusa method for the shared loop: Medusa-1 (`backbone: frozen`) or Medusa-2 (`lora` / `full`)."""

    def __init__(self, target: Target, cfg: MedusaConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.backbone == "lora":
            from peft import LoraConfig, get_peft_model
            target.model = get_peft_model(target.model, LoraConfig(
                r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                target_modules=list(cfg.lora_target_modules)))
        else:
            target.model.requires_grad_(cfg.backbone == "full")
        self.target = target
        c = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        self.heads = MedusaHeads(c.hidden_size, target.lm_head.weight.shape[0], cfg.num_heads, cfg.num_layers,
                                 target.lm_head, cfg.share_lm_head)
        self.choices: Choices | None = None  # decoding tree (None: chain); the evaluator sets the measured one

    @property
    def medusa2(self) -> bool:
        return self.cfg.backbone != "frozen"

    def train(self, mode: bool = True) -> Medusa:
        super().train(mode)
        if not self.medusa2:
            self.target.eval()  # a frozen target never runs dropout
        return self

    def param_groups(self, lr: float) -> list[dict]:
        """Heads at lr * head_lr_multiplier (Medusa-2 only), the trainable backbone at lr."""
        mult = self.cfg.head_lr_multiplier if self.medusa2 else 1.0
        head_params = [p for p in self.heads.parameters() if p.requires_grad]
        ids = {id(p) for p in head_params}
        backbone = [p for p in self.target.parameters() if p.requires_grad and id(p) not in ids]
        groups = [{"params": head_params, "lr": lr * mult}]
        return groups + ([{"params": backbone, "lr": lr}] if backbone else [])

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        ids, mask, pos = batch["input_ids"], batch["loss_mask"], batch.get("position_ids")
        attn = batch.get("attention_mask")
        cfg = self.cfg
        with torch.set_grad_enabled(self.medusa2 and torch.is_grad_enabled()):
            hidden = self.target.tap(ids, attn, pos).hidden  # [b, s, H], the one target forward
        losses, metrics = head_losses(self.heads, hidden, ids, mask, pos, cfg.topk)
        weighted = sum(cfg.decay ** k * ce for k, ce in enumerate(losses))
        if not self.medusa2:
            return weighted, metrics
        logits = self.target.logits(hidden)  # [b, s, V]
        if cfg.self_distill:
            with torch.no_grad(), self.target.model.disable_adapter():
                original = self.target.logits(self.target.tap(ids, attn, pos).hidden)  # [b, s, V]
            lm = masked_kl(original, logits, mask)
        else:
            lm = masked_ce(logits, ids, mask)
        w = cfg.head_coeff * head_warmup(cfg.head_warmup, self.progress(), cfg.head_warmup_ratio)
        metrics.update(lm_loss=lm.item(), head_weight=w)
        return lm + w * weighted, metrics

    def proposer(self, target=None, choices: Choices | None = None) -> MedusaProposer:
        """A proposer over the current heads (the decoder's protocol), on `choices`, else this checkpoint's
        tree, else the chain. For Medusa-2 verify with this method's own backbone, `verifier_model(self.target)`."""
        return MedusaProposer(self.heads, choices or self.choices)

    def save_pretrained(self, out: str | Path) -> None:
        """The project's drafter checkpoint: drafter.json, medusa_heads.safetensors, and the Medusa-2 backbone
        (LoRA adapter in adapter/, or the full model in backbone/)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v for k, v in self.heads.export_state().items() if not (self.cfg.share_lm_head and k.startswith("proj."))}
        save_file(state, out / HEADS_FILE)
        meta = {"variant": "medusa2" if self.medusa2 else "medusa1",
                **target_fields({"target": self.target.path, "target_as_given": self.target.given}),
                "hidden_size": self.heads.hidden_size, "vocab_size": self.heads.vocab_size,
                "medusa": dataclasses.asdict(self.cfg)}
        if self.choices:
            meta["tree_choices"] = [list(c) for c in self.choices]
        write_drafter_meta(out, "medusa", **meta)
        if self.cfg.backbone == "lora":
            self.target.model.save_pretrained(out / "adapter")
        elif self.cfg.backbone == "full":
            self.target.model.save_pretrained(out / "backbone")
            if self.target.tokenizer is not None:
                self.target.tokenizer.save_pretrained(out / "backbone")


@dataclasses.dataclass
class MedusaDrafter:
    """A trained Medusa drafter ready for decoding: the (merged) backbone and its heads."""

    target: Target
    heads: MedusaHeads
    source: str = "medusa1"  # medusa1 / medusa2 for a project checkpoint, else the export format read
    choices: Choices | None = None  # the tree measured for this checkpoint, if any


def load_medusa(path: str | Path, target: Target | None = None, dtype: torch.dtype = torch.float32) -> MedusaDrafter:
    """Load a drafter written by `Medusa.save_pretrained`. For Medusa-2 the backbone is the trained one
    (LoRA merged); for Medusa-1 `target` (or the recorded target path) is used as is."""
    path = Path(path)
    meta = read_drafter_meta(path)
    if meta.get("method") != "medusa":
        raise ValueError(f"{path} holds a {meta.get('method')!r} drafter, not a Medusa one")
    cfg = meta["medusa"]
    if cfg["backbone"] == "full":
        target = load_target(path / "backbone", dtype=dtype)
        target.path = meta["target"]
    elif target is None:
        target = load_target(meta["target"], dtype=dtype)
    if cfg["backbone"] == "lora":
        from peft import PeftModel
        target = Target(PeftModel.from_pretrained(target.model, path / "adapter").merge_and_unload(),
                        target.tokenizer, meta["target"])
        target.model.requires_grad_(False)
    state = read_file(path / HEADS_FILE, REDO_DRAFTER)
    heads = MedusaHeads(meta["hidden_size"], meta["vocab_size"], cfg["num_heads"], cfg["num_layers"],
                        target.lm_head, cfg["share_lm_head"])
    heads.load_state_dict(state)
    heads.to(device=target.lm_head.weight.device, dtype=target.lm_head.weight.dtype)
    choices = [tuple(c) for c in meta["tree_choices"]] if meta.get("tree_choices") else None
    return MedusaDrafter(target, heads.eval(), meta["variant"], choices)


# ---- decoding: the Medusa proposer, its static trees and the greedy tree builder -------------------------

Choices = list[tuple[int, ...]]


def chain_choices(num_heads: int) -> Choices:
    """Chain mode: the top-1 candidate of every head, one path of depth num_heads."""
    return [(0,) * d for d in range(1, num_heads + 1)]


def check_choices(choices: Choices, num_heads: int) -> Choices:
    """Validate Medusa "choices" (node = ranks along its path) and order them parents first, ranks ascending."""
    seen = {()}
    for c in sorted(map(tuple, choices), key=lambda c: (len(c), c)):
        if not 1 <= len(c) <= num_heads or min(c) < 0:
            raise ValueError(f"tree choice {c}: needs 1..{num_heads} non-negative ranks (one per head)")
        if c[:-1] not in seen:
            raise ValueError(f"tree choice {c} has no parent {c[:-1]} in the choices; choices must be prefix-closed")
        seen.add(c)
    return sorted(seen - {()}, key=lambda c: (len(c), c))


def greedy_tree(accuracy: torch.Tensor, budget: int) -> tuple[Choices, float]:
    """The Medusa paper's greedy tree construction under a node budget.

    accuracy [K, R]: accuracy[k, r] = P(head k+1's rank-r candidate is the right token). A node's
    value is the product of its ranks' accuracies along the path, i.e. the probability that the
    whole path is accepted; the expected acceptance length of a tree is 1 + the sum of its node
    values (bonus included). Since a node never beats its parent, repeatedly taking the best
    frontier node yields the best prefix-closed tree of `budget` nodes.
    Returns (choices, expected tau).
    """
    K, R = accuracy.shape
    acc = accuracy.double().tolist()
    frontier = [(-acc[0][r], (r,)) for r in range(R)]
    heapq.heapify(frontier)
    chosen, expected = [], 1.0
    while frontier and len(chosen) < budget:
        neg, c = heapq.heappop(frontier)
        chosen.append(c)
        expected -= neg
        if len(c) < K:
            for r in range(R):
                heapq.heappush(frontier, (neg * acc[len(c)][r], c + (r,)))
    return check_choices(chosen, K), expected


@torch.no_grad()
@torch.no_grad()
def target_passes(target: Target, rows: list[dict], batch_size: int = 8) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    """The target over held-out rows once: (batch on the target's device, last hidden state [b, s, H], the target's
    greedy token for t+1 [b, s]) per `batch_size` rows, for `heldout_accuracy` (Medusa-1's frozen target gives the
    same passes at every checkpoint)."""
    device = target.lm_head.weight.device
    passes = []
    for i in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[i: i + batch_size]).items()}
        hidden = target.tap(batch["input_ids"], batch.get("attention_mask"), batch["position_ids"]).hidden
        passes.append((batch, hidden, target.logits(hidden).argmax(-1)))
    return passes


@torch.no_grad()
def heldout_accuracy(heads: MedusaHeads, passes: list[tuple[dict, torch.Tensor, torch.Tensor]], topk: int = 5,
                     ranks: int = 10) -> tuple[dict[str, float], torch.Tensor]:
    """Each head's logits once over the held-out rows (`target_passes`) -> (metrics, rank accuracy [K, ranks]).

    metrics: head{k}_loss, head{k}_top1, head{k}_top{topk} against the data's token at t+k+1 (as `head_losses`
    computes them, token-weighted over batches); rank accuracy [k-1, r]: how often head k's rank-r candidate is
    the token the target itself predicts greedily at t+k+1 (teacher-forced: the quantity greedy verification
    tests, from which `greedy_tree` builds the tree)."""
    K = heads.num_heads
    sums = torch.zeros(K, 3, dtype=torch.float64)  # [K, (CE sum, top1 hits, top-k hits)]
    hits = torch.zeros(K, ranks, dtype=torch.float64)
    counts = torch.zeros(K, dtype=torch.float64)
    for batch, hidden, greedy in passes:  # hidden [b, s, H], greedy [b, s]
        ids, s = batch["input_ids"], batch["input_ids"].shape[1]
        for k in range(1, K + 1):
            mask = shifted_mask(batch["loss_mask"], batch["position_ids"], k + 1)  # [b, s-k-1]
            logits = heads.head(k - 1, hidden[:, : s - k - 1][mask]).float()  # [n, V]
            labels, target_says = ids[:, k + 1:][mask], greedy[:, k: s - 1][mask]  # [n], [n]
            top = logits.topk(min(max(topk, ranks), logits.shape[-1]), -1).indices  # [n, max(topk, ranks)]
            sums[k - 1, 0] += F.cross_entropy(logits, labels, reduction="sum").item()
            sums[k - 1, 1] += (top[:, 0] == labels).sum().item()
            sums[k - 1, 2] += (top[:, :topk] == labels[:, None]).any(-1).sum().item()
            hits[k - 1] += (top[:, :ranks] == target_says[:, None]).double().sum(0).cpu()
            counts[k - 1] += labels.numel()
    mean = sums / counts.clamp_min(1)[:, None]
    metrics = {}
    for k in range(1, K + 1):
        metrics[f"head{k}_loss"], metrics[f"head{k}_top1"] = mean[k - 1, 0].item(), mean[k - 1, 1].item()
        if topk > 1:
            metrics[f"head{k}_top{topk}"] = mean[k - 1, 2].item()
    return metrics, hits / counts.clamp_min(1)[:, None]


class MedusaProposer(Proposer):
    """Medusa drafting: the heads read the target's last hidden state at the last verified position and
    propose the static tree `choices` below the bonus token (node (r1, .., rd) = rank-r_j token of head j).

    The tree is deterministic (q is a point mass per node), so exact verification at any temperature
    keeps the target's distribution; typical acceptance on top of it is lossy.
    """

    hidden_layers = (-1,)

    def __init__(self, heads: MedusaHeads, choices: Choices | None = None):
        self.heads = heads
        self.choices = check_choices(choices or chain_choices(heads.num_heads), heads.num_heads)
        self.depth = max(len(c) for c in self.choices)
        self.ranks = 1 + max(max(c) for c in self.choices)
        self.reset()

    def reset(self) -> None:
        self.h: torch.Tensor | None = None

    def accept(self, ids: torch.Tensor, verified: Verified) -> None:
        if verified.hidden is not None and verified.hidden.shape[1]:
            self.h = verified.hidden[-1, -1]  # [H], the state that predicted the bonus token ids[-1]

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        if self.h is None:  # a one-token prompt: no hidden state yet
            return DraftTree.empty(ids.device)
        w = self.heads.projection(0).weight
        h = self.h.to(device=w.device, dtype=w.dtype)
        top = torch.stack([self.heads.head(k, h).topk(self.ranks).indices
                           for k in range(self.depth)]).tolist()  # [depth, ranks]
        paths = [[top[d][r] for d, r in enumerate(c)] for c in self.choices]
        return DraftTree.from_paths(paths, ids.device)[0]


def verifier_model(target: Target) -> nn.Module:
    """The Hugging Face model the decoder verifies with: the target itself, LoRA adapters active if any."""
    model = target.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def load_proposer(path: str | Path, target=None, choices: Choices | None = None, chain: bool = False
                  ) -> MedusaProposer:
    """The plug-in's proposer loader (models/registry.py) for a Medusa drafter dir:
    its measured tree unless `choices` or `chain` is given. With a Medusa-2 drafter, verify with its merged
    backbone (`load_medusa(path).target`), not the original target."""
    meta = read_drafter_meta(path)
    given = None if target is None or meta.get("variant") == "medusa2" else Target(target, None, "")
    drafter = load_medusa(path, given)
    return MedusaProposer(drafter.heads, chain_choices(drafter.heads.num_heads) if chain else choices or drafter.choices)


def variants(drafter_dir: Path, target: nn.Module) -> dict[str, Drafting]:
    """The leaderboard's ways to decode with a Medusa drafter: the chain of its heads, and the tree measured at its
    best checkpoint. Medusa-2's merged backbone verifies (its own trained model), Medusa-1's target."""
    frozen = read_drafter_meta(drafter_dir)["medusa"]["backbone"] == "frozen"
    drafter = load_medusa(drafter_dir, Target(target) if frozen else None)
    model, heads, K = drafter.target.model, drafter.heads, drafter.heads.num_heads
    out = {"chain": Drafting(model, lambda g: MedusaProposer(heads, chain_choices(g)), [heads], gamma=K, max_gamma=K)}
    if drafter.choices:
        out["tree"] = Drafting(model, lambda g: MedusaProposer(heads, drafter.choices), [heads])
    return out
