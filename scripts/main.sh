#!/usr/bin/env bash
# The main job on the embedded default: bash scripts/main.sh [key=value overrides]
# Trains Medusa-1 heads on the committed reference target (about 6 minutes on 2 CPU cores),
# measures tau by real speculative decoding at every checkpoint, keeps the best checkpoint by tau,
# and exports it in the original Medusa layout to runs/medusa1-tiny-code/export.
source "$(dirname "$0")/env.sh"
accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
  train/medusa.py --config recipes/medusa/medusa1-tiny-code.yaml "$@"
python scripts/export.py runs/medusa1-tiny-code --format medusa --out runs/medusa1-tiny-code/export --overwrite
