#!/usr/bin/env bash
# The GPU suite, on a CUDA + PyTorch machine without a package registry, from the
# repository root:
#   here:        python -m sgrec.tools.gpu_bundle .whl          # the wheels that machine lacks (~7 MiB)
#   over there:  bash scripts/gpu_suite.sh   # WHEELS=.whl SITE=/tmp/site OUT=$OUT TEST_TIMEOUT=200 BENCH_TIMEOUT=290 STAGED_TIMEOUT=90
# Installs the wheels into a target folder (not the machine's site-packages), records the device,
# runs the CUDA tests (pytest -m cuda), the GPU benchmark (benchmarks/bench_gpu.py) and the staged
# kernel's variants (benchmarks/bench_staged_kernel.py, STAGED_TIMEOUT seconds), and writes
# logs, a JUnit XML and results.json into $OUT (default ./gpu-out). Exits non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-out}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || { echo "gpu_suite: installing the wheels failed" >&2; exit 2; }
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
rc=0
{ nvidia-smi || true; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"; } \
  > "$OUT/device.txt" 2>&1
# only the modules that hold CUDA tests: the others import client packages (openai, sglang, jsonschema)
# that the GPU image lacks and that have no CUDA test to run there
# each step under its own time limit (TEST_TIMEOUT, BENCH_TIMEOUT seconds), so that one that hangs
# leaves the other its turn; bench_gpu.py saves results.json after each of its parts
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m cuda -p no:cacheprovider --junitxml "$OUT/cuda-tests.xml" \
  $(grep -l 'mark.cuda' tests/*.py) 2>&1 | tee "$OUT/cuda-tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
# FlashRec's matrix: its published point only (the whole matrix is a run of its own: docs/gpu.md)
timeout "${BENCH_TIMEOUT:-290}" python3 benchmarks/bench_gpu.py --out "$OUT/results.json" \
  ${BENCH_ARGS:---flashrec-prompts 300 --flashrec-beams 50 --flashrec-concurrency 32} 2>&1 \
  | tee "$OUT/bench_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
# the staged beam-step kernel's launch variants side by side (where a retrieve request's beam steps go)
timeout "${STAGED_TIMEOUT:-90}" python3 benchmarks/bench_staged_kernel.py --out "$OUT/staged_kernel.json" 2>&1 \
  | tee "$OUT/staged_kernel.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
echo "gpu_suite: done (rc=$rc); logs and results in $OUT"
exit $rc
