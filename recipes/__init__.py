"""The shipped recipes, package data of draftsmith: `RECIPES / "medusa/medusa1-tiny-code.yaml"`."""

from pathlib import Path

RECIPES = Path(__file__).parent
