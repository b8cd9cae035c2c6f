"""Export a trained drafter to a serving format.

    draftsmith export RUN --format FORMAT --out DIR [--overwrite]

RUN is a run directory (its best/ checkpoint is used, else the latest checkpoint's model/), or a
drafter directory itself; FORMAT is one of its method's formats, which --help lists from the registry.
The export is written to a temporary directory and renamed into place, so it is either complete or
absent; a non-empty DIR is refused without --overwrite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftsmith.data.core import find_drafter
from draftsmith.models.registry import METHODS, drafter_method, export, get_format
from draftsmith.train.guard import cli


def formats_by_method() -> str:
    """Every method's export formats with what each is for, as --help lists them (the run's drafter.json names its
    method)."""
    return "formats by method:\n" + "\n".join(
        f"  {method}\n" + "\n".join(f"    {name:<12} {fmt.help}" for name, fmt in plugin.formats.items())
        for method, plugin in METHODS.items())


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=formats_by_method(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--format", required=True, dest="fmt", metavar="FORMAT",
                        help="one of the run's method's formats, below")
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
