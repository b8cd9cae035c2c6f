"""Export a trained drafter to a serving format.

    draftsmith export RUN --format medusa|tgi|vllm|hf|sglang|speculators|gguf --out DIR [--overwrite]

RUN is a run directory (its best/ checkpoint is used, else the latest checkpoint's model/), or a
drafter directory itself. The export is written to a temporary directory and renamed into place,
so it is either complete or absent; a non-empty DIR is refused without --overwrite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.data.core import find_drafter
from draftsmith.models.registry import drafter_method, export, get_format
from draftsmith.train.guard import cli


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--format", required=True, dest="fmt")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        src = find_drafter(args.run)
        method = drafter_method(src)
        out = export(src, args.fmt, args.out, overwrite=args.overwrite)
    except (OSError, ValueError) as e:  # missing or taken paths, a full disk, a format that does not fit
        sys.exit(f"export: {e}")
    print(f"exported {src} ({method}) as {args.fmt} ({get_format(method, args.fmt).help}) to {out}")
    return out


if __name__ == "__main__":
    cli(main)
