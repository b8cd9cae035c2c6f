"""The peer trainers' offline training input (speculators 0.9.0, SpecForge 0.2.0), written from one pass of the target.

    python -m draftsmith.train.peers write --config recipes/eagle3/smollm2-135m.yaml --out DIR

Each row (one conversation, unpacked) is run through the target once; from that one forward both peers' files are
written, each in the layout and dtypes the peer's own offline reader takes (bfloat16 features: what both read by
default, `--hidden-states-dtype bfloat16` and `model.torch_dtype: bfloat16`, and what vLLM / SGLang write):

    DIR/manifest.json                  target fingerprint, layers, dtype, data fingerprint, rows, tokens, `complete`
    DIR/speculators/                   `speculators train --data-path DIR/speculators`
        state.json, dataset_info.json, data-*.arrow    datasets.save_to_disk: input_ids, loss_mask int64 [T],
                                                        seq_len, torch format (what `speculators prepare-data` writes)
        hidden_states/hs_{i}.safetensors               token_ids int64 [T]; hidden_states [T, n + 1, H] = the n
                                                        `layers` (hidden_states indices: inputs to those layers)
                                                        and the last layer's output before the final norm (the
                                                        trainer applies the target's norm and head for its teacher)
        d2t-{N}.npy, t2d-{N}.npy                       the draft vocabulary, found there by --draft-vocab-size N
    DIR/specforge/features/data_{i:08d}.ckpt           `data.hidden_states_path`: torch.save of input_ids,
                                                        loss_mask int64 [T], aux_hidden_state [1, T, n*H] (the
                                                        same n layers), hidden_state [1, T, H] (after the final
                                                        norm: the trainer applies only the target's head)
    DIR/specforge/vocab_mapping.pt                     `model.vocab_mapping_path`: {"d2t", "t2d"}

The draft vocabulary is given (d2t[i] = ids[i] - i, t2d[ids] = True, the convention of both peers and of
draftsmith's own export). Every file is written under a temporary name and renamed into place, so it is whole or
absent; the pass resumes at the first row missing a file, and `complete` turns true once every row has both.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from draftsmith.data.core import check_free, collate, read_file, write_atomically
from draftsmith.data.hidden_cache import CacheError, target_fingerprint

FORMAT = "draftsmith-peer-inputs/1"
MANIFEST = "manifest.json"
SPECULATORS_DIR, SPECFORGE_DIR = "speculators", "specforge"
SPECFORGE_FEATURES, SPECFORGE_VOCAB = "specforge/features", "specforge/vocab_mapping.pt"


def write_json(path: Path, obj: dict) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))


def speculators_file(out: Path, i: int) -> Path:
    return out / SPECULATORS_DIR / "hidden_states" / f"hs_{i}.safetensors"


def specforge_file(out: Path, i: int) -> Path:
    return out / SPECFORGE_FEATURES / f"data_{i:08d}.ckpt"


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft ids (sorted target ids) -> d2t int64 [N] (target id = i + d2t[i]), t2d bool [V]."""
    d2t = draft_ids.long() - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids.long()] = True
    return d2t, t2d


def _save_npy(path: Path, value: torch.Tensor) -> None:
    with open(path, "wb") as fh:  # a file object: np.save would add ".npy" to a name without it
        np.save(fh, value.numpy())


def _write_dataset(rows: list[dict], out: Path) -> None:
    """speculators' pre-tokenised rows, as its prepare-data saves them; state.json is moved in last, so the dataset
    is there exactly when it is."""
    ds = datasets.Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows],
         "seq_len": [len(r["input_ids"]) for r in rows]},
        features=datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                    "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                    "seq_len": datasets.Value("int64")}))
    ds.set_format("torch")
    tmp = out / ".dataset.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    for f in sorted(tmp.iterdir(), key=lambda p: p.name == "state.json"):
        f.replace(out / f.name)
    tmp.rmdir()


def write_peer_inputs(target, rows, layers: list[int], draft_ids: torch.Tensor, final_norm: nn.Module,
                      out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, batch_size: int = 8,
                      meta: dict | None = None, log: Callable[[str], None] = print) -> dict:
    """Write both peers' offline input for `rows` under `out_dir` (layout in the module docstring).

    Args:
        target: a `models.target.Target`; its forwards run under no_grad, `batch_size` rows at a time.
        rows: unpacked rows of input_ids and loss_mask (`data.dataset.build_dataset` with data.pack=false).
        layers: the Hugging Face hidden_states indices EAGLE-3 fuses (inputs to those layers).
        draft_ids: the draft vocabulary, sorted target ids (`models.eagle.draft_vocab`).
        final_norm: the target's final norm (`models.layerskip.final_norm`): its input is the last layer's output.
        meta: what the input was written from (e.g. the recipe's data config), kept in the manifest.
    Returns the manifest. Resumes a partial pass of the same target, layers, dtype and rows; refuses a directory
    holding anything else, and a disk without room for the rows left.
    """
    out = Path(out_dir)
    rows = [{"input_ids": list(r["input_ids"]), "loss_mask": list(r["loss_mask"])} for r in rows]
    digest = hashlib.sha256()
    for r in rows:
        digest.update(torch.tensor(r["input_ids"] + r["loss_mask"], dtype=torch.int64).numpy().tobytes())
    digest.update(draft_ids.numpy().tobytes())
    H = target.config.get_text_config().hidden_size
    bytes_per_token = 2 * (len(layers) + 1) * H * dtype.itemsize + 4 * 8  # both peers' features and token columns
    manifest = {"format": FORMAT, "target": str(target.path), "target_sha256": target_fingerprint(target),
                "layers": list(layers), "dtype": str(dtype).removeprefix("torch."), "hidden_size": H,
                "draft_vocab_size": len(draft_ids), "rows": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows),
                "data_sha256": digest.hexdigest(), "meta": meta or {}, "complete": False}
    if (out / MANIFEST).is_file():
        old = read_file(out / MANIFEST, f"delete {out} and write the peers' input again")
        if {**old, "target": "", "meta": {}, "complete": False, "seconds": 0} != \
                {**manifest, "target": "", "meta": {}, "seconds": 0}:
            raise CacheError(f"{out} holds the peers' input of another target, layers, dtype or data; pass a new "
                             "--out or delete that directory")
    elif out.exists() and any(out.iterdir()):
        raise CacheError(f"{out} exists and is not the peers' input; pass a new --out or empty that directory")
    todo = [i for i in range(len(rows)) if not (speculators_file(out, i).is_file() and specforge_file(out, i).is_file())]
    need = sum(len(rows[i]["input_ids"]) for i in todo) * bytes_per_token
    check_free(out, need, f"the peers' input ({len(todo)} of {len(rows)} rows left)",
               "free space, pick another --out, or cut data.limit")
    log(f"peer inputs: {len(rows)} rows, {manifest['tokens']} tokens, ~{need / 2**30:.2f} GiB to write "
        f"({len(rows) - len(todo)} rows already written) at {out}")
    for d in (out / SPECULATORS_DIR / "hidden_states", out / SPECFORGE_FEATURES):
        d.mkdir(parents=True, exist_ok=True)
    write_json(out / MANIFEST, manifest)

    d2t, t2d = vocab_maps(draft_ids, target.config.get_text_config().vocab_size)
    n = len(draft_ids)
    if not (out / SPECULATORS_DIR / "state.json").is_file():
        _write_dataset(rows, out / SPECULATORS_DIR)
    for name, value in ((f"d2t-{n}.npy", d2t), (f"t2d-{n}.npy", t2d)):
        write_atomically(out / SPECULATORS_DIR / name, lambda tmp, v=value: _save_npy(tmp, v))
    write_atomically(out / SPECFORGE_VOCAB, lambda tmp: torch.save({"d2t": d2t, "t2d": t2d}, tmp))

    t0 = time.monotonic()
    last: list[torch.Tensor] = []  # the final norm's input, [b, s, H], one per forward
    hook = final_norm.register_forward_pre_hook(lambda module, args: last.append(args[0]))
    try:
        for lo in range(0, len(todo), batch_size):
            _write_rows(target, rows, todo[lo: lo + batch_size], layers, last, out, dtype)
            if lo // batch_size % 50 == 0:
                log(f"peer inputs: {min(lo + batch_size, len(todo))} of {len(todo)} rows "
                    f"({time.monotonic() - t0:.0f} s)")
    finally:
        hook.remove()
    manifest.update(complete=True, seconds=round(time.monotonic() - t0, 1))
    write_json(out / MANIFEST, manifest)
    return manifest


@torch.no_grad()
def _write_rows(target, rows: list[dict], which: list[int], layers: list[int], last: list[torch.Tensor], out: Path,
                dtype: torch.dtype) -> None:
    """One forward over the rows `which` (right-padded) and, per row, its speculators and SpecForge files."""
    device = target.lm_head.weight.device
    batch = {k: v.to(device) for k, v in collate([rows[i] for i in which]).items()}
    last.clear()
    tap = target.tap(batch["input_ids"], batch.get("attention_mask"), layers=tuple(layers))
    aux = torch.stack([tap.layers[i] for i in layers], 2)  # [b, s, n, H]
    for j, i in enumerate(which):
        T = len(rows[i]["input_ids"])
        ids = torch.tensor(rows[i]["input_ids"], dtype=torch.int64)  # [T]
        feats = torch.cat([aux[j, :T], last[0][j, :T, None]], 1).to("cpu", dtype)  # [T, n + 1, H]
        speculators = {"token_ids": ids, "hidden_states": feats}
        specforge = {"input_ids": ids, "loss_mask": torch.tensor(rows[i]["loss_mask"], dtype=torch.int64),
                     "aux_hidden_state": feats[None, :, :-1].flatten(2).clone(),  # [1, T, n*H]
                     "hidden_state": tap.hidden[j, None, :T].to("cpu", dtype).clone()}  # [1, T, H]
        write_atomically(speculators_file(out, i), lambda tmp, d=speculators: save_file(d, tmp))
        write_atomically(specforge_file(out, i), lambda tmp, d=specforge: torch.save(d, tmp))
