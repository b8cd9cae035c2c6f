# Sourced by scripts/main.sh and scripts/test.sh: make sure a virtual environment with draftsmith exists.
# Uses the active virtual environment if there is one, else creates ./.venv. Installs the CPU build of
# torch where no NVIDIA GPU is present, then DeepSpeed (built against that torch) and draftsmith itself.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x "$ROOT/.venv/bin/python" ] || python3 -m venv "$ROOT/.venv"
  # shellcheck disable=SC1091
  . "$ROOT/.venv/bin/activate"
fi
stamp="$VIRTUAL_ENV/.draftsmith-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip setuptools wheel
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.13"
  else
    python -m pip install -q "torch==2.13.0"  # the CPU wheel where no GPU is present
  fi
  python -m pip install -q --no-build-isolation "deepspeed>=0.19.8"  # its build imports the torch above
  python -m pip install -q -e "$ROOT[dev]"
  echo "$want" > "$stamp"
fi
cd "$ROOT"
