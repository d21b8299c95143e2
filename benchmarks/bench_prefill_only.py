"""Prefill-only scheduling benchmark: FCFS vs plain SRJF vs SRJF with continuous JCT calibration.

The post-recommendation workload of PrefillOnly §7.1, lengths scaled down for CPU with the ratios
kept: users with long profiles (paper: 14,000 +- 3,000 tokens; here --profile-mean/--profile-std),
each scored against --posts posts (paper: 50 posts of 150 tokens), one prefill-only request per
(user, post) whose prompt is profile + post; the profile is the cached prefix. With --arrivals
requests (default) the requests of all users are shuffled and arrive one by one as a Poisson
process, so users interleave; with --arrivals users, users arrive as a Poisson process (paper §7.1),
each with all its post requests at once. Rates are multiples of FCFS's measured capacity. The KV
pool holds about --cache-profiles profiles, so the order of service decides the prefix hit rate.

Each run drives sgrec's real Scheduler (hybrid prefilling, suffix KV discarding, radix cache) in
this process and reports mean / P99 latency, throughput and the prefix hit rate; then, at the mean
latency FCFS reaches at its capacity, the highest rate each policy sustains (linear interpolation
between measured rates). Time: with --clock model (default) each request's service time comes from
a linear model a + b*uncached + c*cached fitted to prefill times measured first on this machine
(the fastest of 5 runs per point), and a virtual clock advances by it: the real scheduler decides
the order and the real radix cache decides the hits, while other load on a shared machine cannot
distort the comparison. --clock wall runs on the wall clock instead (use it on a quiet machine).

    python benchmarks/bench_prefill_only.py                 # ~6 minutes on 2 CPU cores
    python benchmarks/bench_prefill_only.py --users 4 --posts 10 --rates 0.5,2   # quick look
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import tempfile
import time

import numpy as np

from sgrec import Engine
from sgrec.managers.io_struct import TokenizedGenerateReq
from sgrec.tools.results import row, write_record

POLICIES = ["fcfs", "srjf-static", "srjf"]


def make_workload(users: int, posts: int, mean: int, std: int, post_len: int, vocab: int, seed: int,
                  interleave: bool):
    """[(user, prompt ids, profile length)] in arrival order: shuffled, or grouped by user."""
    rng = random.Random(seed)
    profiles = [[rng.randrange(3, vocab) for _ in range(max(post_len, int(rng.gauss(mean, std))))]
                for _ in range(users)]
    reqs = [(u, profiles[u] + [rng.randrange(3, vocab) for _ in range(post_len)], len(profiles[u]))
            for u in range(users) for _ in range(posts)]
    if interleave:
        rng.shuffle(reqs)
    return reqs


def fit_cost(model: str, lengths: list[int], pool: int):
    """LinearJct in seconds from the fastest of 5 timed prefill-only forwards per (n, cached) point."""
    from sgrec.policy.prefill_only import profile_linear_jct

    engine = Engine(model, device="cpu", dtype="float32", max_total_tokens=pool)
    return profile_linear_jct(engine.runner, lengths, repeats=5)


def run(model: str, policy: str, reqs, rate: float, pool: int, seed: int, clock: str = "model", cost=None,
        per_user: bool = False) -> dict:
    """rate: arrivals (requests, or users with per_user) per second."""
    engine = Engine(model, device="cpu", dtype="float32", max_total_tokens=pool, schedule_policy=policy)
    sched = engine.scheduler
    engine.generate(input_ids=reqs[0][1][:32], sampling_params={"max_new_tokens": 0})  # warm-up
    engine.flush_cache()
    rng = np.random.default_rng(seed)
    keys = [u for u, _, _ in reqs] if per_user else list(range(len(reqs)))
    uniq = list(dict.fromkeys(keys))
    gaps = rng.exponential(1.0 / rate, len(uniq)) if rate != float("inf") else np.zeros(len(uniq))
    at = dict(zip(uniq, np.cumsum(gaps) - gaps[0]))
    arrivals = [at[k] for k in keys]
    latency, hit_tokens, in_tokens = {}, 0, 0
    t0, vt, i = time.monotonic(), 0.0, 0

    def now() -> float:
        return vt if clock == "model" else time.monotonic() - t0

    sched.clock = now  # queueing times for the fairness term on the same clock
    while len(latency) < len(reqs):
        while i < len(reqs) and arrivals[i] <= now():
            _, ids, keep = reqs[i]
            sched.add_request(TokenizedGenerateReq(rid=str(i), input_ids=ids, sampling_params={"max_new_tokens": 0},
                                                   cache_prefix_len=keep))
            i += 1
        if not sched.has_work():
            if clock == "model":
                vt = arrivals[i]
            else:
                time.sleep(max(0.0, min(0.002, arrivals[i] - now())))
            continue
        done = [r for r in sched.step() if r.finished]
        if clock == "model":
            vt += sum(cost(len(r.input_ids), r.cached_tokens) for r in done)
        for req in done:
            latency[req.rid] = now() - arrivals[int(req.rid)]
            hit_tokens += req.cached_tokens
            in_tokens += len(req.input_ids)
    duration = now()
    lat = sorted(latency.values())
    engine.check_memory()
    return {
        "mean": statistics.fmean(lat), "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "throughput": len(reqs) / duration, "hit": hit_tokens / in_tokens,
    }


def rate_at_latency(points: list[tuple[float, float]], target: float) -> float:
    """Highest rate whose mean latency stays <= target, interpolating between measured (rate, mean)."""
    points = sorted(points)
    best = 0.0
    for (r0, m0), (r1, m1) in zip(points, points[1:]):
        if m0 <= target:
            best = r0
            if m1 > target:
                return r0 + (r1 - r0) * (target - m0) / (m1 - m0)
    if points and points[-1][1] <= target:
        best = points[-1][0]
    return best


def record_rows(results: dict, sustained: dict, mults: list[float], unit: int, args) -> list[dict]:
    """The result record's rows: each SRJF policy's mean and P99 latency and prefix hit rate beside FCFS's
    at each offered rate, and its sustained rate at FCFS's latency beside FCFS's."""
    base = {"arrivals": args.arrivals, "clock": args.clock}
    out = []
    for p in POLICIES[1:]:
        for m, (_, r), (_, f) in zip(mults, results[p], results["fcfs"]):
            params = {**base, "rate_x_capacity": m}
            out += [row(f"{p}: mean latency", "s", r["mean"], f["mean"], params=params, higher_is_better=False),
                    row(f"{p}: P99 latency", "s", r["p99"], f["p99"], params=params, higher_is_better=False),
                    row(f"{p}: prefix hit rate", "share", r["hit"], f["hit"], params=params)]
        out.append(row("sustained rate at FCFS's mean latency at its capacity", "req/s", sustained[p] * unit,
                       sustained["fcfs"] * unit, params={**base, "policy": p}))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model dir (default: a generated 4-layer, hidden-256 random Llama)")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--posts", type=int, default=10)
    ap.add_argument("--profile-mean", type=int, default=700)
    ap.add_argument("--profile-std", type=int, default=150)
    ap.add_argument("--post-len", type=int, default=8)
    ap.add_argument("--cache-profiles", type=float, default=2.0, help="KV pool size in mean profiles")
    ap.add_argument("--rates", default="0.25,0.5,1,2,4", help="multiples of FCFS's measured capacity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=["model", "wall"], default="model")
    ap.add_argument("--arrivals", choices=["requests", "users"], default="requests")
    ap.add_argument("--plot", default="bench_out/bench_prefill_only.png")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)

    model = args.model
    if model is None:
        from sgrec.tools.make_tiny_model import make_tiny_model

        model = make_tiny_model(tempfile.mkdtemp(prefix="sgrec_po_"), arch="llama", seed=1, hidden_size=256,
                                intermediate_size=1024, num_layers=4, num_heads=4, num_kv_heads=2,
                                max_position_embeddings=4096)
    per_user = args.arrivals == "users"
    reqs = make_workload(args.users, args.posts, args.profile_mean, args.profile_std, args.post_len, 512, args.seed,
                         not per_user)
    unit = args.posts if per_user else 1  # requests per arrival
    pool = int(args.cache_profiles * args.profile_mean * 1.1)
    print(f"workload: {len(reqs)} requests ({args.users} users x {args.posts} posts), profiles "
          f"{args.profile_mean}+-{args.profile_std} tokens, posts {args.post_len} tokens, KV pool {pool} tokens")

    cost = None
    if args.clock == "model":
        longest = max(len(ids) for _, ids, _ in reqs)
        cost = fit_cost(model, [64, longest // 4, longest // 2, longest], pool)
        print(f"service time model (s): {cost.a:.4f} + {cost.b * 1e3:.4f} ms x uncached + {cost.c * 1e3:.4f} ms x cached")
    capacity = run(model, "fcfs", reqs, float("inf"), pool, args.seed, args.clock, cost, per_user)["throughput"] / unit
    print(f"FCFS capacity (all requests at t=0): {capacity * unit:.2f} req/s")
    mults = [float(x) for x in args.rates.split(",")]
    results: dict[str, list[tuple[float, dict]]] = {p: [] for p in POLICIES}
    print(f"\n| rate x cap | req/s offered | policy | mean s | P99 s | throughput req/s | prefix hit |")
    print("|---|---|---|---|---|---|---|")
    for m in mults:
        for p in POLICIES:
            r = run(model, p, reqs, m * capacity, pool, args.seed, args.clock, cost, per_user)
            results[p].append((m * capacity, r))
            print(f"| {m:g} | {m * capacity * unit:.2f} | {p} | {r['mean']:.3f} | {r['p99']:.3f} | {r['throughput']:.2f} "
                  f"| {r['hit']:.1%} |", flush=True)

    fcfs_at_cap = [r for rate, r in results["fcfs"] if abs(rate - capacity) < 1e-9]
    target = fcfs_at_cap[0]["mean"] if fcfs_at_cap else statistics.median(r["mean"] for _, r in results["fcfs"])
    print(f"\nsustained rate at mean latency <= {target:.3f} s (FCFS's mean at its capacity):")
    sustained = {p: rate_at_latency([(rate, r["mean"]) for rate, r in results[p]], target) for p in POLICIES}
    for p in POLICIES:
        ratio = sustained[p] / sustained["fcfs"] if sustained["fcfs"] else float("nan")
        print(f"  {p:12s} {sustained[p] * unit:.2f} req/s  ({ratio:.2f}x FCFS)")
    print("target: calibrated SRJF (srjf) >= 1.4x FCFS")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        for p in POLICIES:
            xs = [rate * unit for rate, _ in results[p]]
            ax[0].plot(xs, [r["mean"] for _, r in results[p]], marker="o", label=p)
            ax[1].plot(xs, [r["p99"] for _, r in results[p]], marker="o", label=p)
        for a, name in zip(ax, ["mean latency (s)", "P99 latency (s)"]):
            a.set_xlabel("offered rate (req/s)"), a.set_ylabel(name), a.set_yscale("log"), a.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"plot: {args.plot}")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print("rerun: python benchmarks/bench_prefill_only.py " + " ".join(sys.argv[1:]))
    if not args.no_record:
        cmd = ("python benchmarks/bench_prefill_only.py " + shlex.join(sys.argv[1:] if argv is None else argv)).strip()
        path = write_record(benchmark="bench_prefill_only",
                            title="Prefill-only scheduling: FCFS, SRJF and calibrated SRJF",
                            command=cmd, results=record_rows(results, sustained, mults, unit, args),
                            peer="FCFS scheduling, the same engine and requests")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
