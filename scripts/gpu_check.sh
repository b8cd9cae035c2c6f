#!/usr/bin/env bash
# Throughput check of every recipe on one GPU (train/gpu_check.py), in the active environment or the checkout's .venv:
#   bash scripts/gpu_check.sh [--smoke] [--steps N]
cd "$(dirname "$0")/.." && { python -c "import draftsmith.train" 2>/dev/null || . .venv/bin/activate; } && exec python -m draftsmith.train.gpu_check "$@"
