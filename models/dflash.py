"""DFlash (block-diffusion drafting; Chen et al. 2026, arXiv 2602.06036): a small drafter conditioned on target
features that fills a block of tokens in one forward; and DSpark, DFlash with a Markov head (`markov_rank` > 0).

The target's hidden states at a few layers (`aux_layers`, Hugging Face hidden_states indices) are fused and
normed once, c_j = hidden_norm(fc([a_j; b_j; ...])) for every committed position j; each draft layer
projects them to its own keys and values (k_norm and RoPE on the keys: the "context"), so the context is never
run through the layers. The block is the last committed token x_p ("anchor") followed by mask tokens, at
positions p..p+B-1; its queries attend to the context (positions < p) and to the whole block (bidirectional, one
denoising step). DFlash drafts x_{p+i} from mask slot i (i = 1..B-1; the anchor is the bonus token):

    c = hidden_norm(fc(g_{<p}))                                                    [p, H]
    x = [e(x_p); e(mask) x (B-1)] -> N x (pre-norm attention over [k(c); k(x)], MLP) -> norm -> h
    z_i = lm_head(h_i)
    L = sum_i w_i CE(softmax(target logits at p+i-1), z_i) / sum_i w_i,   w_i = decay^(i-1) = exp(-(i-1)/gamma)

(the paper's exponential slot weights, gamma = -1/ln(decay); the teacher is the target's distribution, as
speculators trains it, where SpecForge uses the data's next token). DSpark (DeepSeek; SpecForge's and
speculators' `dspark`, llama.cpp's `draft-dspark`) drafts from the anchor's slot as well, slot i drafting
x_{p+1+i} (i = 0..B-1, B tokens per forward), and adds the Markov head's bias of the previous token, the anchor
for slot 0 and then the token drafted before (the data's token in training):

    z_i = lm_head(h_i) + markov_w2(markov_w1[x_{p+i}])                 (rank-r previous-token logit bias)

Training draws `anchors` positions per row where the token and the next are trained and the token has context
in its own sequence (SpecForge's rule: a committed token the target wrote), and builds all their blocks at
once, each seeing only its own sequence's context before its anchor (the training and serving attention are the
same). The layers are Qwen3-style (per-head q_norm / k_norm) and the weights are named as vLLM's, SGLang's and
llama.cpp's DFlash loaders name them (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`, `lm_head`, `d2t`,
`markov_head.*`), so the export is a copy (models/dflash_export.py). The embedding is the target's, frozen; the
LM head is the target's, or with `draft_vocab_size` > 0 the drafter's own over the most frequent trained tokens
(EAGLE-3's draft vocabulary, `d2t`: draft id i is target id i + d2t[i]), started from the target head's rows.
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

    block_size: int = 6  # the anchor + block_size - 1 mask slots: DFlash drafts block_size - 1 tokens, DSpark block_size
    num_layers: int = 1  # draft layers
    aux_layers: list[int] = dataclasses.field(default_factory=list)  # hidden_states indices; []: DFlash's default
    mask_token_id: int = -1  # token whose (frozen) embedding fills the mask slots; -1: `mask_token`'s choice
    anchors: int = 32  # anchor positions drawn per training row
    decay: float = 0.8  # slot weight decay^(i-1) = exp(-(i-1)/gamma), the paper's gamma = -1/ln(decay) (4.5 here)
    intermediate_size: int = 0  # MLP width; 0: the target's
    draft_vocab_size: int = 0  # an own LM head over this many most frequent trained tokens; 0: the target's head
    markov_rank: int = 0  # DSpark: rank of the Markov head's previous-token bias (the anchor slot drafts too); 0: DFlash

    def __post_init__(self):
        for ok, key, why in [(self.block_size >= 2, "block_size", "must be >= 2 (the anchor and a mask slot)"),
                             (self.num_layers >= 1, "num_layers", "must be >= 1"),
                             (self.anchors >= 1, "anchors", "must be >= 1"),
                             (0 < self.decay <= 1, "decay", "must be in (0, 1]"),
                             (self.draft_vocab_size >= 0, "draft_vocab_size", "must be >= 0 (0: the target's head)"),
                             (self.markov_rank >= 0, "markov_rank", "must be >= 0 (0: DFlash, no Markov head)")]:
            if not ok:
                raise ConfigError(f"dflash.{key}: {why}")

    @property
    def drafts(self) -> int:
        """Tokens drafted per block: the mask slots, and with DSpark's Markov head the anchor's slot too."""
        return self.block_size - (0 if self.markov_rank else 1)

    def target_layers(self, num_target_layers: int) -> list[int]:
        """The fused hidden_states indices: aux_layers, or DFlash's default for a target of that depth."""
        return list(self.aux_layers) or default_aux_layers(num_target_layers, self.num_layers)


def default_aux_layers(num_target_layers: int, num_layers: int) -> list[int]:
    """DFlash's choice as hidden_states indices: one feature per draft layer, the output of layer L//2 for one,
    else spread evenly over the outputs of layers 1..L-3 (index = layer + 1)."""
    if num_layers == 1:
        return [num_target_layers // 2 + 1]
    span = num_target_layers - 4
    return sorted({round(1 + i * span / (num_layers - 1)) + 1 for i in range(num_layers)})


def mask_token(target: Target, token_id: int = -1) -> int:
    """The token whose embedding fills the mask slots: `token_id`, or with -1 the first of the tokenizer's mask, pad,
    eos, unk and other special tokens whose embedding row is not zero (a padding row, zero in a model trained with
    padding_idx as the reference target's pad is, gives every mask slot a zero query: DFlash refuses it)."""
    if token_id >= 0:
        return token_id
    tok = target.tokenizer
    found = [tok.mask_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, *tok.all_special_ids] if tok \
        else []
    rows = target.embed.weight
    for t in found:
        if t is not None and 0 <= t < rows.shape[0] and rows[t].any():
            return int(t)
    raise ConfigError("dflash.mask_token_id: the tokenizer has no special token with a trained (non-zero) embedding; "
                      "set dflash.mask_token_id to a token id whose embedding is not zero")


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


class MarkovHead(nn.Module):
    """DSpark's (vanilla) Markov head: the logit bias markov_w2(markov_w1[x]) [.., Vd] of the previous token x."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # near-zero bias at the start: training starts from DFlash
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))


class DFlashDrafter(nn.Module):
    """fc + hidden_norm over the target features, N draft layers, the final norm; the LM head over the draft vocabulary
    `draft_ids` (None: the target's head is used) and DSpark's Markov head (config.markov_rank > 0)."""

    def __init__(self, config: LlamaConfig, n_features: int, draft_ids: torch.Tensor | None = None):
        super().__init__()
        H, V = config.hidden_size, config.vocab_size
        self.config = config
        self.fc = nn.Linear(n_features * H, H, bias=False)
        self.hidden_norm = LlamaRMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(H, config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        self.lm_head = None if draft_ids is None else nn.Linear(H, draft_ids.numel(), bias=False)
        if draft_ids is not None:
            self.register_buffer("d2t", draft_ids.long() - torch.arange(draft_ids.numel()))
        rank = getattr(config, "markov_rank", 0)
        self.markov_head = MarkovHead(V, V if draft_ids is None else draft_ids.numel(), rank) if rank else None

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The target id of each draft-vocabulary row [Vd] (None: the whole target vocabulary)."""
        return None if self.lm_head is None else self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    @property
    def first_slot(self) -> int:
        """The first block slot that drafts: 1 for DFlash (the anchor is the bonus token), 0 for DSpark."""
        return 0 if self.markov_head is not None else 1

    def logits(self, h: torch.Tensor, target_head: nn.Module) -> torch.Tensor:
        """Draft logits [.., Vd] of slot outputs h [.., H] (before DSpark's Markov bias)."""
        return target_head(h) if self.lm_head is None else self.lm_head(h)

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
    """The training method: a frozen target + a DFlashDrafter (draft_ids: the draft vocabulary when
    cfg.draft_vocab_size > 0, `draft_vocab` of the training rows)."""

    def __init__(self, target: Target, cfg: DFlashConfig, mask_token_id: int = 0,
                 draft_ids: torch.Tensor | None = None):
        super().__init__()
        self.target, self.cfg = target, cfg
        text = target.config.get_text_config()
        self.layers = cfg.target_layers(text.num_hidden_layers)
        bad = [j for j in self.layers if not 1 <= j <= text.num_hidden_layers]
        if bad or len(set(self.layers)) != len(self.layers):
            raise ConfigError(f"dflash.aux_layers: {self.layers} must be distinct hidden_states indices in "
                              f"1..{text.num_hidden_layers}")
        if not 0 <= mask_token_id < text.vocab_size:
            raise ConfigError(f"dflash.mask_token_id: {mask_token_id} is not a token id of the target's vocabulary")
        if not target.embed.weight[mask_token_id].any():
            raise ConfigError(f"dflash.mask_token_id: token {mask_token_id}'s embedding is zero (a padding row), so "
                              "every mask slot would read the same zero query; set it to a token with a trained "
                              "embedding (-1 picks one)")
        if (draft_ids is None) != (cfg.draft_vocab_size == 0):
            raise ValueError("DFlash: draft_ids are given exactly when dflash.draft_vocab_size > 0")
        self.mask_token_id = mask_token_id
        config = draft_config(target.config, cfg, text.vocab_size)
        config.draft_vocab_size = text.vocab_size if draft_ids is None else draft_ids.numel()
        config.markov_rank = cfg.markov_rank
        self.drafter = DFlashDrafter(config, len(self.layers), draft_ids).to(target.lm_head.weight)
        if draft_ids is not None:  # the draft head starts as the target head's rows
            self.drafter.lm_head.weight.data.copy_(target.lm_head.weight[draft_ids.to(target.lm_head.weight.device)])

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        return self.blocks(batch)

    def blocks(self, batch: dict, anchors: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss and per-drafted-token metrics of the blocks at `anchors` [b, A] (default: cfg.anchors random
        positions per row): loss_i, acc_i (draft top-1 = target top-1) and cond_acc_i (the same, among anchors whose
        tokens < i were right and whose data continues the target's greedy path, as decoding sees them)."""
        cfg, d = self.cfg, self.drafter
        ids = batch["input_ids"]  # [b, s]
        b, s = ids.shape
        B, n = cfg.block_size, cfg.drafts  # slots per block; tokens drafted, from slot d.first_slot on
        pos = batch.get("position_ids")
        pos = torch.arange(s, device=ids.device).expand(b, s) if pos is None else pos
        seq = (pos == 0).long().cumsum(1)  # [b, s] sequence id within a packed row
        if "attention_mask" in batch:
            seq = seq.masked_fill(batch["attention_mask"] == 0, -1)
        trained = batch["loss_mask"].bool()  # [b, s]
        eligible = trained & torch.cat([trained[:, 1:], torch.zeros_like(trained[:, :1])], 1) & (pos > 0)  # [b, s]
        if anchors is None:  # without replacement; an ineligible one only where a row has too few, and it trains nothing
            anchors = torch.multinomial(eligible.float() + 1e-6, min(cfg.anchors, s))  # [b, A]
        A = anchors.shape[1]
        with torch.no_grad():
            if "aux" in batch:  # offline: the features a hidden-state cache holds (data/hidden_cache.py)
                feats, hidden = batch["aux"], batch["hidden"]  # [b, s, n*H], [b, s, H]
            else:
                tap = self.target.tap(ids, batch.get("attention_mask"), batch.get("position_ids"), tuple(self.layers))
                feats, hidden = torch.cat([tap.layers[i] for i in self.layers], -1), tap.hidden
            feats = feats.to(d.fc.weight.dtype)
            slot = torch.arange(B, device=ids.device)  # [B]
            block_ids = torch.where(slot == 0, torch.gather(ids, 1, anchors)[:, :, None], self.mask_token_id)
            emb = self.target.embed(block_ids).to(feats.dtype).flatten(1, 2)  # [b, A*B, H]
        # query (a, i) sees context j < anchor a of its sequence, and every slot of its own block
        seq_a = torch.gather(seq, 1, anchors)  # [b, A]
        ctx = (torch.arange(s, device=ids.device) < anchors[:, :, None]) & (seq[:, None, :] == seq_a[:, :, None])
        own = torch.eye(A, dtype=torch.bool, device=ids.device).repeat_interleave(B, 0).repeat_interleave(B, 1)
        visible = torch.cat([ctx.repeat_interleave(B, 1), own.expand(b, -1, -1)], -1)  # [b, A*B, s + A*B]
        q_pos = (torch.gather(pos, 1, anchors)[:, :, None] + slot).flatten(1)  # [b, A*B]
        out = d(emb, d.context(feats, pos), q_pos, additive(visible)[:, None])  # [b, A*B, H]
        out = out.view(b, A, B, -1)[:, :, d.first_slot:]  # [b, A, n, H] the drafting slots
        label_at = anchors[:, :, None] + 1 + torch.arange(n, device=ids.device)  # [b, A, n]: drafted token i is x_{a+1+i}
        inside = label_at < s
        label_at = label_at.clamp(max=s - 1)
        prev = (label_at - 1).flatten(1)  # [b, A*n]: the target's distribution there teaches token i; x there is its prev
        z = d.logits(out, self.target.lm_head).float()  # [b, A, n, Vd]
        if d.markov_head is not None:  # teacher-forced: the previous token is the data's
            z = z + d.markov_head(torch.gather(ids, 1, prev).view(b, A, n)).float()
        log_q = F.log_softmax(z, -1)  # [b, A, n, Vd]
        p, greedy = self.teacher(hidden, prev, batch.get("greedy"))  # the target's token at each drafted position
        p, greedy = p.view(b, A, n, -1), greedy.view(b, A, n)  # [b, A, n, Vd], [b, A, n]
        draft_ids = d.draft_ids
        valid = eligible.gather(1, anchors)[:, :, None] & inside \
            & (torch.gather(seq, 1, label_at.flatten(1)).view(b, A, n) == seq_a[:, :, None]) \
            & torch.gather(trained, 1, label_at.flatten(1)).view(b, A, n)
        ce = -(p * log_q).sum(-1)  # [b, A, n]
        drafted = log_q.argmax(-1) if draft_ids is None else draft_ids[log_q.argmax(-1)]  # [b, A, n] target ids
        ok = drafted == greedy
        fed = torch.gather(ids, 1, label_at.flatten(1)).view(b, A, n) == greedy  # the data continues greedily
        total, on_path, metrics = 0.0, torch.ones_like(valid[:, :, 0]), {}
        for i in range(n):
            step = masked_mean(ce[:, :, i], valid[:, :, i])
            total = total + cfg.decay ** i * step
            metrics[f"loss_{i}"] = step.item()
            metrics[f"acc_{i}"] = masked_mean(ok[:, :, i].float(), valid[:, :, i]).item()
            metrics[f"cond_acc_{i}"] = masked_mean(ok[:, :, i].float(), valid[:, :, i] & on_path).item()
            on_path = on_path & ok[:, :, i] & fed[:, :, i]
        return total / sum(cfg.decay ** i for i in range(n)), metrics

    @torch.no_grad()
    def teacher(self, hidden: torch.Tensor, at: torch.Tensor, greedy: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target at positions `at` [b, m] of hidden [b, s, H] (final post-norm) -> (p [b, m, Vd] its softmax,
        renormalised over the draft vocabulary, greedy [b, m] its argmax over the whole vocabulary). The head runs at
        those positions alone, and with a cache's `greedy` [b, s] (offline) over the draft vocabulary's rows alone."""
        x = torch.gather(hidden, 1, at[..., None].expand(-1, -1, hidden.shape[-1])).to(self.target.lm_head.weight.dtype)
        rows = self.drafter.draft_ids
        if greedy is not None and rows is not None:
            return F.softmax(self.target.logits(x, rows).float(), -1), torch.gather(greedy, 1, at).long()
        logits = self.target.logits(x).float()  # [b, m, V]
        return F.softmax(logits if rows is None else logits[..., rows], -1), logits.argmax(-1)

    def proposer(self, target=None, gamma: int | None = None, **unused) -> DFlashProposer:
        return DFlashProposer(self.drafter, self.target.embed, self.target.lm_head, self.layers, self.mask_token_id,
                              gamma or self.cfg.drafts)

    def extra_state(self) -> dict | None:
        ids = self.drafter.draft_ids
        return None if ids is None else {"draft_ids": ids.tolist()}

    def load_extra_state(self, state: dict) -> None:
        ids = self.drafter.draft_ids
        if ids is None or state["draft_ids"] != ids.tolist():
            raise ValueError("the checkpoint's draft vocabulary differs from the one built from this data; "
                             "resume with the same data and dflash.draft_vocab_size")

    def save_pretrained(self, out: str | Path) -> None:
        """drafter.json (method, layers, block size, mask token, target), config.json (with draft_vocab_size and
        markov_rank), dflash.safetensors (with lm_head and d2t for an own draft vocabulary, markov_head for DSpark)."""
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
    state = read_file(path / WEIGHTS_FILE, REDO_DRAFTER)
    draft_ids = state["d2t"] + torch.arange(state["d2t"].numel()) if "d2t" in state else None
    drafter = DFlashDrafter(config, len(meta["aux_layers"]), draft_ids)
    drafter.load_state_dict(state)
    return drafter.to(device=device, dtype=dtype).eval(), meta


def load_proposer(path: str | Path, target, gamma: int | None = None, **unused) -> DFlashProposer:
    """The plug-in's proposer loader (models/registry.py) for a DFlash (or DSpark) drafter dir."""
    target = target if isinstance(target, Target) else Target(target, None, "")
    drafter, meta = load_drafter(path, target.lm_head.weight.device, target.lm_head.weight.dtype)
    return DFlashProposer(drafter, target.embed, target.lm_head, meta["aux_layers"], meta["mask_token_id"],
                          gamma or meta["block_size"] - drafter.first_slot)


def load_dflash(path: str | Path, target: Target | None = None) -> DFlash:
    """A trained DFlash method from a drafter dir (its target loaded from drafter.json unless given)."""
    drafter, meta = load_drafter(path)
    target = target or load_target(meta["target"])
    draft_ids = drafter.draft_ids
    cfg = DFlashConfig(block_size=meta["block_size"], num_layers=drafter.config.num_hidden_layers,
                       aux_layers=meta["aux_layers"], intermediate_size=drafter.config.intermediate_size,
                       draft_vocab_size=0 if draft_ids is None else draft_ids.numel(),
                       markov_rank=getattr(drafter.config, "markov_rank", 0))
    method = DFlash(target, cfg, meta["mask_token_id"], draft_ids)
    method.drafter.load_state_dict(drafter.state_dict())
    return method


class DFlashProposer(Proposer):
    """Block drafting on the shared verifier: one drafter forward per step drafts gamma tokens.

    After each verification the target features of the newly committed positions are projected into
    every layer's context keys and values (kept, like a KV cache; committed positions never roll back).
    Then the block [bonus, mask...] at positions t-1.. attends to the context and to itself, and each drafting
    slot's output, through the LM head (and DSpark's Markov bias of the token drafted before it, the bonus for the
    first), drafts one token from its own distribution (q per node, zero outside the draft vocabulary), which keeps
    exact verification exact.
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
        d, first, t = self.drafter, self.drafter.first_slot, ids.numel()
        dtype = d.fc.weight.dtype
        context = self.context or [(torch.zeros(1, layer.self_attn.kv_heads, 0, layer.self_attn.d, dtype=dtype,
                                                device=ids.device),) * 2 for layer in d.layers]
        n = first + self.gamma
        block = torch.cat([ids[-1:], ids.new_full((n - 1,), self.mask_token_id)])  # [n]: bonus, then mask slots
        mask = torch.zeros(1, 1, n, context[0][0].shape[2] + n, device=ids.device)  # everything visible
        out = d(self.embed(block[None]).to(dtype), context, torch.arange(t - 1, t - 1 + n, device=ids.device)[None],
                mask)
        logits = d.logits(out[0, first:], self.head).float()  # [gamma, Vd]
        draft_ids = d.draft_ids
        prev, drafted, qs = ids[-1:], [], []
        for row in logits:
            if d.markov_head is not None:
                row = row + d.markov_head(prev)[0].float()
            i = draw(row, sampling, qs)
            drafted.append(i if draft_ids is None else int(draft_ids[i]))
            prev = ids.new_tensor(drafted[-1:])
        q = None
        if qs:
            q = torch.stack(qs)  # [gamma, Vd]
            if draft_ids is not None:  # over the target's vocabulary, zero outside the draft's
                q = q.new_zeros(len(qs), d.config.vocab_size).index_copy_(1, draft_ids, q)
        return DraftTree.chain(torch.tensor(drafted, device=ids.device), q)


def variants(drafter_dir: Path, target: nn.Module) -> dict[str, Drafting]:
    """The leaderboard's DFlash chain, up to the tokens a block was trained to draft (block_size - 1; DSpark's
    block_size)."""
    first = load_proposer(drafter_dir, target)
    K = first.gamma

    def proposer(g: int) -> DFlashProposer:
        return DFlashProposer(first.drafter, first.embed, first.head, first.hidden_layers, first.mask_token_id, g)
    return {"chain": Drafting(target, proposer, [first.drafter, first.embed, first.head], gamma=K, max_gamma=K)}
