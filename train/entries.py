"""The training entry scripts by name, as `draftsmith train ENTRY` finds them: the registry's (models/registry.py)
and `target`. ENTRY's shipped recipes are recipes/ENTRY/*.yaml, and `accelerate launch train/ENTRY.py` runs the same
script on many processes."""

from draftsmith.models.registry import ENTRIES
from draftsmith.train import dflash, distill, dspark, eagle, eagle3, layerskip, medusa, p_eagle, target

_SCRIPTS = {m.__name__.rpartition(".")[2]: m for m in (dflash, distill, dspark, eagle, eagle3, layerskip,
                                                        medusa, p_eagle, target)}
TRAIN = {name: _SCRIPTS[name] for name in ENTRIES}  # a KeyError here: a registry entry whose script is not imported
