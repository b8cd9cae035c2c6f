"""Self-distilled chat data for a real target (the code: train/self_distill.py).

    python scripts/self_distill.py --target smollm2-135m-instruct            # resumable; rerun to continue
    python scripts/self_distill.py --target smollm2-135m-instruct --finalize # write data/real/NAME from what is done
"""

from draftsmith.train.guard import cli
from draftsmith.train.self_distill import main

if __name__ == "__main__":
    cli(main)
