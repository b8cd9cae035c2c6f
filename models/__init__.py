"""draftsmith.models: trainable drafters, the target wrapper and export formats."""

from pathlib import Path

# The committed reference target every recipe uses by default (trained by train/target.py).
REFERENCE_TARGET = Path(__file__).resolve().parent / "reference-target"
