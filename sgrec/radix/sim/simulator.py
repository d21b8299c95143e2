"""Trace simulator: replays token-id requests through a radix cache and an eviction policy (no model).

    python -m sgrec.radix.sim --trace gr-users --policy laru --cache-tokens 20000
    python -m sgrec.radix.sim --trace multiturn --policy fpb --cache-tokens 30000 --noise 0.3
    python -m sgrec.radix.sim --trace my_trace.jsonl --policy sglang-lru --cache-tokens 5000

Each request, at virtual time = its index: match the longest cached prefix (its length is the hit),
then, if something is missing and the prompt fits, lock the matched path, insert the prompt, move the
lock to the new leaf, evict down to the capacity and unlock. So eviction never takes what the
request itself uses, and a miss is seen before the eviction it causes (LCR Algorithm 1's order).

Policies: sgrec's lru / laru / fpb / hf / opt (the real RadixCache and policy), SGLang 0.5.23's own
RadixCache as peers (sglang-lru / sglang-lfu / sglang-slru), and libCacheSim's lcs-* on the flattened
node-access stream (each request as the list of nodes of the trace's full radix tree on its path).
Learned policies use the online LightGBM predictor unless --predictor oracle or --noise is given
(oracle = true next access; noise p replaces a prediction by minus the true next access, LCR §5.3).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import math
import time
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sgrec.radix.eviction import EvictionPolicy, PredictivePolicy, make_policy, parse_config
from sgrec.radix.node import TreeNode, child_key, start_key
from sgrec.radix.predictor import OraclePredictor
from sgrec.radix.sim.traces import TRACES, Trace, load_trace, make_trace
from sgrec.radix.tree import RadixCache

SGREC_POLICIES = ("lru", "laru", "fpb", "hf", "opt")
SGLANG_POLICIES = ("sglang-lru", "sglang-lfu", "sglang-slru")
LCS_POLICIES = ("lcs-lru", "lcs-arc", "lcs-s3fifo", "lcs-sieve", "lcs-lhd", "lcs-belady")


# ---- the trace's full tree: true next accesses and the flattened node stream --------------------
class TraceIndex:
    """Inserts every request into one unbounded tree. For every node (by start key) it keeps the
    sorted request indices whose prompt passes through the node's first token, i.e. when content
    that starts there is next needed. Any node of a bounded cache replaying the trace starts where a
    node of this tree starts, so `next_access(start_key(node), t)` is its true next access."""

    def __init__(self, trace: Trace) -> None:
        tree = RadixCache(None, clock=lambda: 0.0)
        for r in trace:
            tree.insert(r.tokens, torch.empty(len(r.tokens), dtype=torch.int64), r.extra_key)
        times: dict[TreeNode, list[int]] = {}
        self.paths: list[list[tuple[int, int]]] = []
        for t, r in enumerate(trace):
            node, path = tree.match_prefix(r.tokens, r.extra_key).last_node, []
            while node is not tree.root:
                times.setdefault(node, []).append(t)
                path.append((node.id, len(node.key)))
                node = node.parent
            self.paths.append(path[::-1])
        self.times = {start_key(n): ts for n, ts in times.items()}
        self.num_nodes = len(times)

    def next_access(self, key: int, after: float) -> float:
        ts = self.times.get(key)
        if not ts:
            return math.inf
        i = bisect.bisect_right(ts, after)
        return float(ts[i]) if i < len(ts) else math.inf

    def flattened(self) -> list[tuple[int, int, int]]:
        """(object id, size in tokens, request index) of every node access, in order."""
        return [(obj, size, t) for t, path in enumerate(self.paths) for obj, size in path]


# ---- results -------------------------------------------------------------------------------------
@dataclass
class SimResult:
    policy: str
    cache_tokens: int
    requests: int = 0
    tokens: int = 0
    hit_tokens: int = 0
    hit_requests: int = 0  # requests with a non-empty cached prefix
    evicted_tokens: int = 0
    evicted_nodes: int = -1  # -1: not reported by this cache
    predictor_calls: int = 0
    predicted_items: int = 0
    peak_nodes: int = -1
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # CPU time of the whole process (all its threads) during the replay

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / max(self.tokens, 1)

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / max(self.requests, 1)

    @property
    def us_per_access(self) -> float:
        return 1e6 * self.seconds / max(self.requests, 1)

    @property
    def cpu_us_per_access(self) -> float:
        """CPU microseconds per request: on a busy shared host steadier than the wall time."""
        return 1e6 * self.cpu_seconds / max(self.requests, 1)

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(token_hit_rate=self.token_hit_rate, request_hit_rate=self.request_hit_rate,
                 us_per_access=self.us_per_access, cpu_us_per_access=self.cpu_us_per_access)
        return d


# ---- sgrec's tree ----------------------------------------------------------------------------------
class SgrecReplay:
    def __init__(self, policy: EvictionPolicy, capacity: int) -> None:
        self.now = 0.0
        self.slots = 0
        self.capacity = capacity
        self.tree = RadixCache(None, policy=policy, clock=lambda: self.now)

    def request(self, t: int, tokens: list[int], extra_key: str | None) -> tuple[int, int]:
        """Returns (tokens hit, tokens evicted)."""
        tree, self.now = self.tree, float(t)
        last = tree.match_prefix(tokens, extra_key).last_node
        hit = last.depth
        if hit == len(tokens) or len(tokens) > self.capacity:
            return hit, 0
        tree.inc_lock_ref(last)
        tree.insert(tokens, torch.arange(self.slots, self.slots + len(tokens)), extra_key)  # unique fake slots
        self.slots += len(tokens)
        leaf = last.children[child_key(extra_key, tokens[hit])]
        tree.inc_lock_ref(leaf)
        tree.dec_lock_ref(last)
        over = tree.total_size() - self.capacity
        evicted = tree.evict(over) if over > 0 else 0
        tree.dec_lock_ref(leaf)
        return hit, evicted

    def nodes(self) -> int:
        idx = getattr(self.tree.policy, "index", None)
        return len(idx.pos) if idx is not None else -1


# ---- SGLang's RadixCache as a peer -----------------------------------------------------------------
class _MockAllocator:
    device = torch.device("cpu")

    def free(self, idx: Any) -> None:
        pass

    def free_segment(self, idx: Any, start_pos: int = 0) -> None:
        pass


class _CounterTime:
    """Stands in for the `time` module inside SGLang's radix_cache: monotonic() strictly increases,
    so recency ties (which SGLang breaks by heap position) cannot happen."""

    def __init__(self) -> None:
        self._n = itertools.count(1)

    def monotonic(self) -> float:
        return float(next(self._n))

    def perf_counter(self) -> float:
        return time.perf_counter()


@contextlib.contextmanager
def sglang_counter_clock() -> Iterator[None]:
    from sglang.srt.mem_cache import radix_cache

    saved = radix_cache.time
    radix_cache.time = _CounterTime()
    try:
        yield
    finally:
        radix_cache.time = saved


class SGLangReplay:
    """The same request steps through sglang.srt.mem_cache.radix_cache.RadixCache (create_simulated)."""

    def __init__(self, strategy: str, capacity: int) -> None:
        from sglang.srt.mem_cache.radix_cache import RadixCache as SGLangRadixCache
        from sglang.srt.mem_cache.utils import get_eviction_strategy

        self.capacity = capacity
        self.cache = SGLangRadixCache.create_simulated(mock_allocator=_MockAllocator())
        self.cache.eviction_strategy = get_eviction_strategy(strategy)

    def request(self, t: int, tokens: list[int], extra_key: str | None) -> tuple[int, int]:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        c = self.cache
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key)))
        hit = m.device_prefix_len
        if hit == len(tokens) or len(tokens) > self.capacity:
            return hit, 0
        c.inc_lock_ref(m.last_device_node)
        res = c.insert(InsertParams(key=RadixKey(array("q", tokens), extra_key)))
        c.inc_lock_ref(res.last_device_node)
        c.dec_lock_ref(m.last_device_node)
        over = c.evictable_size() + c.protected_size() - self.capacity
        evicted = c.evict(EvictParams(num_tokens=over)).num_tokens_evicted if over > 0 else 0
        c.dec_lock_ref(res.last_device_node)
        return hit, evicted


# ---- runners ---------------------------------------------------------------------------------------
def _uses_oracle(policy: str, predictor: str, noise: float | None) -> bool:
    """Whether the policy predicts from the trace's true next accesses (so needs its TraceIndex)."""
    return policy == "opt" or predictor == "oracle" or noise is not None


def sim_policy(name: str, index: TraceIndex | None = None, predictor: str = "lightgbm", noise: float | None = None,
               config: dict[str, Any] | str | None = None, seed: int = 0) -> EvictionPolicy:
    """An sgrec policy for a simulation; `index` (the trace's TraceIndex) is needed for opt, the oracle
    predictor and noise."""
    cfg = parse_config(config)
    if _uses_oracle(name, predictor, noise):
        if index is None:
            raise ValueError("the oracle predictor needs the trace index")
        cfg["predictor"] = OraclePredictor(index.next_access, noise or 0.0, seed)
    elif predictor != "lightgbm":
        raise ValueError(f"unknown predictor {predictor!r}")
    return make_policy(name, cfg)


def replay(trace: Trace, cache: SgrecReplay | SGLangReplay, name: str) -> SimResult:
    res = SimResult(name, cache.capacity)
    peak = -1
    with sglang_counter_clock() if isinstance(cache, SGLangReplay) else contextlib.nullcontext():
        start, cpu = time.perf_counter(), time.process_time()
        for t, r in enumerate(trace):
            hit, evicted = cache.request(t, r.tokens, r.extra_key)
            res.requests += 1
            res.tokens += len(r.tokens)
            res.hit_tokens += hit
            res.hit_requests += hit > 0
            res.evicted_tokens += evicted
            if t % 256 == 0 and isinstance(cache, SgrecReplay):  # SGLang's tree has no node count to read
                peak = max(peak, cache.nodes())
        if isinstance(cache, SgrecReplay) and isinstance(cache.tree.policy, PredictivePolicy):
            cache.tree.policy.flush()  # background work belongs to the replay's time
        res.seconds, res.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    res.peak_nodes = max(peak, cache.nodes()) if isinstance(cache, SgrecReplay) else -1
    if isinstance(cache, SgrecReplay):
        pol = cache.tree.policy
        if isinstance(pol, PredictivePolicy):
            pol.close()
            res.predictor_calls, res.predicted_items = pol.predictor_calls, pol.predicted_items
        res.evicted_nodes = getattr(pol, "evicted", -1)
    return res


def run_libcachesim(name: str, stream: list[tuple[int, int, int]], capacity: int, num_requests: int) -> SimResult:
    """libCacheSim policy `name` (lcs-*) on the flattened node stream; tokens are bytes. A request
    counts as hit when its first node hits; its hit tokens are those of the nodes that hit."""
    import libcachesim as lcs

    cls = {"lcs-lru": lcs.LRU, "lcs-arc": lcs.ARC, "lcs-s3fifo": lcs.S3FIFO, "lcs-sieve": lcs.Sieve,
           "lcs-lhd": lcs.LHD, "lcs-belady": lcs.Belady}[name]
    cache = cls(capacity)
    nxt = [-1] * len(stream)  # next access of the same object, in stream positions (Belady needs it)
    last: dict[int, int] = {}
    for i in range(len(stream) - 1, -1, -1):
        nxt[i] = last.get(stream[i][0], -1)
        last[stream[i][0]] = i
    res = SimResult(name, capacity, requests=num_requests)
    req = lcs.Request()
    prev_t = -1
    start, cpu = time.perf_counter(), time.process_time()
    for i, (obj, size, t) in enumerate(stream):
        req.obj_id, req.obj_size, req.clock_time = obj, size, t
        req.next_access_vtime = nxt[i] if nxt[i] >= 0 else (1 << 62)
        hit = cache.get(req)
        res.tokens += size
        if hit:
            res.hit_tokens += size
        if t != prev_t:
            res.hit_requests += bool(hit)
            prev_t = t
    res.seconds, res.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    return res


def simulate(trace: Trace, policy: str, cache_tokens: int, predictor: str = "lightgbm", noise: float | None = None,
             config: dict[str, Any] | str | None = None, index: TraceIndex | None = None, seed: int = 0) -> SimResult:
    """One replay of `trace` under `policy` (any of SGREC_POLICIES, SGLANG_POLICIES, LCS_POLICIES)."""
    if policy in SGLANG_POLICIES:
        return replay(trace, SGLangReplay(policy.removeprefix("sglang-"), cache_tokens), policy)
    if policy in LCS_POLICIES:
        index = index or TraceIndex(trace)
        return run_libcachesim(policy, index.flattened(), cache_tokens, len(trace))
    needs_index = _uses_oracle(policy, predictor, noise)
    if needs_index and index is None:
        index = TraceIndex(trace)
    pol = sim_policy(policy, index, predictor, noise, config, seed)
    label = policy if not needs_index or policy == "opt" else f"{policy}[oracle{'' if noise is None else f',p={noise}'}]"
    return replay(trace, SgrecReplay(pol, cache_tokens), label)


def load(trace: str, requests: int | None = None) -> Trace:
    if trace in TRACES:
        size_arg = {"gr-users": "max_requests", "scan": "num_requests", "zipf": "num_requests"}.get(trace)
        tr = make_trace(trace, **({size_arg: requests} if requests is not None and size_arg else {}))
    else:
        tr = load_trace(trace)
    return tr if requests is None else tr[:requests]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sgrec.radix.sim", description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, help=f"a JSONL trace file or one of: {', '.join(TRACES)}")
    ap.add_argument("--policy", default="lru", choices=SGREC_POLICIES + SGLANG_POLICIES + LCS_POLICIES)
    ap.add_argument("--cache-tokens", type=int, required=True)
    ap.add_argument("--noise", type=float, default=None, help="oracle predictions, each inverted with this probability")
    ap.add_argument("--predictor", default="lightgbm", choices=("lightgbm", "oracle"))
    ap.add_argument("--config", default=None, help="policy config JSON (as --radix-eviction-policy-config)")
    ap.add_argument("--requests", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    trace = load(a.trace, a.requests)
    r = simulate(trace, a.policy, a.cache_tokens, a.predictor, a.noise, a.config, seed=a.seed)
    print(f"trace={a.trace} policy={r.policy} cache_tokens={a.cache_tokens} requests={r.requests} tokens={r.tokens}")
    print(f"token_hit_rate={r.token_hit_rate:.4f} request_hit_rate={r.request_hit_rate:.4f}")
    print(f"evicted_tokens={r.evicted_tokens} evicted_nodes={r.evicted_nodes} predictor_calls={r.predictor_calls} "
          f"predicted_items={r.predicted_items} peak_nodes={r.peak_nodes}")
    print(f"us_per_access={r.us_per_access:.1f} cpu_us_per_access={r.cpu_us_per_access:.1f} seconds={r.seconds:.2f}")


if __name__ == "__main__":
    main()
