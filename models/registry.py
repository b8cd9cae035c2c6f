"""The one list of methods: method name (as drafter.json records it) -> what decoding and export need of it, and
the recipes that train it, from which `draftsmith train`, the leaderboard (train/bench.py) and the GPU check
(train/gpu_check.py) take their methods.

Adding a method: its own modules (training module, proposer, export formats), its entry script train/<entry>.py
(imported by train/entries.py) and one entry in METHODS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.data.core import DRAFTER_FILE, read_drafter_meta
from draftsmith.decoding.bench import Drafting
from draftsmith.decoding.proposers import Proposer
from draftsmith.decoding.proposers import load_proposer as load_untrained
from draftsmith.models import (
    dflash,
    dflash_export,
    distill,
    eagle_export,
    eagle_proposer,
    layerskip,
    medusa,
    medusa_export,
    p_eagle,
    p_eagle_export,
)
from draftsmith.models.export import Format, write_export


@dataclass(frozen=True)
class Recipe:
    """One way to train a method: `draftsmith train ENTRY` (train/ENTRY.py) on the shipped recipe for the reference
    target; the leaderboard and the GPU check name it `key`."""

    key: str
    name: str  # as the leaderboard shows it
    entry: str
    recipe: str  # under recipes/; a named target's recipe replaces `tiny-code` with the target's name
    curve: str = "eval/tau"  # the checkpoint metric the leaderboard plots against step; {fields} from drafter.json


@dataclass(frozen=True)
class Plugin:
    """load_proposer(drafter_dir, target, **decoding options) -> the decoder's proposer; formats: its exports;
    variants(drafter_dir, target) -> the ways a benchmark decodes with it (decoding/bench.py); recipes: how it
    trains."""

    load_proposer: Callable[..., Proposer]
    formats: dict[str, Format]
    variants: Callable[[Path, Any], dict[str, Drafting]]
    recipes: tuple[Recipe, ...]


METHODS: dict[str, Plugin] = {
    "medusa": Plugin(medusa.load_proposer, medusa_export.FORMATS, medusa.variants, (
        Recipe("medusa1", "Medusa-1", "medusa", "medusa/medusa1-tiny-code.yaml"),
        Recipe("medusa2", "Medusa-2", "medusa", "medusa/medusa2-tiny-code.yaml"))),
    "eagle": Plugin(eagle_proposer.load_proposer, eagle_export.FORMATS, eagle_proposer.variants, (
        Recipe("eagle1", "EAGLE-1", "eagle", "eagle/tiny-code.yaml"),
        Recipe("eagle3", "EAGLE-3", "eagle3", "eagle3/tiny-code.yaml"))),
    "p_eagle": Plugin(p_eagle.load_proposer, p_eagle_export.FORMATS, p_eagle.variants, (
        Recipe("p_eagle", "P-EAGLE", "p_eagle", "p_eagle/tiny-code.yaml"),)),
    "dflash": Plugin(dflash.load_proposer, dflash_export.FORMATS, dflash.variants, (
        Recipe("dflash", "DFlash", "dflash", "dflash/tiny-code.yaml"),
        Recipe("dspark", "DSpark", "dspark", "dspark/tiny-code.yaml"))),
    "layerskip": Plugin(layerskip.load_proposer, layerskip.FORMATS, layerskip.variants, (
        Recipe("layerskip", "LayerSkip", "layerskip", "layerskip/tiny-code.yaml", "eval/tau_exit{exit_layer}"),)),
    "distill": Plugin(distill.load_proposer, distill.FORMATS, distill.variants, (
        Recipe("distill", "distilled draft model", "distill", "distill/tiny-code.yaml"),)),
}
RECIPES = [r for p in METHODS.values() for r in p.recipes]  # every trained recipe, in the leaderboard's order
ENTRIES = [*dict.fromkeys(r.entry for r in RECIPES), "target"]  # train/<entry>.py; `target` trains the reference target


def plugin(method: str) -> Plugin:
    if method not in METHODS:
        raise ValueError(f"no method {method!r}; known methods: {sorted(METHODS)}")
    return METHODS[method]


def drafter_method(drafter_dir: str | Path) -> str:
    """The method recorded in a drafter checkpoint's drafter.json."""
    return read_drafter_meta(drafter_dir)["method"]


def get_format(method: str, name: str) -> Format:
    found = plugin(method).formats
    if name not in found:
        raise ValueError(f"format {name!r} is not available for {method}; choose one of {sorted(found)}")
    return found[name]


def export(drafter_dir: str | Path, name: str, out: str | Path, overwrite: bool = False) -> Path:
    """Write the drafter at `drafter_dir` to `out` in format `name` of its method, atomically."""
    return write_export(drafter_dir, name, get_format(drafter_method(drafter_dir), name), out, overwrite)


def load(method: str, name: str, path: str | Path) -> Any:
    """Read an exported directory back with the project's loader for that format."""
    return get_format(method, name).load(Path(path))


def load_proposer(spec: str, target, tokenizer=None, **kwargs) -> Proposer:
    """A proposer from a command-line spec: a trained drafter's directory (drafter.json names its method), else
    any spec `draftsmith.decoding.proposers.load_proposer` takes (ngram, suffix, lookahead, none, draft:DIR, ...)."""
    path = Path(spec)
    if (path / DRAFTER_FILE).is_file():
        return plugin(drafter_method(path)).load_proposer(path, target, **kwargs)
    return load_untrained(spec, target, tokenizer, **kwargs)
