"""Scale-out on loopback: rank throughput vs number of sgrec servers behind the launch/ front
(Caddy for /v1/rank), with and without user affinity, and item KV shared across servers through the
Mooncake Store that the launch recipe starts (the share of candidate item tokens loaded from it).

    python benchmarks/bench_scale_out.py                       # 1, 2, 3 servers, tiny random model
    python benchmarks/bench_scale_out.py --servers 1 2 --requests 200 --concurrency 8

Workload: `--users` users, each with a fixed history of `--user-tokens` tokens, send rank requests
over `--candidates` items drawn from a `--catalog-items` catalog in proportion to a Zipf(1)
popularity. Closed loop: `--concurrency` clients, `--requests` requests per configuration, users in
a shuffled round-robin order.
- affinity: the client sends X-User-Id, Caddy hashes it (a user's prefix KV stays on one server);
- no affinity: no header, Caddy picks the least busy server (the user's prefix is cached wherever
  it went before, or not at all).
Item phase: the same requests with prefix "item" (candidates' KV read from the item stores), each
server's item store holding `--item-cache-tokens` (default: a tenth of the catalog's tokens), so that
most candidates come from the Mooncake Store once any server computed them: per N the share of
candidate item tokens loaded from it (`meta_info.stored_tokens`) and the throughput. What a fetch
costs against recomputing (and against the ZMQ fetch it replaced): benchmarks/bench_hicache.py.
The servers run with OMP_WAIT_POLICY=PASSIVE (unless set): they share the host's cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import shlex
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from launch.local_cluster import LocalCluster  # noqa: E402
from bench_catalog import header  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from sgrec.tools.results import row, write_record  # noqa: E402


def write_catalog(path: str, n: int, seed: int = 0, vocab: int = 500) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for k in range(n):
        items.append({"id": f"i{k}", "token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(4, 8))],
                      "id_token": rng.randrange(3, vocab), "popularity": round(1000.0 / (k + 1), 3)})
    with open(path, "w") as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
    return items


def make_requests(items: list[dict], users: int, user_tokens: int, candidates: int, n: int, seed: int = 1):
    rng = random.Random(seed)
    hist = {f"u{k}": [rng.randrange(3, 500) for _ in range(user_tokens)] for k in range(users)}
    weights = [it["popularity"] for it in items]
    ids = [it["id"] for it in items]
    order = list(hist)
    out = []
    for j in range(n):
        if j % users == 0:
            rng.shuffle(order)
        u = order[j % users]
        cands: list[str] = []
        while len(cands) < candidates:  # popularity-weighted, without repeats
            c = rng.choices(ids, weights)[0]
            if c not in cands:
                cands.append(c)
        out.append((u, {"user": {"id": u, "token_ids": hist[u]}, "items": cands}))
    return out


def run_load(url: str, reqs, concurrency: int, affinity: bool, prefix: str | None = None) -> dict:
    def one(req):
        u, body = req
        body = {**body, **({"prefix": prefix} if prefix else {})}
        r = client.post(url + "/v1/rank", json=body, headers={"X-User-Id": u} if affinity else {})
        r.raise_for_status()
        return r.json()["meta_info"], r.headers["x-sgrec-server"]

    with httpx.Client(timeout=120) as client, cf.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, reqs[: concurrency * 2]))  # warm the connections (not measured)
        t0 = time.perf_counter()
        results = list(pool.map(one, reqs))
        wall = time.perf_counter() - t0
    metas = [m for m, _ in results]
    prompt = sum(m["prompt_tokens"] for m in metas)
    return {"rps": len(reqs) / wall, "wall": wall, "cached": sum(m["cached_tokens"] for m in metas) / prompt,
            "stored": sum(m.get("stored_tokens", 0) for m in metas), "servers": len({s for _, s in results}),
            "metas": metas}


def print_read_choice(cluster) -> None:
    """Each server's two sides of the read-or-recompute choice for candidates' item KV (its first rank's
    fits, /server_info) and the candidate tokens it chose not to read."""
    def us(x):
        return "-" if x is None else f"{x * 1e6:.1f}"

    for s in cluster.servers:
        info = httpx.get(s.url + "/server_info", timeout=60).json()
        hc = ((info.get("internal_states") or [{}])[0] or {}).get("hicache") or {}
        read, comp = hc.get("item_read") or {}, hc.get("item_recompute") or {}
        print(f"  {s.name}: storage read fixed {us(read.get('fixed_s'))} us + {us(read.get('per_token_s'))} us/token "
              f"({read.get('calls', 0)} reads); recompute {us(comp.get('per_token_s'))} us/token (fixed "
              f"{us(comp.get('fixed_s'))} us, {comp.get('calls', 0)} forwards); item tokens not read: "
              f"{(hc.get('item_tokens') or {}).get('not_read', 0)}", flush=True)


def record_rows(rows: list[tuple], item_rows: list[tuple], item_cache: int, a) -> list[dict]:
    """The result record's rows: per number of servers, rank throughput and cached prompt tokens with user
    affinity beside without it; the item phase's share of candidate item tokens from the store and its
    throughput."""
    base = {"dp_size": a.dp_size, "concurrency": a.concurrency, "store": a.store}
    by = {(n, aff): (rps, cached) for n, aff, rps, _, cached, _ in rows}
    out = []
    for n in dict.fromkeys(n for n, *_ in rows):
        (rps, cached), (rps0, cached0) = by[(n, True)], by[(n, False)]
        out += [row("rank throughput with user affinity", "req/s", rps, rps0, params={**base, "servers": n}),
                row("prompt tokens from cache with user affinity", "share", cached, cached0,
                    params={**base, "servers": n})]
    for n, stored, cached, rps in item_rows:
        p = {**base, "item_cache_tokens": item_cache, "servers": n}
        out += [row("candidate item tokens loaded from the storage tier, prefix item", "share", stored, params=p),
                row("rank throughput, prefix item", "req/s", rps, params=p)]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", help="default: a tiny random Llama (sgrec.tools.make_tiny_model)")
    ap.add_argument("--servers", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--users", type=int, default=24)
    ap.add_argument("--user-tokens", type=int, default=256)
    ap.add_argument("--candidates", type=int, default=20)
    ap.add_argument("--catalog-items", type=int, default=300)
    ap.add_argument("--store", choices=["mooncake", "none"], default="mooncake",
                    help="the storage tier the launch recipe gives the servers (none: no hierarchical cache)")
    ap.add_argument("--item-cache-tokens", type=int, default=None,
                    help="each server's item store (default: a tenth of the catalog's tokens)")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args(argv)
    # N servers share this host's cores: busy-waiting OpenMP threads of one server would starve the
    # others (measured: 2 servers slower than 1 without this). Passive waiting, as one host needs.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    work = tempfile.mkdtemp(prefix="bench-scale-out-")
    model = a.model_path
    if model is None:
        from sgrec.tools.make_tiny_model import make_tiny_model

        model = make_tiny_model(os.path.join(work, "model"), arch="llama", seed=0)
    catalog = os.path.join(work, "catalog.jsonl")
    items = write_catalog(catalog, a.catalog_items)
    reqs = make_requests(items, a.users, a.user_tokens, a.candidates, a.requests)
    cores = os.cpu_count() or 1
    print(header("python benchmarks/bench_scale_out.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "bench_scale_out"))
    print(f"model {model}; {a.catalog_items} items, {a.users} users x {a.user_tokens} tokens, {a.candidates} "
          f"candidates, {a.requests} requests, concurrency {a.concurrency}, dp-size {a.dp_size}, {cores} cores, "
          f"storage tier {a.store}")
    lens = {it["id"]: len(it["token_ids"]) for it in items}
    item_cache = a.item_cache_tokens if a.item_cache_tokens is not None else sum(lens.values()) // 10
    cand_tokens = sum(lens[c] for _, body in reqs for c in body["items"])
    rows, item_rows = [], []
    for n in a.servers:
        cluster = LocalCluster(["--model-path", model, "--device", "cpu", "--max-total-tokens", "16384",
                                "--item-catalog", catalog, "--item-cache-tokens", str(item_cache),
                                "--log-level", "info"], a.dp_size, workdir=os.path.join(work, f"n{n}"),
                               store=None if a.store == "none" else a.store)
        try:
            cluster.up(n)
            url = cluster.front.url
            r = run_load(url, reqs, a.concurrency, True, prefix="item")
            item_rows.append((n, r["stored"] / cand_tokens, r["cached"], r["rps"]))
            print(f"N={n} prefix=item: {r['stored'] / cand_tokens:.3f} of candidate item tokens loaded from the "
                  f"Mooncake Store, {r['rps']:.1f} req/s", flush=True)
            if a.store != "none":
                print_read_choice(cluster)
            for affinity in (True, False):
                for s in cluster.servers:
                    httpx.post(s.url + "/flush_cache", timeout=60)
                r = run_load(url, reqs, a.concurrency, affinity)
                used = min(n * a.dp_size, cores)
                rows.append((n, affinity, r["rps"], r["rps"] / used, r["cached"], r["servers"]))
                print(f"N={n} affinity={affinity}: {r['rps']:.1f} req/s ({r['rps'] / used:.1f} per core), "
                      f"cached {r['cached']:.1%} of prompt tokens, {r['servers']} servers used", flush=True)
        finally:
            cluster.close()

    print("\n| servers | user affinity | req/s | req/s per core used | cached prompt tokens | servers hit |")
    print("|---:|---|---:|---:|---:|---:|")
    for n, aff, rps, per_core, cached, hit in rows:
        print(f"| {n} | {'yes' if aff else 'no'} | {rps:.1f} | {per_core:.1f} | {cached:.1%} | {hit} |")
    print(f"\n| servers | candidate item tokens loaded from the Mooncake Store (item stores of {item_cache} tokens) "
          "| cached prompt tokens | req/s (prefix item) |")
    print("|---:|---:|---:|---:|")
    for n, stored, cached, rps in item_rows:
        print(f"| {n} | {stored:.3f} | {cached:.1%} | {rps:.1f} |")
    if not a.no_record and rows:
        cmd = ("python benchmarks/bench_scale_out.py " + shlex.join(sys.argv[1:] if argv is None else argv)).strip()
        path = write_record(benchmark="bench_scale_out",
                            title="Scale-out: rank throughput across servers and item KV shared between them",
                            command=cmd,
                            results=record_rows(rows, item_rows, item_cache, a),
                            peer="the same servers without user affinity (Caddy picks the least busy)")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
