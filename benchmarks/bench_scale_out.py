"""Scale-out on loopback: rank throughput vs number of sgrec servers behind the launch/ front
(Caddy for /v1/rank), with and without user affinity, and HRCS across servers: the share of item
KV fetched from another server against Algorithm 1's prediction, and what a fetch costs.

    python benchmarks/bench_scale_out.py                       # 1, 2, 3 servers, tiny random model
    python benchmarks/bench_scale_out.py --servers 1 2 --requests 200 --concurrency 8

Workload: `--users` users, each with a fixed history of `--user-tokens` tokens, send rank requests
over `--candidates` items drawn from a `--catalog-items` catalog in proportion to a Zipf(1)
popularity (the catalog's `popularity`, which Algorithm 1 plans with). Closed loop: `--concurrency`
clients, `--requests` requests per configuration, users in a shuffled round-robin order.
- affinity: the client sends X-User-Id, Caddy hashes it (a user's prefix KV stays on one server);
- no affinity: no header, Caddy picks the least busy server (the user's prefix is cached wherever
  it went before, or not at all).
HRCS phase: the same requests with prefix "item" (candidates read from the item stores), once per
fetch policy of `--item-fetch` (the peer file's `item_fetch`: "always" fetches every remote item,
"cost" lets the fetcher's cost model choose, "never" recomputes them), per N the fetched share of
candidate item tokens, next to Algorithm 1's expected remote share for the replication ratio each
server logged. Fetch cost: item KV fetched over tcp://127.0.0.1 from an `ItemKVServer`, one item per
round trip and `--candidates` / 2 items in one, vs recomputing the item, vs the recompute time per
token the cost model uses, and vs Algorithm 1's transfer model at 100 Gbit/s.
The servers run with OMP_WAIT_POLICY=PASSIVE (unless set): they share the host's cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from launch.local_cluster import LocalCluster  # noqa: E402
from sgrec.items.peers import read_servers, write_peer_file  # noqa: E402


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
            "fetched": sum(m.get("fetched_tokens", 0) for m in metas), "servers": len({s for _, s in results}),
            "metas": metas}


def logged_ratio(log_path: str) -> float | None:
    with open(log_path) as f:
        found = re.findall(r"HRCS over (\d+) ranks: replication ratio ([0-9.]+)", f.read())
    return float(found[-1][1]) if found else None


def predicted_remote_share(items: list[dict], reqs, ratio: float, n: int) -> float:
    """Algorithm 1's expectation for this workload: an item is read remotely when it is cold (not
    in the replicated top share of the catalog's popularity order, which the servers plan with) and
    one of the other n - 1 ranks owns it; weighted by how often the requests ask for each item and
    by its tokens (what the servers report as fetched_tokens)."""
    from sgrec.items import hrcs

    ids = [it["id"] for it in items]
    pl = hrcs.plan_placement(ids, [it["popularity"] + 1.0 for it in items], ratio, n)
    lens = {it["id"]: len(it["token_ids"]) for it in items}
    asked = [c for _, body in reqs for c in body["items"]]
    cold = sum(lens[c] for c in asked if c not in pl.replicated)
    return cold / sum(lens[c] for c in asked) * (n - 1) / n


def fetch_cost(model: str, catalog: str, batch: int, repeats: int = 200) -> dict:
    """Seconds to fetch item KV over tcp://127.0.0.1 (one item per round trip, and `batch` items in
    one) vs to recompute one item, in this process; and the cost model's recompute time per token."""
    import torch
    import zmq

    from sgrec.catalog import load_catalog
    from sgrec.items.fetch import ItemKVClient, ItemKVServer, header_key
    from sgrec.items.hrcs import DEFAULT_BANDWIDTH_GBPS
    from sgrec.items.peers import measure_recompute_per_token
    from sgrec.model.attention import SeqLayout
    from sgrec.radix.tree import RadixCache
    from sgrec import layout as L
    from sgrec.rank.executor import RankExecutor
    from sgrec.runner import ModelRunner
    from sgrec.server_args import ServerArgs
    from sgrec.tokenizer import Tokenizer

    args = ServerArgs(model_path=model, device="cpu", dtype="float32", max_total_tokens=8192, item_catalog=catalog)
    runner = ModelRunner(args)
    cat = load_catalog(catalog, Tokenizer(model), runner.config.vocab_size)
    ex = RankExecutor(runner, RadixCache(runner.kv_pool.allocator), cat, args)
    ex.precompute()
    ctx = zmq.Context.instance()
    port = __import__("launch.front", fromlist=["free_port"]).free_port()
    srv = ItemKVServer(ex.store, f"tcp://127.0.0.1:{port}", ctx)
    srv.start()
    cl = ItemKVClient({1: f"tcp://127.0.0.1:{port}"}, ctx)
    ids = [it.id for it in cat.items]
    head = header_key(ex.header_ids)

    def timed(size: int) -> tuple[float, float]:
        toks = 0
        t0 = time.perf_counter()
        for j in range(repeats):
            rep = cl.fetch_many({1: [ids[(j * size + m) % len(ids)] for m in range(size)]}, head, 2000)[1]
            toks += rep.k.shape[1]
        return (time.perf_counter() - t0) / repeats, toks / repeats

    try:
        timed(1)
        one, one_tokens = timed(1)
        many, many_tokens = timed(batch)
    finally:
        cl.close()
        srv.close()
    # recompute: one item through the model (its layout row against the header), as a miss costs
    alloc = runner.kv_pool.allocator
    header = ex.store.ensure_header()
    t0 = None
    for j in range(-5, repeats):  # 5 unmeasured warm-up forwards
        if j == 0:
            t0 = time.perf_counter()
        it = cat.items[j % len(ids)]
        lay = L.item_as_prefix(ex.header_ids, [it.token_ids], [], [])
        seg = lay.items()[0]
        slots = alloc.alloc(seg.length)
        seq = SeqLayout(0, seg.length, torch.cat([header, slots]), lay.mask(list(range(seg.start, seg.stop)), None))
        runner.forward(runner.make_batch(lay.token_ids[seg.start:seg.stop], lay.positions[seg.start:seg.stop],
                                         slots, [seq]), [])
        alloc.free(slots)
    recompute = (time.perf_counter() - t0) / repeats
    per_token_model = measure_recompute_per_token(runner, cat, args.max_rank_candidates)
    cfg = runner.config
    per_token = runner.kv_pool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, runner.kv_pool.dtype)
    model_s = one_tokens * per_token / (DEFAULT_BANDWIDTH_GBPS * 1e9 / 8)
    return {"fetch_s": one, "tokens": one_tokens, "batch": batch, "batch_fetch_s": many, "batch_tokens": many_tokens,
            "recompute_s": recompute, "recompute_per_token_s": per_token_model, "bytes_per_token": per_token,
            "alg1_transfer_s": model_s}


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
    ap.add_argument("--item-fetch", nargs="+", choices=["always", "cost", "never"], default=["always", "cost"],
                    help="fetch policies of the HRCS phase (the peer file's item_fetch), each measured in turn")
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
    print(f"model {model}; {a.catalog_items} items, {a.users} users x {a.user_tokens} tokens, {a.candidates} "
          f"candidates, {a.requests} requests, concurrency {a.concurrency}, dp-size {a.dp_size}, {cores} cores")
    rows, hrcs_rows = [], []
    for n in a.servers:
        cluster = LocalCluster(["--model-path", model, "--device", "cpu", "--max-total-tokens", "16384",
                                "--item-catalog", catalog, "--log-level", "info"], a.dp_size,
                               workdir=os.path.join(work, f"n{n}"))
        try:
            cluster.up(n)
            url = cluster.front.url
            # first, while every rank holds its share (a flush empties the stores)
            cand_tokens = sum(len(next(it for it in items if it["id"] == c)["token_ids"])
                              for _, body in reqs for c in body["items"])
            ratio = logged_ratio(cluster.servers[0].log)
            ranks = n * a.dp_size
            pred = predicted_remote_share(items, reqs, ratio, ranks) if ratio is not None else 0.0
            for policy in a.item_fetch:
                write_peer_file(cluster.peers_path, read_servers(cluster.peers_path), item_fetch=policy)
                time.sleep(1.5)  # the servers re-read the peer file every second
                r = run_load(url, reqs, a.concurrency, True, prefix="item")
                hrcs_rows.append((n, policy, ratio, r["fetched"] / cand_tokens, pred, r["rps"]))
                print(f"N={n} prefix=item, item_fetch={policy}: fetched {r['fetched'] / cand_tokens:.3f} of candidate "
                      f"item tokens (Algorithm 1: {pred:.3f} at r={ratio}), {r['rps']:.1f} req/s", flush=True)
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
    cost = fetch_cost(model, catalog, max(1, a.candidates // 2))

    print("\n| servers | user affinity | req/s | req/s per core used | cached prompt tokens | servers hit |")
    print("|---:|---|---:|---:|---:|---:|")
    for n, aff, rps, per_core, cached, hit in rows:
        print(f"| {n} | {'yes' if aff else 'no'} | {rps:.1f} | {per_core:.1f} | {cached:.1%} | {hit} |")
    print("\n| servers | item_fetch | replication ratio r | fetched share of candidate item tokens | Algorithm 1's expected share | req/s (prefix item) |")
    print("|---:|---|---:|---:|---:|---:|")
    for n, policy, ratio, got, pred, rps in hrcs_rows:
        print(f"| {n} | {policy} | {ratio if ratio is not None else '-'} | {got:.3f} | {pred:.3f} | {rps:.1f} |")
    print(f"\nitem KV fetch over tcp://127.0.0.1: {cost['fetch_s'] * 1e6:.0f} us for one item ({cost['tokens']:.1f} tokens, "
          f"{cost['bytes_per_token']} B/token), {cost['batch_fetch_s'] * 1e6:.0f} us for {cost['batch']} items in one round "
          f"trip ({cost['batch_tokens']:.1f} tokens); recompute one item alone {cost['recompute_s'] * 1e6:.0f} us; the "
          f"cost model's recompute time {cost['recompute_per_token_s'] * 1e6:.1f} us per token "
          f"({cost['recompute_per_token_s'] * cost['batch_tokens'] * 1e6:.0f} us for the {cost['batch']} items); "
          f"Algorithm 1's transfer model at 100 Gbit/s: {cost['alg1_transfer_s'] * 1e6:.2f} us per item")


if __name__ == "__main__":
    main()
