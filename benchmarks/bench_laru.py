"""LARU benchmark: hit rates of every eviction policy and peer on three traces at three cache sizes,
the §5.3 noise sweep (with a PNG plot), and the per-access cost at ~10^4 cached nodes.

    pip install -e ".[bench]"
    python benchmarks/bench_laru.py                      # all of it, moderate sizes (~15 min on 2 busy cores)
    python benchmarks/bench_laru.py --requests 3000 --skip-scale   # quick look
    python benchmarks/bench_laru.py --config-search     # only: LARU configs against the hit-rate targets

Cache sizes are fractions of each trace's footprint (distinct tokens of all its prompts). Rows:
sgrec's lru / laru / fpb / hf with the online LightGBM predictor (laru = Algorithm 1 with the §5.1
lambda rule, the default; laru-every with lambda / b at every detected misprediction; laru-bets and
laru-carry with the opt-in `lambda_reset` robustness beyond Algorithm 1), laru with oracle
predictions, opt (Belady over leaves), SGLang 0.5.23's RadixCache (lru / lfu / slru) on the same
request steps, and libCacheSim on the flattened node-access stream (its hit rates count node hits
without the prefix rule, so they are a reference, not a like-for-like peer). Times are wall and CPU
microseconds per request (CPU time of the process: steadier on a busy shared host).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

from sgrec.radix.sim import LCS_POLICIES, SGLANG_POLICIES, TraceIndex, simulate
from sgrec.radix.sim.traces import gr_users, multiturn, scan, zipf
from sgrec.tools.results import row, write_record

ROWS = [("lru", "lightgbm"), ("laru", "lightgbm"), ("laru-every", "lightgbm"), ("laru-bets", "lightgbm"),
        ("fpb", "lightgbm"), ("hf", "lightgbm"), ("laru", "oracle"), ("opt", "oracle")] + \
    [(p, None) for p in SGLANG_POLICIES + LCS_POLICIES]
VARIANTS = {  # laru variants: name suffix -> config
    "every": {"lambda_rule": "every"},  # Algorithm 1's lambda / b per detected misprediction at any k
    "bets": {"lambda_reset": "bets"},  # opt-in, beyond Algorithm 1 (eviction.LARUPolicy)
    "carry": {"lambda_reset": "carry"},  # opt-in, beyond Algorithm 1
}
NOISE = [0.0, 0.1, 0.3, 0.5, 1.0]
NOISE_POLICIES = ("laru", "laru-every", "laru-bets", "laru-carry", "fpb", "hf")
INVERTED_POLICIES = ("laru", "laru-every", "laru-bets", "laru-carry", "fpb")  # p = 1 at every size


def split(policy: str) -> tuple[str, dict | None]:
    """'laru-bets' -> ('laru', its config); other names -> (name, None)."""
    base, _, variant = policy.partition("-")
    return (base, VARIANTS[variant]) if base == "laru" and variant else (policy, None)


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
                base, cfg = split(policy)
                r = simulate(trace, base, cap, predictor=pred or "lightgbm", index=index, config=cfg)
                out[(tname, frac, label(policy, pred))] = r.row() | {"footprint": fp}
                log(f"{tname:9s} {frac:4.2f} cap={cap:7d} {label(policy, pred):14s} hit={r.token_hit_rate:.4f} "
                    f"req_hit={r.request_hit_rate:.4f} calls={r.predictor_calls} us/acc={r.us_per_access:.0f} "
                    f"cpu_us/acc={r.cpu_us_per_access:.0f}")
    return out


def run_noise(trace, frac: float, log) -> dict:
    index = TraceIndex(trace)
    cap = int(footprint(index) * frac)
    out = {"cap": cap, "lru": simulate(trace, "lru", cap).token_hit_rate,
           "opt": simulate(trace, "opt", cap, index=index).token_hit_rate}
    for policy in NOISE_POLICIES:
        base, cfg = split(policy)
        for p in NOISE:
            r = simulate(trace, base, cap, noise=p, index=index, config=cfg)
            out[(policy, p)] = r.row()
            log(f"noise {policy:10s} p={p:.1f} hit={r.token_hit_rate:.4f} calls={r.predictor_calls}")
    return out


def run_inverted(trace, fractions: list[float], log) -> dict:
    """Noise p = 1 (every prediction replaced by minus the true next access) at every cache size."""
    index = TraceIndex(trace)
    fp = footprint(index)
    out: dict = {}
    for frac in fractions:
        cap = int(fp * frac)
        out[("lru", frac)] = simulate(trace, "lru", cap).token_hit_rate
        for policy in INVERTED_POLICIES:
            base, cfg = split(policy)
            out[(policy, frac)] = simulate(trace, base, cap, noise=1.0, index=index, config=cfg).token_hit_rate
            log(f"p=1 {frac:4.2f} {policy:10s} hit={out[(policy, frac)]:.4f} (lru {out[('lru', frac)]:.4f})")
    return out


SCALE_ROWS = (("lru", None, None), ("laru", "oracle", None), ("laru", "lightgbm", None),
              ("laru", "lightgbm", {"train_async": True}), ("laru", "lightgbm", {"lambda_reset": "bets"}),
              ("sglang-lru", None, None))


def run_scale(log, repeats: int = 3) -> list[dict]:
    """Many small items so that ~10^4 nodes are cached. Each sgrec row is run `repeats` times (rows
    interleaved) and the fastest run is kept: on a shared host the slower ones measure the neighbours."""
    trace = zipf(num_requests=30000, num_items=40000, item_len=4, alpha=0.8, seed=1)
    index = TraceIndex(trace)
    best: dict[int, dict] = {}
    for _ in range(repeats):
        for i, (policy, pred, cfg) in enumerate(SCALE_ROWS):
            if policy.startswith("sglang") and i in best:
                continue  # a peer, ~2 ms per request: once is enough
            r = simulate(trace, policy, 40000, predictor=pred or "lightgbm", index=index, config=cfg)
            name = label(policy, pred) + (f" {json.dumps(cfg)}" if cfg else "")
            row = {**r.row(), "policy": name}
            if i not in best or row["us_per_access"] < best[i]["us_per_access"]:
                best[i] = row
            log(f"scale {name:40s} peak_nodes={r.peak_nodes} us/acc={r.us_per_access:.1f} "
                f"cpu_us/acc={r.cpu_us_per_access:.1f}")
    return [best[i] for i in range(len(SCALE_ROWS))]


SEARCH = {  # --config-search: LARU configs (eviction.LARUPolicy keys) checked against the hit-rate targets
    "paper (default)": {},
    "every": {"lambda_rule": "every"},
    "every b=4": {"lambda_rule": "every", "b": 4},
    "k_div 16": {"k_div": 16},
    "bets": {"lambda_reset": "bets"},
    "carry": {"lambda_reset": "carry"},
    "k_div 8 + bets": {"k_div": 8, "lambda_reset": "bets"},
    "every + bets": {"lambda_rule": "every", "lambda_reset": "bets"},
    "every b=4 + bets": {"lambda_rule": "every", "b": 4, "lambda_reset": "bets"},
    "every b=4 + carry": {"lambda_rule": "every", "b": 4, "lambda_reset": "carry"},
}
SEARCH_PEERS = ("lcs-arc", "lcs-s3fifo", "lcs-sieve", "lcs-lhd")  # the libCacheSim heuristics of the table


def run_config_search(traces: dict, fractions: list[float], log) -> None:
    """Every SEARCH config with the online predictor on every trace and size and with inverted
    predictions (p = 1) on multiturn; prints which of the issue's three hit-rate targets each meets:
    p = 1 within 5% of LRU, online >= LRU everywhere, online >= the best libCacheSim heuristic on
    gr-users (the oracle target holds for all of them: exact predictions never trigger line 14)."""
    caps, lru, best_lcs, idx = {}, {}, {}, {}
    for t, trace in traces.items():
        idx[t] = TraceIndex(trace)
        fp = footprint(idx[t])
        for f in fractions:
            caps[(t, f)] = int(fp * f)
            lru[(t, f)] = simulate(trace, "lru", caps[(t, f)]).token_hit_rate
            if t == "gr-users":
                best_lcs[f] = max(simulate(trace, p, caps[(t, f)], index=idx[t]).token_hit_rate for p in SEARCH_PEERS)
    cols = [(t, f) for t in traces for f in fractions]
    print("\nLARU config search: online-predictor hit rate per trace and size (* = below LRU), inverted "
          "predictions (p = 1) on multiturn against LRU, and the three targets "
          "(p1: within 5% of LRU at p = 1; lru: >= LRU in every cell; lcs: >= the best of "
          f"{', '.join(SEARCH_PEERS)} on gr-users).\n")
    print("| config | " + " | ".join(f"{t} {f:.0%}" for t, f in cols) + " | "
          + " | ".join(f"p=1 multiturn {f:.0%}" for f in fractions) + " | p1 | lru | lcs |")
    print("|---|" + "---:|" * (len(cols) + len(fractions)) + ":-:|:-:|:-:|")
    print("| lru | " + " | ".join(f"{lru[c]:.4f}" for c in cols) + " | " + " | ".join("" for _ in fractions)
          + " | | | |")
    print("| best lcs heuristic | " + " | ".join(f"{best_lcs[f]:.4f}" if t == "gr-users" else "" for t, f in cols)
          + " | " + " | ".join("" for _ in fractions) + " | | | |")
    for name, cfg in SEARCH.items():
        online = {c: simulate(traces[c[0]], "laru", caps[c], index=idx[c[0]], config=cfg).token_hit_rate
                  for c in cols}
        inv = {f: simulate(traces["multiturn"], "laru", caps[("multiturn", f)], noise=1.0, index=idx["multiturn"],
                           config=cfg).token_hit_rate / lru[("multiturn", f)] - 1 for f in fractions}
        ok_p1 = all(v >= -0.05 for v in inv.values())
        ok_lru = all(online[c] >= lru[c] for c in cols)
        ok_lcs = all(online[("gr-users", f)] >= best_lcs[f] for f in fractions)
        log(f"search {name}: p1 {ok_p1} lru {ok_lru} lcs {ok_lcs}")
        print(f"| {name} {json.dumps(cfg)} | "
              + " | ".join(f"{online[c]:.4f}{'*' if online[c] < lru[c] else ''}" for c in cols) + " | "
              + " | ".join(f"{v:+.1%}" for v in inv.values()) + " | "
              + " | ".join("yes" if ok else "no" for ok in (ok_p1, ok_lru, ok_lcs)) + " |")


def plot_noise(noise: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for policy, marker in (("laru", "o"), ("laru-every", "D"), ("laru-bets", "v"), ("laru-carry", "x"), ("fpb", "s"),
                           ("hf", "^")):
        ax.plot(NOISE, [noise[(policy, p)]["token_hit_rate"] for p in NOISE], marker=marker, label=policy.upper())
    ax.axhline(noise["lru"], color="gray", ls="--", label="LRU")
    ax.axhline(noise["opt"], color="black", ls=":", label="OPT")
    ax.set_xlabel("error probability p (prediction := -true next access)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"multiturn, cache {noise['cap']} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_tables(table: dict, traces: list[str], fractions: list[float], noise: dict | None, scale: list[dict],
                 inverted: dict | None = None) -> None:
    cols = [(t, f) for t in traces for f in fractions]
    labels = list(dict.fromkeys(k[2] for k in table))
    print("\nToken hit rate (cache = fraction of the trace's footprint):\n")
    print("| policy | " + " | ".join(f"{t} {f:.0%}" for t, f in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    print("| cache tokens | " + " | ".join(str(table[(t, f, 'lru')]["cache_tokens"]) for t, f in cols) + " |")
    for lab in labels:
        print(f"| {lab} | " + " | ".join(f"{table[(t, f, lab)]['token_hit_rate']:.4f}" for t, f in cols) + " |")
    print("\nPredictor calls / wall / CPU microseconds per request (sgrec policies):\n")
    print("| policy | " + " | ".join(f"{t} {f:.0%}" for t, f in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for lab in ("lru", "laru", "laru-every", "laru-bets", "fpb", "hf", "laru (oracle)", "opt"):
        print(f"| {lab} | " + " | ".join(
            f"{table[(t, f, lab)]['predictor_calls']} / {table[(t, f, lab)]['us_per_access']:.0f} / "
            f"{table[(t, f, lab)]['cpu_us_per_access']:.0f}" for t, f in cols) + " |")
    if noise:
        print(f"\nNoise sweep (multiturn, {noise['cap']} tokens; LRU {noise['lru']:.4f}, OPT {noise['opt']:.4f}):\n")
        print("| policy | " + " | ".join(f"p={p}" for p in NOISE) + " |")
        print("|---|" + "---:|" * len(NOISE))
        for policy in NOISE_POLICIES:
            print(f"| {policy} | " + " | ".join(f"{noise[(policy, p)]['token_hit_rate']:.4f}" for p in NOISE) + " |")
        print("| predictor calls (laru/fpb/hf, p=0) | " + " / ".join(
            str(noise[(pol, 0.0)]["predictor_calls"]) for pol in ("laru", "fpb", "hf")) + " |")
    if inverted:
        print("\nNoise p = 1 on multiturn at every size (hit rate; in brackets the distance to LRU):\n")
        print("| policy | " + " | ".join(f"multiturn {f:.0%}" for f in fractions) + " |")
        print("|---|" + "---:|" * len(fractions))
        print("| lru | " + " | ".join(f"{inverted[('lru', f)]:.4f}" for f in fractions) + " |")
        for policy in INVERTED_POLICIES:
            print(f"| {policy} | " + " | ".join(
                f"{inverted[(policy, f)]:.4f} ({inverted[(policy, f)] / inverted[('lru', f)] - 1:+.1%})"
                for f in fractions) + " |")
    if scale:
        print("\nPer-access cost at ~10^4 nodes (zipf, 40000 items of 4 tokens, cache 40000 tokens; fastest of "
              "the repeats):\n")
        print("| policy | peak nodes | wall us per request | CPU us per request | token hit rate |\n"
              "|---|---:|---:|---:|---:|")
        for r in scale:
            print(f"| {r['policy']} | {r['peak_nodes']} | {r['us_per_access']:.1f} | {r['cpu_us_per_access']:.1f} | "
                  f"{r['token_hit_rate']:.4f} |")


SGREC_LABELS = ("lru", "laru", "laru-every", "laru-bets", "fpb", "hf", "laru (oracle)", "opt")  # the rest: peers


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - not installed: the name alone
        return "(version unknown)"


def record_rows(table: dict, noise: dict, inverted: dict, scale: list[dict]) -> list[dict]:
    """The result record's rows: sgrec's policies' token hit rates beside SGLang's RadixCache LRU in each
    cell; the noise sweep and p = 1 beside sgrec's LRU; the per-request cost beside SGLang's."""
    out = [row("token hit rate", "share", r["token_hit_rate"], table[(t, f, "sglang-lru")]["token_hit_rate"],
               params={"trace": t, "cache_fraction": f, "policy": lab})
           for (t, f, lab), r in table.items() if lab in SGREC_LABELS and (t, f, "sglang-lru") in table]
    out += [row("token hit rate under prediction noise", "share", noise[(policy, p)]["token_hit_rate"], noise["lru"],
                params={"trace": "multiturn", "cache_tokens": noise["cap"], "policy": policy, "noise": p})
            for policy in NOISE_POLICIES for p in NOISE]
    out += [row("token hit rate, inverted predictions (p = 1)", "share", v, inverted[("lru", f)],
                params={"trace": "multiturn", "cache_fraction": f, "policy": policy})
            for (policy, f), v in inverted.items() if policy != "lru"]
    peer = next((r for r in scale if r["policy"].startswith("sglang")), None)
    for r in scale:
        if r is not peer:
            for key, what in (("us_per_access", "wall"), ("cpu_us_per_access", "CPU")):
                out.append(row(f"{what} time per request at ~10^4 cached nodes", "us", r[key],
                               None if peer is None else peer[key], params={"policy": r["policy"]},
                               higher_is_better=False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10000, help="gr-users and scan requests")
    ap.add_argument("--conversations", type=int, default=800, help="multiturn conversations")
    ap.add_argument("--fractions", default="0.05,0.1,0.2")
    ap.add_argument("--noise-fraction", type=float, default=0.1)
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--scale-repeats", type=int, default=3)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--config-search", action="store_true", help="only the LARU config search (about 15 min)")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    fractions = [float(x) for x in a.fractions.split(",")]
    t0 = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    traces = {"gr-users": gr_users(a.requests), "multiturn": multiturn(a.conversations), "scan": scan(a.requests)}
    for n, tr in traces.items():
        log(f"trace {n}: {len(tr)} requests, {sum(len(r.tokens) for r in tr)} prompt tokens")
    header = (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}\ncommand: python benchmarks/bench_laru.py " + " ".join(sys.argv[1:]))
    if a.config_search:
        print(header)
        run_config_search(traces, fractions, log)
        return
    table = run_table(traces, fractions, log)
    noise = run_noise(traces["multiturn"], a.noise_fraction, log)
    inverted = run_inverted(traces["multiturn"], fractions, log)
    plot_path = os.path.join(a.out, "bench_laru_noise.png")
    plot_noise(noise, plot_path)
    scale = [] if a.skip_scale else run_scale(log, a.scale_repeats)
    print(header)
    print_tables(table, list(traces), fractions, noise, scale, inverted)
    print(f"\nnoise plot: {plot_path}; total {time.time() - t0:.0f} s")
    with open(os.path.join(a.out, "bench_laru.json"), "w") as f:
        json.dump({"table": {"|".join(map(str, k)): v for k, v in table.items()},
                   "noise": {"|".join(map(str, k)) if isinstance(k, tuple) else k: v for k, v in noise.items()},
                   "inverted": {"|".join(map(str, k)): v for k, v in inverted.items()}, "scale": scale}, f, indent=1)
    if not a.no_record:
        path = write_record(benchmark="bench_laru",
                            title="Radix-cache eviction policies: LARU against LRU, OPT and other caches",
                            command=("python benchmarks/bench_laru.py " + shlex.join(sys.argv[1:])).strip(),
                            results=record_rows(table, noise, inverted, scale),
                            peer=f"SGLang {sglang_version()} RadixCache, LRU (sgrec's LRU for the noise rows)")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
