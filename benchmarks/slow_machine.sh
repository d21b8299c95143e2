#!/usr/bin/env bash
# Runs pytest as a slow machine would: pinned to one CPU that a busy process shares for the whole run
# (a Python loop spinning on the same CPU), so every test, and every server process it starts, gets
# about half of one core. A test whose verdict depends on the machine's speed shows up here.
#
#   bash benchmarks/slow_machine.sh                                   # the whole suite (README's command)
#   bash benchmarks/slow_machine.sh tests/test_reliability.py -k burst
#   SLOW_CPU=1 bash benchmarks/slow_machine.sh                        # another CPU (two runs side by side)
#
# Prints pytest's summary and one line with the wall time; exits with pytest's code.
set -uo pipefail
cd "$(dirname "$0")/.."
cpu="${SLOW_CPU:-0}"
taskset -c "$cpu" python -c "while True: pass" &
spinner=$!
trap 'kill "$spinner" 2>/dev/null' EXIT
start=$(date +%s)
CI="${CI:-1}" taskset -c "$cpu" python -m pytest -q "$@"
rc=$?
echo "slow-machine run: pytest exit $rc, $(( $(date +%s) - start )) s wall, pinned to CPU $cpu with a spinning process"
exit "$rc"
