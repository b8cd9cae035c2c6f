"""Train a P-EAGLE drafter (parallel drafting): EAGLE-3 that drafts all K tokens in one forward.

    accelerate launch train/p_eagle.py --config recipes/p_eagle/tiny-code.yaml [key=value ...]

The EAGLE entry point (train/eagle.py: online or offline features, the EAGLE-3 draft vocabulary,
held-out conditional acceptance and tau by real decoding at every checkpoint, best by tau) with the
P-EAGLE method of models/p_eagle.py and its `p_eagle` recipe section.
"""

from __future__ import annotations

import dataclasses

from draftsmith.models.p_eagle import PEagle, PEagleConfig
from draftsmith.recipes import RECIPES
from draftsmith.train import eagle
from draftsmith.train.guard import cli
from draftsmith.train.loop import Loop
from draftsmith.train.runner import pad_token, run


@dataclasses.dataclass
class Recipe(eagle.Recipe):
    p_eagle: PEagleConfig = dataclasses.field(default_factory=PEagleConfig)


def build(cfg: Recipe, target, train) -> PEagle:
    return PEagle(target, cfg.eagle, eagle.draft_ids(cfg, target, train),
                  pad_token(target.tokenizer, cfg.p_eagle.ptd_token_id))


SPEC = eagle.spec(RECIPES / "p_eagle/tiny-code.yaml", __doc__, Recipe, build)


def main(argv: list[str] | None = None) -> Loop:
    return run(SPEC, argv)


if __name__ == "__main__":
    cli(main)
