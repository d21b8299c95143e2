"""Reading a running server's health from outside: KV occupancy after drain, process tree RSS and
threads; and holding it in a state a check needs, whatever the machine's speed (the ranks paused in
place, clients that leave on cue). Used by the reliability scripts (benchmarks/soak.py,
benchmarks/fuzz.py, benchmarks/overload.py) and the tests.

`python -m sgrec.tools.probe --url http://127.0.0.1:30000 [--pid LAUNCHER_PID]` prints both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import httpx
import psutil

STATS_PERIOD_S = 0.5  # the schedulers report their KV usage this often (process.STATS_INTERVAL_S), and on a flush or pause
HANG_S = 120.0  # how long a waiter waits for a state before calling it a hang: a bound on hangs, never on speed


def wait_for(check, what: str = "the awaited state", timeout: float = HANG_S, every: float = 0.1):
    """Polls `check()` until it returns a truthy value, and returns that value. After `timeout`
    seconds raises AssertionError naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"never saw {what} within {timeout:.0f} s (last: {got!r})")
        time.sleep(every)


def running_per_rank(client: httpx.Client) -> list[tuple[int, int]]:
    """(running, queued) requests of each rank, from the schedulers' latest stats reports."""
    return [(s["num_running_reqs"], s["num_queue_reqs"]) for s in client.get("/server_info").json()["internal_states"]]


def pause_in_place(client: httpx.Client) -> None:
    """/pause_generation in place: once it answers, no batch runs on any rank, so every request stays
    where it is (running or queued, its KV kept) and none can end by itself, on any machine. Requests
    sent meanwhile are taken and queued; an abort still ends one."""
    r = client.post("/pause_generation", json={"mode": "in_place"})
    assert r.status_code == 200, r.text


@contextmanager
def paused_in_place(client: httpx.Client):
    """`pause_in_place` for the block, /continue_generation after it."""
    pause_in_place(client)
    try:
        yield
    finally:
        r = client.post("/continue_generation")
        assert r.status_code == 200, r.text


class Departing:
    """A request (POST `path` with a JSON body) whose client leaves when told: `leave()` closes its
    connection at a point the caller chose from the server's state, never on a client timeout that
    races the work. The request runs on a thread of its own (an asyncio loop with httpx)."""

    def __init__(self, url: str, path: str, body: dict):
        self._closed = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._future = asyncio.run_coroutine_threadsafe(self._post(url + path, body), self._loop)

    async def _post(self, url: str, body: dict) -> httpx.Response:
        try:
            async with httpx.AsyncClient(timeout=None) as c:
                return await c.post(url, json=body)
        finally:
            self._closed.set()

    def leave(self) -> None:
        """Closes the connection; AssertionError if the answer had come first (then the request ended
        before its client left, and what the caller meant to check did not happen)."""
        try:
            if not self._future.cancel():
                r = self._future.result()
                raise AssertionError(f"the request ended before its client left: {r.status_code} {r.text[:200]}")
            assert self._closed.wait(HANG_S), "the client's connection never closed"
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(HANG_S)
            self._loop.close()


@dataclass
class KVState:
    kv_used: int  # slots held by anything (requests and caches), summed over ranks
    kv_total: int
    running: int
    queued: int

    @property
    def empty(self) -> bool:
        return self.kv_used == 0 and self.running == 0 and self.queued == 0


def percentile_ms(xs: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank, q in [0, 1]; 1 = the largest) of latencies in seconds, in ms
    rounded to 0.1; None for no samples."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 1)


def kv_state(client: httpx.Client) -> KVState:
    states = client.get("/server_info").json()["internal_states"]
    return KVState(
        kv_used=sum(s["memory_usage"]["kv_used_tokens"] for s in states),
        kv_total=sum(s["memory_usage"]["kv_total_tokens"] for s in states),
        running=sum(s["num_running_reqs"] for s in states),
        queued=sum(s["num_queue_reqs"] for s in states),
    )


def kv_after_drain(client: httpx.Client, timeout: float = 30.0) -> KVState:
    """Waits until no request runs or waits, flushes the prefix cache (/flush_cache succeeds only
    then; each rank reports its stats before it answers, so /server_info is fresh once it returns) and
    returns the KV state: after a clean drain every slot is free. Returns the last state seen if the
    server never went idle within `timeout`."""
    deadline = time.monotonic() + timeout
    state = kv_state(client)
    while time.monotonic() < deadline:
        if client.post("/flush_cache").status_code == 200:
            state = kv_state(client)
            if state.empty:
                return state
        time.sleep(0.2)
        state = kv_state(client)
    return state


@dataclass
class ProcTree:
    pids: list[int]
    rss_mb: float  # summed over the launcher and its children
    threads: int  # summed likewise

    @property
    def children(self) -> int:
        return len(self.pids) - 1


def proc_tree(pid: int) -> ProcTree:
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    rss = threads = 0
    pids = []
    for p in procs:
        try:
            with p.oneshot():
                rss += p.memory_info().rss
                threads += p.num_threads()
            pids.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return ProcTree(pids, rss / 2**20, threads)


def alive(pids: list[int]) -> list[int]:
    """The pids still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--pid", type=int, help="the launcher's pid: also report RSS and threads")
    ap.add_argument("--api-key")
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=30) as c:
        out = {"kv_after_drain": asdict(kv_after_drain(c))}
    if args.pid:
        out["proc_tree"] = asdict(proc_tree(args.pid))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
