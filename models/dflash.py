"""DFlash (block-diffusion drafting; Chen et al. 2026, arXiv 2602.06036): a small drafter conditioned on target
features that fills a block of K tokens in one forward.

The target's hidden states at a few layers (`aux_layers`, Hugging Face hidden_states indices) are fused and
normed once, c_j = hidden_norm(fc([a_j; b_j; ...])) for every committed position j; each draft layer
projects them to its own keys and values (the "context"), so the context is never run through the layers.
The block is the last committed token (the bonus x_p, "anchor") followed by K mask tokens, at positions
p..p+K; its queries attend to the whole context (positions < p) and to the whole block (bidirectional, one
denoising step); the output at mask slot i, through the target's own LM head, drafts x_{p+i}:

    c = hidden_norm(fc(g_{<p}))                                                    [p, H]
    x = [e(x_p); e(mask) x K] -> N x (pre-norm attention over [k(c); k(x)], MLP) -> norm -> lm_head
    L = sum_i decay^(i-1) CE(softmax(target logits at p+i-1), draft logits at slot i)

Training draws `anchors` random anchor positions per row and builds all their blocks at once, each block
seeing only its own sequence's context before its anchor (the training and serving attention are the same).
The layers are Qwen3-style (per-head q_norm / k_norm) and the weights are named as vLLM's and SGLang's
DFlash loaders name them (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`), so the export is a copy
(models/dflash_export.py). Embedding and LM head are the target's, frozen.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from draftsmith.data.core import REDO_DRAFTER, ConfigError, read_drafter_meta, read_file, write_drafter_meta
from draftsmith.decoding.bench import Drafting
from draftsmith.decoding.proposers import Proposer, Verified, draw
from draftsmith.decoding.tree import DraftTree
from draftsmith.decoding.verify import Sampling
from draftsmith.models.eagle_config import draft_config
from draftsmith.models.eagle_drafter import additive
from draftsmith.models.lm import masked_mean
from draftsmith.models.method import MethodBase
from draftsmith.models.target import Target, load_target

WEIGHTS_FILE, CONFIG_FILE = "dflash.safetensors", "config.json"


@dataclasses.dataclass
class DFlashConfig:
    """The drafter and its loss."""

    block_size: int = 6  # anchor + K mask slots: K = block_size - 1 tokens drafted per forward
    num_layers: int = 1  # draft layers
    aux_layers: list[int] = dataclasses.field(default_factory=list)  # hidden_states indices; []: DFlash's default
    mask_token_id: int = -1  # token whose (frozen) embedding fills the mask slots; -1: the tokenizer's pad token
    anchors: int = 32  # anchor positions drawn per training row
    decay: float = 0.8  # slot i weighs decay^(i-1)
    intermediate_size: int = 0  # MLP width; 0: the target's

    def __post_init__(self):
        for ok, key, why in [(self.block_size >= 2, "block_size", "must be >= 2 (the anchor and a mask slot)"),
                             (self.num_layers >= 1, "num_layers", "must be >= 1"),
                             (self.anchors >= 1, "anchors", "must be >= 1"),
                             (0 < self.decay <= 1, "decay", "must be in (0, 1]")]:
            if not ok:
                raise ConfigError(f"dflash.{key}: {why}")


def default_aux_layers(num_target_layers: int, num_layers: int) -> list[int]:
    """DFlash's choice as hidden_states indices: one feature per draft layer, the output of layer L//2 for one,
    else spread evenly over the outputs of layers 1..L-3 (index = layer + 1)."""
    if num_layers == 1:
        return [num_target_layers // 2 + 1]
    span = num_target_layers - 4
    return sorted({round(1 + i * span / (num_layers - 1)) + 1 for i in range(num_layers)})


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [b, heads, n, d] at the positions cos / sin [b, n, d] were computed for."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """Attention of the block over [context; block], per-head RMSNorm on q and k (Qwen3)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.d = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)
        self.q_norm = LlamaRMSNorm(d, config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(d, config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of x [b, n, H] -> [b, kv_heads, n, d] each."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.d).transpose(1, 2)
        return rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor], rope_q: tuple, mask: torch.Tensor
                ) -> torch.Tensor:
        """x [b, q, H] (normed block), context (k, v) [b, kv_heads, c, d], mask [b, 1, q, c + q] additive."""
        b, n, _ = x.shape
        q = rope(self.q_norm(self.q_proj(x).view(b, n, self.heads, self.d)).transpose(1, 2), *rope_q)  # [b, h, q, d]
        k, v = self.kv(x, *rope_q)
        k, v = torch.cat([context[0], k], 2), torch.cat([context[1], v], 2)  # [b, kv_heads, c + q, d]
        rep = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=mask.to(q.dtype))  # [b, h, q, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, context, rope_q, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, rope_q, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """fc + hidden_norm over the target features, N draft layers, the final norm (the LM head is the target's)."""

    def __init__(self, config: LlamaConfig, n_features: int):
        super().__init__()
        H = config.hidden_size
        self.config = config
        self.fc = nn.Linear(n_features * H, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(H, config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)

    def context(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys and values of target features feats [b, c, n*H] at positions [b, c]."""
        c = self.hidden_norm(self.fc(feats))  # [b, c, H]
        cos, sin = self.rotary(c, positions)
        return [layer.self_attn.kv(c, cos, sin) for layer in self.layers]

    def forward(self, block: torch.Tensor, context: list[tuple], positions: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        """block [b, q, H] embeddings at positions [b, q]; context from `context`; mask [b, 1, q, c + q] -> [b, q, H]."""
        rope_q = self.rotary(block, positions)
        x = block
        for layer, kv in zip(self.layers, context, strict=True):
            x = layer(x, kv, rope_q, mask)
        return self.norm(x)


class DFlash(MethodBase):
    """The training method: a frozen target + a DFlashDrafter."""

    def __init__(self, target: Target, cfg: DFlashConfig, mask_token_id: int = 0):
        super().__init__()
        self.target, self.cfg = target, cfg
        text = target.config.get_text_config()
        self.layers = list(cfg.aux_layers) or default_aux_layers(text.num_hidden_layers, cfg.num_layers)
        bad = [j for j in self.layers if not 1 <= j <= text.num_hidden_layers]
        if bad or len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"dflash.aux_layers: {self.layers} must be distinct hidden_states indices in "
                              f"1..{text.num_hidden_layers}")
        if not 0 <= mask_token_id < text.vocab_size:
            raise ConfigError(f"dflash.mask_token_id: {mask_token_id} is not a token id of the target's vocabulary")
        self.mask_token_id = mask_token_id
        config = draft_config(target.config, cfg, text.vocab_size)
        self.drafter = DFlashDrafter(config, len(self.layers)).to(target.lm_head.weight)

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        return self.blocks(batch)

    def blocks(self, batch: dict, anchors: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and per-slot metrics of the blocks at `anchors` [b, A] (default: cfg.anchors random positions per
        row): loss_i, acc_i (draft top-1 = target top-1) and cond_acc_i (the same, among anchors whose slots
        < i were right and whose data continues the target's greedy path, as decoding sees them)."""
        cfg, d = self.cfg, self.drafter
        ids = batch["input_ids"]  # [b, s]
        b, s = ids.shape
        K = cfg.block_size - 1
        pos = batch.get("position_ids")
        pos = torch.arange(s, device=ids.device).expand(b, s) if pos is None else pos
        seq = (pos == 0).long().cumsum(1)  # [b, s] sequence id within a packed row
        if "attention_mask" in batch:
            seq = seq.masked_fill(batch["attention_mask"] == 0, -1)
        if anchors is None:  # drawn without replacement, preferring positions with a context and a trained label
            at = torch.arange(s, device=ids.device)
            ok = (at >= 1) & (at < s - 1) & torch.cat([batch["loss_mask"][:, 1:], batch["loss_mask"][:, :1]], 1).bool()
            anchors = torch.multinomial(ok.float() + 1e-6, min(cfg.anchors, s))  # [b, A]
        A = anchors.shape[1]
        with torch.no_grad():
            tap = self.target.tap(ids, batch.get("attention_mask"), batch.get("position_ids"), tuple(self.layers))
            feats = torch.cat([tap.layers[i] for i in self.layers], -1).to(d.fc.weight.dtype)  # [b, s, n*H]
            target_logits = self.target.logits(tap.hidden).float()  # [b, s, V]
            slot = torch.arange(K + 1, device=ids.device)  # [K+1]
            at = (anchors[:, :, None] + slot).clamp(max=s - 1)  # [b, A, K+1] positions of the block
            block_ids = torch.where(slot == 0, torch.gather(ids, 1, anchors)[:, :, None], self.mask_token_id)
            emb = self.target.embed(block_ids).to(feats.dtype).flatten(1, 2)  # [b, A(K+1), H]
        # query (a, i) sees context j < anchor a of its sequence, and every slot of its own block
        seq_a = torch.gather(seq, 1, anchors)  # [b, A]
        ctx = (torch.arange(s, device=ids.device) < anchors[:, :, None]) & (seq[:, None, :] == seq_a[:, :, None])
        own = torch.eye(A, dtype=torch.bool, device=ids.device).repeat_interleave(K + 1, 0).repeat_interleave(K + 1, 1)
        visible = torch.cat([ctx.repeat_interleave(K + 1, 1), own.expand(b, -1, -1)], -1)  # [b, A(K+1), s + A(K+1)]
        q_pos = (torch.gather(pos, 1, anchors)[:, :, None] + slot).flatten(1)  # [b, A(K+1)]
        out = d(emb, d.context(feats, pos), q_pos, additive(visible)[:, None])  # [b, A(K+1), H]
        out = out.view(b, A, K + 1, -1)[:, :, 1:]  # [b, A, K, H] the mask slots
        log_q = F.log_softmax(self.target.logits(out).float(), -1)  # [b, A, K, V]
        prev = at[:, :, :-1]  # [b, A, K]: slot i is trained on the target's distribution at p + i - 1
        p = F.softmax(torch.gather(target_logits, 1, prev.flatten(1)[..., None].expand(-1, -1, target_logits.shape[-1]))
                      .view(b, A, K, -1), -1)  # [b, A, K, V]
        label_at = anchors[:, :, None] + slot[1:]  # [b, A, K] position of the drafted token
        inside = label_at < s
        label_at = label_at.clamp(max=s - 1)
        valid = inside & (torch.gather(seq, 1, label_at.flatten(1)).view(b, A, K) == seq_a[:, :, None]) \
            & torch.gather(batch["loss_mask"], 1, label_at.flatten(1)).view(b, A, K).bool()
        ce = -(p * log_q).sum(-1)  # [b, A, K]
        greedy = p.argmax(-1)  # [b, A, K] the target's token at each slot
        ok = log_q.argmax(-1) == greedy
        fed = torch.gather(ids, 1, label_at.flatten(1)).view(b, A, K) == greedy  # the data continues greedily
        total, on_path, metrics = 0.0, torch.ones_like(valid[:, :, 0]), {}
        for i in range(K):
            step = masked_mean(ce[:, :, i], valid[:, :, i])
            total = total + cfg.decay ** i * step
            metrics[f"loss_{i}"] = step.item()
            metrics[f"acc_{i}"] = masked_mean(ok[:, :, i].float(), valid[:, :, i]).item()
            metrics[f"cond_acc_{i}"] = masked_mean(ok[:, :, i].float(), valid[:, :, i] & on_path).item()
            on_path = on_path & ok[:, :, i] & fed[:, :, i]
        return total, metrics

    def proposer(self, target=None, gamma: int | None = None, **unused) -> DFlashProposer:
        return DFlashProposer(self.drafter, self.target.embed, self.target.lm_head, self.layers, self.mask_token_id,
                              gamma or self.cfg.block_size - 1)

    def save_pretrained(self, out: str | Path) -> None:
        """drafter.json (method, layers, block size, mask token, target), config.json, dflash.safetensors."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.drafter.state_dict().items()}, out / WEIGHTS_FILE)
        (out / CONFIG_FILE).write_text(self.drafter.config.to_json_string())
        write_drafter_meta(out, "dflash", aux_layers=self.layers,
                           aux_layers_convention="hidden_states index: the input to decoder layer i",
                           block_size=self.cfg.block_size, mask_token_id=self.mask_token_id, target=self.target.path)


def load_drafter(path: str | Path, device=None, dtype=None) -> tuple[DFlashDrafter, dict]:
    """A drafter checkpoint dir -> (DFlashDrafter with its weights, drafter.json)."""
    path = Path(path)
    meta = read_drafter_meta(path)
    config = LlamaConfig.from_dict(read_file(path / CONFIG_FILE, REDO_DRAFTER))
    drafter = DFlashDrafter(config, len(meta["aux_layers"]))
    drafter.load_state_dict(read_file(path / WEIGHTS_FILE, REDO_DRAFTER))
    return drafter.to(device=device, dtype=dtype).eval(), meta


def load_proposer(path: str | Path, target, gamma: int | None = None, **unused) -> DFlashProposer:
    """The plug-in's proposer loader (models/registry.py) for a DFlash drafter dir."""
    target = target if isinstance(target, Target) else Target(target, None, "")
    drafter, meta = load_drafter(path, target.lm_head.weight.device, target.lm_head.weight.dtype)
    return DFlashProposer(drafter, target.embed, target.lm_head, meta["aux_layers"], meta["mask_token_id"],
                          gamma or meta["block_size"] - 1)


def load_dflash(path: str | Path, target: Target | None = None) -> DFlash:
    """A trained DFlash method from a drafter dir (its target loaded from drafter.json unless given)."""
    drafter, meta = load_drafter(path)
    target = target or load_target(meta["target"])
    cfg = DFlashConfig(block_size=meta["block_size"], num_layers=drafter.config.num_hidden_layers,
                       aux_layers=meta["aux_layers"], intermediate_size=drafter.config.intermediate_size)
    method = DFlash(target, cfg, meta["mask_token_id"])
    method.drafter.load_state_dict(drafter.state_dict())
    return method


class DFlashProposer(Proposer):
    """Block drafting on the shared verifier: one drafter forward per step drafts gamma tokens.

    After each verification the target features of the newly committed positions are projected into
    every layer's context keys and values (kept, like a KV cache; committed positions never roll back).
    Then the block [bonus, mask x gamma] at positions t-1..t-1+gamma attends to the context and to itself,
    and slot i's output, through the target's LM head, drafts token i, each from its own distribution
    (q per node), which keeps exact verification exact.
    """

    def __init__(self, drafter: DFlashDrafter, embed: nn.Module, target_head: nn.Module, layers, mask_token_id: int,
                 gamma: int = 5):
        if gamma < 1:
            raise ValueError(f"DFlash proposer: gamma must be >= 1, got {gamma}")
        self.drafter, self.embed, self.head = drafter, embed, target_head
        self.hidden_layers, self.mask_token_id, self.gamma = tuple(layers), mask_token_id, gamma
        self.reset()

    def reset(self) -> None:
        self.context: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer (k, v) [1, kv_heads, c, d]

    @torch.no_grad()
    def accept(self, ids: torch.Tensor, verified: Verified) -> None:
        if verified.hidden is None:
            return
        k, m, H = verified.hidden.shape
        feats = verified.hidden.permute(1, 0, 2).reshape(1, m, k * H).to(self.drafter.fc.weight.dtype)  # [1, m, n*H]
        t = ids.numel()
        new = self.drafter.context(feats, torch.arange(t - 1 - m, t - 1, device=ids.device)[None])
        self.context = new if self.context is None else [
            (torch.cat([ck, nk], 2), torch.cat([cv, nv], 2)) for (ck, cv), (nk, nv) in zip(self.context, new, strict=True)]

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, sampling: Sampling) -> DraftTree:
        d, K, t = self.drafter, self.gamma, ids.numel()
        dtype = d.fc.weight.dtype
        context = self.context or [(torch.zeros(1, layer.self_attn.kv_heads, 0, layer.self_attn.d, dtype=dtype,
                                                device=ids.device),) * 2 for layer in d.layers]
        block = torch.cat([ids[-1:], ids.new_full((K,), self.mask_token_id)])  # [K+1]: bonus, then mask slots
        mask = torch.zeros(1, 1, K + 1, context[0][0].shape[2] + K + 1, device=ids.device)  # everything visible
        out = d(self.embed(block[None]).to(dtype), context, torch.arange(t - 1, t + K, device=ids.device)[None], mask)
        logits = self.head(out[0, 1:]).float()  # [K, V]
        qs: list[torch.Tensor] = []
        drafted = [draw(row, sampling, qs) for row in logits]
        return DraftTree.chain(torch.tensor(drafted, device=ids.device), torch.stack(qs) if qs else None)


def variants(drafter_dir: Path, target: nn.Module) -> dict[str, Drafting]:
    """The leaderboard's DFlash chain, up to block_size - 1, the slots it was trained to fill."""
    first = load_proposer(drafter_dir, target)
    K = first.gamma

    def proposer(g: int) -> DFlashProposer:
        return DFlashProposer(first.drafter, first.embed, first.head, first.hidden_layers, first.mask_token_id, g)
    return {"chain": Drafting(target, proposer, [first.drafter, first.embed, first.head], gamma=K, max_gamma=K)}
