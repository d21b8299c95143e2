"""sgrec's plugin in a live stock SGLang server on CPU: `python -m sglang.launch_server
--device cpu` on a tiny random Llama, once with the plugin's three names and once with SGLang's own
policies, driven with real HTTP requests.

    python -m sgrec.tools.sglang_cpu_kernels --sglang-src SGLANG_TREE --out KERNELS   # once
    python benchmarks/bench_sglang_live.py --kernels KERNELS
    python benchmarks/bench_sglang_live.py --kernels KERNELS --requests 300 --constrained 20 --beams 8

Servers (one after the other, same model, `--max-total-tokens` = --cache-tokens, `--enable-metrics`,
`--max-running-requests 8` (a beam group of 8 needs 8 slots) and `--prefill-max-requests 1`, so that
queued requests are admitted one at a time in the policy's order):
  plugin: `--radix-eviction-policy laru --grammar-backend sgrec-sid --schedule-policy srjf`
  stock:  `--radix-eviction-policy lru --schedule-policy fcfs`
Checks:
  1. LARU's token hit rate on the simulator's polluted multi-turn trace (`sgrec.radix.sim`, --requests
     requests, each a /generate of its tokens with max_new_tokens 1, one at a time; the hit is SGLang's
     own `meta_info.cached_tokens`) against LRU's, next to the simulator's numbers for the same trace;
  2. constrained generation (greedy and sampled) and beam search (`beam_width` 8, 4 results) through
     `--grammar-backend sgrec-sid` with random exclude lists and year filters: every output is a
     catalog item's semantic-ID path that the request allows, ended by EOS;
  3. the queue's order: 8 long decodes hold every running slot, --queued requests of distinct lengths
     arrive in a shuffled order, the server's /metrics report them all queued, the long decodes are
     aborted; the order they then complete in is SRJF's (shortest first) on the plugin server and
     arrival order on the stock one. The plugin server runs SRJF without its fairness term
     (SGREC_JCT_FAIRNESS=0): the requests arrive up to seconds apart (each is sent once the one before
     shows in /metrics, which SGLang refreshes every few dozen decode steps), and at the default 500
     tokens a second the older ones would rightly go first.
Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import cpu_flags  # noqa: E402
from sgrec.tools.local_server import ServerProcess, free_port  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

VOCAB, EOS = 100_000, 2  # the trace's token ids are below 10^5; the tiny model's EOS
PLUGIN = ["--radix-eviction-policy", "laru", "--grammar-backend", "sgrec-sid", "--schedule-policy", "srjf"]
STOCK = ["--radix-eviction-policy", "lru", "--schedule-policy", "fcfs"]
SLOTS = 8  # running requests: a beam group of 8; the queue check holds them all


def write_catalog(path: str, n: int, seed: int) -> list[dict]:
    """n items, 3-token semantic IDs over codes [8, 40) per level (distinct paths), a year each."""
    rng = random.Random(seed)
    items, seen = [], set()
    while len(items) < n:
        sid = (rng.randrange(8, 16), rng.randrange(16, 28), rng.randrange(28, 40))
        if sid in seen:
            continue
        seen.add(sid)
        items.append({"id": f"i{len(items)}", "token_ids": [3 + len(items) % 5], "semantic_id": list(sid),
                      "attrs": {"year": 1950 + rng.randrange(70)}})
    with open(path, "w") as f:
        f.writelines(json.dumps(it) + "\n" for it in items)
    return items


def start(flags: list[str], model: str, kernels: str, catalog: str, cache_tokens: int, log: str) -> ServerProcess:
    port = free_port()
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGREC_CATALOG=catalog, SGREC_JCT_FAIRNESS="0",
               PYTHONPATH=os.pathsep.join(filter(None, [kernels, ROOT, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", str(cache_tokens),
           "--max-running-requests", str(SLOTS), "--prefill-max-requests", "1", "--enable-metrics", *flags]
    return ServerProcess(cmd, port, log, env=env, ready_path="/health", ready_timeout=600)


def generate(url: str, body: dict, timeout: float = 120) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=timeout, trust_env=False)
    r.raise_for_status()
    return r.json()


def replay(url: str, trace) -> float:
    """Token hit rate of the trace's requests, one at a time (SGLang's cached_tokens)."""
    hit = total = 0
    for r in trace:
        out = generate(url, {"input_ids": list(r.tokens), "sampling_params": {"max_new_tokens": 1}})
        hit += out["meta_info"]["cached_tokens"]
        total += len(r.tokens)
    httpx.post(url + "/flush_cache", timeout=60, trust_env=False)
    return hit / total


def allowed_paths(items: list[dict], spec: dict) -> set[tuple]:
    ex, f = set(spec.get("exclude_items", ())), spec.get("filter", {}).get("year", {})
    lo, hi = f.get("gte", -1e9), f.get("lt", 1e9)
    return {tuple(it["semantic_id"]) for it in items if it["id"] not in ex and lo <= it["attrs"]["year"] < hi}


def constrained(url: str, items: list[dict], n: int, beams: int, seed: int) -> dict:
    """Generation and beam search under random sgrec-sid specs; counts outputs off the allowed paths."""
    rng = random.Random(seed)
    out = {"requests": 0, "outputs": 0, "bad": 0, "beam_requests": 0, "beam_outputs": 0, "beam_bad": 0}
    for k in range(n + beams):
        spec = {"type": "sgrec-sid", "exclude_items": rng.sample([it["id"] for it in items], rng.randrange(0, 20))}
        if rng.random() < 0.5:
            y = 1950 + rng.randrange(50)
            spec["filter"] = {"year": {"gte": y, "lt": y + 25}}
        ok = allowed_paths(items, spec)
        if not ok:
            continue
        sp = {"max_new_tokens": 8, "structural_tag": json.dumps(spec)}
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 40))]
        if k < n:
            sp["temperature"] = 0.0 if k % 2 else 1.0
            results = [generate(url, {"input_ids": prompt, "sampling_params": sp})]
            key = ""
        else:
            sp.update(temperature=0.0, beam_width=8, n=4)
            res = generate(url, {"input_ids": prompt, "sampling_params": sp})
            results = res["meta_info"]["beam_results"]
            key = "beam_"
        out[key + "requests"] += 1
        for r in results:
            ids = r["output_ids"]
            out[key + "outputs"] += 1
            out[key + "bad"] += not (len(ids) == 4 and ids[-1] == EOS and tuple(ids[:3]) in ok)
    return out


def queue_order(url: str, lengths: list[int], seed: int) -> list[int]:
    """The order (by length) in which requests queued behind long decodes complete once those are aborted."""
    rng = random.Random(seed)
    prompts = {n: [rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths}
    done: list[int] = []
    lock = threading.Lock()

    def one(n: int) -> None:
        generate(url, {"input_ids": prompts[n], "sampling_params": {"max_new_tokens": 1}})
        with lock:
            done.append(n)

    rids = [f"hold-{seed}-{k}" for k in range(SLOTS)]
    holders = [threading.Thread(target=_hold, args=(url, rid)) for rid in rids]
    for h in holders:
        h.start()
    _wait_metric(url, "sglang:num_running_reqs", SLOTS)
    threads = []
    for n in lengths:  # arrival order = the order of `lengths`; each is queued before the next is sent
        before = _metric(url, "sglang:num_queue_reqs")
        t = threading.Thread(target=one, args=(n,))
        t.start()
        threads.append(t)
        _wait_metric(url, "sglang:num_queue_reqs", before + 1)
    for rid in rids:
        httpx.post(url + "/abort_request", json={"rid": rid}, timeout=30, trust_env=False)
    for t in threads + holders:
        t.join()
    return done


def _hold(url: str, rid: str) -> None:
    """A long decode that holds the server's one running slot until it is aborted."""
    try:
        httpx.post(url + "/generate", json={"rid": rid, "input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 1900, "ignore_eos": True}}, timeout=600, trust_env=False)
    except httpx.HTTPError:
        pass


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30, trust_env=False).text
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return sum(vals)


def _wait_metric(url: str, name: str, at_least: float, timeout: float = 120) -> None:
    """Polls /metrics until `name` reaches at_least (the server's own count, not a sleep)."""
    deadline = time.monotonic() + timeout
    while _metric(url, name) < at_least:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not reach {at_least} in {timeout} s")
        time.sleep(0.05)


def record_rows(p: dict, s: dict, sim: dict, args) -> list[dict]:
    """The result record's rows: the plugin server's (LARU) token hit rate beside the stock one's (LRU), live
    and in the simulator, and the two replays' times."""
    params = {"trace": "multiturn", "requests": args.requests, "cache_tokens": args.cache_tokens}
    return [row("token hit rate, live server", "share", p["hit"], s["hit"], params=params),
            row("token hit rate, simulator", "share", sim["laru"], sim["sglang-lru"], params=params),
            row("trace replay, one request at a time", "s", p["replay_s"], s["replay_s"], params=params,
                higher_is_better=False)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default=os.environ.get("SGREC_SGLANG_KERNELS"),
                    help="the overlay of sgrec.tools.sglang_cpu_kernels (default: $SGREC_SGLANG_KERNELS)")
    ap.add_argument("--requests", type=int, default=1800, help="multi-turn trace requests replayed per server")
    ap.add_argument("--cache-tokens", type=int, default=30000, help="the servers' KV pool (--max-total-tokens)")
    ap.add_argument("--constrained", type=int, default=60, help="sgrec-sid generation requests")
    ap.add_argument("--beams", type=int, default=30, help="sgrec-sid beam requests (beam_width 8, n 4)")
    ap.add_argument("--queued", type=int, default=6, help="requests queued behind a long decode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.kernels:
        raise SystemExit("--kernels (or SGREC_SGLANG_KERNELS): the overlay of python -m sgrec.tools.sglang_cpu_kernels")
    import sglang

    from sgrec.radix.sim import load, simulate
    from sgrec.tools.make_tiny_model import make_tiny_model

    work = args.workdir or tempfile.mkdtemp(prefix="sgrec-sglang-live-")
    print(f"# bench_sglang_live: SGLang {sglang.__version__} on CPU, {time.strftime('%Y-%m-%d %H:%M')}\n"
          f"command: python benchmarks/bench_sglang_live.py {' '.join(argv if argv is not None else sys.argv[1:])}\n"
          f"cpu flags: {cpu_flags()}")
    model = make_tiny_model(os.path.join(work, "model"), "llama", dtype="bfloat16", vocab_size=VOCAB)
    catalog = os.path.join(work, "catalog.jsonl")
    items = write_catalog(catalog, 200, args.seed)
    trace = load("multiturn", args.requests)
    rng = random.Random(args.seed)
    lengths = [200 + 300 * k for k in range(args.queued)]
    arrival = lengths[:]
    rng.shuffle(arrival)
    res = {}
    for name, flags in (("plugin", PLUGIN), ("stock", STOCK)):
        srv = start(flags, model, args.kernels, catalog, args.cache_tokens, os.path.join(work, f"{name}.log"))
        try:
            t0 = time.monotonic()
            r = {"hit": replay(srv.url, trace), "replay_s": time.monotonic() - t0}
            if name == "plugin":
                r.update(constrained(srv.url, items, args.constrained, args.beams, args.seed))
            r["order"] = queue_order(srv.url, arrival, args.seed)
            res[name] = r
        finally:
            srv.stop()
    sim = {p: simulate(trace, p, args.cache_tokens).token_hit_rate for p in ("laru", "sglang-lru")}
    p, s = res["plugin"], res["stock"]
    checks = {
        "LARU's hit rate >= LRU's (live)": p["hit"] >= s["hit"],
        "generation on allowed catalog paths": p["requests"] > 0 and p["bad"] == 0,
        "beams on allowed catalog paths": p["beam_requests"] > 0 and p["beam_outputs"] > 0 and p["beam_bad"] == 0,
        "srjf: shortest first": p["order"] == sorted(arrival),
        "fcfs: arrival order": s["order"] == arrival,
    }
    print(f"\n| server | token hit rate (live) | simulator | replay s |\n|---|---:|---:|---:|\n"
          f"| plugin (laru) | {p['hit']:.4f} | {sim['laru']:.4f} | {p['replay_s']:.1f} |\n"
          f"| stock (lru) | {s['hit']:.4f} | {sim['sglang-lru']:.4f} | {s['replay_s']:.1f} |\n"
          f"LARU vs LRU live: {p['hit'] / s['hit']:.3f}x ({args.requests} requests, {args.cache_tokens} KV tokens)")
    print(f"sgrec-sid: {p['requests']} generations ({p['outputs']} outputs, {p['bad']} off the allowed paths); "
          f"{p['beam_requests']} beam requests ({p['beam_outputs']} beams, {p['beam_bad']} off the allowed paths)")
    print(f"queue: arrival (tokens) {arrival}; plugin (srjf) completed {p['order']}; stock (fcfs) {s['order']}")
    for k, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {k}")
    print(f"RESULT {json.dumps({'checks': checks, 'plugin': p, 'stock': s, 'sim': sim})}")
    if not args.no_record and all(checks.values()):  # a failed check: no record of the run
        cmd = ("python benchmarks/bench_sglang_live.py " + shlex.join(sys.argv[1:] if argv is None else argv)).strip()
        path = write_record(benchmark="bench_sglang_live", title="sgrec's plugin inside a live stock SGLang server",
                            command=cmd, results=record_rows(p, s, sim, args),
                            peer=f"stock SGLang {sglang.__version__} (LRU eviction, FCFS)")
        print(f"result record: {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
