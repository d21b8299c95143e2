#!/usr/bin/env bash
# Runs pytest as a much faster machine would see it: the tests' own clock slowed K times
# (SGREC_TEST_CLIENT_SLOWDOWN, tests/conftest.py): every client timeout and every sleep in the test
# process lasts K times longer, while the servers, their models and their clocks run as they are, so
# to the tests every generation, beam and batch finishes K times sooner. A test that needs the work
# to be slower than a client (a timeout shorter than a generation, "not finished yet" after a sleep,
# a length picked to outlast a client) fails here as it would on that machine. docs/reliability.md.
#
#   bash benchmarks/fast_machine.sh                          # the tests that race clients against servers
#   bash benchmarks/fast_machine.sh tests/test_server.py -k burst
#   FAST_K=50 bash benchmarks/fast_machine.sh                # 50 times faster (default 20)
#   bash benchmarks/fast_machine.sh tests                    # the whole suite
#
# Prints pytest's summary and one line with K and the wall time; exits with pytest's code.
set -uo pipefail
cd "$(dirname "$0")/.."
k="${FAST_K:-20}"
if [ "$#" -eq 0 ]; then
  # the files whose tests drive server processes with clients that time out, leave, or wait for a
  # state. Not tests whose components run inside the test process: their own timeouts are the
  # machine's clock there, and a test's sleep that stands for a slow component (a lock held 1 s
  # against a 5 s fetch timeout, tests/test_item_fetch.py) would outlast them.
  set -- tests/test_openai_api.py tests/test_server.py tests/test_reliability.py tests/test_rec_server.py \
    tests/test_catalog_server.py
fi
start=$(date +%s)
CI="${CI:-1}" SGREC_TEST_CLIENT_SLOWDOWN="$k" python -m pytest -q "$@"
rc=$?
echo "fast-machine run: pytest exit $rc, $(( $(date +%s) - start )) s wall, the tests' clock slowed ${k}x"
exit "$rc"
