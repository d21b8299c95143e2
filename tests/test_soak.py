"""The 60-second soak (benchmarks/soak.py): mixed traffic at ~80% of measured capacity on loopback.

Nothing here counts events per second: the soak sends every arrival its seeded schedule puts in
the 60 s (at least benchmarks.soak.MIN_REQUESTS on average, however slow the machine), every route
comes up in the first len(MIX) requests, and every sample tick is either sampled or reported with
why it was not."""

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
    assert res["requests"] == res["sent"], f"sent {res['sent']} but only {res['requests']} ended within 120 s"
    assert res["ok"] == res["requests"] and res["errors"] == 0, brief
    assert len(res["per_route"]) <= res["sent"] <= 5000, brief
    assert all(res["per_route"][k]["n"] > 0 for k in res["per_route"]), brief  # every route was driven
    assert res["kv_after_drain"]["kv_used"] == 0 and res["kv_after_drain"]["queued"] == 0, brief
    assert res["processes_alive"] and res["threads_end"] <= res["threads_start"] + 4, brief
    assert res["rss_mb_end"] <= 1.25 * res["rss_mb_start"], brief  # memory stays bounded
    assert res["tracebacks_in_log"] == 0, brief
    # RSS / KV / P99 over time: one sample per tick of the schedule (or the reason it has none), and
    # the final one after the last request
    ticked = len(res["samples"]) - 1
    assert res["ticks_due"] >= int(60 // res["sample_period_s"]), brief
    assert ticked + len(res["ticks_skipped"]) == res["ticks_due"] and ticked >= 1, brief
