"""Cross-rank item KV fetch for HRCS placement (BAT §5.2, Algorithm 1).

With `--dp-size N` and HRCS, each rank's item store holds the replicated hot items and its shard of
the cold ones. A cold item owned by another rank is either fetched from the owner as KV bytes over
ZMQ or recomputed, whichever Algorithm 1's cost model says is cheaper: fetching n tokens costs
`latency_s + n * bytes_per_token / bandwidth_Bps`, recomputing them `recompute_s(n)`.

Pieces (plain, no scheduler knowledge):

- `ItemKVServer(store, kv_pool, endpoint)`: a ZMQ ROUTER bound at `endpoint` that answers
  `{"item", "header"}` with the item's K and V for every layer if the store holds it and was built
  with the same header (else a miss). `poll(timeout_ms)` serves what is pending in the caller's
  thread; a scheduler calls it once per loop iteration (the store is not thread-safe). `start()`
  runs a background thread instead (tests, or a store no other thread mutates).
- `ItemKVClient(endpoints)`: one DEALER per peer rank. `fetch(rank, item_id, header_key, timeout_ms,
  serve=...)` returns `(k, v)` as float tensors `[layers, n, kv_heads, head_dim]`, or None on a miss,
  a timeout or a dead peer; while waiting it calls `serve()` (the caller's own server's poll), so two
  ranks fetching from each other do not deadlock. A peer that timed out is skipped for
  `dead_cooldown_s` (requests to it go straight to recomputation); stale replies are dropped by id.
- `ItemFetcher(rank, placement, client, ...)`: what RankExecutor calls (`fetcher=`):
  `fetch(item_id, n_tokens)` -> `(k, v)` or None (None: recompute). It asks the owner only when the
  item is not this rank's, the owner is alive and fetching is cheaper than recomputing.
- `connect_loopback(executors)`: in-process endpoints (inproc://) wiring a list of RankExecutors
  (benchmark and tests): every executor gets a server on its store and a fetcher to the others.

Wire format: request one JSON frame `{"id", "item", "header"}`; reply a JSON frame `{"id", "ok",
"shape", "dtype"}` and, when ok, two raw frames with K and V (C-contiguous, the pool's dtype).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch
import zmq

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MS = 200
DEAD_COOLDOWN_S = 5.0
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def header_key(header_ids: Sequence[int]) -> str:
    """Identity of the header item KV was computed under (KV with another header is not the same)."""
    return f"{len(header_ids)}:{hash(tuple(int(t) for t in header_ids)) & 0xFFFFFFFFFFFF:x}"


def read_item_kv(kv_pool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `slots` for every layer: two tensors [layers, n, kv_heads, head_dim] (CPU)."""
    loc = slots.to(kv_pool.device)
    ks, vs = [], []
    for layer in range(kv_pool.num_layers):
        k, v = kv_pool.get_kv(layer)
        ks.append(k[loc])
        vs.append(v[loc])
    return torch.stack(ks).cpu(), torch.stack(vs).cpu()


def write_item_kv(kv_pool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes fetched K and V ([layers, n, heads, dim]) into `slots` of this rank's pool."""
    dev = kv_pool.device
    loc = slots.to(dev)
    for layer in range(kv_pool.num_layers):
        kv_pool.set_kv(layer, loc, k[layer].to(dev, kv_pool.dtype), v[layer].to(dev, kv_pool.dtype))


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def _tensor_from(buf: bytes, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.frombuffer(bytearray(buf), dtype=torch.int16).view(torch.bfloat16).reshape(shape)
    return torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)


class ItemKVServer:
    def __init__(self, store, kv_pool, endpoint: str, ctx: zmq.Context | None = None):
        self.store = store
        self.kv_pool = kv_pool
        self.endpoint = endpoint
        self.header = header_key(store.header_ids)
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.served = self.missed = 0
        self._lock = threading.Lock()
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
            rid, item = req["id"], str(req["item"])
        except (ValueError, KeyError, TypeError):
            logger.warning("item fetch: dropped a malformed request")
            return
        entry = self.store.entries.get(item) if req.get("header") == self.header else None
        if entry is None:
            self.missed += 1
            self.sock.send_multipart([peer, json.dumps({"id": rid, "ok": False}).encode()])
            return
        k, v = read_item_kv(self.kv_pool, entry.slots)
        self.served += 1
        meta = {"id": rid, "ok": True, "shape": list(k.shape), "dtype": str(k.dtype)}
        self.sock.send_multipart([peer, json.dumps(meta).encode(), _tensor_bytes(k), _tensor_bytes(v)], copy=False)

    def start(self) -> None:
        """Serves from a background thread until close()."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"item-kv {self.endpoint}", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll(20)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self.sock.close(0)


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
        self._next_id = 0
        self.fetched = self.timeouts = 0

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

    def fetch(self, rank: int, item_id: str, header: str, timeout_ms: int = DEFAULT_TIMEOUT_MS,
              serve: Callable[[], object] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.alive(rank):
            return None
        addr = self.endpoints[rank]
        sock = self._sock(addr)
        self._next_id += 1
        rid = self._next_id
        try:
            sock.send(json.dumps({"id": rid, "item": item_id, "header": header}).encode(), zmq.NOBLOCK)
        except zmq.Again:
            self._mark_dead(addr)
            return None
        deadline = self.clock() + timeout_ms / 1000.0
        while True:
            left = deadline - self.clock()
            if left <= 0:
                self._mark_dead(addr)
                return None
            wait_ms = left * 1000.0 if serve is None else min(left * 1000.0, 5)  # serve() every 5 ms
            if sock.poll(wait_ms):
                frames = sock.recv_multipart()
                try:
                    meta = json.loads(frames[0])
                except ValueError:
                    continue
                if meta.get("id") != rid:
                    continue  # a late reply to a request that already timed out
                if not meta.get("ok") or len(frames) != 3:
                    return None
                dtype = _DTYPES.get(meta.get("dtype"))
                if dtype is None:
                    return None
                self.fetched += 1
                return _tensor_from(frames[1], meta["shape"], dtype), _tensor_from(frames[2], meta["shape"], dtype)
            if serve is not None:
                serve()

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
    """RankExecutor's hook: KV of a cold item owned by another rank, or None (recompute it).

    Algorithm 1's cost model decides per item: fetch when latency_s + n * bytes_per_token /
    bandwidth_Bps < recompute_s(n) (recompute_s: seconds to compute n item tokens on this rank; None
    means always fetch)."""

    def __init__(self, rank: int, placement, client: ItemKVClient, header_ids: Sequence[int] = (),
                 bytes_per_token: int = 0, bandwidth_Bps: float = float("inf"), latency_s: float = 0.0,
                 recompute_s: Callable[[int], float] | None = None, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 server: ItemKVServer | None = None):
        self.rank = rank
        self.placement = placement
        self.client = client
        self.header = header_key(header_ids)
        self.bytes_per_token = bytes_per_token
        self.bandwidth_Bps = bandwidth_Bps
        self.latency_s = latency_s
        self.recompute_s = recompute_s
        self.timeout_ms = timeout_ms
        self.server = server  # polled while waiting, so mutual fetches do not deadlock
        # remote_items: misses on items another rank owns; of those, fetched_items came over the
        # network (fetch_seconds in all, misses and timeouts included), the rest were recomputed
        self.remote_items = self.fetched_items = 0
        self.fetched_tokens = self.recomputed_tokens = 0
        self.fetch_seconds = 0.0

    def owner(self, item_id: str) -> int | None:
        """The rank holding item_id, None when this rank should hold it itself."""
        pl = self.placement
        if pl is None or item_id in pl.replicated:
            return None
        r = pl.owner.get(item_id)
        return None if r is None or r == self.rank else r

    def worth_fetching(self, n_tokens: int) -> bool:
        if self.recompute_s is None:
            return True
        transfer = self.latency_s + n_tokens * self.bytes_per_token / self.bandwidth_Bps
        return transfer < self.recompute_s(n_tokens)

    def fetch(self, item_id: str, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        owner = self.owner(item_id)
        if owner is None:
            return None
        self.remote_items += 1
        kv = None
        if self.client.alive(owner) and self.worth_fetching(n_tokens):
            serve = self.server.poll if self.server is not None else None
            t0 = time.perf_counter()
            kv = self.client.fetch(owner, item_id, self.header, self.timeout_ms, serve=serve)
            self.fetch_seconds += time.perf_counter() - t0
        if kv is None or kv[0].shape[1] != n_tokens:
            self.recomputed_tokens += n_tokens
            return None
        self.fetched_items += 1
        self.fetched_tokens += n_tokens
        return kv


_loopback_ids = itertools.count()


def connect_loopback(executors: Sequence, ctx: zmq.Context | None = None, threaded: bool = True, **fetcher_kw):
    """Wires in-process RankExecutors (rank k = executors[k]): a server on each store, a fetcher to
    the others. threaded=True: each server answers from a background thread (fine while the ranks
    run one at a time, as in a single-threaded replay: no store is mutated while another rank reads
    it); False: servers answer only when polled. Returns the servers (close() them when done)."""
    ctx = ctx or zmq.Context.instance()
    tag = next(_loopback_ids)
    eps = {k: f"inproc://item-kv-{tag}-{k}" for k in range(len(executors))}
    servers = [ItemKVServer(ex.store, ex.runner.kv_pool, eps[k], ctx) for k, ex in enumerate(executors)]
    for k, ex in enumerate(executors):
        client = ItemKVClient({r: e for r, e in eps.items() if r != k}, ctx)
        ex.fetcher = ItemFetcher(k, ex.placement, client, ex.header_ids, server=servers[k], **fetcher_kw)
        if threaded:
            servers[k].start()
    return servers
