"""Training data: load, tokenize with the target's chat template, cut to length, pack, cache.

`build_dataset(cfg, tokenizer)` returns a `datasets.Dataset` with `input_ids` and `loss_mask`
(plus `position_ids` when packed) from
  * a local file (`.json`, `.jsonl`, `.parquet`, `.arrow`), a directory written by
    `Dataset.save_to_disk`, a directory of data files, or a hub dataset name;
  * by default (no path) the reference target's chat examples (`data/reference.py`), so that
    recipes run offline.
Rows may be OpenAI `messages`, ShareGPT `conversations` or plain `text` (see `data/chat.py`).

A conversation whose chat template rewrites earlier turns (Qwen3, gpt-oss, ...) becomes several examples, one per
run of assistant turns (data/chat.py). Over-long examples are truncated to their first `max_length` tokens or dropped;
what that cuts from the assistant tokens is said in one warning per dataset, with how to keep it. An example
with no assistant token left, or with a turn whose content is not text (null, missing, image
parts), is an error by default (a count and the first offending row), or dropped and counted. The result is cached with `save_to_disk` under a key that hashes the tokenizer, the
chat template, the data and the config fields that change the output, and reused on a hit.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Literal

import datasets

from draftsmith.data.chat import NoAssistantTokens, UnreadableContent, to_messages, tokenize_sequences
from draftsmith.data.core import ConfigError, json_lines, read_file
from draftsmith.data.packing import pack

log = logging.getLogger("draftsmith.data")

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
DEFAULT_CACHE = Path.home() / ".cache" / "draftsmith" / "datasets"
ROW_FEATURES = {"input_ids": datasets.Sequence(datasets.Value("int32")),
                "loss_mask": datasets.Sequence(datasets.Value("int8")),
                "position_ids": datasets.Sequence(datasets.Value("int32"))}
# The pipeline's own code is part of the cache key: a change to it invalidates old caches.
PIPELINE_FILES = [Path(__file__), Path(__file__).with_name("chat.py"), Path(__file__).with_name("packing.py")]


@dataclasses.dataclass
class DataConfig:
    """Where the training conversations come from and how they become rows."""

    path: str = ""  # hub name, local file (json/jsonl/parquet/arrow) or directory; empty: reference chat examples
    extra: list[str] = dataclasses.field(default_factory=list)  # more sources as `path` takes them ("": the reference
    # examples), each built alone (and cached) and its rows appended to path's: a mix of fixed and regenerated data
    split: str = "train"  # hub or saved DatasetDict split; reference examples: "train"/"heldout"; single files: unused
    revision: str = ""  # hub revision (a commit pins the data for the cache key)
    max_length: int = 2048  # tokens per example, and per row when packed
    overlong: Literal["truncate", "drop"] = "truncate"
    on_no_assistant: Literal["error", "drop"] = "error"
    on_unreadable: Literal["error", "drop"] = "error"  # a turn whose content is null, missing or not text
    pack: bool = False
    num_proc: int = 1
    cache: bool = True
    cache_dir: str = ""  # empty: ~/.cache/draftsmith/datasets
    limit: int = 0  # first examples only (of each source); 0: all

    def __post_init__(self):
        if self.max_length < 2:
            raise ConfigError("data.max_length: must be >= 2")
        if self.num_proc < 1:
            raise ConfigError("data.num_proc: must be >= 1")
        if self.limit < 0:
            raise ConfigError("data.limit: must be >= 0 (0: all examples)")
        if "" in (self.path, *self.extra) and self.split not in ("train", "heldout"):
            raise ConfigError(f"data.split: the reference examples have splits 'train' and 'heldout', not "
                              f"{self.split!r}")


@dataclasses.dataclass
class DataStats:
    """What happened to the examples on their way to rows. `read` counts the rows read, `examples` what they became
    (more where a chat template splits a conversation per assistant turn); the counts after it are of examples."""

    read: int = 0
    examples: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    no_assistant: int = 0  # dropped (or the error) for having no assistant token, after truncation
    unreadable: int = 0  # rows dropped (or the error) for a turn whose content is not text
    kept: int = 0
    rows: int = 0
    tokens: int = 0  # in rows, padding excluded
    trained_tokens: int = 0  # loss_mask ones
    over_length: int = 0  # examples longer than max_length (truncated, dropped, or cut to no assistant token)
    cut_trained: int = 0  # loss_mask ones that truncation cut or over-long examples dropped took
    longest: int = 0  # tokens of the longest example, before truncation

    def summary(self) -> str:
        split = f" -> {self.examples} examples (one per run of assistant turns)" if self.examples != self.read else ""
        return (f"read {self.read} examples{split}: truncated {self.truncated}, dropped {self.dropped_overlong} "
                f"over-long, dropped {self.no_assistant} without assistant tokens, {self.unreadable} with unreadable "
                f"content; kept {self.kept} -> {self.rows} rows, {self.tokens} tokens, {self.trained_tokens} trained")

    def cut_note(self, max_length: int, overlong: str) -> str:
        """One line on the assistant tokens that over-long examples lost and how to keep them; empty when none."""
        if not self.cut_trained:
            return ""
        total = self.cut_trained + self.trained_tokens
        how, other = ("truncating", "data.overlong=drop to leave such examples out") if overlong == "truncate" else \
            ("dropping", "data.overlong=truncate to train on their first data.max_length tokens")
        return (f"data: {self.over_length} of {self.examples} examples are longer than data.max_length={max_length}; "
                f"{how} them lost {self.cut_trained} of {total} assistant tokens ({self.cut_trained / total:.1%}), "
                f"the longest has {self.longest} tokens: raise data.max_length to keep them, or set {other}")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (data cache keys, checkpoint manifests, GGUF checks)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

def _local_kind(path: Path) -> str:
    """'file:<builder>', 'saved' (save_to_disk) or 'files' (a directory of data files)."""
    if path.is_dir():
        return "saved" if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() \
            else "files"
    suffixes = [x.lower() for x in path.suffixes]
    builder = LOCAL_FORMATS.get(suffixes[-2] if suffixes[-1:] == [".gz"] and len(suffixes) > 1 else path.suffix.lower())
    if builder is None:
        raise ValueError(f"data.path {path}: unsupported file type {path.suffix!r}; use one of {sorted(LOCAL_FORMATS)} (json and jsonl may be gzipped)")
    return f"file:{builder}"


def check_json_rows(path: Path, keys: tuple[str, ...] = ("messages", "conversations", "text"), what: str = "data.path"
                    ) -> int:
    """Parse a .json (array or JSON lines) or .jsonl file up front; raise one line naming the file and line of the
    first bad row (unparseable, not an object, or none of `keys`), or an empty file. Returns the row count."""
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix.lower() == ".gz" else raw).decode("utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"{what} {path} is empty; give a file with one JSON object per line (keys {list(keys)})")
    try:
        if path.name.lower().endswith((".json", ".json.gz")) and text.lstrip().startswith("["):
            rows = [(0, r) for r in json.loads(text)]
        else:
            rows = json_lines(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); fix that line") from None
    for i, (n, row) in enumerate(rows):
        where = f"{path}:{n}" if n else f"{path} (element {i})"
        if not isinstance(row, dict) or not any(k in row for k in keys):
            got = json.dumps(row)[:120] if isinstance(row, dict) else repr(row)[:80]
            raise ValueError(f"{where}: each row needs one of {list(keys)}, got {got}")
    if not rows:
        raise ValueError(f"{what} {path} holds no rows")
    return len(rows)


def load_raw(cfg: DataConfig) -> datasets.Dataset:
    """The examples as they are stored (messages / conversations / text columns), before tokenizing."""
    if not cfg.path:
        from draftsmith.data.reference import chat_examples, stdlib_files

        rows = []
        for f in stdlib_files():
            if f.split == cfg.split:
                rows += chat_examples(f)
                if cfg.limit and len(rows) >= cfg.limit:
                    break
        ds = datasets.Dataset.from_list(rows)
    else:
        path = Path(cfg.path).expanduser()
        if path.exists():
            kind = _local_kind(path)
            if kind == "saved":
                ds = datasets.load_from_disk(str(path))
                if isinstance(ds, datasets.DatasetDict):
                    if cfg.split not in ds:
                        raise ValueError(f"data.split {cfg.split!r} not in {path}; it has {sorted(ds)}")
                    ds = ds[cfg.split]
            elif kind == "files":
                ds = datasets.load_dataset(str(path), split=cfg.split)
            else:
                if kind == "file:json":
                    check_json_rows(path)
                ds = datasets.load_dataset(kind.split(":")[1], data_files=str(path), split="train")
        elif path.suffix.lower() in LOCAL_FORMATS or cfg.path.startswith((".", "/", "~")):
            raise ValueError(f"data.path {cfg.path} does not exist; give an existing file or directory, or a hub "
                             "dataset name")
        else:
            ds = datasets.load_dataset(cfg.path, split=cfg.split, revision=cfg.revision or None)
    if cfg.limit:
        ds = ds.select(range(min(cfg.limit, len(ds))))
    if not len(ds):
        raise ValueError(f"data.path {cfg.path or '(reference examples)'} (split {cfg.split!r}) has no examples; "
                         "point data.path at data with rows")
    return ds


def sources(cfg: DataConfig) -> list[DataConfig]:
    """data.path and each data.extra source as a config of its own (no extra)."""
    return [dataclasses.replace(cfg, path=path, extra=[]) for path in [cfg.path, *cfg.extra]]


def _data_key(cfg: DataConfig) -> dict[str, Any]:
    """What identifies the data itself: file hashes, the hub name + revision, or the stdlib corpus (each source's)."""
    if cfg.extra:
        return {"sources": [_data_key(one) for one in sources(cfg)]}
    if not cfg.path:
        from draftsmith.data.reference import corpus_fingerprint, stdlib_files

        return {"reference": corpus_fingerprint(stdlib_files()), "split": cfg.split}
    path = Path(cfg.path).expanduser()
    if path.is_file():
        return {"file": sha256_file(path)}
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {"dir": {p.relative_to(path).as_posix(): sha256_file(p) for p in files}, "split": cfg.split}
    return {"hub": cfg.path, "revision": cfg.revision, "split": cfg.split}


def _tokenizer_key(tokenizer) -> str:
    """Hash of the vocabulary/merges, special tokens and chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None
             else json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps({"special": tokenizer.special_tokens_map, "template": tokenizer.chat_template,
                         "class": type(tokenizer).__name__}, sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_key(cfg: DataConfig, tokenizer) -> str:
    """sha256 over tokenizer, template, data, pipeline code and the output-relevant config fields."""
    fields = {k: getattr(cfg, k) for k in ("max_length", "overlong", "on_no_assistant", "on_unreadable", "pack",
                                           "limit")}
    code = [hashlib.sha256(p.read_bytes()).hexdigest() for p in PIPELINE_FILES]
    blob = json.dumps({"tokenizer": _tokenizer_key(tokenizer), "data": _data_key(cfg), "config": fields,
                       "code": code}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _tokenize_rows(batch: dict[str, list], indices: list[int], tokenizer, max_length: int,
                   overlong: str) -> dict[str, list]:
    """Each row of `batch` -> its examples (`tokenize_sequences`), truncated or dropped. Per example: `status` says
    what happened, `row` the row it came from, `cut` the loss_mask ones lost to length, `length` its length before."""
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "status": [], "row": [], "cut": [], "length": []}

    def add(status: str, row: int, ids=(), mask=(), cut: int = 0, length: int = 0) -> None:
        for key, value in zip(out, (list(ids), list(mask), status, row, cut, length), strict=True):
            out[key].append(value)

    for j, row in enumerate(indices):
        try:
            sequences = tokenize_sequences(tokenizer, {k: v[j] for k, v in batch.items()})
        except NoAssistantTokens:
            add("no_assistant", row)
            continue
        except UnreadableContent:
            add("unreadable", row)
            continue
        for seq in sequences:
            ids, mask, n = seq["input_ids"], seq["loss_mask"], len(seq["input_ids"])
            if n <= max_length:
                add("ok" if any(mask) else "no_assistant", row, ids, mask, length=n)
            elif overlong == "drop":
                add("overlong", row, cut=sum(mask), length=n)
            else:
                kept = mask[:max_length]
                add("truncated" if any(kept) else "no_assistant", row, ids[:max_length], kept,
                    cut=sum(mask) - sum(kept), length=n)
    return out


def tokenize_dataset(raw: datasets.Dataset, cfg: DataConfig, tokenizer) -> tuple[datasets.Dataset, DataStats]:
    """Tokenize, cut to length, check assistant tokens and optionally pack `raw`."""
    tokenized = raw.map(_tokenize_rows, fn_kwargs={"tokenizer": tokenizer, "max_length": cfg.max_length,
                                                   "overlong": cfg.overlong},
                        batched=True, with_indices=True, remove_columns=raw.column_names,
                        num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
                        features=datasets.Features({"input_ids": ROW_FEATURES["input_ids"], "loss_mask": ROW_FEATURES["loss_mask"],
                                                    "status": datasets.Value("string"), "row": datasets.Value("int64"),
                                                    "cut": datasets.Value("int64"), "length": datasets.Value("int64")}),
                        keep_in_memory=True, new_fingerprint=uuid.uuid4().hex, desc="tokenizing")
    status, row_of = tokenized["status"], tokenized["row"]
    stats = DataStats(read=len(raw), examples=len(tokenized) - status.count("unreadable"),
                      truncated=status.count("truncated"), dropped_overlong=status.count("overlong"),
                      no_assistant=status.count("no_assistant"), unreadable=status.count("unreadable"),
                      over_length=sum(n > cfg.max_length for n in tokenized["length"]),
                      cut_trained=sum(tokenized["cut"]), longest=max(tokenized["length"], default=0))
    if stats.unreadable and cfg.on_unreadable == "error":
        first = row_of[status.index("unreadable")]
        try:
            to_messages(raw[first])
        except UnreadableContent as e:
            why = str(e).split(";")[0]
        raise UnreadableContent(
            f"{cfg.path or '(reference examples)'} row {first}: {why} ({stats.unreadable} of {stats.read} "
            "examples have such a turn); fix the data, or set data.on_unreadable=drop to skip and count them")
    if stats.no_assistant and cfg.on_no_assistant == "error":
        first = row_of[status.index("no_assistant")]
        raise NoAssistantTokens(
            f"{stats.no_assistant} of {stats.examples} examples have no assistant token to train on (first: row "
            f"{first}: {_describe(raw[first])}), counting those whose assistant turns lie beyond "
            f"max_length={cfg.max_length}; fix the data, raise data.max_length, or set data.on_no_assistant=drop to "
            "skip them")
    keep = [i for i, s in enumerate(status) if s in ("ok", "truncated")]
    ds = tokenized.select(keep).remove_columns(["status", "row", "cut", "length"])
    stats.kept = len(ds)
    stats.tokens = sum(map(len, ds["input_ids"]))
    if cfg.pack and len(ds):
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise ValueError("packing needs a pad or EOS token id; set tokenizer.pad_token")
        rows = pack(ds.to_list(), cfg.max_length, pad_id)
        ds = datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in ROW_FEATURES},
                                        features=datasets.Features(ROW_FEATURES))
    stats.rows = len(ds)
    stats.trained_tokens = sum(map(sum, ds["loss_mask"]))
    return ds, stats


def _describe(example: dict[str, Any]) -> str:
    """A short, one-line view of an example for error messages."""
    text = json.dumps({k: v for k, v in example.items() if k in ("messages", "conversations", "text")},
                      ensure_ascii=False)
    return text if len(text) <= 160 else text[:157] + "..."


def _warn_cut(stats: DataStats, cfg: DataConfig) -> None:
    note = stats.cut_note(cfg.max_length, cfg.overlong)
    if note:
        log.warning(note)


def prepare(cfg: DataConfig, tokenizer) -> tuple[datasets.Dataset, DataStats]:
    """One source's rows (data.path's; `build_dataset` appends data.extra's) and the counts of what was read,
    truncated and dropped."""
    root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else DEFAULT_CACHE
    final = root / cache_key(cfg, tokenizer) if cfg.cache else None
    if final is not None and (final / "stats.json").is_file():
        stats = DataStats(**read_file(final / "stats.json", f"delete {final} (a damaged data cache); the next run "
                                      "rebuilds it"))
        log.info("data: cache hit %s: %s", final, stats.summary())
        _warn_cut(stats, cfg)
        return datasets.load_from_disk(str(final)), stats
    ds, stats = tokenize_dataset(load_raw(cfg), cfg, tokenizer)
    log.info("data: %s", stats.summary())
    _warn_cut(stats, cfg)
    if not len(ds):
        raise ValueError(f"data: no example left to train on ({stats.summary()}); check data.path, data.max_length "
                         "and data.overlong")
    if final is None:
        return ds, stats
    tmp = root / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    ds.save_to_disk(str(tmp))
    (tmp / "stats.json").write_text(json.dumps(dataclasses.asdict(stats)))
    try:
        os.rename(tmp, final)  # atomic: readers see a complete cache or none
    except OSError:  # another process wrote the same key first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("data: cached at %s", final)
    return datasets.load_from_disk(str(final)), stats


def build_dataset(cfg: DataConfig, tokenizer) -> datasets.Dataset:
    """Rows of `input_ids` and `loss_mask` (+ `position_ids` when packed), cached on disk: data.path's, then each
    data.extra source's."""
    parts = [prepare(one, tokenizer)[0] for one in sources(cfg)]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def heldout_rows(cfg: DataConfig, tokenizer, limit: int, path: str = "", split: str = "heldout") -> list[dict]:
    """The first `limit` held-out examples as unpacked rows with position_ids, through the same pipeline as
    `cfg` (the reference held-out split unless `path` names other data); an empty result is an error."""
    held = dataclasses.replace(cfg, path=path, extra=[], split=split, pack=False, limit=limit, overlong="truncate",
                               on_no_assistant="drop")
    rows = [{**r, "position_ids": list(range(len(r["input_ids"])))} for r in build_dataset(held, tokenizer)]
    if not rows:
        raise ValueError("no held-out example to evaluate on; raise eval.heldout_examples or point the held-out "
                         "path at data with assistant turns")
    return rows
