#!/usr/bin/env bash
# Every bench script in its quick mode (--quick: the same code paths at a tiny size, figures
# marked and not comparable), BENCH_JOBS at a time (default 2: most of a quick run is waiting on
# processes and timers), each under a time limit, so that a benchmark that no longer runs fails
# CI (.ci/run) the day it breaks instead of months later. Each run's output is printed whole
# when it ends.
#
#   bench/run_quick.sh                      # with .venv/bin/python
#   PYTHON=.venv-ci/bin/python bench/run_quick.sh
#   BENCH_TIMEOUT=300 bench/run_quick.sh    # seconds per script (default 120)
#   BENCH_JOBS=1 bench/run_quick.sh         # one after the other
#
# It runs them all, prints each one's wall time and the total, and exits 1 when any exited
# non-zero or ran past its limit. tests/test_bench_quick.py fails when a bench/*.py script with
# a __main__ entry is missing from QUICK below.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
LIMIT=${BENCH_TIMEOUT:-120}

# One run per line: the script, then any arguments beside --quick (added to every line).
QUICK=(
    "eventstore.py"
    "heartbeats.py"
    "heartbeat_steps.py"
    "scheduler.py"
    "nats_security.py"
    "front.py"
    "sim.py"
    "failover.py"
    "failover.py --clients 4"
    "failover.py --clients 4 --controller-down 2 --seconds 6"
    "failover.py --classes controller-stop --clients 4"
    "gateway.py"
    "crashloop.py"
    "crashloop.py --ha"
    "soak.py"
    "dashboard.py"
    "coldstart.py"
    "rollout.py"
    "realmodel.py"
    "stage_link.py"
    "stage_link.py --secure"
    "outbox.py"
)

JOBS=${BENCH_JOBS:-2}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# One run, its output to $OUT/<n>.log, its exit code and wall time to $OUT/<n>.end.
run_one() {
    local n=$1 line=$2
    local -a argv
    read -r -a argv <<<"$line"
    local start code took
    start=$(date +%s.%N)
    timeout --kill-after=15 "$LIMIT" "$PYTHON" "bench/${argv[0]}" "${argv[@]:1}" --quick \
        >"$OUT/$n.log" 2>&1
    code=$?
    took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    echo "$code $took" >"$OUT/$n.end"
}

failed=()
times=()
shown=0
# Print, in QUICK's order, every run that has ended and whose predecessors have been printed.
show_ended() {
    while [ "$shown" -lt "${#QUICK[@]}" ] && [ -f "$OUT/$shown.end" ]; do
        local line=${QUICK[$shown]} code took
        read -r code took <"$OUT/$shown.end"
        echo "== bench/$line --quick"
        cat "$OUT/$shown.log"
        if [ "$code" -ne 0 ]; then
            why="exit $code"
            [ "$code" -eq 124 ] || [ "$code" -eq 137 ] && why="past the ${LIMIT} s limit (exit $code)"
            failed+=("bench/$line --quick: $why")
        fi
        times+=("$(printf '%6s s  bench/%s --quick' "$took" "$line")")
        shown=$((shown + 1))
    done
}

start_all=$(date +%s.%N)
running=0
for n in "${!QUICK[@]}"; do
    if [ "$running" -ge "$JOBS" ]; then
        wait -n
        running=$((running - 1))
        show_ended
    fi
    run_one "$n" "${QUICK[$n]}" &
    running=$((running + 1))
done
wait
show_ended
total=$(awk -v a="$start_all" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')

echo "== bench quick runs, wall time"
printf '%s\n' "${times[@]}"
printf '%6s s  in all\n' "$total"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "== FAILED"
    printf '%s\n' "${failed[@]}"
    exit 1
fi
