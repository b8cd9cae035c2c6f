#!/usr/bin/env bash
# The main job on the embedded default: bash scripts/main.sh
# Evaluates the committed reference target (held-out loss, a greedy answer) and writes
# benchmarks/reference_target.json.
source "$(dirname "$0")/env.sh"
exec python scripts/eval_target.py "$@"
