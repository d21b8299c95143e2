"""LARU benchmark: hit rates of every eviction policy and peer on three traces at three cache sizes,
the §5.3 noise sweep (with a PNG plot), and the per-access cost at ~10^4 cached nodes.

    pip install -e ".[bench]"
    python benchmarks/bench_laru.py                      # all of it, moderate sizes (~15 min on 2 busy cores)
    python benchmarks/bench_laru.py --requests 3000 --skip-scale   # quick look

Cache sizes are fractions of each trace's footprint (distinct tokens of all its prompts). Rows:
sgrec's lru / laru / fpb / hf with the online LightGBM predictor (laru with the §5.1 lambda rule, the
default; laru-every with lambda / b at every detected misprediction), laru with oracle predictions, opt
(Belady over leaves), SGLang 0.5.23's RadixCache (lru / lfu / slru) on the same request steps, and
libCacheSim on the flattened node-access stream (its hit rates count node hits without the
prefix rule, so they are a reference, not a like-for-like peer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from sgrec.radix.sim import LCS_POLICIES, SGLANG_POLICIES, TraceIndex, simulate
from sgrec.radix.traces import gr_users, multiturn, scan, zipf

ROWS = [("lru", "lightgbm"), ("laru", "lightgbm"), ("laru-every", "lightgbm"), ("fpb", "lightgbm"), ("hf", "lightgbm"),
        ("laru", "oracle"), ("opt", "oracle")] + [(p, None) for p in SGLANG_POLICIES + LCS_POLICIES]
EVERY = {"lambda_rule": "every"}  # laru-every: Algorithm 1's lambda / b per detected misprediction at any k
NOISE = [0.0, 0.1, 0.3, 0.5, 1.0]


def footprint(index: TraceIndex) -> int:
    sizes: dict[int, int] = {}
    for path in index.paths:
        for obj, size in path:
            sizes[obj] = size
    return sum(sizes.values())


def label(policy: str, predictor: str | None) -> str:
    return f"{policy} (oracle)" if policy == "laru" and predictor == "oracle" else policy


def run_table(traces: dict, fractions: list[float], log) -> dict:
    out: dict = {}
    for tname, trace in traces.items():
        index = TraceIndex(trace)
        fp = footprint(index)
        for frac in fractions:
            cap = int(fp * frac)
            for policy, pred in ROWS:
                r = simulate(trace, policy.removesuffix("-every"), cap, predictor=pred or "lightgbm", index=index,
                             config=EVERY if policy.endswith("-every") else None)
                out[(tname, frac, label(policy, pred))] = r.row() | {"footprint": fp}
                log(f"{tname:9s} {frac:4.2f} cap={cap:7d} {label(policy, pred):14s} hit={r.token_hit_rate:.4f} "
                    f"req_hit={r.request_hit_rate:.4f} calls={r.predictor_calls} us/acc={r.us_per_access:.0f}")
    return out


def run_noise(trace, frac: float, log) -> dict:
    index = TraceIndex(trace)
    cap = int(footprint(index) * frac)
    out = {"cap": cap, "lru": simulate(trace, "lru", cap).token_hit_rate,
           "opt": simulate(trace, "opt", cap, index=index).token_hit_rate}
    for policy in ("laru", "laru-every", "fpb", "hf"):
        for p in NOISE:
            r = simulate(trace, policy.removesuffix("-every"), cap, noise=p, index=index,
                         config=EVERY if policy.endswith("-every") else None)
            out[(policy, p)] = r.row()
            log(f"noise {policy:4s} p={p:.1f} hit={r.token_hit_rate:.4f} calls={r.predictor_calls}")
    return out


def run_scale(log) -> list[dict]:
    """Many small items so that ~10^4 nodes are cached."""
    trace = zipf(num_requests=30000, num_items=40000, item_len=4, alpha=0.8, seed=1)
    index = TraceIndex(trace)
    rows = []
    for policy, pred in (("lru", None), ("laru", "oracle"), ("laru", "lightgbm"), ("sglang-lru", None)):
        r = simulate(trace, policy, 40000, predictor=pred or "lightgbm", index=index)
        rows.append({"policy": label(policy, pred), **r.row()})
        log(f"scale {label(policy, pred):14s} peak_nodes={r.peak_nodes} us/acc={r.us_per_access:.1f}")
    return rows


def plot_noise(noise: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for policy, marker in (("laru", "o"), ("laru-every", "D"), ("fpb", "s"), ("hf", "^")):
        ax.plot(NOISE, [noise[(policy, p)]["token_hit_rate"] for p in NOISE], marker=marker, label=policy.upper())
    ax.axhline(noise["lru"], color="gray", ls="--", label="LRU")
    ax.axhline(noise["opt"], color="black", ls=":", label="OPT")
    ax.set_xlabel("error probability p (prediction := -true next access)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"multiturn, cache {noise['cap']} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_tables(table: dict, traces: list[str], fractions: list[float], noise: dict | None, scale: list[dict]) -> None:
    cols = [(t, f) for t in traces for f in fractions]
    labels = list(dict.fromkeys(k[2] for k in table))
    print("\nToken hit rate (cache = fraction of the trace's footprint):\n")
    print("| policy | " + " | ".join(f"{t} {f:.0%}" for t, f in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    print("| cache tokens | " + " | ".join(str(table[(t, f, 'lru')]["cache_tokens"]) for t, f in cols) + " |")
    for lab in labels:
        print(f"| {lab} | " + " | ".join(f"{table[(t, f, lab)]['token_hit_rate']:.4f}" for t, f in cols) + " |")
    print("\nPredictor calls / microseconds per request (sgrec policies):\n")
    print("| policy | " + " | ".join(f"{t} {f:.0%}" for t, f in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for lab in ("lru", "laru", "laru-every", "fpb", "hf", "laru (oracle)", "opt"):
        print(f"| {lab} | " + " | ".join(f"{table[(t, f, lab)]['predictor_calls']} / {table[(t, f, lab)]['us_per_access']:.0f}"
                                         for t, f in cols) + " |")
    if noise:
        print(f"\nNoise sweep (multiturn, {noise['cap']} tokens; LRU {noise['lru']:.4f}, OPT {noise['opt']:.4f}):\n")
        print("| policy | " + " | ".join(f"p={p}" for p in NOISE) + " |")
        print("|---|" + "---:|" * len(NOISE))
        for policy in ("laru", "laru-every", "fpb", "hf"):
            print(f"| {policy} | " + " | ".join(f"{noise[(policy, p)]['token_hit_rate']:.4f}" for p in NOISE) + " |")
        print("| predictor calls (laru/fpb/hf, p=0) | " + " / ".join(
            str(noise[(pol, 0.0)]["predictor_calls"]) for pol in ("laru", "fpb", "hf")) + " |")
    if scale:
        print("\nPer-access cost at ~10^4 nodes (zipf, 40000 items of 4 tokens, cache 40000 tokens):\n")
        print("| policy | peak nodes | us per request | token hit rate |\n|---|---:|---:|---:|")
        for r in scale:
            print(f"| {r['policy']} | {r['peak_nodes']} | {r['us_per_access']:.1f} | {r['token_hit_rate']:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10000, help="gr-users and scan requests")
    ap.add_argument("--conversations", type=int, default=800, help="multiturn conversations")
    ap.add_argument("--fractions", default="0.05,0.1,0.2")
    ap.add_argument("--noise-fraction", type=float, default=0.1)
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--out", default="bench_out")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    fractions = [float(x) for x in a.fractions.split(",")]
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    traces = {"gr-users": gr_users(a.requests), "multiturn": multiturn(a.conversations), "scan": scan(a.requests)}
    for n, tr in traces.items():
        log(f"trace {n}: {len(tr)} requests, {sum(len(r.tokens) for r in tr)} prompt tokens")
    table = run_table(traces, fractions, log)
    noise = run_noise(traces["multiturn"], a.noise_fraction, log)
    plot_path = os.path.join(a.out, "bench_laru_noise.png")
    plot_noise(noise, plot_path)
    scale = [] if a.skip_scale else run_scale(log)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print("command: python benchmarks/bench_laru.py " + " ".join(sys.argv[1:]))
    print_tables(table, list(traces), fractions, noise, scale)
    print(f"\nnoise plot: {plot_path}; total {time.time() - t0:.0f} s")
    with open(os.path.join(a.out, "bench_laru.json"), "w") as f:
        json.dump({"table": {"|".join(map(str, k)): v for k, v in table.items()},
                   "noise": {"|".join(map(str, k)) if isinstance(k, tuple) else k: v for k, v in noise.items()},
                   "scale": scale}, f, indent=1)


if __name__ == "__main__":
    main()
