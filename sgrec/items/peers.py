"""HRCS across servers (BAT §5.2): who shares the item pool, and re-planning when that changes.

One scheduler process (one DP rank) of one server runs an `ItemPool`. The pool's members are the
item-KV endpoints of every rank of every server, in order; a rank's place in that list is its rank in
the placement (`sgrec.items.hrcs`, Algorithm 1 with N = all ranks of all servers). Each rank keeps
the replicated hot items and its shard of the cold ones, serves them to the others from a thread of
its own (`ItemKVServer`, safe against the scheduler's evictions: see `sgrec.items.fetch`), and
for a request fetches the cold items it does not own from their owners, one round trip per owner,
or recomputes them (`ItemFetcher`; a dead owner: recomputed, never an error). Fetch or recompute is
the fetcher's cost model: the measured latency of each owner against this runner's recompute time
per token: given, or measured once at the first plan (`measure_recompute_per_token`) and then
taken from the executor's own forwards (`RankExecutor.token_time`, a moving average).

Membership comes from a peer file (`--item-peers`), JSON:

    {"servers": [{"name": "s0", "url": "http://10.0.0.1:30000",
                  "item_kv": ["tcp://10.0.0.1:40000", "tcp://10.0.0.1:40001"]},   # one per DP rank
                 {"name": "s1", "url": "http://10.0.0.2:30000", "item_kv": ["tcp://10.0.0.2:40000"]}]}

Only `item_kv` matters here (`name` and `url` are for people and the launch recipes), plus an optional
top-level `"item_fetch"`: `"cost"` (default, the cost model), `"always"` (fetch from every live owner:
tests, and deployments that want to save compute whatever the latency) or `"never"`. The file is
re-read when it changes (checked every `CHECK_INTERVAL_S`), so servers are admitted and removed at
run time without a restart: the placement is re-planned over the new list, items this rank no longer
owns are freed and the ones it now owns are computed. A server whose own endpoint is not in the file
(or with no file) pools its own DP ranks only. Every server derives the placement from the same
static inputs (catalog order and popularity), so all agree on the owners; while they re-read the file
at slightly different moments a fetch may miss, and a miss is recomputed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence

from sgrec.items import hrcs
from sgrec.items.fetch import FETCH_POLICIES, ItemFetcher, ItemKVClient, ItemKVServer

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
STATS_LOG_INTERVAL_S = 10.0  # fetch counters logged at most this often, when there was fetch traffic


def _load(path: str) -> dict:
    """The peer file, checked: a dict whose `servers` each have a non-empty `item_kv` list and whose
    `item_fetch` (if any) is a fetch policy. ValueError on a malformed file."""
    with open(path) as f:
        data = json.load(f)
    servers = data.get("servers") if isinstance(data, dict) else None
    if not isinstance(servers, list):
        raise ValueError(f"{path}: expected {{\"servers\": [...]}}")
    for k, srv in enumerate(servers):
        eps = srv.get("item_kv") if isinstance(srv, dict) else None
        if not isinstance(eps, list) or not eps or not all(isinstance(e, str) and e for e in eps):
            raise ValueError(f"{path}: server {k} needs a non-empty list 'item_kv' of endpoints")
    policy = data.get("item_fetch", "cost")
    if policy not in FETCH_POLICIES:
        raise ValueError(f"{path}: item_fetch must be one of {', '.join(FETCH_POLICIES)}, got {policy!r}")
    return data


def read_servers(path: str) -> list[dict]:
    """The server entries of the peer file at `path`; ValueError on a malformed file."""
    return _load(path)["servers"]


def read_peer_file(path: str) -> list[str]:
    """The item-KV endpoints of every rank of every server listed in `path`, in order.
    ValueError on a malformed file."""
    return read_peer_config(path)[0]


def read_peer_config(path: str) -> tuple[list[str], str]:
    """(item-KV endpoints of every rank of every server, in order; the fetch policy). ValueError on
    a malformed file."""
    data = _load(path)
    out = [e for srv in data["servers"] for e in srv["item_kv"]]
    if len(set(out)) != len(out):
        raise ValueError(f"{path}: an item_kv endpoint is listed twice")
    return out, data.get("item_fetch", "cost")


def write_peer_file(path: str, servers: Sequence[dict], **settings) -> None:
    """Writes the peer file atomically (readers never see half a file). Top-level settings of the
    file there (`item_fetch`) are kept unless given in `settings`."""
    data: dict = {}
    try:
        with open(path) as f:
            old = json.load(f)
        if isinstance(old, dict):
            data = {k: v for k, v in old.items() if k != "servers"}
    except (OSError, ValueError):
        pass
    data.update(settings)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"servers": list(servers), **data}, f, indent=1)
    os.replace(tmp, path)


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
    """The item pool as seen by one rank: its server, its fetcher (set on the executor) and the
    membership; `refresh()` (called from the scheduler loop) applies changes of the peer file."""

    def __init__(self, executor, runner, ctx, local_addrs: Sequence[str], dp_rank: int,
                 peers_path: str | None = None, clock: Callable[[], float] = time.monotonic,
                 bandwidth_gbps: float | None = None, prefill_time: Callable[[float, float], float] | None = None,
                 recompute_per_token_s: float | None = None):
        self.ex = executor
        self.runner = runner
        self.local_addrs = list(local_addrs)
        self.addr = self.local_addrs[dp_rank]
        self.peers_path = peers_path
        self.clock = clock
        self.bandwidth_gbps = bandwidth_gbps or hrcs.DEFAULT_BANDWIDTH_GBPS
        self.tau_u = hrcs.DEFAULT_TAU_U
        self.alpha = hrcs.DEFAULT_ALPHA
        cfg = runner.config
        pool = runner.kv_pool
        self.bytes_per_token = pool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pool.dtype)
        self.server = ItemKVServer(executor.store, self.addr, ctx)
        self.server.start()  # answers peers from its own thread, not between scheduler steps
        self.client = ItemKVClient({}, ctx)
        self.fetcher = ItemFetcher(dp_rank, executor.placement, self.client, executor.header_ids,
                                   bytes_per_token=self.bytes_per_token,
                                   bandwidth_Bps=self.bandwidth_gbps * 1e9 / 8, clock=clock)
        self._per_token = recompute_per_token_s  # None: measured on this runner at the first plan
        self._per_token_given = recompute_per_token_s is not None  # given: fixed, never re-measured
        executor.fetcher = self.fetcher
        self.members: list[str] = []
        self._prefill_model = prefill_time  # None: fitted on this runner at the first plan
        self._stamp: tuple | None = None
        self._next_check = 0.0
        self.replans = 0
        self._filled = False
        self._next_log, self._logged = 0.0, (0, 0)
        self.apply(self._read() or self.local_addrs)

    # ---- membership -----------------------------------------------------------------------
    def _read(self) -> list[str] | None:
        """The listed endpoints if this rank is among them, the local ranks if it is not, None when
        the file is unchanged or unreadable (the current membership stays)."""
        if not self.peers_path:
            return None
        try:
            st = os.stat(self.peers_path)
        except OSError:
            return None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return None
        try:
            members, self.fetcher.policy = read_peer_config(self.peers_path)
        except (OSError, ValueError) as e:
            logger.warning("item peers: %s; keeping the current members", e)
            return None
        self._stamp = stamp
        return members if self.addr in members else self.local_addrs

    def refresh(self) -> bool:
        """Re-reads the peer file when due and changed; True when the membership changed."""
        if not self._filled:  # first call, after the warm-up flushed the store: this rank's share now
            self._filled = True
            self.ex.store.precompute()
        now = self.clock()
        if now >= self._next_log:
            self._log_stats(now)
        if now < self._next_check:
            return False
        self._next_check = now + CHECK_INTERVAL_S
        members = self._read()
        if members is None or members == self.members:
            return False
        self.apply(members)
        return True

    def apply(self, members: Sequence[str]) -> None:
        """Re-plans the placement over `members` and re-shards this rank's item store."""
        members = list(members)
        rank, n = members.index(self.addr), len(members)
        ex = self.ex
        if not (members == self.local_addrs and ex.placement is not None and ex.placement.n == n):
            ex.placement = self._plan(n) if n > 1 else None
        if n > 1 and self.fetcher.recompute_s is None:
            if self._per_token is None:
                self._per_token = measure_recompute_per_token(self.runner, ex.catalog, ex.args.max_rank_candidates)
                logger.info("item fetch: recomputing an item token costs %.1f us here", self._per_token * 1e6)
            per_token = self._per_token
            if self._per_token_given:
                self.fetcher.recompute_s = lambda n_tokens: n_tokens * per_token
            else:  # the start-up measurement until the executor has timed its own forwards
                self.fetcher.recompute_s = lambda n_tokens: n_tokens * (ex.token_time or per_token)
        ex.dp_rank = rank  # the executor's rank in the placement
        self.fetcher.rank, self.fetcher.placement = rank, ex.placement
        self.client.set_endpoints({r: a for r, a in enumerate(members) if r != rank})
        freed = ex.store.drop_unowned()
        added = ex.store.precompute() if self._filled else 0
        if self.members:
            self.replans += 1
        logger.info("item pool: rank %d of %d; freed %d item tokens, computed %d items", rank, n, freed, added)
        self.members = members

    def _plan(self, n: int):
        catalog = self.ex.catalog
        if self._prefill_model is None:
            self._prefill_model = hrcs.fit_catalog_prefill(self.runner, catalog, self.ex.args.max_rank_candidates)
        placement, rep = hrcs.plan_catalog(catalog, n, self._prefill_model, self.bytes_per_token,
                                           self.ex.args.max_rank_candidates, self.tau_u, self.bandwidth_gbps,
                                           self.alpha)
        logger.info("HRCS over %d ranks: replication ratio %.3f (%d items)", n, rep.ratio, rep.num_replicated)
        return placement

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
                "served": self.server.served, "replans": self.replans}

    def close(self) -> None:
        self.client.close()
        self.server.close()
