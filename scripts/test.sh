#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args]   (--slow also runs the slow tests)
source "$(dirname "$0")/env.sh"
if [ "${1:-}" = "--slow" ]; then shift; exec python -m pytest -q -m "" "$@"; fi
exec python -m pytest -q "$@"
