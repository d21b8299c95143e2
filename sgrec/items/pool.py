"""HRCS across the DP ranks of one server (BAT §5.2): the item pool, its placement and its fetches.

One scheduler process (one DP rank) runs an `ItemPool`. The pool's members are the item-KV endpoints
(ipc) of the server's ranks, in order; a rank's place in that list is its rank in the placement
(`sgrec.items.hrcs`, Algorithm 1 with N = the server's DP ranks). Each rank keeps the replicated hot
items and its shard of the cold ones, serves them to the others from a thread of its own
(`ItemKVServer`, safe against the scheduler's evictions: see `sgrec.items.fetch`), and for a request
fetches the cold items it does not own from their owners, one round trip per owner, or recomputes
them (`ItemFetcher`; a dead owner: recomputed, never an error). Fetch or recompute is the fetcher's
cost model: the measured latency of each owner against this runner's recompute time per token:
given, or measured once at the start (`measure_recompute_per_token`) and then taken from the
executor's own forwards (`RankExecutor.token_time`, a moving average).

Across servers, item KV goes through the storage tier (`--hicache-storage-backend mooncake`, see
`sgrec.radix.hicache`): it replaced the peer file of earlier versions (`--item-peers`), which
fetched at the same latency and moved the same bytes (docs/performance.md) but needed a
membership file, TCP ports per rank and a re-plan whenever a server came or went.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from sgrec.items import hrcs
from sgrec.items.fetch import ItemFetcher, ItemKVClient, ItemKVServer

logger = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0  # fetch counters logged at most this often, when there was fetch traffic


def measure_recompute_per_token(runner, catalog, max_candidates: int, repeats: int = 2) -> float:
    """Seconds this runner spends per item token it recomputes inside a rank request's forward: the
    per-new-token slope b of t = a + b * new + c * cached (`LinearJct`, non-negative least squares)
    fitted on prefills of the shapes such a forward has (new tokens over up to c * tau_i cached)."""
    from sgrec.policy.prefill_only import LinearJct

    prefix = round(min(100, max_candidates, len(catalog)) * hrcs.mean_item_tokens(catalog))
    shapes = [(s, p) for s in (16, 64, 256) for p in (0, prefix)]
    samples = hrcs.measure_prefill(runner, shapes, repeats=repeats)
    return LinearJct.fit([(s + p, p, t) for s, p, t in samples]).b


class ItemPool:
    """The item pool as seen by one rank: its server, its fetcher (the executor's, `join`) and the
    placement over `local_addrs` (every rank of this server, in order); `refresh()` (called from the
    scheduler loop) computes this rank's share at its first call and logs the fetch counters."""

    def __init__(self, executor, runner, ctx, local_addrs: Sequence[str], dp_rank: int,
                 clock: Callable[[], float] = time.monotonic, bandwidth_gbps: float | None = None,
                 prefill_time: Callable[[float, float], float] | None = None,
                 recompute_per_token_s: float | None = None):
        self.ex = executor
        self.runner = runner
        self.members = list(local_addrs)
        self.clock = clock
        self.bandwidth_gbps = bandwidth_gbps or hrcs.DEFAULT_BANDWIDTH_GBPS
        self.bytes_per_token = runner.memory.bytes_per_token
        self.server = ItemKVServer(executor.store, self.members[dp_rank], ctx)
        self.server.start()  # answers peers from its own thread, not between scheduler steps
        self.client = ItemKVClient({r: a for r, a in enumerate(self.members) if r != dp_rank}, ctx)
        n = len(self.members)
        placement = executor.placement  # the one precompute planned, if it was for n ranks
        if n == 1:
            placement = None
        elif placement is None or placement.n != n:
            placement = executor.plan_placement(n, prefill_time, self.bandwidth_gbps, dp_rank)
        self.fetcher = ItemFetcher(dp_rank, placement, self.client, executor.header_ids,
                                   bytes_per_token=self.bytes_per_token,
                                   bandwidth_Bps=self.bandwidth_gbps * 1e9 / 8, clock=clock)
        executor.join(dp_rank, placement, self.fetcher)
        if n > 1:
            per_token = recompute_per_token_s
            if per_token is None:
                per_token = measure_recompute_per_token(runner, executor.catalog, executor.args.max_rank_candidates)
                logger.info("item fetch: recomputing an item token costs %.1f us here", per_token * 1e6)
                # the start-up measurement until the executor has timed its own forwards
                self.fetcher.recompute_s = lambda n_tokens: n_tokens * (executor.token_time or per_token)
            else:  # given: fixed, never re-measured
                self.fetcher.recompute_s = lambda n_tokens: n_tokens * per_token
        freed = executor.store.drop_unowned()
        logger.info("item pool: rank %d of %d; freed %d item tokens", dp_rank, n, freed)
        self._filled = False
        self._next_log, self._logged = 0.0, (0, 0)

    def refresh(self) -> None:
        """The scheduler loop's call: this rank's share is computed at the first one (after the
        warm-up flushed the store); the fetch counters are logged when due."""
        if not self._filled:
            self._filled = True
            self.ex.store.precompute()
        now = self.clock()
        if now >= self._next_log:
            self._log_stats(now)

    def _log_stats(self, now: float) -> None:
        f = self.fetcher
        if (f.remote_items, self.server.served) != self._logged:
            per_token = f.recompute_s(1) if f.recompute_s is not None else float("nan")
            lat = ", ".join(f"{a} {s * 1e3:.2f} ms" for a, s in sorted(f.latency.items())) or "none measured"
            logger.info("item fetch (%s): %d remote items, %d fetched, %d skipped by cost, %d probes; served %d; "
                        "owner latency %s; recompute %.1f us/token", f.policy, f.remote_items, f.fetched_items,
                        f.skipped_items, f.probes, self.server.served, lat, per_token * 1e6)
            self._logged = (f.remote_items, self.server.served)
        self._next_log = now + STATS_LOG_INTERVAL_S

    def stats(self) -> dict:
        f = self.fetcher
        return {"rank": f.rank, "ranks": len(self.members), "remote_items": f.remote_items,
                "fetched_items": f.fetched_items, "skipped_items": f.skipped_items, "probes": f.probes,
                "fetched_tokens": f.fetched_tokens, "recomputed_tokens": f.recomputed_tokens,
                "fetch_seconds": f.fetch_seconds, "peer_latency_s": dict(f.latency),
                "served": self.server.served}

    def close(self) -> None:
        self.client.close()
        self.server.close()
