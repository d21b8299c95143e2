"""Cross-rank item KV fetch for HRCS placement (BAT §5.2, Algorithm 1).

With `--dp-size N` and HRCS (the ranks of one server, `sgrec.items.pool`), each rank's item store
holds the replicated hot items and its shard of the cold ones. The cold items of a request owned by
other ranks are fetched from their owners as KV bytes over ZMQ, or recomputed in the request's
forward, whichever the cost model says is cheaper.

Pieces (plain, no scheduler knowledge):

- `ItemKVServer(store, endpoint)`: a ZMQ ROUTER bound at `endpoint`. `start()` answers
  from a background thread, so a peer's fetch never waits for this rank's scheduler step (the
  scheduler may be in the middle of a forward). `poll(timeout_ms)` answers what is pending in the
  calling thread instead (tests).
- `ItemKVClient(endpoints)`: one DEALER per peer rank. `fetch_many({rank: [item ids]}, header,
  timeout_ms)` sends one request to every owner first, then collects the replies, so the owners
  work in parallel and each owner costs one round trip per request however many of its items the
  request needs. A peer that does not answer within the timeout is skipped for `dead_cooldown_s`
  (its items are recomputed); stale replies are dropped by id.
- `ItemFetcher(rank, placement, client, ...)`: what RankExecutor calls (`fetcher=`):
  `fetch_many([(item id, tokens), ...])` returns the fetched KV (`Fetched` chunks, one per owner
  that answered) and counts the rest as recomputed.
- `connect_loopback(executors)`: in-process endpoints (inproc://) wiring a list of RankExecutors
  (benchmarks and tests): every executor gets a threaded server on its store and a fetcher.

Safety of answering from a thread while the scheduler mutates the store: the server reads item KV
only through `ItemStore.read_kv`, which holds the store's lock while it looks the items up and
copies their K and V out of the KV pool. The scheduler thread takes the same lock for every change
of the store's entries and every free of a stored slot (admit, evict, drop_unowned, reset,
precompute's publishing), so a slot being read is never freed, reused by a request and overwritten
mid-copy; an item evicted first is simply a miss (the requester recomputes it). Entries are
published only once their KV is written (see `sgrec.items.store`). The lock is held for the copy
only (microseconds for a request's items), never across a forward. Serialisation and sending happen
outside it.

Cost model (BAT §5.2: communication is worth it while it costs less than the computation it saves,
Algorithm 1's comparison of transfer time and prefill time, made per request and owner): fetching
n tokens from owner p is estimated as `latency_p + n * bytes_per_token / bandwidth_Bps`, where
latency_p is an exponential moving average (weight `ema_weight`) of the measured round trips to p
minus their transfer term (prior: `latency_s`; a timeout counts as a round trip of the timeout).
Recomputing them costs `recompute_s(n)` (`sgrec.items.pool` measures the runner's prefill
time per token). With linear costs on both sides the best choice for one owner is all of its items
or none, so the decision is per owner: fetch when the estimate is below the recompute time. An
owner the model skips is fetched from anyway once its estimate is `latency / probe_share` seconds
old (within [probe_min_s, probe_max_s]; a probe): a latency spike (one slow round trip lifts the
EMA) is measured away within a fraction of a second, while probes of a really slow owner take at
most `probe_share` of the time. `policy`: "cost" (the model), "always" (every
alive owner) or "never"; with `recompute_s=None` the model always fetches.

Wire format: request one JSON frame `{"id", "items": [ids], "header"}`; reply a JSON frame `{"id",
"ok", "items": [[id, tokens], ...], "shape", "dtype"}` listing the requested items the owner holds
(in request order; the others are misses), and when that list is not empty two raw frames with
their K and V concatenated along the token axis (C-contiguous, the pool's dtype). `ok` is false
when the owner's store has another header (its KV is not this rank's).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import zmq

from sgrec.mem.kv_pool import FP8

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MS = 200
DEAD_COOLDOWN_S = 5.0
EMA_WEIGHT = 0.2
PROBE_SHARE = 0.02  # an owner the model skips is probed every latency / PROBE_SHARE seconds ...
PROBE_MIN_S, PROBE_MAX_S = 0.1, 10.0  # ... within these bounds
FETCH_POLICIES = ("cost", "always", "never")
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, FP8)}


def header_key(header_ids: Sequence[int]) -> str:
    """Identity of the header item KV was computed under (KV with another header is not the same)."""
    return f"{len(header_ids)}:{hash(tuple(int(t) for t in header_ids)) & 0xFFFFFFFFFFFF:x}"


NO_NUMPY = {torch.bfloat16: torch.int16, FP8: torch.uint8}  # sent as their bits


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.view(NO_NUMPY.get(t.dtype, t.dtype)).numpy().tobytes()


def _tensor_from(buf, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(buf), dtype=NO_NUMPY.get(dtype, dtype)).view(dtype).reshape(shape)


@dataclass
class Fetched:
    """KV of items from one owner: `items[j]` has `lens[j]` tokens; k and v are
    [layers, sum(lens), kv_heads, head_dim], the items' tokens one after the other."""

    items: list[str]
    lens: list[int]
    k: torch.Tensor
    v: torch.Tensor


class ItemKVServer:
    def __init__(self, store, endpoint: str, ctx: zmq.Context | None = None):
        self.store = store
        self.endpoint = endpoint
        self.header = header_key(store.header_ids)
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.served = self.missed = self.requests = 0  # items served / missed, requests answered
        self._lock = threading.Lock()  # one thread on the socket at a time
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def poll(self, timeout_ms: int = 0) -> int:
        """Answers every pending request (waiting up to timeout_ms for the first); returns how many."""
        n = 0
        with self._lock:
            if self.sock.closed:
                return 0
            while self.sock.poll(timeout_ms if n == 0 else 0):
                frames = self.sock.recv_multipart()
                self._answer(frames[0], frames[-1])
                n += 1
        return n

    def _answer(self, peer: bytes, raw: bytes) -> None:
        try:
            req = json.loads(raw)
            rid, items = req["id"], [str(i) for i in req["items"]]
        except (ValueError, KeyError, TypeError):
            logger.warning("item fetch: dropped a malformed request")
            return
        self.requests += 1
        if req.get("header") != self.header:
            self.missed += len(items)
            self.sock.send_multipart([peer, json.dumps({"id": rid, "ok": False}).encode()])
            return
        fps = req.get("fps")  # the asker's fingerprint of each item's tokens (its catalog version)
        fps = {str(i): f for i, f in fps.items()} if isinstance(fps, dict) else None
        found, k, v = self.store.read_kv(items, fps)  # under the store's lock (see the module docstring)
        self.served += len(found)
        self.missed += len(items) - len(found)
        meta = {"id": rid, "ok": True, "items": found}
        if not found:
            self.sock.send_multipart([peer, json.dumps(meta).encode()])
            return
        meta.update(shape=list(k.shape), dtype=str(k.dtype))
        self.sock.send_multipart([peer, json.dumps(meta).encode(), _tensor_bytes(k), _tensor_bytes(v)], copy=False)

    def start(self) -> None:
        """Serves from a background thread until close()."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"item-kv {self.endpoint}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll(20)
            except Exception:  # never let one bad request end the thread: peers would time out
                logger.exception("item fetch: answering a request failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self.sock.close(0)


@dataclass
class PeerReply:
    """One owner's answer: the items it held (id, tokens) with their K and V, and the round trip."""

    items: list[tuple[str, int]]
    k: torch.Tensor | None
    v: torch.Tensor | None
    seconds: float


class ItemKVClient:
    """DEALER sockets to the peers' item-KV servers, by rank. Sockets and dead marks are kept per
    address, so a re-numbering of the ranks (a server joined or left) keeps both."""

    def __init__(self, endpoints: dict[int, str], ctx: zmq.Context | None = None,
                 dead_cooldown_s: float = DEAD_COOLDOWN_S, clock: Callable[[], float] = time.monotonic):
        self.ctx = ctx or zmq.Context.instance()
        self.endpoints = dict(endpoints)
        self.socks: dict[str, zmq.Socket] = {}
        self.dead_until: dict[str, float] = {}
        self.dead_cooldown_s = dead_cooldown_s
        self.clock = clock
        self._ids = itertools.count(1)
        self.fetched = self.timeouts = 0  # replies received, peers that timed out

    def set_endpoints(self, endpoints: dict[int, str]) -> None:
        """New rank -> address map (membership changed); sockets to addresses no longer listed close."""
        self.endpoints = dict(endpoints)
        keep = set(self.endpoints.values())
        for addr in [a for a in self.socks if a not in keep]:
            self.socks.pop(addr).close(0)
        self.dead_until = {a: t for a, t in self.dead_until.items() if a in keep}

    def _sock(self, addr: str) -> zmq.Socket:
        s = self.socks.get(addr)
        if s is None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
            self.socks[addr] = s
        return s

    def alive(self, rank: int) -> bool:
        addr = self.endpoints.get(rank)
        return addr is not None and self.clock() >= self.dead_until.get(addr, 0.0)

    def fetch_many(self, wants: dict[int, Sequence[str]], header: str,
                   timeout_ms: int = DEFAULT_TIMEOUT_MS, fps: dict[str, int] | None = None
                   ) -> dict[int, PeerReply | None]:
        """One request per owner rank for all its items in `wants`, sent to every owner before any
        reply is awaited (`fps`: item id -> fingerprint of the tokens wanted; owners holding KV of
        other tokens leave the item out). Per rank: its reply, or None (dead, timed out, another header)."""
        out: dict[int, PeerReply | None] = {}
        pending: dict[zmq.Socket, tuple[int, int, float]] = {}  # socket -> (rank, request id, sent at)
        for rank, items in wants.items():
            out[rank] = None
            if not items or not self.alive(rank):
                continue
            addr = self.endpoints[rank]
            sock = self._sock(addr)
            rid = next(self._ids)
            try:
                req = {"id": rid, "items": list(items), "header": header}
                if fps is not None:
                    req["fps"] = {i: fps[i] for i in items if i in fps}
                sock.send(json.dumps(req).encode(), zmq.NOBLOCK)
            except zmq.Again:
                self._mark_dead(addr)
                continue
            pending[sock] = (rank, rid, time.perf_counter())
        deadline = time.perf_counter() + timeout_ms / 1000.0
        poller = zmq.Poller()
        for sock in pending:
            poller.register(sock, zmq.POLLIN)
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            for sock, _ in poller.poll(left * 1000.0):
                frames = sock.recv_multipart()
                rank, rid, sent = pending[sock]
                try:
                    meta = json.loads(frames[0])
                except ValueError:
                    continue
                if not isinstance(meta, dict) or meta.get("id") != rid:
                    continue  # a late reply to a request that already timed out
                del pending[sock]
                poller.unregister(sock)
                self.fetched += 1
                out[rank] = self._reply(meta, frames, time.perf_counter() - sent)
        for sock, (rank, _, _) in pending.items():  # no answer in time
            self._mark_dead(self.endpoints[rank])
        return out

    @staticmethod
    def _reply(meta: dict, frames: list, seconds: float) -> PeerReply | None:
        if not meta.get("ok"):
            return None
        try:
            items = [(str(i), int(n)) for i, n in meta.get("items", [])]
        except (TypeError, ValueError):
            return None
        if not items:
            return PeerReply([], None, None, seconds)
        dtype = _DTYPES.get(meta.get("dtype"))
        shape = meta.get("shape")
        if dtype is None or len(frames) != 3 or not isinstance(shape, list) or len(shape) != 4 \
                or shape[1] != sum(n for _, n in items):
            return None
        try:
            k, v = _tensor_from(frames[1], shape, dtype), _tensor_from(frames[2], shape, dtype)
        except (RuntimeError, ValueError):
            return None
        return PeerReply(items, k, v, seconds)

    def _mark_dead(self, addr: str) -> None:
        self.timeouts += 1
        self.dead_until[addr] = self.clock() + self.dead_cooldown_s
        logger.warning("item fetch: %s did not answer; recomputing its items for %.0f s", addr,
                       self.dead_cooldown_s)
        s = self.socks.pop(addr, None)  # drop queued requests with the socket
        if s is not None:
            s.close(0)

    def close(self) -> None:
        for s in self.socks.values():
            s.close(0)
        self.socks.clear()


class ItemFetcher:
    """RankExecutor's hook: KV of the cold items other ranks own, for one request (the rest is
    recomputed). The decision per owner is the module docstring's cost model."""

    def __init__(self, rank: int, placement, client: ItemKVClient, header_ids: Sequence[int] = (),
                 bytes_per_token: int = 0, bandwidth_Bps: float = float("inf"), latency_s: float = 0.0,
                 recompute_s: Callable[[int], float] | None = None, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 policy: str = "cost", ema_weight: float = EMA_WEIGHT, probe_share: float = PROBE_SHARE,
                 probe_min_s: float = PROBE_MIN_S, probe_max_s: float = PROBE_MAX_S,
                 clock: Callable[[], float] = time.monotonic):
        if policy not in FETCH_POLICIES:
            raise ValueError(f"fetch policy must be one of {', '.join(FETCH_POLICIES)}, got {policy!r}")
        self.rank = rank
        self.placement = placement
        self.client = client
        self.header = header_key(header_ids)
        self.bytes_per_token = bytes_per_token
        self.bandwidth_Bps = bandwidth_Bps
        self.latency_s = latency_s  # prior of every owner's latency
        self.recompute_s = recompute_s
        self.timeout_ms = timeout_ms
        self.policy = policy
        self.ema_weight = ema_weight
        self.probe_share, self.probe_min_s, self.probe_max_s = probe_share, probe_min_s, probe_max_s
        self.clock = clock
        self.latency: dict[str, float] = {}  # owner address -> EMA of measured latency (s)
        self.measured_at: dict[str, float] = {}  # owner address -> clock() of its last round trip
        # remote_items: misses on items another rank owns; of those, fetched_items came over the
        # network, the rest were recomputed (skipped_items of them because the cost model chose to);
        # fetch_seconds: wall time in fetch_many's round trips (timeouts included)
        self.remote_items = self.fetched_items = self.skipped_items = self.probes = 0
        self.fetched_tokens = self.recomputed_tokens = 0
        self.fetch_seconds = 0.0

    def owner(self, item_id: str) -> int | None:
        """The rank holding item_id, None when this rank should hold it itself."""
        pl = self.placement
        if pl is None or item_id in pl.replicated:
            return None
        r = pl.owner.get(item_id)
        return None if r is None or r == self.rank else r

    # ---- cost model ---------------------------------------------------------------------------
    def _transfer_s(self, n_tokens: int) -> float:
        return n_tokens * self.bytes_per_token / self.bandwidth_Bps

    def estimate_fetch_s(self, rank: int, n_tokens: int) -> float:
        """Expected seconds to fetch n_tokens of KV from `rank`: its latency EMA (or the prior) plus
        the transfer at the bandwidth."""
        lat = self.latency.get(self.client.endpoints.get(rank, ""), self.latency_s)
        return lat + self._transfer_s(n_tokens)

    def observe(self, rank: int, n_tokens: int, seconds: float) -> None:
        """A measured round trip to `rank` that carried n_tokens: updates its latency EMA."""
        addr = self.client.endpoints.get(rank)
        if addr is None:
            return
        sample = max(0.0, seconds - self._transfer_s(n_tokens))
        old = self.latency.get(addr)
        self.latency[addr] = sample if old is None else old + self.ema_weight * (sample - old)
        self.measured_at[addr] = self.clock()

    def probe_interval_s(self, rank: int) -> float:
        """How old the estimate of an owner the model skips may get before it is probed."""
        lat = self.latency.get(self.client.endpoints.get(rank, ""), self.latency_s)
        return min(self.probe_max_s, max(self.probe_min_s, lat / self.probe_share))

    def worth_fetching(self, rank: int, n_tokens: int) -> bool:
        """Fetch n_tokens from `rank` rather than recompute them (the policy; for "cost": cheaper,
        or a probe is due)."""
        if self.policy != "cost":
            return self.policy == "always"
        if self.recompute_s is None or self.estimate_fetch_s(rank, n_tokens) < self.recompute_s(n_tokens):
            return True
        addr = self.client.endpoints.get(rank, "")
        if self.clock() - self.measured_at.get(addr, float("-inf")) >= self.probe_interval_s(rank):
            self.probes += 1
            return True
        return False

    # ---- fetching -----------------------------------------------------------------------------
    def fetch_many(self, wanted: Sequence[tuple[str, int]], fps: dict[str, int] | None = None) -> list[Fetched]:
        """KV of the items in `wanted` ((item id, tokens)) that other ranks own and are worth
        fetching, one chunk per owner that answered; items left out are recomputed by the caller.
        `fps`: the fingerprint of each item's tokens (so another catalog version's KV is not taken)."""
        by_rank: dict[int, list[tuple[str, int]]] = {}
        for item_id, n in wanted:
            owner = self.owner(item_id)
            if owner is not None:
                by_rank.setdefault(owner, []).append((item_id, n))
        if not by_rank:
            return []
        total = {r: sum(n for _, n in its) for r, its in by_rank.items()}
        self.remote_items += sum(len(its) for its in by_rank.values())
        ask = {}
        for r, its in by_rank.items():
            if not self.client.alive(r):
                continue
            if self.worth_fetching(r, total[r]):
                ask[r] = [i for i, _ in its]
            else:
                self.skipped_items += len(its)
        out: list[Fetched] = []
        got_tokens = 0
        if ask:
            t0 = time.perf_counter()
            replies = self.client.fetch_many(ask, self.header, self.timeout_ms, fps)
            self.fetch_seconds += time.perf_counter() - t0
            for r, rep in replies.items():
                if rep is None:
                    if not self.client.alive(r):  # timed out: as slow as the timeout, for the estimate
                        self.observe(r, 0, self.timeout_ms / 1000.0)
                    continue
                self.observe(r, sum(n for _, n in rep.items), rep.seconds)
                chunk = self._checked(rep, dict(by_rank[r]))
                if chunk is not None:
                    out.append(chunk)
                    self.fetched_items += len(chunk.items)
                    got_tokens += sum(chunk.lens)
        self.fetched_tokens += got_tokens
        self.recomputed_tokens += sum(total.values()) - got_tokens
        return out

    @staticmethod
    def _checked(rep: PeerReply, want: dict[str, int]) -> Fetched | None:
        """The reply's items that were asked for with the expected length (an owner that predates
        fingerprints could hold another catalog version's); None when none is left."""
        keep, rows, off = [], [], 0
        for item_id, n in rep.items:
            if want.get(item_id) == n:
                keep.append((item_id, n))
                rows += range(off, off + n)
            off += n
        if not keep:
            return None
        k, v = rep.k, rep.v
        if len(rows) != k.shape[1]:
            idx = torch.tensor(rows, dtype=torch.int64)
            k, v = k.index_select(1, idx), v.index_select(1, idx)
        return Fetched([i for i, _ in keep], [n for _, n in keep], k, v)


_loopback_ids = itertools.count()


def connect_loopback(executors: Sequence, ctx: zmq.Context | None = None, threaded: bool = True,
                     **fetcher_kw) -> list[ItemKVServer]:
    """Wires in-process RankExecutors (rank k = executors[k]): a server on each store (answering
    from its own thread unless threaded=False: then only when polled) and a fetcher to the others.
    Returns the servers (close() them when done)."""
    ctx = ctx or zmq.Context.instance()
    tag = next(_loopback_ids)
    eps = {k: f"inproc://item-kv-{tag}-{k}" for k in range(len(executors))}
    servers = [ItemKVServer(ex.store, eps[k], ctx) for k, ex in enumerate(executors)]
    for k, ex in enumerate(executors):
        client = ItemKVClient({r: e for r, e in eps.items() if r != k}, ctx)
        ex.join(k, ex.placement, ItemFetcher(k, ex.placement, client, ex.header_ids, **fetcher_kw))
        if threaded:
            servers[k].start()
    return servers
