"""Measure a drafter by real speculative decoding with its target (`draftsmith evaluate`).

    python scripts/evaluate.py --help      # the options and the code: train/evaluate.py
"""

from draftsmith.train.evaluate import main
from draftsmith.train.guard import cli

if __name__ == "__main__":
    cli(main)
