#!/usr/bin/env bash
# Set everything up and open the demo: Dagster UI on http://127.0.0.1:3000 with the synthetic
# source replaying the last 24 hours (18 at once, 6 on a 30x event clock) and then streaming. Stop with Ctrl-C, or SIGTERM to its PID
# (however it was started: from a terminal, nohup, a CI script).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
scripts/setup.sh
export PARTFIN_HOME=$(realpath -m "${PARTFIN_HOME:-$REPO/.partfin}")
export DAGSTER_HOME=$(realpath -m "${DAGSTER_HOME:-$PARTFIN_HOME/dagster}")
mkdir -p "$PARTFIN_HOME" "$DAGSTER_HOME"
# PARTFIN_DAGSTER_CONFIG=dagster.postgres.yaml keeps the instance in PostgreSQL (docs/operations.md: Production)
cp "${PARTFIN_DAGSTER_CONFIG:-dagster.yaml}" "$DAGSTER_HOME/dagster.yaml"
# Hourly partitions start where the demo's data starts: the first hour the source replays (24 hours
# before the current hour), kept in PARTFIN_HOME so a restart of the same demo shows the same hours.
if [ -z "${PARTFIN_PARTITIONS_START:-}" ]; then
  start_file=$PARTFIN_HOME/partitions_start
  now=$(date -u +%s)
  [ -s "$start_file" ] || date -u -d "@$(( now - now % 3600 - 24 * 3600 ))" +%Y-%m-%d-%H:00 > "$start_file"
  PARTFIN_PARTITIONS_START=$(cat "$start_file")
fi
export PARTFIN_PARTITIONS_START
# The demo's source: orders from the partitions' start on, on an event clock that runs 30x faster than
# the wall clock from the demo's first start, beginning 6 hours behind it: 18 hours are there at once,
# then an event hour ends every 2 wall minutes (hours finalize live, late records come minutes later and
# re-run their downstream hour) until the event clock meets the wall clock (~12 minutes), where it stays.
# A late tail (0.05% of records, 1-6 hours late) below the policy's 0.1% lets the watermark move on.
# Event times remain the times the changes happened at the (simulated) source: never in the future.
if [ -z "${PARTFIN_SOURCE:-}" ]; then
  source_file=$PARTFIN_HOME/demo_source
  if [ ! -s "$source_file" ]; then
    now=$(date -u +%s)
    start=$(date -u -d "@$(( now - now % 3600 - 24 * 3600 ))" +%Y-%m-%dT%H:00:00Z)
    since=$(date -u -d "@$now" +%Y-%m-%dT%H:%M:%SZ)
    behind=$(date -u -d "@$(( now - now % 3600 - 6 * 3600 ))" +%Y-%m-%dT%H:00:00Z)
    echo "synthetic:rate=2,key_space=1000000,late_fraction=0.0005,start=$start,speed=30,speed_since=$since,speed_event=$behind" > "$source_file"
  fi
  PARTFIN_SOURCE=$(cat "$source_file")
  export PARTFIN_SOURCE
fi
# Dagster reads its instance from DAGSTER_HOME and warns about the repo's dagster.yaml template when
# started here: run it from DAGSTER_HOME (the workspace and PARTFIN_HOME are absolute paths).
cd "$DAGSTER_HOME"
# A job started in the background by a non-interactive shell (nohup, CI) inherits SIGINT ignored, and
# dagster dev copies SIGINT's handler onto SIGTERM: it would ignore both. bash cannot reset a signal
# ignored on entry; env does, so dagster dev installs its own SIGINT/SIGTERM handling (clean shutdown).
exec env --default-signal=INT,TERM "$REPO/.venv/bin/dagster" dev -w "$REPO/workspace.yaml" -h 127.0.0.1 -p "${PARTFIN_PORT:-3000}"
