"""Export a trained drafter to a serving format (`draftsmith export`).

    python scripts/export.py --help      # the options and the code: train/export.py
"""

from draftsmith.train.export import main

if __name__ == "__main__":
    main()
