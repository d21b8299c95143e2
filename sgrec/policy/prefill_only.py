"""Which prefill-only request runs next (PrefillOnly §6, Algorithm 1).

`fcfs` takes the oldest. `srjf-static` (plain SRJF) ranks by the job time estimated once, on
arrival. `srjf` (PrefillOnly) re-reads each waiting request's cached prefix from the radix tree
before every pick (continuous JCT calibration), so a request whose prefix was just cached jumps
ahead before that prefix is evicted. Both SRJF forms subtract `fairness * seconds queued`, so a
long request gets through after a bounded wait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

logger = logging.getLogger(__name__)


class PrefillOnlyJob(Protocol):
    arrival: float  # seconds, same clock as `now`
    n_input: int
    cached_on_arrival: int


JctFn = Callable[[int, int], float]


def jct_uncached_tokens(n_input: int, n_cached: int) -> float:
    """PrefillOnly's default proxy: the number of tokens that miss the prefix cache."""
    return float(n_input - n_cached)


@dataclass
class LinearJct:
    """jct = a + b * uncached + c * cached, fitted by least squares on profiled prefills."""

    a: float
    b: float
    c: float

    def __call__(self, n_input: int, n_cached: int) -> float:
        return self.a + self.b * (n_input - n_cached) + self.c * n_cached

    def in_tokens(self) -> "LinearJct":
        """The same model in units of one uncached token's time, so that --jct-fairness keeps its
        meaning (tokens per second queued) whichever JCT model is used."""
        b = self.b if self.b > 0 else 1.0
        return LinearJct(self.a / b, self.b / b, self.c / b)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> "LinearJct":
        """samples: (n_input, n_cached, seconds). Non-negative least squares, solved exactly: the
        least-squares fit on every subset of the three terms, the best one whose coefficients are
        all non-negative (a term that timing noise would make negative is left out)."""
        X = np.array([[1.0, n - c, c] for n, c, _ in samples])
        y = np.array([t for _, _, t in samples])
        best, best_err = [0.0, 0.0, 0.0], float(np.sum(y * y))
        for keep in ([0, 1, 2], [0, 1], [0, 2], [1, 2], [0], [1], [2]):
            coef, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
            if (coef < 0).any():
                continue
            err = float(np.sum((X[:, keep] @ coef - y) ** 2))
            if err < best_err:
                best, best_err = [0.0, 0.0, 0.0], err
                for k, v in zip(keep, coef):
                    best[k] = float(v)
        return cls(*best)


def profile_linear_jct(runner, lengths: Sequence[int], repeats: int = 1) -> LinearJct:
    """Times prefill-only forwards of each length with nothing, half and all but 8 tokens cached (the
    fastest of `repeats` runs per point; PrefillOnly §6.3 profiles at a 1,000-token granularity) and
    fits LinearJct in seconds. If the fit says an uncached token costs nothing (b = 0: the timings
    were noise, e.g. a busy host), the profile is taken once more with 3 runs per point; if that
    still gives b = 0, the result is the token-count proxy LinearJct(0, 1, 0) with a warning, since
    a model that ranks jobs without their uncached tokens would make SRJF meaningless."""
    jct = _profile(runner, lengths, repeats)
    if jct.b <= 0 and repeats < 3:
        jct = _profile(runner, lengths, 3)
    if jct.b <= 0:
        logger.warning(
            "profiled prefill times do not grow with uncached tokens (%s); using the uncached-token count", jct)
        return LinearJct(0.0, 1.0, 0.0)
    return jct


def _profile(runner, lengths: Sequence[int], repeats: int) -> LinearJct:
    import time

    import torch

    from sgrec.model.attention import SeqLayout

    alloc, vocab = runner.memory.allocator, runner.config.vocab_size
    samples = []
    for n in lengths:
        ids = [(7 * t) % (vocab - 3) + 3 for t in range(n)]
        for cached in sorted({0, n // 2, max(n - 8, 0)}):
            slots = alloc.alloc(cached)
            if slots is None or cached >= n:
                continue
            if cached:
                runner.forward(runner.make_batch(ids[:cached], list(range(cached)), slots,
                                                 [SeqLayout(0, cached, slots)]), [cached - 1])
            new = n - cached
            zeros = torch.zeros(new, dtype=torch.int64)
            batch = runner.make_batch(ids[cached:], list(range(cached, n)), zeros,
                                      [SeqLayout(0, new, torch.cat([slots, zeros]))])
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                runner.forward_prefill_only(batch, [new - 1])
                best = min(best, time.perf_counter() - start)
            samples.append((n, cached, best))
            alloc.free(slots)
    return LinearJct.fit(samples)


def prefill_only_key(policy: str, now: float, cached_now: Callable[[PrefillOnlyJob], int], fairness: float = 0.0,
                     jct: JctFn = jct_uncached_tokens) -> Callable[[Sequence[PrefillOnlyJob], int], tuple]:
    """The rank of queue[i] under `policy` (Algorithm 1): the smallest goes first; ties go to the
    older request, then to the earlier position."""
    if policy == "fcfs":
        return lambda queue, i: (queue[i].arrival, i)
    if policy not in ("srjf", "srjf-static"):
        raise ValueError(f"unknown prefill-only policy {policy!r}")
    calibrate = policy == "srjf"

    def key(queue: Sequence[PrefillOnlyJob], i: int) -> tuple:
        job = queue[i]
        cached = cached_now(job) if calibrate else job.cached_on_arrival
        return (jct(job.n_input, cached) - fairness * (now - job.arrival), job.arrival, i)

    return key


def pick_prefill_only(
    queue: Sequence[PrefillOnlyJob],
    policy: str,
    now: float,
    cached_now: Callable[[PrefillOnlyJob], int],
    fairness: float = 0.0,
    jct: JctFn = jct_uncached_tokens,
) -> int:
    """Index in `queue` of the request to run next (Algorithm 1; ties go to the older request)."""
    if not queue:
        raise ValueError("empty queue")
    key = prefill_only_key(policy, now, cached_now, fairness, jct)
    return min(range(len(queue)), key=lambda i: key(queue, i))


def order_prefill_only(
    queue: Sequence[PrefillOnlyJob],
    policy: str,
    now: float,
    cached_now: Callable[[PrefillOnlyJob], int],
    fairness: float = 0.0,
    jct: JctFn = jct_uncached_tokens,
) -> list[int]:
    """Indices of `queue` in the order `pick_prefill_only` takes them at `now` when nothing is cached
    in between (each job's cached prefix read once): for an engine that sorts its waiting queue
    (sgrec's SGLang plugin) instead of picking one request at a time."""
    key = prefill_only_key(policy, now, cached_now, fairness, jct)
    return sorted(range(len(queue)), key=lambda i: key(queue, i))
