"""Rewrite every assistant turn of a chat dataset with the target itself (`draftsmith regenerate`).

    python scripts/regenerate.py --help      # the options and the code: train/regenerate.py
"""

from draftsmith.train.guard import cli
from draftsmith.train.regenerate import main

if __name__ == "__main__":
    cli(main)
