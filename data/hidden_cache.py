"""Offline hidden states for EAGLE: the frozen target's features written once, read back by training.

    draftsmith cache --config recipes/eagle3/tiny-code.yaml --out DIR

Only what the method reads is stored: `hidden`, the final post-norm hidden state [T, H] (EAGLE-1's
feature and, through the target's LM head, the soft targets of both versions: logits are never
stored), and for EAGLE-3 `aux`, the chosen `hidden_states[i]` concatenated in `layers` order
[T, n*H], with the two numbers its teacher needs from the whole vocabulary: `log_z` [T] (float32), the
log-normaliser of the target's logits, and `greedy` [T] (int32), their argmax. With them training runs the
target's head over the draft vocabulary's rows alone (4,096 of SmolLM2's 49,152). Per token that is
(1 + n) * H * bytes(dtype), plus 9 bytes of token columns (and 8 of teacher columns with `aux`).

Layout of DIR:
    manifest.json            target path and fingerprint (config, sampled weights), layers, dtype,
                             data fingerprint, the shard plan, and `complete` (false until the
                             last shard is in place)
    shard-00000.safetensors  a run of consecutive rows, concatenated along tokens:
                             input_ids [T] int32, loss_mask [T] int8, position_ids [T] int32,
                             offsets [r + 1] int64 (row k is tokens offsets[k]:offsets[k+1]),
                             hidden [T, H], aux [T, n*H], log_z [T], greedy [T]

Each shard is written under a temporary name and renamed into place, so a shard file is whole or
absent; an interrupted run resumes at the first missing shard. The reader opens shards lazily and
memory-mapped, and reads a row's features only when `row["hidden"]` / `row["aux"]` is asked for, so
a pass over the token columns (e.g. building the draft vocabulary) never touches the features.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.data.core import collate, open_safetensors, read_file, safetensors_damage, write_atomically

MANIFEST = "manifest.json"
FORMAT = "draftsmith-hidden-cache/1"
TOKEN_BYTES = 4 + 1 + 4  # input_ids int32, loss_mask int8, position_ids int32
DISK_MARGIN = 1.05, 256 << 20  # refuse unless free space >= estimate * 1.05 + 256 MiB
TOKEN_KEYS = ("input_ids", "loss_mask", "position_ids")
TEACHER_KEYS = ("log_z", "greedy")  # written with aux (EAGLE-3): float32 and int32 per token
TEACHER_BYTES = 4 + 4
LOGIT_CHUNK = 64  # positions per chunk of full-vocabulary logits while writing
SHARD_BYTES = 512 << 20  # default shard size: bounds host memory while writing and the work an interruption loses


class CacheError(ValueError):
    """A hidden-state cache that cannot be written or does not fit the target / method reading it."""


def target_fingerprint(target) -> str:
    """sha256 of the target's config (architecture, sizes, dtype) and of 64 evenly spaced values of every
    weight tensor: what decides its hidden states, cheap even for a large model."""
    config = {k: v for k, v in target.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, p in target.model.named_parameters():
        sample = p.detach().reshape(-1)[:: max(1, p.numel() // 64)][:64].contiguous().cpu()  # [<= 64]
        h.update(name.encode() + sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rows(dataset) -> Iterator[dict[str, list[int]]]:
    """The token columns of each row; position_ids default to 0..len-1 (what the target uses without them)."""
    for i in range(len(dataset)):
        row = dataset[i]
        ids = list(row["input_ids"])
        pos = row["position_ids"] if "position_ids" in row else range(len(ids))
        yield {"input_ids": ids, "loss_mask": list(row["loss_mask"]), "position_ids": list(pos)}


def plan_shards(lengths: list[int], shard_tokens: int) -> list[dict]:
    """Consecutive rows cut into shards of at most `shard_tokens` tokens (a longer row gets a shard of its own)."""
    shards, first, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if tokens and tokens + n > shard_tokens:
            shards.append({"first_row": first, "rows": i - first, "tokens": tokens})
            first, tokens = i, 0
        tokens += n
    if tokens:
        shards.append({"first_row": first, "rows": len(lengths) - first, "tokens": tokens})
    for k, s in enumerate(shards):
        s["file"] = f"shard-{k:05d}.safetensors"
    return shards


def _write_json(path: Path, obj: dict) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1)))


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def write_cache(target, dataset, layers: list[int], out_dir: str | Path, shard_tokens: int = 0,
                dtype: torch.dtype | str = torch.bfloat16, batch_size: int = 8, meta: dict | None = None,
                log: Callable[[str], None] = print, reuse: str | Path | None = None) -> dict:
    """Write the target's `hidden` (and, with `layers`, `aux`) for every row of `dataset` under `out_dir`.

    Args:
        target: a `models.target.Target` (frozen); its forwards run under no_grad, `batch_size` rows at a time.
        dataset: rows with input_ids, loss_mask and optionally position_ids (`data.dataset.build_dataset`).
        layers: Hugging Face hidden_states indices stored as `aux` (EAGLE-3); [] stores `hidden` only (EAGLE-1).
        shard_tokens: tokens per shard; host memory holds one shard's features, shard_tokens*(1+n)*H values, and an
            interrupted run loses at most one shard's work. 0: as many as fit in SHARD_BYTES.
        meta: provenance kept in the manifest (e.g. the recipe's data config and the command).
        reuse: an earlier cache of the same target, layers and dtype (e.g. written before data.extra added a source
            after the first): a shard it holds with the same place in the plan and the same token columns is
            hard-linked (or copied) instead of recomputed.
    Returns the manifest. Resumes a partial cache of the same target, layers, dtype and data; refuses (CacheError)
    a directory holding anything else, and a disk without room for the remaining shards.
    """
    out, reuse = Path(out_dir), Path(reuse) if reuse is not None else None
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    H = target.config.get_text_config().hidden_size
    digest, lengths = hashlib.sha256(), []
    for row in _rows(dataset):
        for k in TOKEN_KEYS:
            digest.update(torch.tensor(row[k], dtype=torch.int32).numpy().tobytes())
        lengths.append(len(row["input_ids"]))
    bytes_per_token = (1 + len(layers)) * H * dtype.itemsize + TOKEN_BYTES + (TEACHER_BYTES if layers else 0)
    shards = plan_shards(lengths, shard_tokens or max(1, SHARD_BYTES // bytes_per_token))
    manifest = {"format": FORMAT, "target": str(target.path), "target_sha256": target_fingerprint(target),
                "layers": list(layers), "teacher": list(TEACHER_KEYS) if layers else [], "hidden_size": H,
                "dtype": str(dtype).removeprefix("torch."),
                "rows": len(lengths), "tokens": sum(lengths), "bytes_per_token": bytes_per_token,
                "data_sha256": digest.hexdigest(), "shards": shards, "meta": meta or {}, "complete": False}

    if (out / MANIFEST).is_file():
        old = read_file(out / MANIFEST, f"delete {out} (a damaged cache) and write it again")
        if {**old, "target": "", "meta": {}, "complete": False} != {**manifest, "target": "", "meta": {}}:
            raise CacheError(f"{out} holds a cache of another target, layers, dtype, data or shard size; "
                             "pass a new --out or delete that directory")
    elif out.exists() and any(out.iterdir()):
        raise CacheError(f"{out} exists and is not a hidden-state cache; pass a new --out or empty that directory")
    reusable = _reusable(reuse, manifest) if reuse is not None else []
    todo = [s for s in shards if not (out / s["file"]).is_file()]
    missing = {s["file"] for s in todo}
    need = sum(s["tokens"] for s in todo) * bytes_per_token
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    total = manifest["tokens"] * bytes_per_token
    log(f"hidden cache: {manifest['tokens']} tokens x {bytes_per_token} bytes = {_size(total)} in {len(shards)} "
        f"shards ({len(shards) - len(todo)} already written); {_size(need)} to write, {_size(free)} free at {out}")
    if free < need * DISK_MARGIN[0] + DISK_MARGIN[1]:
        raise CacheError(f"not enough disk for the hidden cache: {_size(need)} to write (+5% and 256 MiB margin) "
                         f"but {_size(free)} free at {out}; free space, pick another --out, or cut data.limit")
    _write_json(out / MANIFEST, manifest)

    rows = _rows(dataset)
    for s in shards:
        shard_rows = [next(rows) for _ in range(s["rows"])]
        if s["file"] in missing and s in reusable and _same_tokens(reuse / s["file"], shard_rows):
            _link(reuse / s["file"], out / s["file"])
            log(f"hidden cache: reused {s['file']} of {reuse} ({s['rows']} rows, {s['tokens']} tokens)")
        elif s["file"] in missing:
            _write_shard(target, shard_rows, layers, out / s["file"], dtype, batch_size)
            log(f"hidden cache: wrote {s['file']} ({s['rows']} rows, {s['tokens']} tokens)")
    manifest["complete"] = True
    _write_json(out / MANIFEST, manifest)
    return manifest


def _reusable(other: Path, manifest: dict) -> list[dict]:
    """The entries of `manifest`'s shard plan that cache `other` holds as files under the same plan entry; refuses a
    cache of another target, layers or dtype."""
    if not (other / MANIFEST).is_file():
        raise CacheError(f"--reuse {other} is not a hidden-state cache (no {MANIFEST}); pass a directory that "
                         "draftsmith cache wrote")
    m = read_file(other / MANIFEST, f"delete {other} or pass another cache to --reuse")
    if any(m[k] != manifest[k] for k in ("format", "target_sha256", "layers", "teacher", "dtype", "bytes_per_token")):
        raise CacheError(f"--reuse {other} holds a cache of another target, layers or dtype; pass one written with "
                         "this recipe's target and eagle settings, or drop --reuse")
    return [s for s in manifest["shards"] if s in m["shards"] and (other / s["file"]).is_file()]


def _same_tokens(path: Path, rows: list[dict]) -> bool:
    """Whether the shard file at `path` holds exactly `rows`' token columns (a reordered or edited dataset is not)."""
    f = open_safetensors(path, f"delete {path} or pass another cache to --reuse")
    return all(torch.equal(f.get_tensor(k), v) for k, v in _token_columns(rows).items())


def _link(src: Path, dst: Path) -> None:
    """dst as a hard link to src (no disk used), or a copy on another file system; whole or absent, like a shard."""
    def put(tmp: Path) -> None:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
    write_atomically(dst, put)


def _token_columns(rows: list[dict]) -> dict[str, torch.Tensor]:
    """`rows`' TOKEN_KEYS concatenated, each [T], in the dtypes a shard stores them in."""
    return {k: torch.tensor([t for r in rows for t in r[k]], dtype=torch.int8 if k == "loss_mask" else torch.int32)
            for k in TOKEN_KEYS}


@torch.no_grad()
def teacher_stats(target, f: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """f [..., s, H] final features -> (log_z, greedy) [..., s]: the target's whole-vocabulary log-normaliser and
    argmax, what an EAGLE-3 teacher needs beyond a pruned draft vocabulary; logits [..., chunk, V] at a time."""
    log_z, greedy = [], []
    for x in f.split(chunk or f.shape[-2], -2):
        z = target.logits(x.to(target.lm_head.weight.dtype)).float()  # [..., c, V]
        log_z.append(z.logsumexp(-1))
        greedy.append(z.argmax(-1))
    return torch.cat(log_z, -1), torch.cat(greedy, -1)


@torch.no_grad()
def _write_shard(target, rows: list[dict], layers: list[int], path: Path, dtype: torch.dtype,
                 batch_size: int) -> None:
    """Forward `rows` through the target in batches and save their features as one shard, atomically."""
    lengths = torch.tensor([len(r["input_ids"]) for r in rows])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])  # [r + 1]
    H, T = target.config.get_text_config().hidden_size, int(offsets[-1])
    tensors = _token_columns(rows)
    tensors["offsets"] = offsets
    tensors["hidden"] = torch.empty(T, H, dtype=dtype)
    if layers:
        tensors["aux"] = torch.empty(T, len(layers) * H, dtype=dtype)
        tensors["log_z"], tensors["greedy"] = torch.empty(T), torch.empty(T, dtype=torch.int32)
    device = target.lm_head.weight.device
    for lo in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[lo: lo + batch_size]).items()}
        tap = target.tap(batch["input_ids"], batch.get("attention_mask"), batch["position_ids"], tuple(layers))
        aux = torch.cat([tap.layers[i] for i in layers], -1) if layers else None  # [b, s, n*H]
        for j in range(batch["input_ids"].shape[0]):
            a, b = int(offsets[lo + j]), int(offsets[lo + j + 1])
            tensors["hidden"][a:b] = tap.hidden[j, : b - a].to("cpu", dtype)  # [len, H]
            if layers:
                tensors["aux"][a:b] = aux[j, : b - a].to("cpu", dtype)  # [len, n*H]
                log_z, greedy = teacher_stats(target, tap.hidden[j, : b - a], LOGIT_CHUNK)  # [len] each
                tensors["log_z"][a:b], tensors["greedy"][a:b] = log_z.cpu(), greedy.cpu()
    write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata={"format": FORMAT}))


class CachedRow(Mapping):
    """One cached row: token lists at hand, `hidden` [len, H] / `aux` [len, n*H] / `log_z`, `greedy` [len] read
    from disk when asked for."""

    def __init__(self, tokens: dict[str, list[int]], read: Callable[[str], torch.Tensor], features: tuple[str, ...]):
        self.tokens, self.read, self.features = tokens, read, features

    def __getitem__(self, key: str):
        if key in self.tokens:
            return self.tokens[key]
        if key in self.features:
            return self.read(key)
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return key in self.tokens or key in self.features

    def __iter__(self):
        return iter((*self.tokens, *self.features))

    def __len__(self) -> int:
        return len(self.tokens) + len(self.features)


class HiddenCache:
    """A written cache as a map-style dataset: `cache[i]` -> input_ids, loss_mask, position_ids (lists),
    hidden [len, H] and, for EAGLE-3, aux [len, n*H] (tensors in the cache's dtype, read lazily) and, in a cache
    written since they exist, log_z and greedy [len].

    With `target` (and `layers`), refuses a cache written for another target (or other layers).
    """

    def __init__(self, path: str | Path, target=None, layers: list[int] | None = None):
        self.path = Path(path)
        if not (self.path / MANIFEST).is_file():
            raise CacheError(f"{self.path} is not a hidden-state cache (no {MANIFEST}); write one with "
                             "draftsmith cache --config <recipe> --out DIR")
        self.manifest = m = read_file(self.path / MANIFEST, f"delete {self.path} and write the cache again with "
                                      "draftsmith cache --config <recipe> --out DIR")
        if not m["complete"]:
            done = sum((self.path / s["file"]).is_file() for s in m["shards"])
            raise CacheError(f"hidden cache {self.path} is incomplete ({done} of {len(m['shards'])} shards); rerun "
                             f"draftsmith cache with the same recipe and --out {self.path} to resume it")
        if target is not None and m["target_sha256"] != target_fingerprint(target):
            raise CacheError(f"hidden cache {self.path} was written for another target ({m['target']}), not "
                             f"{target.path}; write a cache of this target with draftsmith cache "
                             "and point offline.path at it")
        if layers is not None and list(layers) != m["layers"]:
            raise CacheError(f"hidden cache {self.path} holds layers {m['layers'] or 'final only'} but the method "
                             f"reads {list(layers) or 'final only'}; write a cache with this recipe's eagle settings "
                             "(draftsmith cache) and point offline.path at it")
        for s in m["shards"]:  # a header read each: a damaged shard is named here, not deep in a data loader
            f = self.path / s["file"]
            why = "is missing" if not f.is_file() else safetensors_damage(f)
            if why:
                raise CacheError(f"hidden cache {self.path}: {s['file']} {why}; {self.rewrite(s['file'])}")
        self.layers, self.hidden_size = m["layers"], m["hidden_size"]
        self.features = ("hidden", "aux", *m.get("teacher", ())) if self.layers else ("hidden",)
        self.starts = [s["first_row"] for s in m["shards"]]
        self.open: dict[int, tuple] = {}  # shard -> (safe_open handle, offsets list)

    def __len__(self) -> int:
        return self.manifest["rows"]

    def rewrite(self, shard: str) -> str:
        """The fix for a damaged shard: the writer resumes at missing shards."""
        command = self.manifest.get("meta", {}).get("command") or \
            f"draftsmith cache --config <the recipe that wrote it> --out {self.path}"
        return f"delete it and rerun `{command}`, which writes missing shards again"

    def shard(self, k: int) -> tuple:
        if k not in self.open:
            name = self.manifest["shards"][k]["file"]
            f = open_safetensors(self.path / name, self.rewrite(name))
            self.open[k] = f, f.get_tensor("offsets").tolist()
        return self.open[k]

    def __getitem__(self, i: int) -> CachedRow:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for a cache of {len(self)} rows")
        i %= len(self)
        k = bisect.bisect_right(self.starts, i) - 1
        f, offsets = self.shard(k)
        a, b = offsets[i - self.starts[k]], offsets[i - self.starts[k] + 1]
        tokens = {key: f.get_slice(key)[a:b].tolist() for key in TOKEN_KEYS}
        return CachedRow(tokens, lambda key: f.get_slice(key)[a:b], self.features)


def collate_features(rows: list[Mapping]) -> dict[str, torch.Tensor]:
    """Cached rows -> the batch `train.loop.collate` makes of their tokens (same padding and attention_mask),
    plus hidden [b, s, H] and aux [b, s, n*H], zero-padded, in the cache's dtype (`Eagle.features` upcasts), and
    log_z, greedy [b, s] where the cache has them."""
    batch = collate([{k: r[k] for k in TOKEN_KEYS} for r in rows])
    s = batch["input_ids"].shape[1]
    for key in ("hidden", "aux", *TEACHER_KEYS):
        if key in rows[0]:
            feats = [r[key] for r in rows]  # each [len, D] or [len]: padded along the first dimension to s
            batch[key] = torch.stack([torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, s - x.shape[0]))
                                      for x in feats])
    return batch
