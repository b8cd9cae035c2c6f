"""The training entry scripts by method, as `draftsmith train METHOD` finds them; METHOD's shipped recipes are
recipes/METHOD/*.yaml, and `accelerate launch train/METHOD.py` runs the same script on many processes."""

from draftsmith.train import dflash, distill, eagle, eagle3, layerskip, medusa, p_eagle, target

TRAIN = {"medusa": medusa, "eagle": eagle, "eagle3": eagle3, "p_eagle": p_eagle, "dflash": dflash,
         "distill": distill, "layerskip": layerskip, "target": target}
