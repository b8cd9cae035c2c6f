"""Train a DSpark drafter: DFlash's block drafter that drafts from the anchor's slot as well, with a Markov head
biasing each slot's logits by the token before it.

    accelerate launch train/dspark.py --config recipes/dspark/tiny-code.yaml [key=value ...]

The same entry point as train/dflash.py (one script, one loop) with the DSpark recipe (dflash.markov_rank > 0) as
default; see models/dflash.py for the method and train/dflash.py for what is evaluated at each checkpoint.
"""

from __future__ import annotations

import dataclasses

from draftsmith.recipes import RECIPES
from draftsmith.train import dflash
from draftsmith.train.dflash import Recipe
from draftsmith.train.guard import cli
from draftsmith.train.loop import Loop
from draftsmith.train.runner import run

__all__ = ["Recipe", "main"]  # the DFlash recipe schema, shared with train/dflash.py
SPEC = dataclasses.replace(dflash.SPEC, default_recipe=RECIPES / "dspark/tiny-code.yaml", doc=__doc__)


def main(argv: list[str] | None = None) -> Loop:
    return run(SPEC, argv)


if __name__ == "__main__":
    cli(main)
