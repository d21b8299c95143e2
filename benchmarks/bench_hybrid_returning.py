"""The hybrid family's prefix cache on the returning-user trace: rank requests with state snapshots on
(the radix cache) and off (--disable-radix-cache), side by side in one run.

    python benchmarks/bench_hybrid_returning.py                    # Qwen3.5-0.8B's shape, random weights, bf16
    python benchmarks/bench_hybrid_returning.py --requests 20 --max-history 50   # a smoke run

The trace is `gr-users` (sgrec.radix.sim.traces, as benchmarks/bench_hicache.py builds it): MovieLens-100K
visits from --start, merged at random across users (each user's own order kept); a request ranks
--candidates movies (the true one among them) for the user's profile (a shared system prompt, a user
token, the user's last --max-history (item, rating) pairs), one request at a time through
`sgrec.Engine.rank`. On a hybrid model rank runs user-as-prefix with a state fork per candidate, and
the user's state is kept as a snapshot at the profile's end: a returning user whose profile grew
resumes from it. The latency of a rank request is its time to the first (only) token: prefill-only.
Reported per configuration: the hit rate (cached / prompt tokens over the trace), TTFT P50 and P99,
and the P50's ratio of off against on (target: 2x). Both configurations answer each request with the
same ranking (the first items are compared).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402
from bench_hicache import pct, requests  # noqa: E402
from bench_hybrid import model_dir  # noqa: E402
from sgrec import Engine  # noqa: E402
from sgrec.radix.sim.traces import ITEM_BASE, RANK_TOKEN  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402


def write_catalog(path: str) -> None:
    """Every MovieLens-100K movie as a catalog item: its item token, which is also its id token."""
    from sgrec.data.movielens import load_ml100k

    with open(path, "w") as f:
        for m in sorted(load_ml100k().movies):
            f.write(json.dumps({"id": f"m{m}", "token_ids": [ITEM_BASE + m], "id_token": ITEM_BASE + m}) + "\n")


def run(path: str, catalog: str, reqs: list, args, snapshots: bool) -> dict:
    engine = Engine(path, device="cpu", dtype=args.dtype, item_catalog=catalog, max_total_tokens=args.pool,
                    max_mamba_cache_size=args.states, disable_radix_cache=not snapshots)
    try:
        first = reqs[0]
        engine.rank({"id": "warm-up", "token_ids": first.profile[:8]}, [f"m{c}" for c in first.candidates],
                    instruction=[RANK_TOKEN], prefix="none")
        lat, prompt, cached, top, hits = [], 0, 0, [], []
        for r in reqs:
            t = time.perf_counter()
            out = engine.rank({"id": str(r.user), "token_ids": r.profile}, [f"m{c}" for c in r.candidates],
                              instruction=[RANK_TOKEN])
            lat.append(time.perf_counter() - t)
            prompt += out["meta_info"]["prompt_tokens"]
            cached += out["meta_info"]["cached_tokens"]
            hits.append(out["meta_info"]["cached_tokens"] > 0)
            top.append(out["ranking"][0]["item"])
    finally:
        engine.shutdown()
    return {"hit_rate": cached / prompt, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "top": top,
            "rps": len(lat) / sum(lat), "lat": lat, "hits": hits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--start", type=int, default=20000)
    ap.add_argument("--max-history", type=int, default=200)
    ap.add_argument("--candidates", type=int, default=10)
    ap.add_argument("--pool", type=int, default=65536, help="--max-total-tokens")
    ap.add_argument("--states", type=int, default=64, help="--max-mamba-cache-size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cmd = " ".join(["python", "benchmarks/bench_hybrid_returning.py", *map(shlex.quote, sys.argv[1:])])
    print(header(cmd, "bench_hybrid_returning"), flush=True)
    path = model_dir(args)
    reqs, _ = requests(args.requests, args.start, args.max_history, False, "interleaved", args.seed)
    for r in reqs:  # the trace's candidates (sampled with repeats), at most --candidates distinct ones a request
        r.candidates = list(dict.fromkeys(r.candidates))[: args.candidates]
    users = len({r.user for r in reqs})
    print(f"  {len(reqs)} requests of {users} users, profiles of {min(len(r.profile) for r in reqs)}-"
          f"{max(len(r.profile) for r in reqs)} tokens, up to {args.candidates} candidates each", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        catalog = os.path.join(tmp, "catalog.jsonl")
        write_catalog(catalog)
        res = {}
        for name, on in (("snapshots on", True), ("snapshots off", False)):
            res[name] = run(path, catalog, reqs, args, on)
            r = res[name]
            print(f"  {name}: hit rate {r['hit_rate']:.1%}, TTFT P50 {r['p50'] * 1e3:.0f} ms, "
                  f"P99 {r['p99'] * 1e3:.0f} ms", flush=True)
    on, off = res["snapshots on"], res["snapshots off"]
    same = sum(a == b for a, b in zip(on["top"], off["top"]))
    print()
    print(md_table(["configuration", "hit rate", "TTFT P50", "TTFT P99", "requests/s"],
                   [[k, f"{v['hit_rate']:.1%}", f"{v['p50'] * 1e3:.0f} ms", f"{v['p99'] * 1e3:.0f} ms",
                     f"{v['rps']:.2f}"] for k, v in res.items()]))
    print(f"\nTTFT P50 off / on: **{off['p50'] / on['p50']:.2f}x**; same first item: {same}/{len(reqs)}")
    # the requests that found their user's snapshot, in both configurations
    back = [i for i, h in enumerate(on["hits"]) if h]
    back_on, back_off = pct([on["lat"][i] for i in back], 0.5), pct([off["lat"][i] for i in back], 0.5)
    print(f"requests that resumed from a snapshot: {len(back)}; their TTFT P50 {back_on * 1e3:.0f} ms on, "
          f"{back_off * 1e3:.0f} ms off ({back_off / back_on:.2f}x)")
    if not args.no_record:
        params = {"model": os.path.basename(path.rstrip("/")), "dtype": args.dtype, "requests": len(reqs),
                  "max_history": args.max_history, "candidates": args.candidates}
        results = [
            row("TTFT P50", "ms", on["p50"] * 1e3, off["p50"] * 1e3, higher_is_better=False, params=params),
            row("TTFT P99", "ms", on["p99"] * 1e3, off["p99"] * 1e3, higher_is_better=False, params=params),
            row("prefix-cache hit rate", "%", 100 * on["hit_rate"], 100 * off["hit_rate"], ratio=None, params=params),
            row("TTFT P50 of the requests that resumed", "ms", back_on * 1e3, back_off * 1e3, higher_is_better=False,
                params={**params, "resumed_requests": len(back)}),
        ]
        out = write_record(benchmark="bench_hybrid_returning",
                           title="The hybrid family's state snapshots on the returning-user trace", command=cmd,
                           results=results, peer="sgrec with --disable-radix-cache (no snapshots)")
        print(f"result record: {out}")


if __name__ == "__main__":
    main()
