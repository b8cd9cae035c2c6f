"""The leaderboard: every drafter on the same target, the same held-out prompts, the same training budget.

    python scripts/bench.py [--budget-minutes 5] [--methods ngram medusa1 ...] [...]   # = draftsmith bench
    python scripts/bench.py --help      # the options; the code: train/bench.py
"""

from draftsmith.train.bench import main

if __name__ == "__main__":
    main()
