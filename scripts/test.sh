#!/usr/bin/env bash
# Set everything up and run the whole test suite. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh || exit 1
# two workers (the machine has two cores), tests handed out as workers free up; extra arguments win
.venv/bin/python -m pytest -n "${PARTFIN_TEST_WORKERS:-2}" --dist worksteal --durations=40 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
