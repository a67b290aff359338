#!/usr/bin/env bash
# Every bench script in its quick mode (--quick: the same code paths at a tiny size, figures
# marked and not comparable), one after the other, each under a time limit, so that a benchmark
# that no longer runs fails CI (.ci/run) the day it breaks instead of months later.
#
#   bench/run_quick.sh                      # with .venv/bin/python
#   PYTHON=.venv-ci/bin/python bench/run_quick.sh
#   BENCH_TIMEOUT=300 bench/run_quick.sh    # seconds per script (default 120)
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
)

failed=()
times=()
start_all=$(date +%s.%N)
for line in "${QUICK[@]}"; do
    read -r -a argv <<<"$line"
    script=${argv[0]}
    echo "== bench/$line --quick"
    start=$(date +%s.%N)
    timeout --kill-after=15 "$LIMIT" "$PYTHON" "bench/$script" "${argv[@]:1}" --quick
    code=$?
    took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [ "$code" -ne 0 ]; then
        why="exit $code"
        [ "$code" -eq 124 ] || [ "$code" -eq 137 ] && why="past the ${LIMIT} s limit (exit $code)"
        failed+=("bench/$line --quick: $why")
    fi
    times+=("$(printf '%6s s  bench/%s --quick' "$took" "$line")")
done
total=$(awk -v a="$start_all" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')

echo "== bench quick runs, wall time"
printf '%s\n' "${times[@]}"
printf '%6s s  in all\n' "$total"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "== FAILED"
    printf '%s\n' "${failed[@]}"
    exit 1
fi
