"""Concurrent execution (RecOS §4.1 concurrency levels, xGR §7 multi-stream batches):
closed-loop clients at concurrency 1, 8, 15, 22, 30 on mixed rank / score / retrieve traffic.

    python benchmarks/bench_concurrency.py                       # CPU defaults below
    python benchmarks/bench_concurrency.py --requests-per-client 6 --occupancy 0.25 --num-streams 4 \\
        --json bench_out/bench_concurrency.json

Each client sends a request, waits for its answer, sends the next (no think time); client i's
k-th request is of kind (i + k) mod 3 over rank, score, retrieve, so every level sees the same mix.

1. Profile: each kind is timed --profile-reps times on a real in-process `sgrec.Engine` (a tiny
   random llama, a 27-item catalog with 3-level semantic IDs) after a warm-up; the median is the
   kind's cost.
2. Measured: the clients are threads calling an Engine, three times: `one` (--max-batch-tokens 1:
   every rank / retrieve request runs alone, as before batching), `batched` (the scheduler's batch
   formation: --max-batch-tokens 16384, --batch-wait-ms as given; each batch runs whole in its
   step) and `interleaved` (the same with --interleave-rounds: the batches under way advance a
   phase per step, new ones start between). All run inline on one stream (CPU). Score requests are
   batched by the prefill-only scheduler in each.
3. Simulated: the same closed loop on `SimStreams` (virtual clock), each request one work unit with
   the profiled cost of its kind, under `single` (one stream, FIFO) and `sgrec` (--num-streams
   streams, DepValue order, RecOS stream selection). The occupancy of a unit cannot be measured on
   a CPU; --occupancy (default 0.25, RecOS Figure 3's "a quarter of the device") is an assumption,
   and the multi-stream gain is bounded by min(num_streams, 1 / occupancy). On a GPU the scheduler
   runs batches on CUDA streams (--num-streams); not measured here (no GPU).

Prints per level and kind: mean and P99 latency (ms) of the measured one-at-a-time and batched runs
and their ratio, the simulated single-stream and multi-stream runs and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sgrec.policy.streams import MultiStreamScheduler, SimStreams, UnitCost, WorkUnit  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

KINDS = ("rank", "score", "retrieve")


def kind_of(client: int, k: int) -> str:
    """The kind of client `client`'s k-th request (the same mix at every level)."""
    return KINDS[(client + k) % 3]


def write_catalog(path: str, n: int = 27, seed: int = 1) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for k in range(n):
            tokens = [rng.randrange(3, 500) for _ in range(rng.randint(1, 5))]
            item = {"id": f"i{k}", "token_ids": tokens, "id_token": rng.randrange(3, 500),
                    "semantic_id": [k // 9, (k // 3) % 3, k % 3]}
            f.write(json.dumps(item) + "\n")
    return path


class Traffic:
    """Request k of client i: kind (i + k) % 3, a user history of --history tokens; sent to an
    in-process Engine, or (url given) to a server's /v1/rank, /v1/score and /v1/retrieve."""

    def __init__(self, engine, history: int, candidates: int, beam_width: int, seed: int = 0, url: str | None = None):
        self.engine, self.history, self.candidates, self.beam_width = engine, history, candidates, beam_width
        self.seed, self.url = seed, url
        self.local = threading.local()

    def _post(self, route: str, body: dict) -> dict:
        import httpx

        if not hasattr(self.local, "client"):
            self.local.client = httpx.Client(base_url=self.url, timeout=600)
        r = self.local.client.post(route, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{route}: {r.status_code} {r.text[:300]}")
        return r.json()

    def call(self, kind: str, client: int, k: int):
        rng = random.Random(self.seed * 1_000_003 + client * 1009 + k)
        user = {"id": f"u{client}", "token_ids": [rng.randrange(3, 500) for _ in range(self.history)]}
        if kind == "rank":
            items = [f"i{j}" for j in rng.sample(range(27), self.candidates)]
            if self.url:
                return self._post("/v1/rank", {"user": user, "items": items})
            return self.engine.rank(user, items)
        if kind == "score":
            items = [[rng.randrange(3, 500) for _ in range(3)] for _ in range(self.candidates)]
            if self.url:
                return self._post("/v1/score", {"query": user["token_ids"], "items": items, "label_token_ids": [5, 6, 7]})
            return self.engine.score(query=user["token_ids"], items=items, label_token_ids=[5, 6, 7])
        if self.url:
            return self._post("/v1/retrieve", {"user": user, "beam_width": self.beam_width, "num_items": 5})
        return self.engine.retrieve(user, beam_width=self.beam_width, num_items=5)


def batch_gain(model: str, catalog: str, traffic: Traffic, sizes: list[int], reps: int) -> list[dict]:
    """Executor level, in this process: B requests of a kind as one batch vs one at a time, the
    best of `reps` alternating runs each (minimum: robust to other load on the machine), from a
    cold cache every time (--disable-radix-cache: no run reads what an earlier one cached)."""
    from sgrec import Engine
    from sgrec.managers.rec import build_rank_task, build_retrieve_task
    from sgrec.policy.batching import run_to_end

    e = Engine(model, device="cpu", dtype="float32", max_total_tokens=16384, item_catalog=catalog,
               disable_radix_cache=True, item_cache_tokens=0)
    rows = []
    for kind in ("rank", "retrieve"):
        steps = e.scheduler.tasks.kinds[kind].run_steps
        run_batch = lambda payloads: run_to_end(steps(payloads))  # noqa: E731 - a batch alone, all its phases
        for b in sizes:
            payloads = []
            for i in range(b):
                rng = random.Random(7919 * b + i)
                user = {"id": f"g{i}", "token_ids": [rng.randrange(3, 500) for _ in range(traffic.history)]}
                if kind == "rank":
                    obj = {"user": user, "items": [f"i{j}" for j in rng.sample(range(27), traffic.candidates)]}
                    payloads.append(build_rank_task(obj, e.tokenizer, e.builder, 100).payload)
                else:
                    obj = {"user": user, "beam_width": traffic.beam_width, "num_items": 5}
                    payloads.append(build_retrieve_task(obj, e.tokenizer, e.builder, 512).payload)
            run_batch(payloads)  # warm-up
            one = batched = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                for p in payloads:
                    run_batch([p])
                one = min(one, time.perf_counter() - t)
                t = time.perf_counter()
                run_batch(payloads)
                batched = min(batched, time.perf_counter() - t)
            rows.append({"kind": kind, "batch": b, "one_ms": one * 1e3, "batched_ms": batched * 1e3})
    return rows


def profile(traffic: Traffic, reps: int) -> dict[str, float]:
    costs = {}
    for kind in KINDS:
        traffic.call(kind, 999, 0)  # warm-up
        times = []
        for r in range(reps):
            t0 = time.perf_counter()
            traffic.call(kind, 1000 + r, r)
            times.append(time.perf_counter() - t0)
        costs[kind] = statistics.median(times)
    return costs


def measured_closed_loop(traffic: Traffic, concurrency: int, per_client: int) -> dict[str, list[float]]:
    lat: dict[str, list[float]] = {k: [] for k in KINDS}
    lock = threading.Lock()
    errors = []

    def client(i: int) -> None:
        try:
            for k in range(per_client):
                kind = kind_of(i, k)
                t0 = time.perf_counter()
                traffic.call(kind, i, k)
                dt = time.perf_counter() - t0
                with lock:
                    lat[kind].append(dt)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return lat


def simulated_closed_loop(costs: dict[str, float], concurrency: int, per_client: int, policy: str,
                          num_streams: int, occupancy: float) -> dict[str, list[float]]:
    sim = SimStreams(num_streams)
    sch = MultiStreamScheduler(sim, policy)
    lat: dict[str, list[float]] = {k: [] for k in KINDS}
    issued: dict[str, tuple[int, int, str, float]] = {}

    def submit(i: int, k: int) -> None:
        kind = kind_of(i, k)
        name = f"c{i}.r{k}"
        issued[name] = (i, k, kind, sim.now())
        sch.submit([WorkUnit(name, UnitCost(costs[kind], occupancy), group=f"c{i}")])

    for i in range(concurrency):
        submit(i, 0)
    while not sch.idle:
        for name in sch.step():
            i, k, kind, t0 = issued[name]
            lat[kind].append(sim.now() - t0)
            if k + 1 < per_client:
                submit(i, k + 1)
    return lat


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(0.99 * len(xs) + 0.5)) - 1))]


def record_rows(gain: list[dict], rows: list[dict], args) -> list[dict]:
    """The result record's rows: the executor's batch beside one request at a time; per level, over all
    kinds, the measured batched server's mean and P99 latency beside one-at-a-time's, and the interleaved
    one's beside the batched one's (the per-kind rows and the simulated runs stay in the printed table)."""
    out = [row(f"{r['kind']}: B requests as one batch", "ms", r["batched_ms"], r["one_ms"], higher_is_better=False,
               params={"batch": r["batch"]}) for r in gain]
    for r in (r for r in rows if r["kind"] == "all"):
        params = {"clients": r["clients"], "target": args.target}
        for stat in ("mean", "P99"):
            k = stat.lower()
            out.append(row(f"closed-loop {stat} latency, all kinds, batched", "ms", r[f"batched_{k}_ms"],
                           r[f"one_{k}_ms"], params=params, higher_is_better=False))
            out.append(row(f"closed-loop {stat} latency, all kinds, interleaved rounds", "ms",
                           r[f"interleaved_{k}_ms"], r[f"batched_{k}_ms"], params=params, higher_is_better=False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,15,22,30")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--profile-reps", type=int, default=15)
    ap.add_argument("--history", type=int, default=64, help="user history tokens per request")
    ap.add_argument("--candidates", type=int, default=8, help="rank candidates / score items per request")
    ap.add_argument("--beam-width", type=int, default=8)
    ap.add_argument("--num-streams", type=int, default=4)
    ap.add_argument("--occupancy", type=float, default=0.25, help="assumed device share of one request")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--batch-wait-ms", type=float, default=2.0, help="wait quota of the batched engine")
    ap.add_argument("--target", choices=("server", "engine"), default="server",
                    help="server: a real server process per configuration, clients over HTTP (loopback); "
                         "engine: in-process Engines called from threads (their lock serialises arrivals, so "
                         "batches rarely form)")
    ap.add_argument("--batch-sizes", default="1,4,8,16", help="executor-level batch gain: batch sizes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args()

    import torch

    from sgrec import Engine
    from sgrec.tools.make_tiny_model import make_tiny_model

    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="bench_concurrency_")
    model = make_tiny_model(os.path.join(tmp, "model"), arch="llama")
    catalog = write_catalog(os.path.join(tmp, "catalog.jsonl"))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    gain = batch_gain(model, catalog, Traffic(None, args.history, args.candidates, args.beam_width), sizes, 5)
    print("executor level: B requests one at a time vs one batch (best of 5, cold cache)")
    print("| kind | B | one at a time ms | one batch ms | gain |")
    print("|---|---|---|---|---|")
    for r in gain:
        print(f"| {r['kind']} | {r['batch']} | {r['one_ms']:.1f} | {r['batched_ms']:.1f} | "
              f"{r['one_ms'] / r['batched_ms']:.2f}x |", flush=True)
    configs = {"one": {"max_batch_tokens": 1}, "batched": {"batch_wait_ms": args.batch_wait_ms},
               "interleaved": {"batch_wait_ms": args.batch_wait_ms, "interleave_rounds": True}}
    common = {"max_total_tokens": 16384, "item_catalog": catalog}
    servers: dict = {}
    traffic = {}
    if args.target == "engine":
        for name, kw in configs.items():
            e = Engine(model, device="cpu", dtype="float32", **common, **kw)
            traffic[name] = Traffic(e, args.history, args.candidates, args.beam_width)
    else:
        from sgrec.tools.local_server import LocalServer

        def start(name: str) -> Traffic:
            flags = ["--model-path", model, "--dtype", "float32", "--device", "cpu"]
            for k, v in {**common, **configs[name]}.items():
                flags += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
            servers[name] = LocalServer(flags, log_path=os.path.join(tmp, f"{name}.log"))
            return Traffic(None, args.history, args.candidates, args.beam_width, url=servers[name].url)

        for name in configs:  # both up (an idle server sleeps in its poll), measured in turn per level
            traffic[name] = start(name)
    costs = profile(traffic["one"], args.profile_reps)
    print(f"profiled cost per request ({args.target}, median of {args.profile_reps}): "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in costs.items()))
    print(f"batched: --batch-wait-ms {args.batch_wait_ms}; simulated: occupancy {args.occupancy} per request "
          f"(assumed), multi-stream = sgrec policy on {args.num_streams} streams")
    levels = [int(x) for x in args.concurrency.split(",")]
    profile(traffic["batched"], 2)  # warm-up
    profile(traffic["interleaved"], 2)
    measured: dict[str, dict[int, dict]] = {name: {} for name in configs}
    try:
        for c in levels:  # alternating, so that load drifting over the run hits both alike
            for name in configs:
                measured[name][c] = measured_closed_loop(traffic[name], c, args.requests_per_client)
    finally:
        for srv in servers.values():
            srv.stop()

    rows = []
    header = ("| clients | kind | n | one-at-a-time mean / P99 ms | batched mean / P99 ms | one / batched (mean) | "
              "one / batched (P99) | interleaved mean / P99 ms | batched / interleaved (mean) | "
              "sim single mean / P99 ms | sim multi mean / P99 ms | sim single / multi (mean) |")
    print(header)
    print("|" + "---|" * 12)
    for c in levels:
        one, bat, inter = measured["one"][c], measured["batched"][c], measured["interleaved"][c]
        single = simulated_closed_loop(costs, c, args.requests_per_client, "single", 1, args.occupancy)
        multi = simulated_closed_loop(costs, c, args.requests_per_client, "depvalue", args.num_streams, args.occupancy)
        for kind in KINDS + ("all",):
            pick = (lambda d: [x for k in KINDS for x in d[k]]) if kind == "all" else (lambda d, kind=kind: d[kind])
            m, b, i, s, u = pick(one), pick(bat), pick(inter), pick(single), pick(multi)
            if not m:  # too few requests per client for every kind at this level
                continue
            row = {"clients": c, "kind": kind, "n": len(m),
                   "one_mean_ms": statistics.mean(m) * 1e3, "one_p99_ms": p99(m) * 1e3,
                   "batched_mean_ms": statistics.mean(b) * 1e3, "batched_p99_ms": p99(b) * 1e3,
                   "interleaved_mean_ms": statistics.mean(i) * 1e3, "interleaved_p99_ms": p99(i) * 1e3,
                   "sim_single_mean_ms": statistics.mean(s) * 1e3, "sim_single_p99_ms": p99(s) * 1e3,
                   "sim_multi_mean_ms": statistics.mean(u) * 1e3, "sim_multi_p99_ms": p99(u) * 1e3}
            rows.append(row)
            print(f"| {c} | {kind} | {len(m)} | {row['one_mean_ms']:.1f} / {row['one_p99_ms']:.1f} | "
                  f"{row['batched_mean_ms']:.1f} / {row['batched_p99_ms']:.1f} | "
                  f"{row['one_mean_ms'] / row['batched_mean_ms']:.2f}x | {row['one_p99_ms'] / row['batched_p99_ms']:.2f}x | "
                  f"{row['interleaved_mean_ms']:.1f} / {row['interleaved_p99_ms']:.1f} | "
                  f"{row['batched_mean_ms'] / row['interleaved_mean_ms']:.2f}x | "
                  f"{row['sim_single_mean_ms']:.1f} / {row['sim_single_p99_ms']:.1f} | "
                  f"{row['sim_multi_mean_ms']:.1f} / {row['sim_multi_p99_ms']:.1f} | "
                  f"{row['sim_single_mean_ms'] / row['sim_multi_mean_ms']:.2f}x |", flush=True)
    print("rerun: python benchmarks/bench_concurrency.py " + " ".join(sys.argv[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "costs_s": costs, "batch_gain": gain, "rows": rows}, f, indent=1)
    if not args.no_record:
        path = write_record(benchmark="bench_concurrency",
                            title="Closed-loop mixed rank / score / retrieve traffic at RecOS concurrency levels",
                            command=("python benchmarks/bench_concurrency.py " + shlex.join(sys.argv[1:])).strip(),
                            results=record_rows(gain, rows, args),
                            peer="the same server one request at a time (--max-batch-tokens 1); for interleaved "
                                 "rounds, the batched server")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
