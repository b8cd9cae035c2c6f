"""Three EAGLE-3 trainers side by side on SmolLM2-135M-Instruct: draftsmith, speculators and SpecForge.

    python scripts/bench_peers.py [--work runs/bench-peers] [--budget-minutes 30] [--lr 1e-3] [--plan] ...

The benchmark lives in draftsmith.train.peers_bench (its docstring says what it needs and how long it takes), so that
the tests exercise its plan and state file through the package.
"""

from draftsmith.train.guard import cli
from draftsmith.train.peers_bench import main

if __name__ == "__main__":
    cli(main)
