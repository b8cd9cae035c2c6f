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


@dataclasses.dataclass
class Recipe(eagle.Recipe):
    p_eagle: PEagleConfig = dataclasses.field(default_factory=PEagleConfig)


def build(cfg: Recipe, target, draft_ids) -> PEagle:
    ptd = cfg.p_eagle.ptd_token_id
    if ptd < 0:
        ptd = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    return PEagle(target, cfg.eagle, draft_ids, ptd)


def main(argv: list[str] | None = None):
    return eagle.main(argv, RECIPES / "p_eagle/tiny-code.yaml", __doc__, Recipe, build)


if __name__ == "__main__":
    main()
