#!/usr/bin/env bash
# Set everything up and open the demo: Dagster UI on http://127.0.0.1:3000 with the synthetic
# source replaying the last 24 hours (18 at once, 6 on a 30x event clock) and then streaming. Stop with Ctrl-C, or SIGTERM to its PID
# (however it was started: from a terminal, nohup, a CI script).
set -euo pipefail
# A job started in the background by a non-interactive shell (nohup, CI) inherits SIGINT ignored, and bash
# can neither trap nor reset a signal ignored on entry: start again with SIGINT and SIGTERM at their
# defaults, so the stop below runs on either (SigIgn bit 1 is SIGINT).
if (( 0x$(awk '/^SigIgn:/ { print $2 }' /proc/$$/status) & 2 )); then
  exec env --default-signal=INT,TERM bash "$0" "$@"
fi
cd "$(dirname "$0")/.."
REPO=$PWD
scripts/setup.sh
export PARTFIN_HOME=$(realpath -m "${PARTFIN_HOME:-$REPO/.partfin}")
export DAGSTER_HOME=$(realpath -m "${DAGSTER_HOME:-$PARTFIN_HOME/dagster}")
mkdir -p "$PARTFIN_HOME" "$DAGSTER_HOME"
# the log says where the tables are: `partfin status` reads the same home only when PARTFIN_HOME says so
echo "demo: PARTFIN_HOME=$PARTFIN_HOME (its tables: PARTFIN_HOME=$PARTFIN_HOME partfin status), DAGSTER_HOME=$DAGSTER_HOME" >&2
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
# A run a previous demo left in flight (killed with it) would hold the table's writer slot for good:
# marked failed first (partfin_assets/defs/stopped_runs.py); its commits are atomic, the next run goes on.
"$REPO/.venv/bin/python" -m partfin_assets.defs.stopped_runs
# Stopping (docs/secrets-and-stopping.md): dagster dev runs in a process group of its own (set -m) with
# everything it starts: the webserver, the daemon, the code server and its run workers. SIGTERM or SIGINT
# to this script, however it was started, sends SIGINT to that whole group: Dagster shuts its services
# down, and a run worker interrupts its step (a commit is atomic; the writer records its pending
# checkpoints) and marks its run failed. Whatever is still there after STOP_GRACE seconds is killed,
# so the demo and every process of it are gone within about STOP_GRACE + 1 s of the signal (at most 10 s).
# dagster dev copies SIGINT's handler onto SIGTERM; env starts it with both at their defaults whatever
# this shell was given, so it installs its own handling (clean shutdown).
STOP_GRACE=${PARTFIN_STOP_GRACE:-6}
set -m
env --default-signal=INT,TERM "$REPO/.venv/bin/dagster" dev -w "$REPO/workspace.yaml" -h 127.0.0.1 -p "${PARTFIN_PORT:-3000}" &
group=$!
set +m
group_alive() { ps -e -o pgid=,stat= | awk -v group="$group" '$1 == group && $2 !~ /^Z/ { found = 1 } END { exit !found }'; }
stop() {  # $1: the exit status (128 + the signal's number)
  trap '' INT TERM
  echo "demo: stopping Dagster and its runs (at most ${STOP_GRACE}s)" >&2
  kill -INT -- "-$group" 2>/dev/null || true
  local deadline=$(( ${EPOCHREALTIME/./} + STOP_GRACE * 1000000 ))  # by the clock: a loaded machine slows the loop
  while group_alive && (( ${EPOCHREALTIME/./} < deadline )); do sleep 0.2; done
  if group_alive; then
    echo "demo: still running after ${STOP_GRACE}s: killed (a run cut short is marked failed at the next start)" >&2
    kill -KILL -- "-$group" 2>/dev/null || true
  fi
  wait "$group" 2>/dev/null || true
  exit "$1"
}
trap 'stop 130' INT
trap 'stop 143' TERM
wait "$group" || true
# dagster dev ended by itself (a crash): take the rest of its group with it
kill -KILL -- "-$group" 2>/dev/null || true
