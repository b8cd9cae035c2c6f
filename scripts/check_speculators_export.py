"""Check an EAGLE-3 export where speculators loads it: the same drafts, step 0, from speculators' own model.

    python scripts/check_speculators_export.py prepare RUN OUT     # the project's venv: export + reference drafts
    /path/to/speculators-venv/bin/python scripts/check_speculators_export.py check OUT    # speculators' venv

`prepare` exports RUN (a drafter dir) in the speculators format to OUT/export and records, for one random 40-token row
of the target, the drafter's fused features, step-0 output hidden states and step-0 draft tokens (OUT/ref.pt). `check`
imports nothing from draftsmith: it builds speculators' Eagle3DraftModel from OUT/export (eager attention), gives it
the verifier's embedding (speculators' own verifier loading did not, with speculators 0.9.0; vLLM shares the target's),
runs its forward for one step on the same row and prints the share of positions drafting the same token and the
largest hidden-state difference. Its later teacher-forced steps are not compared: speculators' training loop, not what
vLLM serves, differed from the drafter's for one-layer exports as much as for multi-layer ones.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def prepare(run: Path, out: Path) -> None:
    from draftsmith.models import registry
    from draftsmith.models.eagle import load_eagle
    from draftsmith.models.eagle_drafter import additive

    m = load_eagle(run).eval()
    registry.export(run, "speculators", out / "export")
    ids = torch.randint(0, m.target.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, g = m.features({"input_ids": ids})  # [1, s, 3H] in the drafter's layer order
        emb = m.target.embed(ids[:, 1:])  # [1, s-1, H] step 0 at t reads token t+1
        n = emb.shape[1]
        causal = additive(torch.ones(n, n, dtype=torch.bool).tril())[None, None]  # [1, 1, s-1, s-1]
        h = m.drafter(emb, g[:, :-1], torch.arange(n)[None], causal, None)  # [1, s-1, H]
        tokens = m.drafter.logits(h, m.target.lm_head).argmax(-1)  # [1, s-1] draft ids
    torch.save({"ids": ids, "g": g, "hidden": h, "tokens": tokens, "layers": m.layers}, out / "ref.pt")
    print(f"exported {out / 'export'}: {m.drafter.config.num_hidden_layers} layer(s), aux layers {m.layers}")


def check(out: Path) -> None:
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    ref = torch.load(out / "ref.pt")
    config = Eagle3SpeculatorConfig.from_pretrained(out / "export")
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(out / "export", config=config).eval()
    model.load_verifier_weights()
    verifier = config.speculators_config.verifier.name_or_path
    weights = load_file(Path(verifier) / "model.safetensors")
    model.embed_tokens.weight.data.copy_(weights["model.embed_tokens.weight"])
    order = sorted(range(3), key=ref["layers"].__getitem__)  # the export serves the layers in increasing order
    g = torch.cat([ref["g"].chunk(3, -1)[i] for i in order], -1)[:, :-1]  # [1, s-1, 3H]
    ids = ref["ids"][:, 1:]  # [1, s-1]: position t reads token t+1
    hidden = []
    model.layers[-1].register_forward_hook(lambda mod, args, o: hidden.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        drafts = model(hidden_states=g, input_ids=ids, document_ids=torch.zeros_like(ids),
                       position_ids=torch.arange(ids.shape[1])[None], ttt_steps=1)
    same = (drafts[0] == ref["tokens"]).float().mean().item()
    diff = (hidden[0] - ref["hidden"]).abs().max().item()
    print(f"speculators: {len(model.layers)} layer(s); step 0 drafts the same token at {same:.3f} of "
          f"{ids.shape[1]} positions; largest hidden-state difference {diff:.2e}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "check":
        check(Path(sys.argv[2]))
    elif sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
    else:
        sys.exit("usage: check_speculators_export.py prepare RUN OUT | check OUT")
