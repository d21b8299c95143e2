"""The 60-second soak (benchmarks/soak.py): mixed traffic at ~80% of measured capacity on loopback."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_soak_60s_mixed_traffic(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--duration", "60",
                           "--calibrate", "10", "--max-requests", "5000", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    brief = {k: v for k, v in res.items() if k != "samples"}
    assert proc.returncode == 0 and res["ok_run"], brief
    assert 50 <= res["requests"] <= 5000 and res["ok"] == res["requests"] and res["errors"] == 0, brief
    assert all(res["per_route"][k]["n"] > 0 for k in res["per_route"]), brief  # every route was driven
    assert res["kv_after_drain"]["kv_used"] == 0 and res["kv_after_drain"]["queued"] == 0, brief
    assert res["processes_alive"] and res["threads_end"] <= res["threads_start"] + 4, brief
    assert res["rss_mb_end"] <= 1.25 * res["rss_mb_start"], brief  # memory stays bounded
    assert res["tracebacks_in_log"] == 0, brief
    assert len(res["samples"]) >= 10  # RSS / KV / P99 over time
