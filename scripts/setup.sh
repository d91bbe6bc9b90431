#!/usr/bin/env bash
# Create .venv and install partfin with its test and benchmark tools. Idempotent.
# Once installed it needs no network: pip runs again only when pyproject.toml changed since the last
# install (the demo restarts offline).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.partfin-installed
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[dev]"
  echo "$wanted" > "$stamp"
fi
