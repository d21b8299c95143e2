"""Overload: bursts of 10x capacity against a server with --max-queued-requests.

Starts `python -m sgrec.launch_server` on loopback (the embedded demo model) with
--max-running-requests R and --max-queued-requests Q (capacity = R + Q requests in the server),
measures the latency of R simultaneous requests (nothing queued, for reference), then runs --rounds
rounds of: R + Q simultaneous requests (the most the server admits: the baseline a served request
should keep), then a burst of 10 x (R + Q) simultaneous requests of the same shape. It reports, per
round and overall: how many were served and how many got 503 `The request queue is full.`, the 503s'
latency (they must come back fast), the served requests' latency against the baseline of the same
round (the slowest of each; the rounds' median ratio), RSS of the process tree after each burst
(bounded), the queue after the burst (empty) and the KV pool after drain (all free).

    python benchmarks/overload.py [--running 4] [--queued 4] [--rounds 5] [--no-limit] [--out overload.json]

--no-limit is the contrast: the same bursts against a server without --max-queued-requests (every
request is admitted, so the served ones wait behind the whole burst).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sgrec.tools.local_server import LocalServer  # noqa: E402
from sgrec.tools.probe import STATS_PERIOD_S, kv_after_drain, kv_state, proc_tree  # noqa: E402
from sgrec.tools.probe import percentile_ms as pct  # noqa: E402

BODY = {"sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}}


async def one(client: httpx.AsyncClient, i: int) -> tuple[int | str, float, dict]:
    """(status or transport error name, latency, body) of one request."""
    t0 = time.monotonic()
    try:
        r = await client.post("/generate", json={**BODY, "text": f"<i{i % 1600 + 1}><i{(7 * i) % 1600 + 1}>"})
    except httpx.TransportError as e:
        return type(e).__name__, time.monotonic() - t0, {}
    return r.status_code, time.monotonic() - t0, r.json()


async def burst(client: httpx.AsyncClient, n: int, offset: int) -> list[tuple[int, float, dict]]:
    return await asyncio.gather(*(one(client, offset + i) for i in range(n)))


async def run(url: str, pid: int, running: int, queued: int, rounds: int, baseline_reps: int,
              limitless: bool = False) -> dict:
    cap = running + queued
    # a connection per request, as from many clients (and no reuse of a keep-alive the server is closing)
    limits = httpx.Limits(max_connections=10 * cap + 8, max_keepalive_connections=0)
    out: dict = {"running": running, "queued": queued, "burst_size": 10 * cap, "rounds": []}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        # the latency of R alone, for reference (nothing waits)
        base = []
        for k in range(baseline_reps):
            base += [lat for code, lat, _ in await burst(client, running, 10_000 + k * running) if code == 200]
        out["baseline_running_p50_ms"], out["baseline_running_p99_ms"] = pct(base, 0.5), pct(base, 0.99)
        with httpx.Client(base_url=url, timeout=30) as sync:
            out["rss_mb_start"] = round(proc_tree(pid).rss_mb, 1)
            served_all, rejected_all, cap_all = [], [], []
            for r in range(rounds):
                # the baseline right before each burst: R + Q simultaneous requests, the most the server
                # admits, so both see the same machine (a shared machine's load drifts between rounds)
                capr = [lat for code, lat, _ in await burst(client, cap, 20_000 + r * cap) if code == 200]
                cap_all += capr
                res = await burst(client, 10 * cap, r * 10 * cap)
                served = [lat for code, lat, _ in res if code == 200]
                rejected = [lat for code, lat, body in res if code == 503
                            and body.get("message") == "The request queue is full."]
                other = [code for code, _, _ in res if code not in (200, 503)]
                served_all += served
                rejected_all += rejected
                await asyncio.sleep(2 * STATS_PERIOD_S + 0.1)  # a stats report from after the burst
                st = await asyncio.to_thread(kv_state, sync)
                out["rounds"].append({
                    "sent": len(res), "served": len(served), "rejected_503": len(rejected), "other": other,
                    "capacity_baseline_served": len(capr), "capacity_baseline_max_ms": pct(capr, 1.0),
                    "served_max_ms": pct(served, 1.0),
                    "served_max_over_baseline_max": round(max(served) / max(capr), 2) if served and capr else None,
                    "served_p50_ms": pct(served, 0.5), "capacity_baseline_p50_ms": pct(capr, 0.5),
                    "rejected_p99_ms": pct(rejected, 0.99),
                    "queued_after": st.queued, "rss_mb": round(proc_tree(pid).rss_mb, 1)})
            kv = await asyncio.to_thread(kv_after_drain, sync)
    out.update({
        "sent": sum(r["sent"] for r in out["rounds"]), "served": len(served_all), "rejected_503": len(rejected_all),
        "errors": sum(len(r["other"]) for r in out["rounds"]),
        "served_p50_ms": pct(served_all, 0.5), "served_p99_ms": pct(served_all, 0.99),
        "rejected_p50_ms": pct(rejected_all, 0.5), "rejected_p99_ms": pct(rejected_all, 0.99),
        "rss_mb_end": out["rounds"][-1]["rss_mb"] if out["rounds"] else None,
        "queued_after_all": max((r["queued_after"] for r in out["rounds"]), default=0),
        "kv_after_drain": kv.__dict__,
    })
    out["baseline_capacity_p50_ms"], out["baseline_capacity_p99_ms"] = pct(cap_all, 0.5), pct(cap_all, 0.99)
    ratios = sorted(r["served_max_over_baseline_max"] for r in out["rounds"] if r["served_max_over_baseline_max"])
    out["median_round_served_max_over_baseline_max"] = ratios[len(ratios) // 2] if ratios else None
    out["ok"] = out["errors"] == 0 and kv.empty and (out["rejected_503"] > 0 or limitless)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=4, help="--max-running-requests of the server")
    ap.add_argument("--queued", type=int, default=4, help="--max-queued-requests of the server")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline-reps", type=int, default=5)
    ap.add_argument("--no-limit", action="store_true",
                    help="contrast run: the same bursts against a server without --max-queued-requests")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    log = os.path.join(tempfile.mkdtemp(prefix="sgrec-overload-"), "server.log")
    flags = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "16384", "--max-running-requests", str(a.running)]
    if not a.no_limit:
        flags += ["--max-queued-requests", str(a.queued)]
    with LocalServer(flags, log_path=log) as srv:
        res = asyncio.run(run(srv.url, srv.pid, a.running, a.queued, a.rounds, a.baseline_reps, a.no_limit))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
