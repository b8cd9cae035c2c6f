"""Train an EAGLE-3 drafter: fused features from three target layers, training-time test, pruned vocabulary.

    accelerate launch train/eagle3.py --config recipes/eagle3/tiny-code.yaml [key=value ...]

The same entry point as train/eagle.py (one script, one loop) with the EAGLE-3 recipe as default;
see models/eagle.py for the method and train/eagle.py for what is evaluated at each checkpoint.
"""

from __future__ import annotations

from draftsmith.recipes import RECIPES
from draftsmith.train import eagle
from draftsmith.train.eagle import Recipe
from draftsmith.train.guard import cli
from draftsmith.train.loop import Loop
from draftsmith.train.runner import run

__all__ = ["Recipe", "main"]  # the EAGLE recipe schema, shared with train/eagle.py
SPEC = eagle.spec(RECIPES / "eagle3/tiny-code.yaml", __doc__)


def main(argv: list[str] | None = None) -> Loop:
    return run(SPEC, argv)


if __name__ == "__main__":
    cli(main)
