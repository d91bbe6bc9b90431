#!/usr/bin/env bash
# Set everything up and open the demo: Dagster UI on http://127.0.0.1:3000 with the synthetic
# source replaying the last 24 hours and then streaming. Stop with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PARTFIN_HOME=${PARTFIN_HOME:-$PWD/.partfin}
export DAGSTER_HOME=${DAGSTER_HOME:-$PARTFIN_HOME/dagster}
mkdir -p "$DAGSTER_HOME"
# PARTFIN_DAGSTER_CONFIG=dagster.postgres.yaml keeps the instance in PostgreSQL (README: Production)
cp "${PARTFIN_DAGSTER_CONFIG:-dagster.yaml}" "$DAGSTER_HOME/dagster.yaml"
# hourly partitions from two days ago, so the replayed 24 hours fill the UI's partition bar
export PARTFIN_PARTITIONS_START=${PARTFIN_PARTITIONS_START:-$(date -u -d '2 days ago' +%Y-%m-%d-00:00)}
# job control: dagster dev maps SIGTERM to its SIGINT handler only in its own process group
set -m
exec .venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "${PARTFIN_PORT:-3000}"
