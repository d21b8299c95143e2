"""Soak test: mixed traffic at ~80% of measured capacity for a bounded time, on loopback.

Starts `python -m sgrec.launch_server` (the embedded demo recommender and its catalog) on
127.0.0.1, or uses --url (a loopback demo server; --pid for its process tree). Then:

1. capacity: a closed loop of --concurrency clients sends the mix for --calibrate seconds;
   capacity = completed requests / second;
2. soak: open-loop Poisson arrivals at --load x capacity for --duration seconds (at most
   --max-requests requests, at most --max-inflight outstanding), the mix being /generate (half of
   them streamed), /v1/completions, /v1/chat/completions, /v1/score, /v1/rank and /v1/retrieve
   for a pool of users whose histories repeat (so the caches hit and evict);
3. every --sample seconds: RSS and threads of the server's process tree, KV slots in use, and the
   P99 latency of the requests that ended in that window;
4. drain: waits for outstanding requests, flushes the cache and reads the KV pool (all free).

Prints a report (requests, errors by status, 503s, P50/P99 overall, per route and per window,
P99 drift = last window / first window, RSS start/max/end, threads start/end, KV after drain)
and writes it as JSON with --out. Exits 1 when a request failed (not 503), KV is left in use
after drain, a server process died or the thread count grew.

    python benchmarks/soak.py                      # 10 minutes
    python benchmarks/soak.py --duration 60        # what CI runs (tests/test_soak.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sgrec import demo  # noqa: E402
from sgrec.tools.local_server import LocalServer  # noqa: E402
from sgrec.tools.probe import alive, kv_after_drain, kv_state, percentile_ms, proc_tree  # noqa: E402

SERVER_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "32768", "--max-beam-width", "64"]
MIX = {"generate": 20, "generate_stream": 10, "completions": 15, "chat": 10, "score": 15, "rank": 15,
       "retrieve": 15}  # weights
USERS = 300
MIN_REQUESTS = 2 * len(MIX)  # the arrival rate's floor: this many requests over the soak on average
THREAD_SLACK = 4


class Traffic:
    """Request bodies of the mix over the demo catalog, for a fixed pool of users."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        with open(demo.catalog_path()) as f:
            items = [json.loads(line) for line in f if line.strip()]
        self.item_ids = [it["id"] for it in items]
        self.id_tokens = [it["id_token"] for it in items]
        self.histories = [self._history() for _ in range(USERS)]
        self.deck: list[str] = []

    def _history(self) -> list[str]:
        return self.rng.sample(self.item_ids, self.rng.randint(5, 30))

    def user(self) -> tuple[str, str]:
        u = self.rng.randrange(USERS)
        if self.rng.random() < 0.05:  # a user's history grows now and then
            self.histories[u] = (self.histories[u] + [self.rng.choice(self.item_ids)])[-30:]
        return f"u{u}", "".join(f"<i{i[1:]}>" for i in self.histories[u])

    def request(self, kind: str) -> tuple[str, dict, bool]:
        uid, hist = self.user()
        r = self.rng
        if kind in ("generate", "generate_stream"):
            return "/generate", {"text": hist + "\nNext item:", "stream": kind == "generate_stream",
                                 "sampling_params": {"max_new_tokens": r.randint(1, 16), "temperature": 0.7}}, \
                kind == "generate_stream"
        if kind == "completions":
            return "/v1/completions", {"prompt": hist + "\nNext item:", "max_tokens": r.randint(1, 16),
                                       "temperature": 0.7}, False
        if kind == "chat":
            return "/v1/chat/completions", {"messages": [{"role": "user", "content": hist}],
                                            "max_tokens": r.randint(1, 16)}, False
        if kind == "score":
            return "/v1/score", {"query": hist, "items": ["\nNext item:"], "apply_softmax": True,
                                 "label_token_ids": r.sample(self.id_tokens, 10)}, False
        if kind == "rank":
            return "/v1/rank", {"user": {"id": uid, "text": hist}, "items": r.sample(self.item_ids, 20),
                                "top_k": 5}, False
        return "/v1/retrieve", {"user": {"id": uid, "text": hist + "\nSemantic ID:"}, "beam_width": 16,
                                "num_items": 5}, False

    def kind(self) -> str:
        """The next request's kind: decks of DECK cards in MIX's proportions, each deck starting with
        one of every kind (shuffled), so any DECK-aligned run of len(MIX) requests drives every route."""
        if not self.deck:
            unit = math.gcd(*MIX.values())
            rest = [k for k, w in MIX.items() for _ in range(w // unit - 1)]
            first = list(MIX)
            self.rng.shuffle(first)
            self.rng.shuffle(rest)
            self.deck = first + rest
        return self.deck.pop(0)


@dataclass
class Record:
    kind: str
    status: int | str
    start: float
    end: float


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    inflight: int = 0
    refused_by_client: int = 0  # arrivals skipped because --max-inflight requests were outstanding
    sent: int = 0
    ticks_due: int = 0  # sample ticks whose time came during the soak
    ticks_skipped: list[dict] = field(default_factory=list)  # ticks with no sample, and why


async def send(client: httpx.AsyncClient, traffic: Traffic, run: Run) -> None:
    kind = traffic.kind()
    path, body, stream = traffic.request(kind)
    t0 = time.monotonic()
    run.inflight += 1
    try:
        if stream:
            async with client.stream("POST", path, json=body) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if line.startswith("data:") and '"error"' in line[:20]:
                        status = "stream-error"
        else:
            r = await client.post(path, json=body)
            status = r.status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    finally:
        run.inflight -= 1
    run.records.append(Record(kind, status, t0, time.monotonic()))


async def closed_loop(client, traffic, seconds: float, concurrency: int) -> Run:
    run = Run()
    end = time.monotonic() + seconds

    async def worker():
        while time.monotonic() < end:
            await send(client, traffic, run)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return run


async def sampler(on_tick, tick: float, start: float, stop: asyncio.Event, run: Run) -> None:
    """Calls on_tick at start + k * tick (k = 1, 2, ...) until `stop`. A tick whose time passed while
    the previous sample ran (or the event loop was busy) gets no sample and an entry in
    run.ticks_skipped saying why; at the stop, run.ticks_due = the ticks whose time came, so
    samples + skipped == due whatever the machine's speed."""
    k = 1
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, start + k * tick - time.monotonic()))
            break
        except asyncio.TimeoutError:
            pass
        late = time.monotonic() - (start + k * tick)
        t0 = time.monotonic()
        await on_tick()
        took = time.monotonic() - t0
        now_k = int((time.monotonic() - start) // tick)
        for missed in range(k + 1, now_k + 1):
            run.ticks_skipped.append({"tick": missed, "why": f"sample {k} started {late:.2f} s late and took "
                                                             f"{took:.2f} s, past this tick (period {tick} s)"})
        k = max(k, now_k) + 1
    run.ticks_due = int((time.monotonic() - start) // tick)
    for missed in range(k, run.ticks_due + 1):
        run.ticks_skipped.append({"tick": missed, "why": "the soak ended before this tick's sample could run"})


async def open_loop(client, traffic, rate: float, seconds: float, max_requests: int, max_inflight: int,
                    on_tick, tick: float) -> Run:
    """Poisson arrivals at `rate` for `seconds`: every arrival scheduled before the end is sent (late
    if the machine is slow), so how many are sent depends on the rate and the seed, not on speed."""
    run = Run()
    rng = random.Random(1)
    start = time.monotonic()
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(lambda: on_tick(run), tick, start, stop, run))
    tasks: set[asyncio.Task] = set()
    next_arrival = start
    while next_arrival < start + seconds and run.sent < max_requests:
        wait = next_arrival - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        next_arrival += rng.expovariate(rate)
        if run.inflight >= max_inflight:
            run.refused_by_client += 1
            continue
        task = asyncio.create_task(send(client, traffic, run))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        run.sent += 1
    await asyncio.sleep(max(0.0, start + seconds - time.monotonic()))
    stop.set()
    await sampling
    if tasks:
        await asyncio.wait(tasks, timeout=120)
    await on_tick(run)  # the final sample, after the last request
    return run


def summarize(records: list[Record]) -> dict:
    ok = [r for r in records if r.status == 200]
    lat = [r.end - r.start for r in ok]
    by_status: dict[str, int] = {}
    for r in records:
        by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    per_kind = {}
    for kind in MIX:
        xs = [r.end - r.start for r in ok if r.kind == kind]
        per_kind[kind] = {"n": len(xs), "p50_ms": percentile_ms(xs, 0.5), "p99_ms": percentile_ms(xs, 0.99)}
    return {"requests": len(records), "ok": len(ok), "status_counts": by_status,
            "errors": sum(n for s, n in by_status.items() if s not in ("200", "503")),
            "rejected_503": by_status.get("503", 0),
            "p50_ms": percentile_ms(lat, 0.5), "p99_ms": percentile_ms(lat, 0.99), "per_route": per_kind}


async def soak(url: str, pid: int | None, duration: float, load: float, calibrate: float, concurrency: int,
               max_requests: int, max_inflight: int, sample: float, seed: int) -> dict:
    traffic = Traffic(seed)
    limits = httpx.Limits(max_connections=max_inflight + 8, max_keepalive_connections=max_inflight + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        cal = await closed_loop(client, traffic, calibrate, concurrency)
        cal_sum = summarize(cal.records)
        capacity = cal_sum["ok"] / calibrate
        rate = max(MIN_REQUESTS / duration, load * capacity)  # a slow machine still drives every route twice
        with httpx.Client(base_url=url, timeout=30) as sync:
            samples = []
            start_tree = proc_tree(pid) if pid else None
            t_start = time.monotonic()
            last_n = [0]

            async def on_tick(run: Run) -> None:
                st = await asyncio.to_thread(kv_state, sync)
                tree = await asyncio.to_thread(proc_tree, pid) if pid else None
                window = [r for r in run.records[last_n[0]:] if r.status == 200]
                last_n[0] = len(run.records)
                samples.append({"t_s": round(time.monotonic() - t_start, 1),
                                "rss_mb": round(tree.rss_mb, 1) if tree else None,
                                "threads": tree.threads if tree else None, "kv_used": st.kv_used,
                                "inflight": run.inflight, "done": len(run.records),
                                "p99_ms": percentile_ms([r.end - r.start for r in window], 0.99)})

            run = await open_loop(client, traffic, rate, duration, max_requests, max_inflight, on_tick, sample)
            kv = await asyncio.to_thread(kv_after_drain, sync)
            end_tree = proc_tree(pid) if pid else None
    res = summarize(run.records)
    p99s = [s["p99_ms"] for s in samples if s["p99_ms"] is not None]
    rss = [s["rss_mb"] for s in samples if s["rss_mb"] is not None]
    res.update({
        "duration_s": duration, "capacity_rps": round(capacity, 2), "target_rps": round(rate, 2),
        "achieved_rps": round(len(run.records) / duration, 2), "calibration": cal_sum,
        "refused_by_client": run.refused_by_client, "sent": run.sent, "sample_period_s": sample,
        "ticks_due": run.ticks_due, "ticks_skipped": run.ticks_skipped,
        "p99_first_window_ms": p99s[0] if p99s else None, "p99_last_window_ms": p99s[-1] if p99s else None,
        "p99_drift": round(p99s[-1] / p99s[0], 2) if len(p99s) > 1 and p99s[0] else None,
        "rss_mb_start": round(start_tree.rss_mb, 1) if start_tree else None, "rss_mb_max": max(rss) if rss else None,
        "rss_mb_end": round(end_tree.rss_mb, 1) if end_tree else None,
        "threads_start": start_tree.threads if start_tree else None,
        "threads_end": end_tree.threads if end_tree else None,
        "processes_alive": (alive(start_tree.pids) == start_tree.pids) if start_tree else None,
        "kv_after_drain": kv.__dict__, "samples": samples,
    })
    res["ok_run"] = bool(res["errors"] == 0 and kv.empty and res["processes_alive"] is not False
                         and (end_tree is None or end_tree.threads <= start_tree.threads + THREAD_SLACK))
    return res


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"soak.py drives loopback servers only, not {host!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of soak (default 600)")
    ap.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of measured capacity")
    ap.add_argument("--calibrate", type=float, default=None, help="seconds of capacity measurement "
                    "(default: 10%% of --duration, 5 to 30 s)")
    ap.add_argument("--concurrency", type=int, default=4, help="closed-loop clients while measuring capacity")
    ap.add_argument("--max-requests", type=int, default=100_000, help="bound on requests sent in the soak")
    ap.add_argument("--max-inflight", type=int, default=64, help="bound on outstanding requests")
    ap.add_argument("--sample", type=float, default=None, help="seconds between samples (default duration/12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", help="a running loopback demo server (default: start one)")
    ap.add_argument("--pid", type=int, help="with --url: the launcher's pid, for RSS and threads")
    ap.add_argument("--out", help="write the report JSON here")
    ap.add_argument("server_flags", nargs="*", help="extra launch_server flags (after --)")
    a = ap.parse_args(argv)
    calibrate = a.calibrate if a.calibrate is not None else min(30.0, max(5.0, a.duration / 10))
    sample = a.sample or max(2.0, a.duration / 12)
    srv = None
    if a.url:
        check_loopback(a.url)
        url, pid = a.url, a.pid
    else:
        log = os.path.join(tempfile.mkdtemp(prefix="sgrec-soak-"), "server.log")
        srv = LocalServer(SERVER_FLAGS + a.server_flags, log_path=log)
        url, pid = srv.url, srv.pid
    try:
        res = asyncio.run(soak(url, pid, a.duration, a.load, calibrate, a.concurrency, a.max_requests,
                               a.max_inflight, sample, a.seed))
        if srv is not None:
            res["tracebacks_in_log"] = srv.read_log().count("Traceback")
            res["ok_run"] = res["ok_run"] and res["tracebacks_in_log"] == 0
    finally:
        if srv is not None:
            srv.stop()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    print(f"{'t_s':>7} {'rss_mb':>8} {'threads':>7} {'kv_used':>8} {'inflight':>8} {'done':>7} {'p99_ms':>8}")
    for s in res["samples"]:
        print(f"{s['t_s']:>7} {s['rss_mb']!s:>8} {s['threads']!s:>7} {s['kv_used']:>8} {s['inflight']:>8} "
              f"{s['done']:>7} {s['p99_ms']!s:>8}")
    return 0 if res["ok_run"] else 1


if __name__ == "__main__":
    sys.exit(main())
