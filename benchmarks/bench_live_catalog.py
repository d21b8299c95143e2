"""Live catalogs: retrieve latency while items are updated, update-to-visibility time on a
10^6-item catalog, and /v1/recommend against retrieve + rank as two calls.

    python benchmarks/bench_live_catalog.py            # all three parts (run it alone: ~10 min)
    python benchmarks/bench_live_catalog.py --quick    # shorter phases, a 10^5-item catalog
    python benchmarks/bench_live_catalog.py --parts traffic recommend

1. Traffic: the demo server (MovieLens model and catalog). --clients clients send retrieve requests
   (BW 16, 10 items) back to back; in the "updates" phases one more client replaces --rate items per
   second (batches of --batch demo items with corrected attributes, each batch one POST that is
   acknowledged after the journal's fsync and the switch of every rank). A control phase sends the
   same POSTs with one bad item at the end of each batch (a 400 once the server parsed the batch: the
   HTTP and validation share of the cost, no new version). Quiet, control and update phases alternate
   (--rounds of each), so the machine's drift lands on all. Reported: retrieve P50 / P99 per phase
   kind, their ratio (target: P99 within 1.2x), the update rate reached and the updates'
   acknowledgement latency.
2. Visibility: a server on an N-item catalog (the tiny random model; items as in bench_catalog). Each
   trial inserts one new item on a new semantic-ID path; timed: the POST until its acknowledgement
   (the new catalog version and trie built off the step, journaled, switched), and from the
   acknowledgement until a retrieve restricted to that item returns it (target: under 5 s in all).
3. Recommend: the demo server; the same users through /v1/recommend and through /v1/retrieve then
   /v1/rank with the retrieved ids (checked equal first), --clients clients, one mode at a time,
   alternating; reported: requests per second of each and the ratio (target: >= 1.3x).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time

import httpx
import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench_catalog import header, md_table, verdict, write_jsonl  # noqa: E402
from sgrec import demo  # noqa: E402
from sgrec.tools.local_server import LocalServer  # noqa: E402
from sgrec.tools.make_tiny_model import make_tiny_model  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def demo_server(work: str, name: str, a) -> LocalServer:
    flags = ["--device", "cpu", "--dtype", "float32", "--item-catalog", demo.catalog_path(), "--catalog-journal",
             os.path.join(work, f"{name}.journal"), "--max-beam-width", "64"]
    if a.cpu_threads is not None:
        flags += ["--cpu-threads", str(a.cpu_threads)]
    if a.catalog_update_cores is not None:
        flags += ["--catalog-update-cores", str(a.catalog_update_cores)]
    return LocalServer(flags, log_path=os.path.join(work, f"{name}.log"))


def demo_items() -> list[dict]:
    with open(demo.catalog_path(), "rb") as f:
        return [orjson.loads(line) for line in f]


def retrieve_body(rng: random.Random, items: list[dict]) -> dict:
    hist = "".join(f"<i{it['movie_id']}>" for it in rng.sample(items, 8))
    return {"user": {"text": hist + "\nSemantic ID:"}, "beam_width": 16, "num_items": 10}


# ---- 1. retrieve under updates ---------------------------------------------------------------
def push_updates(url: str, bodies: list[bytes], per_s: float, start: float, stop: float, expect: int, q) -> None:
    """The updater process: one POST per body, paced at `per_s`, from `start` until `stop`
    (monotonic), each answered with status `expect`; reports (posts, seconds, answer latencies)."""
    time.sleep(max(0.0, start - time.monotonic()))
    t0, n, acks = time.monotonic(), 0, []
    with httpx.Client(base_url=url, timeout=300, headers={"content-type": "application/json"}) as c:
        while time.monotonic() < stop and n < len(bodies):
            t = time.perf_counter()
            r = c.post("/v1/catalog/items", content=bodies[n])
            assert r.status_code == expect, r.text
            acks.append(time.perf_counter() - t)
            n += 1
            wait = t0 + n / per_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
    q.put((n, time.monotonic() - t0, acks))


def bench_traffic(work: str, a) -> list[dict]:
    items = demo_items()
    rows = []
    with demo_server(work, "traffic", a) as srv, httpx.Client(base_url=srv.url, timeout=300) as c:
        for _ in range(2):  # warm-up: both request kinds once
            assert c.post("/v1/retrieve", json=retrieve_body(random.Random(0), items)).status_code == 200
        lat: dict[str, list[float]] = {"quiet": [], "rejected": [], "updates": []}
        acks: list[float] = []
        pushed = [0, 0.0]  # items acknowledged, seconds of update phases

        def clients(phase: str, seconds: float, seed: int) -> None:
            proc = None
            if phase != "quiet":  # from another process, bodies encoded beforehand: the clients' GIL
                rng = random.Random(seed)  # and CPU are not the updater's
                bad = [{"id": "no-tokens"}] if phase == "rejected" else []  # the last item: a 400 after parsing
                bodies = [orjson.dumps({"items": [{**it, "attrs": {**it["attrs"], "year": rng.randint(1900, 2000)}}
                                                  for it in rng.sample(items, a.batch)] + bad})
                          for _ in range(int(seconds * a.rate / a.batch) + 1)]
                ctx = multiprocessing.get_context("fork")  # forked before the client threads start
                q = ctx.Queue()
                start = time.monotonic() + 0.5
                proc = ctx.Process(target=push_updates, args=(srv.url, bodies, a.rate / a.batch, start,
                                                              start + seconds, 400 if bad else 200, q))
                proc.start()
                time.sleep(max(0.0, start - time.monotonic()))
            stop = time.monotonic() + seconds

            def one(k: int) -> None:
                rng = random.Random(seed * 100 + k)
                with httpx.Client(base_url=srv.url, timeout=300) as cc:
                    while time.monotonic() < stop:
                        t = time.perf_counter()
                        r = cc.post("/v1/retrieve", json=retrieve_body(rng, items))
                        assert r.status_code == 200, r.text
                        lat[phase].append(time.perf_counter() - t)

            ts = [threading.Thread(target=one, args=(k,)) for k in range(a.clients)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if proc is not None:
                n, secs, ack = q.get()
                proc.join()
                if phase == "updates":
                    acks.extend(ack)
                    pushed[0] += n * a.batch
                    pushed[1] += secs

        for k in range(a.rounds):
            for j, phase in enumerate(("quiet", "rejected", "updates")):
                clients(phase, a.phase_s, 3 * k + j)
        version = c.get("/v1/catalog").json()["version"]
    for phase in ("quiet", "rejected", "updates"):
        xs = lat[phase]
        rows.append({"phase": phase, "n": len(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99)})
    rows.append({"rate": pushed[0] / max(pushed[1], 1e-9), "ack_p50": pct(acks, 0.5), "ack_p99": pct(acks, 0.99),
                 "versions": version})
    return rows


def report_traffic(rows: list[dict], a) -> None:
    q, rej, u, up = rows
    print(f"\n## 1. Retrieve on the demo server, {a.clients} clients, BW 16: quiet vs {a.rate} item updates/s "
          f"(batches of {a.batch}), {a.rounds} x {a.phase_s:.0f} s each, alternating")
    print(md_table(["phase", "requests", "P50 ms", "P99 ms"],
                   [[r["phase"], r["n"], f"{r['p50'] * 1e3:.1f}", f"{r['p99'] * 1e3:.1f}"] for r in (q, rej, u)]))
    ratio = u["p99"] / q["p99"]
    print(f"\nP99 with updates / quiet: {ratio:.2f}x (target <= 1.2x: {verdict(ratio <= 1.2)}); "
          f"P50 {u['p50'] / q['p50']:.2f}x")
    print(f"control, the same POSTs rejected after parsing (HTTP, body, validation; no new version): "
          f"P99 {rej['p99'] / q['p99']:.2f}x, P50 {rej['p50'] / q['p50']:.2f}x of quiet")
    print(f"updates: {up['rate']:.0f} items/s acknowledged ({up['versions']} versions), acknowledgement "
          f"P50 {up['ack_p50'] * 1e3:.1f} ms, P99 {up['ack_p99'] * 1e3:.1f} ms")


# ---- 2. acknowledgement and visibility at N items --------------------------------------------
def bench_visibility(work: str, a) -> list[dict]:
    codes, base = 1024, 320
    model = make_tiny_model(os.path.join(work, "tiny"), vocab_size=3 * codes + base, seed=0)
    cat = os.path.join(work, f"catalog_{a.items}.jsonl")
    write_jsonl(cat, a.items, codes, base, seed=0)
    flags = ["--model-path", model, "--device", "cpu", "--dtype", "float32", "--item-catalog", cat, "--catalog-journal",
             os.path.join(work, "visibility.journal"), "--max-total-tokens", "65536", "--item-cache-tokens", "4096"]
    rows = []
    t = time.perf_counter()
    with LocalServer(flags, log_path=os.path.join(work, "visibility.log"), ready_timeout=1800) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as c:
        start_s = time.perf_counter() - t
        for k in range(a.trials):
            item = {"id": f"new{k}", "token_ids": [5, 6, 7], "id_token": 9,
                    "semantic_id": [base + codes - 1, base + 2 * codes - 1, base + 3 * codes - 1 - k]}
            t0 = time.perf_counter()
            r = c.post("/v1/catalog/items", json={"items": [item]})
            t1 = time.perf_counter()
            assert r.status_code == 200, r.text
            while True:  # first answer that holds it (the first one does: the acknowledgement follows the switch)
                got = c.post("/v1/retrieve", json={"user": {"token_ids": [11, 12, 13]}, "beam_width": 1,
                                                   "num_items": 1, "include_items": [item["id"]]}).json()
                if [x["item"] for x in got["items"]] == [item["id"]]:
                    break
            rows.append({"ack": t1 - t0, "visible": time.perf_counter() - t1})
    rows.append({"start_s": start_s})
    return rows


def report_visibility(rows: list[dict], a) -> None:
    trials, start = rows[:-1], rows[-1]
    print(f"\n## 2. One new item on a {a.items:,}-item catalog (server start-up {start['start_s']:.1f} s), "
          f"{len(trials)} trials")
    acks, vis = [r["ack"] for r in trials], [r["visible"] for r in trials]
    total = [x + y for x, y in zip(acks, vis)]
    print(md_table(["", "median s", "max s"], [["POST until acknowledged", f"{statistics.median(acks):.2f}",
                                                 f"{max(acks):.2f}"],
                                                ["acknowledged until a retrieve returns it",
                                                 f"{statistics.median(vis):.3f}", f"{max(vis):.3f}"],
                                                ["both", f"{statistics.median(total):.2f}", f"{max(total):.2f}"]]))
    print(f"\nupdate to visibility under 5 s: {verdict(max(total) < 5)}")


# ---- 3. recommend vs two calls ---------------------------------------------------------------
def bench_recommend(work: str, a) -> list[dict]:
    items = demo_items()
    rng = random.Random(3)
    users = [retrieve_body(rng, items)["user"] for _ in range(64)]
    stage = {"beam_width": 32, "num_candidates": 20}
    out = []
    with demo_server(work, "recommend", a) as srv, httpx.Client(base_url=srv.url, timeout=300) as c:
        def one_call(cc, u):
            r = cc.post("/v1/recommend", json={"user": u, "retrieve": stage, "top_k": 10})
            assert r.status_code == 200, r.text
            return [x["item"] for x in r.json()["items"]]

        def two_calls(cc, u):
            r = cc.post("/v1/retrieve", json={"user": u, "beam_width": stage["beam_width"],
                                              "num_items": stage["num_candidates"]})
            assert r.status_code == 200, r.text
            ids = [x["item"] for x in r.json()["items"]]
            r = cc.post("/v1/rank", json={"user": u, "items": ids, "top_k": 10})
            assert r.status_code == 200, r.text
            return [x["item"] for x in r.json()["ranking"]]

        for u in users[:8]:  # equal results first
            assert one_call(c, u) == two_calls(c, u)
        modes = {"recommend": one_call, "retrieve + rank": two_calls}
        done = {m: [0, 0.0] for m in modes}
        for k in range(a.rounds):
            for name, fn in modes.items():
                stop = time.monotonic() + a.phase_s
                count = [0]

                def client(j: int) -> None:
                    with httpx.Client(base_url=srv.url, timeout=300) as cc:
                        i = j
                        while time.monotonic() < stop:
                            fn(cc, users[i % len(users)])
                            count[0] += 1
                            i += a.clients

                t0 = time.monotonic()
                ts = [threading.Thread(target=client, args=(j,)) for j in range(a.clients)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                done[name][0] += count[0]
                done[name][1] += time.monotonic() - t0
        for name, (n, s) in done.items():
            out.append({"mode": name, "n": n, "rps": n / s})
    return out


def report_recommend(rows: list[dict], a) -> None:
    print(f"\n## 3. /v1/recommend vs /v1/retrieve + /v1/rank (demo server, BW 32, 20 candidates, top 10, "
          f"{a.clients} clients, {a.rounds} x {a.phase_s:.0f} s per mode, alternating; results checked equal)")
    print(md_table(["mode", "requests", "req/s"], [[r["mode"], r["n"], f"{r['rps']:.2f}"] for r in rows]))
    ratio = rows[0]["rps"] / rows[1]["rps"]
    print(f"\nrecommend / two calls: {ratio:.2f}x (target >= 1.3x: {verdict(ratio >= 1.3)})")


def record_rows(got: dict[str, list[dict]], a) -> list[dict]:
    """The result record's rows, per part run (got: part -> its bench_* rows): retrieve latency under
    updates (and under the rejected control) beside the quiet phases', the update rate and its
    acknowledgements; acknowledgement and visibility times; /v1/recommend's req/s beside two calls'."""
    out = []
    if "traffic" in got:
        q, rej, u, up = got["traffic"]
        p = {"clients": a.clients, "rate": a.rate, "batch": a.batch, "beam_width": 16}
        for stat in ("p50", "p99"):
            out.append(row(f"retrieve {stat.upper()} latency while items are updated", "ms", u[stat] * 1e3,
                           q[stat] * 1e3, params=p, higher_is_better=False))
            out.append(row(f"retrieve {stat.upper()} latency beside rejected updates (control)", "ms", rej[stat] * 1e3,
                           q[stat] * 1e3, params=p, higher_is_better=False))
        out.append(row("item updates acknowledged", "items/s", up["rate"], params=p))
        for stat in ("p50", "p99"):
            out.append(row(f"update acknowledgement {stat.upper()}", "ms", up[f"ack_{stat}"] * 1e3, params=p,
                           higher_is_better=False))
    if "visibility" in got:
        trials, start = got["visibility"][:-1], got["visibility"][-1]
        p = {"items": a.items, "trials": len(trials)}
        acks, vis = [r["ack"] for r in trials], [r["visible"] for r in trials]
        for name, xs in (("POST until acknowledged", acks), ("acknowledged until a retrieve returns it", vis),
                         ("update to visibility", [x + y for x, y in zip(acks, vis)])):
            out.append(row(f"{name} (median)", "s", statistics.median(xs), params=p, higher_is_better=False))
            out.append(row(f"{name} (max)", "s", max(xs), params=p, higher_is_better=False))
        out.append(row("server start-up", "s", start["start_s"], params={"items": a.items}, higher_is_better=False))
    if "recommend" in got:
        one, two = got["recommend"]
        out.append(row("/v1/recommend throughput", "req/s", one["rps"], two["rps"],
                       params={"clients": a.clients, "beam_width": 32, "candidates": 20, "top_k": 10}))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["traffic", "visibility", "recommend"],
                    choices=["traffic", "visibility", "recommend"])
    ap.add_argument("--quick", action="store_true", help="5 s phases, 2 rounds, a 10^5-item catalog")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--rate", type=float, default=1000.0, help="item updates per second in the update phases")
    ap.add_argument("--batch", type=int, default=100, help="items per update request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--items", type=int, default=1_000_000, help="catalog size of part 2")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--workdir")
    ap.add_argument("--cpu-threads", type=int, help="the demo servers' --cpu-threads (default: theirs)")
    ap.add_argument("--catalog-update-cores", type=int,
                    help="the demo servers' --catalog-update-cores (default: theirs; 0: the forward keeps every thread)")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args(argv)
    if a.quick:
        a.phase_s, a.rounds, a.items, a.trials = 5.0, 2, min(a.items, 100_000), 3
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    work = a.workdir or tempfile.mkdtemp(prefix="sgrec-live-")
    os.makedirs(work, exist_ok=True)
    print(header(" ".join(["python benchmarks/bench_live_catalog.py", *(argv or sys.argv[1:])]),
                 "bench_live_catalog"))
    print(f"workdir: {work}")
    got = {}
    if "traffic" in a.parts:
        got["traffic"] = bench_traffic(work, a)
        report_traffic(got["traffic"], a)
    if "visibility" in a.parts:
        got["visibility"] = bench_visibility(work, a)
        report_visibility(got["visibility"], a)
    if "recommend" in a.parts:
        got["recommend"] = bench_recommend(work, a)
        report_recommend(got["recommend"], a)
    if not a.no_record:
        cmd = ("python benchmarks/bench_live_catalog.py " + shlex.join(argv or sys.argv[1:])).strip()
        path = write_record(benchmark="bench_live_catalog",
                            title="Live catalogs: retrieve under item updates, update visibility, /v1/recommend",
                            command=cmd, results=record_rows(got, a),
                            peer="the quiet phases, no updates (traffic); /v1/retrieve then /v1/rank (recommend)")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
