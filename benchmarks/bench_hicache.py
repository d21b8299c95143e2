"""The hierarchical KV cache on the returning-user trace, with a KV pool ten times too small.

    python benchmarks/bench_hicache.py                       # all configurations, then two servers
    python benchmarks/bench_hicache.py --configs none host --requests 500
    python benchmarks/bench_hicache.py --no-two-servers

The trace is `gr-users` (sgrec.radix.sim.traces): MovieLens-100K interactions in time order from
--start, each a request of that user (a shared system prompt, the user's history of up to
--max-history (item, rating) pairs, the candidates). MovieLens users rate in sessions, so by default
a request is a user's visit: the first interaction of each run of one user's consecutive
interactions (--every-interaction sends them all). MovieLens raters rated one after another, so in
the data's time order about two users are active at any time and a small pool already holds the
returning user; by default the users' visits are merged at random (seeded, each user's own order
kept), as many concurrent users would send them (--order time keeps the data's order). Requests are /generate with max_new_tokens 1, one
at a time, so a request's latency is its time to first token. The working set is the longest prompt of every user in
the window; the pool (--max-total-tokens) is that divided by --pool-ratio (10).

1. One server per configuration, each on the same requests: `none` (no hierarchy: what the pool
   evicts is recomputed), `host` (--enable-hierarchical-cache, a host tier that holds the working
   set), `file` and `mooncake` (a host tier of --hicache-ratio 1 over a storage tier; a fresh
   directory, a fresh mooncake_master). Reported: hit rate (cached / prompt tokens), TTFT P50 / P99,
   requests per second, and the P50's ratio against `none` (target: 2x).
2. Two servers on one mooncake_master behind a real sglang-router with its random policy; the
   X-Sgrec-Server header of each answer says which server served it: a request whose user's
   previous request went to the other server is a moving user's. Reported: hit rate of moving and
   of staying users' requests (target: moving within 10% of staying), and the same for two servers
   without the hierarchy. (The router's choices are not seeded: the split differs between runs.)
3. Item KV across servers (--item-fetch): the same items' KV fetched by the retired `--item-peers`'s
   path (the ZMQ fetch that a server's DP ranks still use: an ItemKVServer on the owner's item
   store, over tcp://127.0.0.1, one request for all of a rank request's cold items) and from
   Mooncake Store (the storage tier's batch read, get_many, and its decode), against recomputing them (the runner's measured recompute time per item token, as the
   fetch cost model uses). Reported per request of k items: milliseconds and bytes moved.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # launch/ (the router)
from bench_catalog import header  # noqa: E402

from sgrec.radix.sim.traces import build_gr_requests  # noqa: E402
from sgrec.tools.local_server import LocalServer  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

CONFIGS = ("none", "host", "file", "mooncake")  # the default run
# LARU's eviction under file storage, writing through (file-laru) or only what its LightGBM predictor
# expects to be reused (file-selective): what selective writes save, and what they cost in hits
LARU_CONFIGS = ("file-laru", "file-selective")


def requests(n: int, start: int, max_history: int, every: bool, order: str, seed: int) -> tuple[list, int]:
    """The first n visits (or interactions, every=True) from `start`, in the data's time order or
    interleaved (each user's own order kept), and the working set in tokens."""
    reqs = build_gr_requests(n if every else 40 * n, start=start, max_history=max_history)
    if not every:  # a visit: the first of a run of one user's consecutive interactions
        reqs = [r for i, r in enumerate(reqs) if i == 0 or reqs[i - 1].user != r.user][:n]
    if order == "interleaved":  # a random merge of the users' sequences
        queues: dict[int, list] = {}
        for r in reqs:
            queues.setdefault(r.user, []).append(r)
        slots = [u for u in queues for _ in queues[u]]
        random.Random(seed).shuffle(slots)
        reqs = [queues[u].pop(0) for u in slots]
    longest: dict[int, int] = {}
    for r in reqs:
        longest[r.user] = max(longest.get(r.user, 0), len(r.tokens()))
    return reqs, sum(longest.values())


PREFETCH = ["--hicache-storage-prefetch-policy", "timeout"]  # main() sets the policy
MOONCAKE_SEGMENT = 4 << 30  # each server's share of the store: the working set fits (main() may change it)


def flags_for(config: str, pool: int, work: str, master: str | None) -> list[str]:
    base = ["--max-total-tokens", str(pool), "--dtype", "float32", "--chunked-prefill-size", "-1"]
    if config == "none":
        return base
    hier = [*base, "--enable-hierarchical-cache"]
    if config == "host":
        return [*hier, "--hicache-ratio", "20"]  # the working set fits the host tier
    if config.startswith("file"):
        laru = [] if config == "file" else ["--radix-eviction-policy", "laru"]
        if config == "file-selective":
            laru += ["--hicache-write-policy", "write_through_selective"]
        return [*hier, *PREFETCH, *laru, "--hicache-ratio", "1", "--hicache-storage-backend", "file",
                "--hicache-storage-backend-extra-config",
                json.dumps({"file_storage_path": os.path.join(work, f"kv-{config}")})]  # its own: no reuse
    return [*hier, *PREFETCH, "--hicache-ratio", "1", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config",
            json.dumps({"master_server_address": master, "global_segment_size": MOONCAKE_SEGMENT})]


def send(client: httpx.Client, r) -> tuple[float, int, int, str]:
    """(seconds, prompt tokens, cached tokens, the server that answered)."""
    body = {"input_ids": r.tokens(), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    t = time.perf_counter()
    out = client.post("/generate", json=body)
    dt = time.perf_counter() - t
    out.raise_for_status()
    meta = out.json()["meta_info"]
    return dt, meta["prompt_tokens"], meta["cached_tokens"], out.headers.get("x-sgrec-server", "")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def tiers(srv: LocalServer) -> dict | None:
    return httpx.get(srv.url + "/get_server_info", timeout=30).json()["internal_states"][0].get("hicache")


def one_config(config: str, model: str, reqs: list, pool: int, work: str, master: str | None) -> dict:
    with LocalServer(["--model-path", model, "--device", "cpu", *flags_for(config, pool, work, master)],
                     log_path=os.path.join(work, f"{config}.log")) as srv:
        client = httpx.Client(base_url=srv.url, timeout=300)
        for r in reqs[:3]:  # warm the code paths (their users come back in the trace: a few hits for all)
            send(client, r)
        t0 = time.perf_counter()
        rows = [send(client, r) for r in reqs]
        wall = time.perf_counter() - t0
        info = tiers(srv)
    lat = [x[0] for x in rows]
    return {"config": config, "hit": sum(x[2] for x in rows) / sum(x[1] for x in rows),
            "p50": pct(lat, 0.5) * 1e3, "p99": pct(lat, 0.99) * 1e3, "rps": len(rows) / wall, "tiers": info}


def two_servers(model: str, reqs: list, pool: int, work: str, master: str | None) -> dict:
    """Both servers behind a real sglang-router with its random policy; the X-Sgrec-Server header of
    each answer says which server served it."""
    import subprocess

    from launch.front import START_TIMEOUT_S, router_cmd, router_workers, wait_until
    from sgrec.tools.local_server import free_port

    config = "mooncake" if master else "none"
    flags = ["--model-path", model, "--device", "cpu", *flags_for(config, pool, work, master)]
    with LocalServer(flags, log_path=os.path.join(work, f"two-{config}-a.log")) as a, \
            LocalServer(flags, log_path=os.path.join(work, f"two-{config}-b.log")) as b:
        port = free_port()
        with open(os.path.join(work, f"router-{config}.log"), "w") as log:
            router = subprocess.Popen(router_cmd("127.0.0.1", port, [a.url, b.url], policy="random"),
                                      stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: len(router_workers(url)) == 2, START_TIMEOUT_S, "sglang-router", router)
            client = httpx.Client(base_url=url, timeout=300)
            last: dict = {}
            tok = {"moving": [0, 0, 0], "staying": [0, 0, 0]}  # cached tokens, prompt tokens, requests
            for r in reqs:
                _, prompt, cached, server = send(client, r)
                if r.user in last:
                    kind = "staying" if last[r.user] == server else "moving"
                    tok[kind][0] += cached
                    tok[kind][1] += prompt
                    tok[kind][2] += 1
                last[r.user] = server
        finally:
            router.kill()
            router.wait()
    return {**{k: c / max(p, 1) for k, (c, p, _) in tok.items()}, **{f"{k}_requests": n for k, (_, _, n) in tok.items()}}


def item_fetch(model: str, work: str, master: str, ks=(1, 8, 32), repeats: int = 20) -> list[dict]:
    """Part 3 (see the module docstring): an in-process engine's item store as the owner. Returns the
    table's rows (milliseconds)."""

    import zmq

    from sgrec import Engine
    from sgrec.items.fetch import ItemKVClient, ItemKVServer, header_key
    from sgrec.items.pool import measure_recompute_per_token
    from sgrec.items.store import fingerprint
    from sgrec.mem.mooncake import MooncakeStorage
    from sgrec.mem.tiers import Page, decode, encode, item_key
    from sgrec.tools.local_server import free_port

    rng = random.Random(0)
    path = os.path.join(work, "items.jsonl")
    with open(path, "w") as f:
        for i in range(64):
            f.write(json.dumps({"id": f"i{i}", "token_ids": [rng.randrange(100, 40000) for _ in range(rng.randint(12, 28))],
                                "id_token": rng.randrange(100, 40000)}) + "\n")
    eng = Engine(model, device="cpu", dtype="float32", max_total_tokens=8192, item_catalog=path)
    ex = eng.scheduler.rank_executor
    store, cat = ex.store, ex.catalog
    ids = [f"i{i}" for i in range(64)]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = ItemKVServer(store, endpoint, zmq.Context.instance())
    server.start()
    client = ItemKVClient({1: endpoint})
    mc = MooncakeStorage({"master_server_address": master, "global_segment_size": 256 << 20})
    keys, sizes = {}, {}
    for i in ids:
        names, k, v = store.read_kv([i])
        toks = [int(t) for t in cat.token_ids(cat.index[i])]
        keys[i], sizes[i] = item_key("bench", ex.header_ids, toks), len(toks)
        mc.put(keys[i], encode(Page(k, v)))
    per_token = measure_recompute_per_token(ex.runner, cat, 64)
    like = {i: Page(*(torch_empty(k.shape[0], sizes[i], *k.shape[2:], k.dtype) for _ in range(2))) for i in ids}
    print("\n| items per request | --item-peers ms | Mooncake ms | recompute ms | bytes per item (peers / Mooncake) |")
    print("|---|---|---|---|---|")
    out = []
    for n in ks:
        tp, tm = [], []
        for r in range(repeats):
            want = rng.sample(ids, n)
            fps = {i: fingerprint(cat.token_ids(cat.index[i])) for i in want}
            t = time.perf_counter()
            rep = client.fetch_many({1: want}, header_key(ex.header_ids), 5000, fps)[1]
            tp.append(time.perf_counter() - t)
            assert rep is not None and len(rep.items) == n
            t = time.perf_counter()
            datas = mc.get_many([keys[i] for i in want])  # the tier's call: batch_is_exist + get_batch
            pages = [decode(d, like[i]) for d, i in zip(datas, want)]
            tm.append(time.perf_counter() - t)
            assert all(p is not None for p in pages)
        tokens = sum(sizes[i] for i in ids) / len(ids) * n
        row_bytes = like[ids[0]].nbytes / sizes[ids[0]]
        print(f"| {n} | {statistics.median(tp) * 1e3:.2f} | {statistics.median(tm) * 1e3:.2f} | "
              f"{tokens * per_token * 1e3:.2f} | {row_bytes * tokens / n:.0f} / {row_bytes * tokens / n + 48:.0f} |",
              flush=True)
        out.append({"items": n, "peers_ms": statistics.median(tp) * 1e3, "mooncake_ms": statistics.median(tm) * 1e3,
                    "recompute_ms": tokens * per_token * 1e3})
    server.close()
    mc.close()
    return out


def torch_empty(*shape_and_dtype):
    import torch

    *shape, dtype = shape_and_dtype
    return torch.empty(*shape, dtype=dtype)


def record_rows(results: list[dict], two: list[tuple[str, dict]], fetch: list[dict], a) -> list[dict]:
    """The result record's rows: part 1's configurations beside `none` (no hierarchy), part 2's moving
    users' hit rate beside the staying users', part 3's fetches beside recomputing the items."""
    base = next((r for r in results if r["config"] == "none"), None)
    params = {"requests": a.requests, "pool_ratio": a.pool_ratio}
    out = []
    for r in results:
        p = {**params, "config": r["config"]}
        peer = base if base is not None and r is not base else {}
        out += [row("TTFT P50", "ms", r["p50"], peer.get("p50"), params=p, higher_is_better=False),
                row("TTFT P99", "ms", r["p99"], peer.get("p99"), params=p, higher_is_better=False),
                row("prefix hit rate", "share", r["hit"], peer.get("hit"), params=p),
                row("throughput, one request at a time", "req/s", r["rps"], peer.get("rps"), params=p)]
    out += [row("moving users' hit rate, two servers behind sglang-router", "share", h["moving"], h["staying"],
                params={**params, "servers": name}) for name, h in two]
    for r in fetch:
        for key, how in (("mooncake_ms", "from Mooncake Store"), ("peers_ms", "by --item-peers (ZMQ)")):
            out.append(row(f"item KV fetched {how} (median)", "ms", r[key], r["recompute_ms"],
                           params={"items_per_request": r["items"]}, higher_is_better=False))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M, prepared from its wheel)")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--max-history", type=int, default=1000, help="most (item, rating) pairs in a profile")
    ap.add_argument("--every-interaction", action="store_true", help="a request per interaction, not per visit")
    ap.add_argument("--order", choices=("interleaved", "time"), default="interleaved",
                    help="time: the data's order (about two users at a time); interleaved: the users' visits "
                         "merged at random, each user's own order kept (many users at a time, as in production)")
    ap.add_argument("--start", type=int, default=80000,
                    help="first MovieLens-100K interaction of the window (late: users with long histories)")
    ap.add_argument("--pool-ratio", type=float, default=10.0, help="working set / KV pool")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=CONFIGS + LARU_CONFIGS,
                    help="part 1 (none: skip it); also file-laru and file-selective (LARU, writing through or "
                    "selectively)")
    ap.add_argument("--no-two-servers", action="store_true")
    ap.add_argument("--no-item-fetch", action="store_true", help="skip part 3 (item KV: --item-peers against Mooncake)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefetch-policy", default="timeout", choices=("best_effort", "wait_complete", "timeout"))
    ap.add_argument("--mooncake-segment-gb", type=float, default=4.0,
                    help="memory each server adds to Mooncake Store (the working set of SmolLM2 fits 4)")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    PREFETCH[-1] = args.prefetch_policy
    global MOONCAKE_SEGMENT
    MOONCAKE_SEGMENT = int(args.mooncake_segment_gb * 2**30)
    model = args.model
    if model is None:
        from sgrec.tools.prepare_smollm2 import default_dir

        model = default_dir()
        if not os.path.exists(os.path.join(model, "config.json")):
            sys.exit(f"no model at {model}: run python -m sgrec.tools.prepare_smollm2 (README), or pass --model")
    reqs, working = requests(args.requests, args.start, args.max_history, args.every_interaction, args.order,
                             args.seed)
    pool = max(int(working / args.pool_ratio), max(len(r.tokens()) for r in reqs) + 8)
    print(header("python benchmarks/bench_hicache.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "bench_hicache"))
    kind = "interactions" if args.every_interaction else "visits"
    print(f"model {model}; {len(reqs)} {kind} of {len({r.user for r in reqs})} users from interaction "
          f"{args.start}; working set {working} tokens, pool {pool} tokens (1/{args.pool_ratio:g})")
    work = tempfile.mkdtemp(prefix="bench_hicache_")
    master = None
    needs_master = "mooncake" in args.configs or not args.no_two_servers or not args.no_item_fetch
    if needs_master:
        from sgrec.tools.mooncake_master import MooncakeMaster, missing

        if missing():
            sys.exit(f"mooncake: {missing()}")
        master = MooncakeMaster(os.path.join(work, "master.log")).start()
    results, two, fetch = [], [], []
    try:
        for config in args.configs:
            results.append(one_config(config, model, reqs, pool, work, master.address if master else None))
            r = results[-1]
            print(f"  {config}: hit {r['hit']:.1%}, P50 {r['p50']:.1f} ms", flush=True)
        base = next((r for r in results if r["config"] == "none"), None)
        if results:
            print("\n| configuration | hit rate | TTFT P50 ms | TTFT P99 ms | req/s | P50 vs none |")
            print("|---|---|---|---|---|---|")
        for r in results:
            ratio = f"{base['p50'] / r['p50']:.2f}x" if base else "-"
            print(f"| {r['config']} | {r['hit']:.1%} | {r['p50']:.1f} | {r['p99']:.1f} | {r['rps']:.1f} | {ratio} |")
        for r in results:
            if r["tiers"]:
                t = r["tiers"]
                print(f"{r['config']} tiers: loaded {t['loaded_tokens']}; host {t['host']}"
                      + (f"; storage {t['storage']}" if "storage" in t else ""))
        if not args.no_two_servers:
            print("\nTwo servers behind sglang-router (policy random):")
            print("| servers | moving users' hit rate (requests) | staying users' hit rate (requests) | moving / staying |")
            print("|---|---|---|---|")
            for m in (None, master.address):
                h = two_servers(model, reqs, pool, work, m)
                two.append(("mooncake" if m else "no hierarchy", h))
                print(f"| {'mooncake' if m else 'no hierarchy'} | {h['moving']:.1%} ({h['moving_requests']}) | "
                      f"{h['staying']:.1%} ({h['staying_requests']}) | "
                      f"{h['moving'] / max(h['staying'], 1e-9):.2f} |", flush=True)
        if not args.no_item_fetch:
            print("\nItem KV across servers (median of 20 requests each):")
            fetch = item_fetch(model, work, master.address)
    finally:
        if master is not None:
            master.stop()
        shutil.rmtree(work, ignore_errors=True)
    print("\nrerun: python benchmarks/bench_hicache.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    rows = [] if args.no_record else record_rows(results, two, fetch, args)
    if rows:
        cmd = ("python benchmarks/bench_hicache.py " + shlex.join(argv if argv is not None else sys.argv[1:])).strip()
        beside = len(results) > 1 and any(r["config"] == "none" for r in results)
        peers = [what for what, ran in (("no hierarchy (config none)", beside), ("staying users (two servers)", two),
                                        ("recomputing the items' KV", fetch)) if ran]
        path = write_record(benchmark="bench_hicache", title="Hierarchical KV cache on the returning-user trace",
                            command=cmd, results=rows, peer="; ".join(peers) or None)
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
