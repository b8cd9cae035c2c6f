"""Acceptance statistics of speculative decoding runs.

tau counts committed tokens per target verification forward, bonus included (the EAGLE, Medusa and
Spec-Bench convention; see `generate` for which forwards count). Acceptance at draft position k is
conditional: among the steps whose draft reached position k with positions 1..k-1 accepted, the
fraction that accepted position k, which is what a per-head or per-step accuracy should predict.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    sequences: int = 0
    steps: int = 0  # target verification forwards
    new_tokens: int = 0  # tokens committed (bonus tokens included)
    drafted: int = 0  # draft nodes sent to the target
    accepted: int = 0  # draft nodes accepted
    reached: Counter = field(default_factory=Counter)  # k -> steps that offered position k after k-1 accepted
    passed: Counter = field(default_factory=Counter)  # k -> steps that accepted position k
    lengths: Counter = field(default_factory=Counter)  # tokens committed per step -> steps
    drafter_s: float = 0.0
    target_s: float = 0.0
    wall_s: float = 0.0

    def record(self, offered: int, drafted: int, accepted: int, committed: int, drafter_s: float,
               target_s: float) -> None:
        """One verification step: positions offered along the accepted path (accepted, + 1 if the last
        accepted node had children), nodes drafted and accepted, tokens committed."""
        self.steps += 1
        self.new_tokens += committed
        self.drafted += drafted
        self.accepted += accepted
        for k in range(1, offered + 1):
            self.reached[k] += 1
        for k in range(1, accepted + 1):
            self.passed[k] += 1
        self.lengths[committed] += 1
        self.drafter_s += drafter_s
        self.target_s += target_s

    def merge(self, other: DecodeStats) -> DecodeStats:
        for name in ("sequences", "steps", "new_tokens", "drafted", "accepted", "drafter_s", "target_s", "wall_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("reached", "passed", "lengths"):
            getattr(self, name).update(getattr(other, name))
        return self

    @property
    def tau(self) -> float:
        return self.new_tokens / max(1, self.steps)

    def acceptance_by_position(self) -> list[float]:
        """Conditional acceptance rate at draft positions 1, 2, ... (as far as drafts reached)."""
        return [self.passed[k] / self.reached[k] for k in range(1, max(self.reached, default=0) + 1)]

    def summary(self) -> dict:
        return {"tau": self.tau, "acceptance_by_position": self.acceptance_by_position(),
                "accept_length_histogram": {str(k): self.lengths[k] for k in sorted(self.lengths)},
                "sequences": self.sequences, "target_forwards": self.steps, "new_tokens": self.new_tokens,
                "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "drafter_s": self.drafter_s, "target_s": self.target_s, "wall_s": self.wall_s}
