"""Write the offline hidden-state cache an EAGLE recipe trains from (`draftsmith cache`).

    python scripts/cache_hidden_states.py --help      # the options and the code: train/cache.py
"""

from draftsmith.train.cache import main

if __name__ == "__main__":
    main()
