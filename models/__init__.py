"""draftsmith.models: trainable drafters, the target wrapper and export formats."""

import os

# transformers >= 5.24 swaps a model's layers for Hugging Face Hub kernels at load by default: on a GPU that needs
# the Hub (a load fails offline) and changes the target's numerics between runs and machines. draftsmith loads
# plain models; USE_HUB_KERNELS=YES in the environment opts back in.
os.environ.setdefault("USE_HUB_KERNELS", "NO")
