"""EAGLE-1 (Li et al. 2024, arXiv 2401.15077) and EAGLE-3 (Li et al. 2025, arXiv 2503.01840) drafters.

One Llama-style decoder layer ("midlayer") autoregresses in the target's feature space, with the
target's own (frozen) token embedding; both versions share the layer, the training-time-test loop
and the proposer, and differ in what goes in and comes out:

    EAGLE-1:  x_t = fc([e(x_{t+1}); f_t])  -> layer (no input norm) -> f^_{t+1}; logits = target lm_head(f^)
              L = w_feat * SmoothL1(f^_{t+1}, f_{t+1}) + w_tok * CE(softmax(lm_head(f_{t+1})), lm_head(f^))
    EAGLE-3:  g_t = fc([a_t; b_t; c_t])  (target hidden states of three layers, 3H -> H, no bias;
              EAGLE 3.1's fc_norm: fc([n_a(a_t); n_b(b_t); n_c(c_t)]), one RMSNorm per layer)
              layer input [input_layernorm(e(x_{t+1})); hidden_norm(g_t)] (2H), residual g_t
              -> h_{t+1}; logits = lm_head(norm(h)) over a pruned draft vocabulary; lm_head starts from the
              target's head rows picked by t2d (frozen or trained; speculators), or random (SpecForge)
              L = sum_k decay^k D(p_k, q_k), p_k = softmax(target logits restricted to the draft vocab),
              D = forward KL (soft CE; EAGLE), total variation (1 - TV(p, q) is the T=1 acceptance
              probability, DistillSpec) or LK's negative log-acceptance -log sum min(p, q) (Samarin et al. 2026,
              arXiv 2602.23881: TV's gradient scaled by 1/acceptance); optionally
              + w_feat * SmoothL1(norm(h_{t+1+k}), f_{t+1+k}), EAGLE-1's feature regression on what the head
              reads (eagle.feature_weight, 0 by default for EAGLE-3);
              optionally + w_in * SmoothL1(h_{t+1+k}, sg(g'_{t+1+k})), g' = fc(..) the fused input step 0 reads:
              each output regressed on what step 0 reads one position on, the input the next step takes it for
              (eagle.input_weight; EAGLE-1's regression carried into EAGLE-3's own input space)

f_t is the target's last hidden state after its final norm (the tap's `hidden`); the layers of g_t and
their convention: models/eagle_config.py; the drafter's layers, their weight names and loading: models/eagle_drafter.py;
its proposer: models/eagle_proposer.py.

Training-time test (EAGLE-3; also available to EAGLE-1): step k = 0..K-1 feeds the layer its own
step-(k-1) output in place of the target feature, with the ground-truth token x_{t+1+k}, at rope
position pos_t + k; its queries see the step-0 keys causally and the keys of steps 1..k at the same
position only (what the drafter's KV cache holds while drafting token k+1 at serving time). K may
grow from 1 to ttt_steps over the first `ttt_ramp` of the run (Loop.progress).

Cost: in training the draft head and loss run only at the positions the loss trains, gathered (a prompt's
are not), and the teacher's full-vocabulary head only where a step learns the next token; the forward KL is one fused
function (`ForwardKL`). Step 0's layer runs at every position, as attention needs; a later step's query reads the
step-0 keys and its own position's later steps alone, so steps 1..K-1 run only at the positions one of them trains
(or, with `ttt_fraction`, at a random share of those, drawn per row and batch), and score the later steps' keys as
one dot product each (`ttt_attention`: eager attention, which on CPU in bf16 is also faster than SDPA's kernel).

Memory: the target's full-vocabulary logits exist only for `logit_chunk` positions at a time (kept:
their argmax and the draft-vocabulary softmax), and the draft head and loss run per chunk of `loss_chunk`
positions (default: the same) under activation checkpointing, so peak memory grows with the draft vocabulary,
not the target's; `loss_chunk` 0 keeps a small draft vocabulary's logits instead of recomputing them. Attention
scores [b, heads, m, s] exist per unrolled step (eager attention; no fused kernel takes the later steps' keys).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.checkpoint import checkpoint

from draftsmith.data.core import ConfigError, write_drafter_meta
from draftsmith.models.eagle_config import EagleConfig, aux_layers, draft_config
from draftsmith.models.eagle_drafter import CONFIG_FILE, WEIGHTS_FILE, EagleDrafter, TTTPast, load_drafter
from draftsmith.models.eagle_proposer import EagleProposer
from draftsmith.models.lm import masked_mean
from draftsmith.models.method import MethodBase
from draftsmith.models.target import Target, load_target, target_fields


def draft_vocab(dataset, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent loss-masked tokens of `dataset` (rows with input_ids, loss_mask), sorted by id.

    Ties and unused slots are filled by the lowest ids, so the result is deterministic.
    """
    size = min(size, vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(len(dataset)):
        row = dataset[i]
        ids = torch.as_tensor(row["input_ids"])
        counts += torch.bincount(ids[torch.as_tensor(row["loss_mask"]).bool()], minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(order[:size]))


class ForwardKL(torch.autograd.Function):
    """(-sum_v p_v log q_v [..], q [.., V]) with q = softmax(z), z [.., V] the draft logits, p [.., V] the teacher.

    The same value and gradient, dz = (q sum_v p_v - p) per unit of loss, as log_softmax + sum under autograd, which
    keeps log q and recomputes its exp in the backward: here one [.., V] buffer, q, is made and kept, and is also
    what the acceptance metric reads (on CPU, passes over fresh [.., V] buffers dominate an EAGLE-3 step)."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lse = z.logsumexp(-1, keepdim=True)  # [.., 1]
        q = (z - lse).exp_()  # [.., V]
        p_sum = p.sum(-1, keepdim=True)  # [.., 1] (1, or 0 at an untrained row)
        ctx.save_for_backward(q, p, p_sum)
        ctx.mark_non_differentiable(q)
        return (lse * p_sum).squeeze(-1) - (p * z).sum(-1), q

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor, None]:
        q, p, p_sum = ctx.saved_tensors
        return (q * p_sum).sub_(p).mul_(grad[..., None]), None


def take(x: torch.Tensor, t: torch.Tensor, n: int = 0, fill=0) -> torch.Tensor:
    """x [b, s, ...] at positions t + n, t [b, m] -> [b, m, ...]; past the end: fill."""
    i = (t + n).view(*t.shape, *[1] * (x.dim() - 2))  # [b, m, 1...]
    got = x.gather(1, i.clamp(max=x.shape[1] - 1).expand(*t.shape, *x.shape[2:]))
    return got.masked_fill(i >= x.shape[1], fill)


def later_positions(needed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """needed [b, s] (a later unrolled step has a token to learn there) -> (t [b, m] the positions the steps after
    step 0 run at, keep [b, m] which of them train): each row's needed positions in order, padded to the longest
    row's count with positions that train nothing."""
    order = (~needed).long().argsort(dim=1, stable=True)  # [b, s] needed positions first
    t = order[:, :max(int(needed.sum(1).max()), 1)]  # [b, m]
    return t, needed.gather(1, t)


def row_uniform(ids: torch.Tensor, real: torch.Tensor | None, salt: str) -> torch.Tensor:
    """ids [b, s], real [b, s] (its non-padding positions; None: all) -> u [b, s] uniform in [0, 1), each row's from a
    generator seeded by its real tokens and `salt` alone: a row draws the same in whichever process, micro-batch or
    padding it lands."""
    u = torch.ones(ids.shape)  # [b, s] padding: never drawn
    for r, row in enumerate(ids.cpu() if real is None else [x[m.bool()] for x, m in zip(ids.cpu(), real.cpu(), strict=True)]):
        seed = hashlib.blake2b(row.numpy().tobytes() + salt.encode(), digest_size=8).digest()
        u[r, :len(row)] = torch.rand(len(row), generator=torch.Generator().manual_seed(int.from_bytes(seed, "little")))
    return u.to(ids.device)


class Eagle(MethodBase):
    """The training method: a frozen target (online) or its cached features (offline) + an EagleDrafter."""

    def __init__(self, target: Target, cfg: EagleConfig, draft_ids: torch.Tensor | None = None):
        super().__init__()
        self.target, self.cfg = target, cfg
        L = target.config.get_text_config().num_hidden_layers
        V = target.config.get_text_config().vocab_size
        self.layers = aux_layers(cfg, L)
        if self.layers:
            bad = [i for i in self.layers if not 0 <= i <= L]
            if bad:
                raise ConfigError(f"eagle.aux_layers: {bad} out of range for a {L}-layer target; use 0..{L} "
                                  f"(or -{L + 1}..-1 from the end)")
            if len(set(self.layers)) != len(self.layers):
                raise ConfigError(f"eagle.aux_layers: {self.layers} repeats a layer; list distinct layers")
        draft_ids = torch.arange(V) if draft_ids is None or cfg.version == 1 else draft_ids
        config = draft_config(target.config, cfg, draft_ids.numel())
        self.drafter = EagleDrafter(config, cfg.version, draft_ids, max(1, len(self.layers))).to(target.lm_head.weight)
        if cfg.version == 3 and cfg.head_init != "random":  # the target's head rows of the draft vocabulary
            rows = target.lm_head.weight.detach()[self.drafter.draft_ids].clone()  # [Vd, H]
            head = self.drafter.lm_head
            if cfg.head_init == "frozen":  # a buffer: no gradient, and whole on every rank under FSDP2 for exports
                del head.weight
                head.register_buffer("weight", rows)
            else:
                head.weight.data.copy_(rows)

    # ---- features ----------------------------------------------------------------------------------

    def features(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(f [b, s, H] final post-norm hidden states, g [b, s, n*H] step-0 input features), from the batch's
        cached `hidden` / `aux` (offline) or a forward of the frozen target (online)."""
        if "hidden" in batch:
            f = batch["hidden"].float()
            return f, (batch["aux"].float() if self.cfg.version == 3 else f)
        with torch.no_grad():
            tap = self.target.tap(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"),
                                  tuple(self.layers))
        f = tap.hidden.float()
        return f, (torch.cat([tap.layers[i] for i in self.layers], -1).float() if self.layers else f)

    # ---- training-time test --------------------------------------------------------------------------

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        return self.ttt(batch)

    def ttt_length(self) -> int:
        """Steps to unroll now: eagle.ttt_steps, or with eagle.ttt_ramp, 1 growing linearly to ttt_steps by that
        fraction of the run."""
        K, ramp = self.cfg.ttt_steps, self.cfg.ttt_ramp
        return min(K, 1 + int(self.progress() / ramp * (K - 1))) if ramp else K

    def chunks(self, *xs: torch.Tensor, n: int | None = None) -> zip:
        """The tensors [b, s, ...] cut into n (default eagle.logit_chunk; 0: all) positions along the sequence."""
        n = (self.cfg.logit_chunk if n is None else n) or xs[0].shape[1]
        return zip(*(x.split(n, 1) for x in xs), strict=True)

    @torch.no_grad()
    def teacher(self, f: torch.Tensor, cached: tuple[torch.Tensor, torch.Tensor] | None = None, batch: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """f [b, s, H] -> (p [b, s, Vd] the target's softmax renormalised over the draft vocabulary, mass [b, s] the
        target's probability on the draft vocabulary, greedy [b, s] its argmax over the whole vocabulary);
        full-vocabulary logits [b, batch x logit_chunk, V] exist for one chunk at a time (f [1, n, H] gathered from a
        batch of `batch` rows: the peak of that batch's chunk). With `cached` (EAGLE-3 from a hidden-state cache:
        log_z, greedy [b, s], the whole vocabulary's log-normaliser and argmax) the head runs over a pruned draft
        vocabulary's rows only. A draft vocabulary that is the whole vocabulary (EAGLE-1's) has mass 1."""
        pruned = self.cfg.version == 3 and self.drafter.d2t.numel() < self.drafter.t2d.numel()
        rows = self.drafter.draft_ids if pruned and cached is not None else None
        ps, masses, greedy = [], [], []
        for x, *known in self.chunks(f, *(cached if rows is not None else ()), n=batch * self.cfg.logit_chunk):
            logits = self.target.logits(x.to(self.target.lm_head.weight.dtype), rows).float()  # [b, c, V or Vd]
            if rows is None:
                known = [logits.logsumexp(-1) if pruned else None, logits.argmax(-1)]  # [b, c] each
                logits = logits[..., self.drafter.draft_ids] if pruned else logits  # [b, c, Vd]
            log_z, top = known
            greedy.append(top.long())
            masses.append((logits.logsumexp(-1) - log_z).exp().clamp(max=1.0) if pruned
                          else torch.ones_like(top, dtype=logits.dtype))
            ps.append(F.softmax(logits, -1))
        return torch.cat(ps, 1), torch.cat(masses, 1), torch.cat(greedy, 1)

    def divergence(self, out: torch.Tensor, p: torch.Tensor, mass: torch.Tensor, measure: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """out [b, c, H], p [b, c, Vd], mass [b, c] -> (D(p, q) [b, c], the draft's top-1 [b, c] in draft ids,
        accept [b, c]; both None unless `measure`), q the drafter's softmax. kl: -sum p log q (forward KL up to p's
        entropy); tv: 1/2 sum |p - q| = 1 - sum min(p, q); lk: -log accept. accept = sum_v min(mass p_v, q_v): the probability that exact
        verification at temperature 1 accepts a token drawn from q, against the target's whole-vocabulary
        distribution."""
        z = self.drafter.logits(out, self.target.lm_head).float()  # [b, c, Vd]
        if self.cfg.loss == "kl":
            d, q = ForwardKL.apply(z, p)  # [b, c], [b, c, Vd]
        else:
            q = F.softmax(z, -1)
        if measure or self.cfg.loss == "lk":
            accept = torch.minimum(p * mass[..., None], q if self.cfg.loss == "lk" else q.detach()).sum(-1)  # [b, c]
        if self.cfg.loss == "tv":
            d = 0.5 * (p - q).abs().sum(-1)
        elif self.cfg.loss == "lk":
            d = -accept.clamp_min(1e-6).log()
        return (d, z.argmax(-1), accept.detach()) if measure else (d, None, None)

    def chunked_divergence(self, out: torch.Tensor, p: torch.Tensor, mass: torch.Tensor, measure: bool
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`divergence` over chunks of eagle.loss_chunk positions, each recomputed in the backward (activation
        checkpointing), so that draft logits [b, chunk, Vd] exist for one chunk at a time; with 0, at once and kept."""
        n = self.cfg.loss_chunk
        recompute = n and torch.is_grad_enabled()
        parts = [checkpoint(self.divergence, o, q, m, measure, use_reentrant=False) if recompute
                 else self.divergence(o, q, m, measure) for o, q, m in self.chunks(out, p, mass, n=n)]
        return tuple(None if x[0] is None else torch.cat(x, 1) for x in zip(*parts, strict=True))

    def ttt(self, batch: dict, steps: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The training-time test unrolled `steps` times (default: `ttt_length()` in training, eagle.ttt_steps in
        evaluation, which may unroll further than training did); returns the weighted loss and per-step metrics:
        loss_k, acc_k (draft top-1 = target top-1) and cond_acc_k, the acceptance decoding sees: the
        same, among positions whose steps 0..k-1 were all accepted and fed the target's greedy tokens; and
        accept_k, the expected acceptance at temperature 1 of step k along the row (`divergence`). In training the
        head and the loss run at the trained positions alone (about half of a chat batch's), and the metrics count
        those; in evaluation, every position. Training steps that are not `measuring` return loss_k alone (the
        acceptance metrics cost a tenth of a 5-step EAGLE-3 step on CPU)."""
        cfg, d = self.cfg, self.drafter
        ids = batch["input_ids"]  # [b, s]
        b, s = ids.shape
        pos = batch.get("position_ids")
        pos = torch.arange(s, device=ids.device).expand(b, s) if pos is None else pos
        seq = (pos == 0).long().cumsum(1)  # [b, s] sequence id within a packed row
        if "attention_mask" in batch:
            seq = seq.masked_fill(batch["attention_mask"] == 0, -1)
        f, g = self.features(batch)  # [b, s, H], [b, s, n*H]
        K = steps or (self.ttt_length() if self.training else cfg.ttt_steps)
        measure = self.measuring or not self.training
        t = torch.arange(s, device=ids.device).expand(b, s)  # [b, m] the positions this step's queries run at
        keep = torch.ones_like(ids, dtype=torch.bool)  # [b, m] those of them that train

        def valid_at(t: torch.Tensor, j: int) -> torch.Tensor:
            """[b, m]: position t's step j - 1 has a target token to learn, x_{t+j+1} in t's sequence and loss-masked."""
            return (take(seq, t, j + 1, -2) == take(seq, t)) & take(batch["loss_mask"], t, j + 1).bool()
        # the teacher runs where a step learns the next token (in training; everywhere in evaluation); row[u] is
        # position u's row of its outputs
        first = valid_at(t, 0)  # [b, s] the positions whose step 0 trains
        need = first if self.training else torch.ones_like(keep)  # [b, s]
        row = need.flatten().cumsum(0).view(b, s) - 1  # [b, s]
        cached = (batch["log_z"][need][None], batch["greedy"][need][None]) if "log_z" in batch else None  # offline
        target_p, mass, top_n = (x[0] for x in self.teacher(f[need][None], cached, b))  # [n, Vd], [n], [n]
        greedy = torch.zeros_like(ids).masked_scatter(need, top_n)  # [b, s] the target's next token
        with torch.no_grad():
            emb = self.target.embed(ids).float()  # [b, s, H]
        if self.training and cfg.feature_noise:
            g = g + (torch.rand_like(g) - 0.5) * cfg.feature_noise * 512 / s
        same = (seq[:, :, None] == seq[:, None, :]) & (seq[:, :, None] >= 0)  # [b, s, s]
        causal = same & torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        past = [TTTPast() for _ in range(cfg.num_layers)]  # per layer, each step's keys and values
        h, on_path, total = g, torch.ones_like(ids, dtype=torch.bool), 0.0
        if cfg.input_weight or cfg.fuse_weight:  # step 0 reads fc(g), which the regressions below read too
            h = d.fuse(g)  # [b, s, H]
            fused = h.detach()
        if cfg.fuse_weight:  # step 0's input through the norm, against the feature the later steps' inputs approach
            l1 = F.smooth_l1_loss(d.norm(h), f, reduction="none").mean(-1)  # [b, s]
            total = total + cfg.fuse_weight * masked_mean(l1, first)  # 0 on a batch with nothing to train
        metrics: dict[str, float] = {}
        for k in range(K):
            j = 1 + k  # query t reads token x_{t+j} and is trained on the target's distribution at t+j
            if k == 1 and self.training:  # later steps run where one trains (a query reads step-0 keys and its own)
                needed = torch.stack([valid_at(t, i) for i in range(2, K + 1)]).any(0)  # [b, s]
                if cfg.ttt_fraction < 1:  # an unbiased sample of them: each later step's mean loss is unchanged
                    u = row_uniform(ids, batch.get("attention_mask"), f"{self.progress():.12f}")  # [b, s]
                    needed = needed & (u < cfg.ttt_fraction)
                t, keep = later_positions(needed)
                h, on_path = take(h, t), take(on_path, t)  # [b, m, H], [b, m]
            m = t.shape[1]
            visible = causal.gather(1, t[..., None].expand(b, m, s))  # [b, m, s] step 0's keys each query reads
            out = d(*self.step_input(k, take(emb, t, j), h), take(pos, t) + k, visible, past)  # [b, m, H]
            valid = valid_at(t, j) & keep  # [b, m]
            target_next = take(greedy, t, j)  # [b, m]
            trained = valid & d.t2d[target_next]  # a target argmax outside the draft vocabulary is not trained
            rows = trained if self.training else torch.ones_like(valid)  # [b, m] where the head and loss run
            bi, ti = rows.nonzero(as_tuple=True)  # [N] each
            tj = (t[bi, ti] + j).clamp(max=s - 1)  # [N] past the end: never trained
            div, top, accept = (x if x is None else x[0] for x in self.chunked_divergence(
                out[bi, ti][None], target_p[row[bi, tj]][None], mass[row[bi, tj]][None], measure))  # [N] each
            step_loss = masked_mean(div, trained[bi, ti]) * (cfg.token_weight if cfg.version == 1 else 1.0)
            if cfg.feature_weight:  # the features the head reads, against the target's own (EAGLE-1's regression)
                read = out if cfg.version == 1 else d.norm(out)  # [b, m, H]
                l1 = F.smooth_l1_loss(read, take(f, t, j), reduction="none").mean(-1)  # [b, m]
                step_loss = step_loss + cfg.feature_weight * masked_mean(l1, valid)
            if cfg.input_weight:  # the output step k + 1 reads, against what step 0 reads at t + j
                l1 = F.smooth_l1_loss(out[bi, ti], fused[bi, tj], reduction="none").mean(-1)  # [N]
                step_loss = step_loss + cfg.input_weight * masked_mean(l1, trained[bi, ti])
            total = total + cfg.decay ** k * step_loss
            metrics[f"loss_{k}"] = step_loss.item()
            if measure:  # the acceptance metrics read the draft logits
                ok = torch.zeros_like(valid).index_put((bi, ti), d.draft_ids[top] == target_next[bi, ti])  # [b, m]
                counted = valid & rows  # [b, m] the positions the metrics count
                metrics[f"acc_{k}"] = masked_mean(ok.float(), counted).item()
                metrics[f"cond_acc_{k}"] = masked_mean(ok.float(), counted & on_path).item()
                metrics[f"accept_{k}"] = masked_mean(accept, counted[bi, ti]).item()
                on_path = on_path & ok & (take(ids, t, j + 1) == target_next)  # next step fed what decoding would feed
            h = out
        return total, metrics

    def step_input(self, k: int, emb: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What TTT step k feeds the drafter: the embedding of x_{t+1+k} [b, s, H] and, after step 0, the drafter's
        own previous output h [b, s, H] (P-EAGLE feeds placeholders instead, models/p_eagle.py)."""
        return emb, h

    # ---- decoding and checkpoints ---------------------------------------------------------------------

    def proposer(self, target=None, **kwargs) -> EagleProposer:
        """A proposer over the current drafter (chain by default; mode='tree' for EAGLE-2 dynamic trees)."""
        return EagleProposer(self.drafter, self.target.embed, self.target.lm_head, self.layers, **kwargs)

    def extra_state(self) -> dict:
        return {"draft_ids": self.drafter.draft_ids.tolist()}

    def load_extra_state(self, state: dict) -> None:
        if state["draft_ids"] != self.drafter.draft_ids.tolist():
            raise ValueError("the checkpoint's draft vocabulary differs from the one built from this data; "
                             "resume with the same data and eagle.draft_vocab_size")

    def save_pretrained(self, out: str | Path) -> None:
        """drafter.json (method, version, layers, target), config.json (the layer's Llama config) and
        eagle.safetensors (SGLang names; no embedding, the target's is used)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous() for k, v in self.drafter.state_dict().items()}, out / WEIGHTS_FILE)
        (out / CONFIG_FILE).write_text(self.drafter.config.to_json_string())
        write_drafter_meta(out, "eagle", version=self.cfg.version, aux_layers=self.layers,
                           aux_layers_convention="hidden_states index: the input to decoder layer i (EAGLE repository)",
                           ttt_steps=self.cfg.ttt_steps,
                           **target_fields({"target": self.target.path, "target_as_given": self.target.given}))


def load_eagle(path: str | Path, target: Target | None = None) -> Eagle:
    """A trained Eagle method from a drafter dir (its target loaded from drafter.json unless given)."""
    drafter, meta = load_drafter(path)
    target = target or load_target(meta["target"])
    cfg = EagleConfig(version=meta["version"], aux_layers=meta["aux_layers"], ttt_steps=meta["ttt_steps"],
                      draft_vocab_size=drafter.d2t.numel(), intermediate_size=drafter.config.intermediate_size,
                      num_key_value_heads=drafter.config.num_key_value_heads,
                      fc_norm=getattr(drafter.config, "fc_norm", False),
                      num_layers=drafter.config.num_hidden_layers)
    method = Eagle(target, cfg, drafter.draft_ids)
    method.drafter.load_state_dict(drafter.state_dict())
    return method
