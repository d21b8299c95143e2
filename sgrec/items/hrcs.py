"""Hot-replicated cold-sharded (HRCS) item KV placement (BAT §5.2, Algorithm 1).

With N data-parallel ranks each holding an item store, the hottest share r of the items is
replicated on every rank and the rest is partitioned uniformly. r comes from Algorithm 1:

    t     = PrefillTime(tau_u, c * tau_i)          (a polynomial regression on measured prefills)
    R_max = alpha * t * B * (N - 1) / (c * S_item * N),  S_item = tau_i
    r     = i / |F| for the first i at which the CDF of the frequencies, sorted descending,
            reaches 1 - R_max

B is the network bandwidth in tokens/s. Everything here is pure (no I/O) except `measure_prefill`
(times forwards on a runner) and the CLI, which prints the plan:

    python -m sgrec.items.hrcs --bandwidth-gbps 100 --bytes-per-token 28672 --tau-u 1500 --tau-i 10 \
        -c 100 -N 4 --alpha 0.1 --num-items 10000 --zipf 1.0 --prefill-time 0.05
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

CDF_EPS = 1e-12  # the CDF of normalised floats may end a hair below 1
# what a start-up plan assumes before anything was measured (RankExecutor's and ItemPool's plans over a
# server's DP ranks)
DEFAULT_TAU_U = 1000  # user tokens assumed by the start-up HRCS plan before any request was seen
DEFAULT_BANDWIDTH_GBPS = 100.0
DEFAULT_ALPHA = 0.1


# ---- prefill-time model ---------------------------------------------------------------------
@dataclass
class PrefillTimeModel:
    """Seconds of a prefill of `suffix` new tokens over `prefix` cached ones: a bivariate polynomial
    of total degree `degree` in (suffix, prefix) / 1000, fitted by least squares."""

    degree: int = 2
    coef: np.ndarray | None = None
    exps: list[tuple[int, int]] = field(default_factory=list)

    @staticmethod
    def _exps(degree: int) -> list[tuple[int, int]]:
        return [(a, d - a) for d in range(degree + 1) for a in range(d, -1, -1)]

    def _features(self, suffix: np.ndarray, prefix: np.ndarray) -> np.ndarray:
        s, p = np.asarray(suffix, float) / 1000.0, np.asarray(prefix, float) / 1000.0
        return np.stack([s**a * p**b for a, b in self.exps], axis=-1)

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float, float]], degree: int = 2,
            relative: bool = False) -> "PrefillTimeModel":
        """samples: (suffix_tokens, prefix_tokens, seconds). relative: minimise relative rather than
        absolute errors (rows weighted by 1/seconds), so short prefills are fitted as well as long."""
        m = cls(degree)
        m.exps = cls._exps(degree)
        if len(samples) < len(m.exps):
            raise ValueError(f"a degree-{degree} fit needs at least {len(m.exps)} samples, got {len(samples)}")
        arr = np.asarray(samples, float)
        x, y = m._features(arr[:, 0], arr[:, 1]), arr[:, 2]
        if relative:
            w = 1.0 / np.maximum(y, 1e-9)
            x, y = x * w[:, None], y * w
        m.coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        return m

    def __call__(self, suffix: float, prefix: float) -> float:
        if self.coef is None:
            raise ValueError("PrefillTimeModel is not fitted")
        return max(0.0, float(self._features(np.array([suffix]), np.array([prefix]))[0] @ self.coef))


def measure_prefill(runner, shapes: Sequence[tuple[int, int]], repeats: int = 2) -> list[tuple[int, int, float]]:
    """Times runner forwards of `suffix` new tokens attending to `prefix` cached slots (whatever KV
    they hold) plus themselves; returns (suffix, prefix, best seconds) per shape."""
    from sgrec.model.attention import SeqLayout

    alloc = runner.memory.allocator
    vocab = runner.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    out = []
    for suffix, prefix in shapes:
        slots = alloc.alloc(suffix + prefix)
        if slots is None:
            raise RuntimeError(f"measure_prefill: no room for {suffix + prefix} slots")
        try:
            ids = torch.randint(0, vocab, (suffix,), generator=gen).tolist()
            mask = torch.ones(suffix, prefix + suffix, dtype=torch.bool)
            mask[:, prefix:] = torch.ones(suffix, suffix, dtype=torch.bool).tril()
            best = math.inf
            for _ in range(repeats):
                seq = SeqLayout(0, suffix, slots, mask)
                batch = runner.make_batch(ids, list(range(prefix, prefix + suffix)), slots[prefix:], [seq])
                t0 = time.perf_counter()
                runner.forward(batch, [suffix - 1])
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                best = min(best, time.perf_counter() - t0)
            out.append((suffix, prefix, best))
        finally:
            alloc.free(slots)
    return out


# ---- Algorithm 1 ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicationResult:
    ratio: float  # r: share of items replicated on every rank
    num_replicated: int
    r_max: float  # max allowed KV communication ratio
    prefill_time: float  # t


def compute_replication_ratio(bandwidth: float, freqs: Sequence[float], tau_u: float, tau_i: float,
                              alpha: float, c: int, n: int,
                              prefill_time: Callable[[float, float], float]) -> ReplicationResult:
    """Algorithm 1. `bandwidth` in tokens/s; `freqs` per item (normalised here to sum 1);
    `prefill_time(suffix_tokens, prefix_tokens)` in seconds."""
    if n < 1 or c < 1 or tau_i <= 0 or bandwidth < 0 or alpha < 0:
        raise ValueError("need n >= 1, c >= 1, tau_i > 0, bandwidth >= 0, alpha >= 0")
    f = np.asarray(freqs, float)
    if f.size == 0 or (f < 0).any() or f.sum() <= 0:
        raise ValueError("freqs must be non-negative with a positive sum")
    t = float(prefill_time(tau_u, c * tau_i))
    t_max = alpha * t
    s_item = tau_i
    r_max = t_max * bandwidth * (n - 1) / (c * s_item * n)
    f = np.sort(f / f.sum())[::-1]
    cdf = np.cumsum(f)
    hit = np.nonzero(cdf >= 1.0 - r_max - CDF_EPS)[0]
    i = int(hit[0]) + 1 if hit.size else f.size
    return ReplicationResult(i / f.size, i, r_max, t)


# ---- placement ------------------------------------------------------------------------------
@dataclass
class Placement:
    """Which items each of `n` ranks holds: `replicated` on all, every other item on `owner[id]`."""

    n: int
    replicated: set[str]
    owner: dict[str, int]

    def owns(self, rank: int, item_id: str) -> bool:
        return item_id in self.replicated or self.owner.get(item_id, rank) == rank

    def items_of(self, rank: int) -> list[str]:
        return sorted(self.replicated) + sorted(k for k, r in self.owner.items() if r == rank)


class RowPlacement:
    """`plan_placement`'s plan for a catalog version, as arrays (no set or dict of 10^7 ids per rank):
    `pos[row]` is the row's place in the order by descending frequency (-1: a dead row), the first `k`
    places replicated, place j >= k on rank j mod n. An item the plan does not know (added later) is
    everyone's, as Placement's `owner.get(id, rank)`."""

    def __init__(self, n: int, catalog, pos: np.ndarray, k: int):
        self.n, self.catalog, self.pos, self.k = n, catalog, pos, k

    def owns(self, rank: int, item_id: str) -> bool:
        row = self.catalog.index.get(item_id)
        if row is None:
            return True
        j = int(self.pos[row])
        return j < self.k or j % self.n == rank

    def _rows(self, mask: np.ndarray) -> list[str]:
        ids = self.catalog.ids
        return sorted(ids[r] for r in np.flatnonzero(mask).tolist())

    @property
    def replicated(self) -> set[str]:
        return set(self._rows((self.pos >= 0) & (self.pos < self.k)))

    @property
    def owner(self) -> dict[str, int]:
        ids = self.catalog.ids
        return {ids[r]: int(self.pos[r]) % self.n for r in np.flatnonzero(self.pos >= self.k).tolist()}

    def items_of(self, rank: int) -> list[str]:
        rep = (self.pos >= 0) & (self.pos < self.k)
        return self._rows(rep) + self._rows((self.pos >= self.k) & (self.pos % self.n == rank))


def placement_order(freqs: np.ndarray, ratio: float) -> tuple[np.ndarray, int]:
    """(order, k): positions by descending frequency (ties: first position first) and how many of
    them are replicated (round(ratio * |items|))."""
    order = np.argsort(-np.asarray(freqs, dtype=np.float64), kind="stable")
    return order, min(order.size, max(0, round(ratio * order.size)))


def plan_placement(item_ids: Sequence[str], freqs: Sequence[float], ratio: float, n: int) -> Placement:
    """Replicates the round(ratio * |items|) most frequent items (ties: catalog order); deals the rest
    to the n ranks round-robin in descending frequency, so every rank gets an equal share of the
    items and of the cold traffic. The owner of the item at position j of that order is j mod n
    whatever the ratio, so ranks that measured different prefill times (a different r) still agree
    on the owner of every item they both shard."""
    if len(item_ids) != len(freqs):
        raise ValueError("item_ids and freqs differ in length")
    order, k = placement_order(freqs, ratio)
    order = order.tolist()
    replicated = {item_ids[j] for j in order[:k]}
    owner = {item_ids[j]: pos % n for pos, j in enumerate(order) if pos >= k}
    return Placement(n, replicated, owner)


@dataclass(frozen=True)
class Plan:
    replication: ReplicationResult
    placement: Placement
    per_rank_items: list[int]
    per_rank_tokens: list[int]
    per_rank_bytes: list[int]
    remote_fraction: float  # expected share of item accesses served by another rank


def make_plan(item_ids: Sequence[str], item_lens: Sequence[int], freqs: Sequence[float], bytes_per_token: int,
              bandwidth: float, tau_u: float, tau_i: float, alpha: float, c: int, n: int,
              prefill_time: Callable[[float, float], float]) -> Plan:
    rep = compute_replication_ratio(bandwidth, freqs, tau_u, tau_i, alpha, c, n, prefill_time)
    pl = plan_placement(item_ids, freqs, rep.ratio, n)
    lens = dict(zip(item_ids, item_lens))
    per_items, per_tokens = [], []
    for rank in range(n):
        mine = pl.items_of(rank)
        per_items.append(len(mine))
        per_tokens.append(sum(lens[i] for i in mine))
    f = np.asarray(freqs, float)
    f = f / f.sum()
    cold = sum(fi for i, fi in zip(item_ids, f) if i not in pl.replicated)
    remote = cold * (n - 1) / n
    return Plan(rep, pl, per_items, per_tokens, [t * bytes_per_token for t in per_tokens], float(remote))


def catalog_freqs(catalog) -> np.ndarray:
    """Static item frequencies for placement: catalog popularity + 1 (the items' `popularity` key).
    Every rank computes the same numbers, so all agree on the owners (run-time access counts
    differ between ranks). One per live item, in row order."""
    rows = catalog.live_rows()
    out = np.ones(rows.size, dtype=np.float64)
    if catalog.meta:
        with_meta = np.array(sorted(catalog.meta), dtype=np.int64)
        at = np.searchsorted(rows, with_meta)
        ok = (at < rows.size) & (rows[np.minimum(at, rows.size - 1)] == with_meta)
        out[at[ok]] += [float(catalog.meta[r].get("popularity", 0)) for r in with_meta[ok].tolist()]
    return out


def mean_item_tokens(catalog) -> float:
    return catalog.total_tokens / len(catalog)


def fit_catalog_prefill(runner, catalog, max_candidates: int) -> Callable[[float, float], float]:
    """Prefill-time model of this runner over the shapes a rank request of the catalog has. Timing
    noise can bend the quadratic fit below zero outside the measured shapes (t = 0 would replicate
    every item), so predictions are floored at the longest measured prefill: the shapes asked for
    (tau_u user tokens over c * tau_i) are at least as long. `catalog`: sgrec.catalog.Catalog."""
    tau_i = mean_item_tokens(catalog)
    c = min(100, max_candidates, len(catalog))
    prefix = round(c * tau_i)
    shapes = [(s, p) for s in (32, 128, 512) for p in (0, prefix // 2, prefix)]
    samples = measure_prefill(runner, shapes, repeats=1)
    model, floor = PrefillTimeModel.fit(samples), max(t for _, _, t in samples)
    return lambda suffix, prefix_: max(model(suffix, prefix_), floor)


def plan_catalog(catalog, n: int, prefill_time: Callable[[float, float], float], bytes_per_token: int,
                 max_candidates: int, tau_u: float, bandwidth_gbps: float, alpha: float
                 ) -> tuple[RowPlacement, ReplicationResult]:
    """Algorithm 1 and the placement over `n` ranks (the DP ranks of a server) for a catalog
    (sgrec.catalog.Catalog: read from its columns, no item objects)."""
    freqs = catalog_freqs(catalog)
    c = min(100, max_candidates, len(catalog))
    bandwidth = bandwidth_gbps * 1e9 / 8 / bytes_per_token
    rep = compute_replication_ratio(bandwidth, freqs, tau_u, mean_item_tokens(catalog), alpha, c, n, prefill_time)
    order, k = placement_order(freqs, rep.ratio)
    pos = np.full(catalog.num_rows, -1, dtype=np.int32 if catalog.num_rows < 2**31 else np.int64)  # per rank
    pos[catalog.live_rows()[order]] = np.arange(order.size)
    return RowPlacement(n, catalog, pos, k), rep


def format_plan(plan: Plan) -> str:
    rep = plan.replication
    lines = [
        f"prefill time t          : {rep.prefill_time * 1e3:.3f} ms",
        f"max remote ratio R_max  : {rep.r_max:.4f}",
        f"replication ratio r     : {rep.ratio:.4f} ({rep.num_replicated} items on every rank)",
        f"expected remote fraction: {plan.remote_fraction:.4f} of item accesses",
        "rank  items  tokens  bytes",
    ]
    for rank, (i, t, b) in enumerate(zip(plan.per_rank_items, plan.per_rank_tokens, plan.per_rank_bytes)):
        lines.append(f"{rank:>4}  {i:>5}  {t:>6}  {b / 2**20:.1f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sgrec.items.hrcs", description="Print an HRCS item placement plan.")
    bw = ap.add_mutually_exclusive_group(required=True)
    bw.add_argument("--bandwidth-tokens", type=float, help="network bandwidth B in tokens/s")
    bw.add_argument("--bandwidth-gbps", type=float, help="network bandwidth in Gbit/s (needs --bytes-per-token)")
    ap.add_argument("--bytes-per-token", type=int, default=28672, help="KV bytes per token (Qwen2-1.5B fp16: 28672)")
    ap.add_argument("--tau-u", type=float, required=True, help="average user tokens")
    ap.add_argument("--tau-i", type=float, required=True, help="average item tokens")
    ap.add_argument("-c", "--candidates", type=int, default=100, help="candidate items per request")
    ap.add_argument("-N", "--ranks", type=int, default=4, help="KV cache workers (data-parallel ranks)")
    ap.add_argument("--alpha", type=float, default=0.1, help="tolerable communication time / computation time")
    freq = ap.add_mutually_exclusive_group(required=True)
    freq.add_argument("--freq-file", help="item access counts: one 'item_id count [tokens]' per line")
    freq.add_argument("--num-items", type=int, help="synthetic Zipf frequencies over this many items")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the synthetic frequencies")
    pt = ap.add_mutually_exclusive_group(required=True)
    pt.add_argument("--prefill-time", type=float, help="prefill seconds of tau_u tokens over c*tau_i cached")
    pt.add_argument("--prefill-samples", help="JSON [[suffix, prefix, seconds], ...] to fit (degree 2)")
    pt.add_argument("--model-path", help="measure prefills of this model on CPU and fit (degree 2)")
    a = ap.parse_args(argv)

    if a.freq_file:
        ids, counts, lens = [], [], []
        with open(a.freq_file) as f:
            for line in f:
                parts = line.split()
                if parts:
                    ids.append(parts[0])
                    counts.append(float(parts[1]))
                    lens.append(int(parts[2]) if len(parts) > 2 else round(a.tau_i))
    else:
        ids = [f"i{k}" for k in range(a.num_items)]
        counts = [1.0 / (k + 1) ** a.zipf for k in range(a.num_items)]
        lens = [round(a.tau_i)] * a.num_items
    bandwidth = a.bandwidth_tokens if a.bandwidth_tokens is not None else a.bandwidth_gbps * 1e9 / 8 / a.bytes_per_token
    if a.prefill_time is not None:
        fn = lambda s, p: a.prefill_time  # noqa: E731
    elif a.prefill_samples:
        import json

        with open(a.prefill_samples) as f:
            fn = PrefillTimeModel.fit([tuple(x) for x in json.load(f)])
    else:
        from sgrec.runner import ModelRunner
        from sgrec.server_args import ServerArgs

        runner = ModelRunner(ServerArgs(model_path=a.model_path, device="cpu", max_total_tokens=1 << 14))
        shapes = [(s, p) for s in (32, 128, 512) for p in (0, 256, 1024)]
        fn = PrefillTimeModel.fit(measure_prefill(runner, shapes))
    plan = make_plan(ids, lens, counts, a.bytes_per_token, bandwidth, a.tau_u, a.tau_i, a.alpha,
                     a.candidates, a.ranks, fn)
    print(f"B = {bandwidth:.0f} tokens/s, tau_u = {a.tau_u}, tau_i = {a.tau_i}, c = {a.candidates}, "
          f"N = {a.ranks}, alpha = {a.alpha}, {len(ids)} items")
    print(format_plan(plan))


if __name__ == "__main__":
    main()
