"""sgrec's plugin in a live stock SGLang server on CPU: benchmarks/bench_sglang_live.py
at a small size, its checks asserted. It needs SGLang's CPU kernels, which no package index has: build
them once with `python -m sgrec.tools.sglang_cpu_kernels --sglang-src SGLANG_TREE --out DIR` and set
SGREC_SGLANG_KERNELS=DIR (`pytest -m sglang_live`). Skipped without them, as the CUDA tests are
without a GPU; docs/performance.md records where it ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = os.environ.get("SGREC_SGLANG_KERNELS")

pytestmark = [pytest.mark.sglang_live,
              pytest.mark.skipif(not (KERNELS and Path(KERNELS, "sgl_kernel").is_dir()),
                                 reason="needs SGLang's CPU kernels (SGREC_SGLANG_KERNELS: see sgrec.tools.sglang_cpu_kernels)")]


def test_plugin_in_a_live_sglang_server(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sglang_live.py"), "--kernels", KERNELS,
                          "--requests", "300", "--constrained", "16", "--beams", "6", "--queued", "4",
                          "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    res = json.loads(lines[0][len("RESULT "):])
    assert all(res["checks"].values()), res["checks"]
    p = res["plugin"]
    assert p["requests"] > 0 and p["bad"] == 0 and p["beam_outputs"] > 0 and p["beam_bad"] == 0
    assert out.returncode == 0
