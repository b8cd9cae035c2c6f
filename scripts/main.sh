#!/usr/bin/env bash
# The main job on the embedded default: bash scripts/main.sh [key=value overrides]
# Trains Medusa-1 heads on the committed reference target (about 6 minutes on 2 CPU cores),
# measures tau by real speculative decoding at every checkpoint, keeps the best checkpoint by tau,
# and exports it in the original Medusa layout to <loop.output_dir>/export (runs/medusa1-tiny-code/export).
source "$(dirname "$0")/env.sh"
run=runs/medusa1-tiny-code  # the recipe's loop.output_dir, unless an override names another (the last one wins)
for arg in "$@"; do [[ "$arg" == loop.output_dir=* ]] && run="${arg#loop.output_dir=}"; done
# -q: a failed run prints its one-line error without accelerate's own traceback after it
accelerate launch -q --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
  train/medusa.py --config recipes/medusa/medusa1-tiny-code.yaml "$@"
draftsmith export "$run" --format medusa --out "$run/export" --overwrite
