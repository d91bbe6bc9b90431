#!/usr/bin/env bash
# Set everything up and run the whole test suite. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
.venv/bin/python -m pytest "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
