"""Write the offline hidden-state cache an EAGLE recipe trains from (`offline.path=DIR`).

    draftsmith cache --config recipes/eagle3/tiny-code.yaml [key=value ...] --out DIR

Reads the same recipe as train/eagle.py or train/p_eagle.py (same target, data pipeline, overrides), stores only
the layers the method reads (EAGLE-1: the final hidden state; EAGLE-3: that plus `eagle.aux_layers`, or
the EAGLE default), prints the disk estimate first and refuses when the disk cannot hold it, and
resumes an interrupted run when called again with the same arguments; `--reuse DIR` takes the shards an earlier
cache holds already (same rows at the same place: a source added after the first). Layout: data/hidden_cache.py.
"""

from __future__ import annotations

import argparse
import sys

import torch

from draftsmith.data.dataset import build_dataset, cache_key
from draftsmith.data.hidden_cache import CacheError, write_cache
from draftsmith.models.eagle_config import aux_layers
from draftsmith.models.target import load_target
from draftsmith.recipes import RECIPES
from draftsmith.train import config as C
from draftsmith.train.guard import cli
from draftsmith.train.p_eagle import Recipe  # EAGLE's + a p_eagle section: reads EAGLE and P-EAGLE recipes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(RECIPES / "eagle3/tiny-code.yaml"), help="YAML recipe")
    parser.add_argument("--out", required=True, help="cache directory (created; resumed if partial)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--shard-tokens", type=int, default=0,
                        help="tokens per shard (bounds host memory and the work an interruption loses); 0: 512 MiB")
    parser.add_argument("--batch-size", type=int, default=0, help="rows per target forward; 0: loop.batch_size")
    parser.add_argument("--reuse", default=None, help="an earlier cache of this target and layers (e.g. before "
                        "data.extra added a source): its shards holding the same rows are linked, not recomputed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("overrides", nargs="*", help="dotted key=value, e.g. data.limit=100")
    args = parser.parse_args(argv)
    cfg = C.load(Recipe, args.config, args.overrides)

    target = load_target(cfg.target.path, cfg.target.dtype, cfg.target.trust_remote_code)
    target.model.to(args.device)
    layers = aux_layers(cfg.eagle, target.config.get_text_config().num_hidden_layers)
    rows = build_dataset(cfg.data, target.tokenizer)
    print(f"EAGLE-{cfg.eagle.version}: caching {len(rows)} rows, layers {layers or 'final only'}, {args.dtype}")
    command = " ".join(["draftsmith", "cache", *(sys.argv[1:] if argv is None else argv)])
    meta = {"recipe": C.to_dict(cfg), "data_key": cache_key(cfg.data, target.tokenizer), "command": command}
    try:
        return write_cache(target, rows, layers, args.out, args.shard_tokens, args.dtype,
                           args.batch_size or cfg.loop.batch_size, meta, reuse=args.reuse)
    except CacheError as e:
        if argv is not None:
            raise
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    cli(main)
