"""Batch formation with a token budget and an SLO-bounded wait (xGR §7).

Requests of one kind (rank, score, retrieve, ...) queue in arrival order. A batch takes the oldest
requests of a kind while their tokens fit in `max_batch_tokens`, and is dispatched

- when it is full: the next queued request of that kind would not fit (or the budget is met), or
- when its oldest request has waited its quota.

`poll(now)` forms every batch that is due; a scheduler that calls it at least once per tick of
length T dispatches every request at most quota + T after its arrival. Requests are never
reordered within a kind, so none starves: the oldest request of a kind is in the next batch of that
kind, and that batch is due at the latest when this request's quota runs out. A request with more
tokens than the budget is refused on `add` (it could never be dispatched).

The wait quota. With --batch-wait-ms it is that value. With only --slo-ms it is derived per kind
(`SloWaitQuota`): a request waits in the batcher (quota q), may wait for one batch of its kind
already running on its stream (about T_exec) and then runs (T_exec), so the SLO holds when
q + 2 * T_exec <= SLO. Half of that slack is given to batching and half kept as margin for the
scheduler tick and execution-time variance: q = max(0, SLO - 2 * T_exec) / 2, where T_exec is an
exponential moving average of the kind's measured batch execution time. Before the first
measurement T_exec is taken as SLO / 4, so the quota starts at SLO / 4.

Retrieval runs as fixed-step rounds: a dispatched retrieve batch runs one prefill then ND - 1 beam
forwards together (ND semantic-ID levels; level 0 is selected from the prefill's logits), and no
request joins or leaves mid-round. `run_fixed_round` drives a round through
`RoundHooks` so that the host-side preparation of step i + 1 (buffer reuse, pre-allocation, the
parts of the valid-path mask that do not read step i's output) runs while step i's device work is
in flight. `fixed_round_steps` is the same round a phase at a time, so a scheduler can drive the
rounds of several batches in turn (sgrec.scheduler.task.TaskQueue). The clock is always passed in:
nothing here reads the time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

DEFAULT_WAIT_S = 0.002  # neither --batch-wait-ms nor --slo-ms given


@dataclass(frozen=True)
class BatchItem:
    rid: str
    kind: str
    num_tokens: int
    arrival: float  # seconds, the same clock as `now`


@dataclass
class Batch:
    kind: str
    items: list[BatchItem]
    dispatched_at: float
    reason: str  # "full" or "quota"

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens for it in self.items)


EMA_ALPHA = 0.2  # smoothing of a kind's measured batch time


class WaitQuota(Protocol):
    def quota(self, kind: str, exec_s: float | None) -> float:
        """Seconds a request of `kind` may wait; exec_s: the kind's measured batch time (None before
        the first batch)."""


@dataclass
class FixedWaitQuota:
    seconds: float

    def quota(self, kind: str, exec_s: float | None = None) -> float:
        return self.seconds


@dataclass
class SloWaitQuota:
    """q(kind) = max(0, slo - 2 * T_exec(kind)) / 2, T_exec the kind's measured batch time
    (initially slo / 4); see the module docstring for the derivation."""

    slo_s: float

    def __post_init__(self) -> None:
        if self.slo_s <= 0:
            raise ValueError("slo must be positive")

    def quota(self, kind: str, exec_s: float | None = None) -> float:
        t = self.slo_s / 4 if exec_s is None else exec_s
        return max(0.0, self.slo_s - 2 * t) / 2


def make_wait_quota(batch_wait_ms: float | None, slo_ms: float | None) -> FixedWaitQuota | SloWaitQuota:
    """--batch-wait-ms wins when given; else derived from --slo-ms; else DEFAULT_WAIT_S."""
    if batch_wait_ms is not None:
        return FixedWaitQuota(batch_wait_ms / 1000)
    if slo_ms is not None:
        return SloWaitQuota(slo_ms / 1000)
    return FixedWaitQuota(DEFAULT_WAIT_S)


def batch_former_from_args(args) -> "BatchFormer":
    """From ServerArgs: --max-batch-tokens, --batch-wait-ms, --slo-ms."""
    return BatchFormer(args.max_batch_tokens, make_wait_quota(args.batch_wait_ms, args.slo_ms))


class BatchFormer:
    def __init__(self, max_batch_tokens: int, wait_quota: WaitQuota | float):
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be at least 1")
        self.max_batch_tokens = max_batch_tokens
        self.wait_quota = FixedWaitQuota(float(wait_quota)) if isinstance(wait_quota, (int, float)) else wait_quota
        self._queues: dict[str, deque[BatchItem]] = {}
        self._tokens: dict[str, int] = {}
        self.exec_s: dict[str, float] = {}  # kind -> EMA of its measured batch time

    def observe(self, kind: str, exec_s: float) -> None:
        """A batch of `kind` took exec_s seconds (feeds the SLO quota and the units' cost)."""
        old = self.exec_s.get(kind)
        self.exec_s[kind] = exec_s if old is None else (1 - EMA_ALPHA) * old + EMA_ALPHA * exec_s

    def quota(self, kind: str) -> float:
        return self.wait_quota.quota(kind, self.exec_s.get(kind))

    def add(self, rid: str, kind: str, num_tokens: int, now: float) -> BatchItem:
        if num_tokens < 1:
            raise ValueError("a request needs at least one token")
        if num_tokens > self.max_batch_tokens:
            raise ValueError(f"request {rid!r} has {num_tokens} tokens, more than the batch budget "
                             f"({self.max_batch_tokens}, --max-batch-tokens)")
        q = self._queues.setdefault(kind, deque())
        if q and now < q[-1].arrival:
            raise ValueError("arrivals must not go back in time")
        item = BatchItem(rid, kind, num_tokens, now)
        q.append(item)
        self._tokens[kind] = self._tokens.get(kind, 0) + num_tokens
        return item

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def remove(self, rid: str) -> BatchItem | None:
        """Takes a queued request out (an abort); None if it is not queued."""
        for kind, q in self._queues.items():
            for it in q:
                if it.rid == rid:
                    q.remove(it)
                    self._tokens[kind] -= it.num_tokens
                    return it
        return None

    def queued_tokens(self, kind: str) -> int:
        return self._tokens.get(kind, 0)

    def deadline(self, kind: str) -> float | None:
        """When the oldest queued request of `kind` has waited its quota (None when empty)."""
        q = self._queues.get(kind)
        return q[0].arrival + self.quota(kind) if q else None

    def has_full(self) -> bool:
        """Some kind has a full batch queued (due now, whatever its quota)."""
        return any(q and self._take(kind)[1] for kind, q in self._queues.items())

    def next_deadline(self) -> float | None:
        """The earliest quota expiry over all kinds: a scheduler may sleep until then (unless
        `has_full`)."""
        ds = [d for k in self._queues if (d := self.deadline(k)) is not None]
        return min(ds) if ds else None

    def _take(self, kind: str) -> tuple[int, bool]:
        """How many of the oldest requests fit in the budget; full is True when the next one does not
        fit (or the budget is met)."""
        q = self._queues[kind]
        n, i = 0, 0
        while i < len(q) and n + q[i].num_tokens <= self.max_batch_tokens:
            n += q[i].num_tokens
            i += 1
        return i, i < len(q) or n == self.max_batch_tokens

    def _pop(self, kind: str, count: int, now: float, reason: str) -> Batch:
        q = self._queues[kind]
        items = [q.popleft() for _ in range(count)]
        self._tokens[kind] -= sum(it.num_tokens for it in items)
        return Batch(kind, items, now, reason)

    def poll(self, now: float) -> list[Batch]:
        """Every batch due at `now`, oldest first request first."""
        out = []
        for kind, q in self._queues.items():
            while q:
                count, full = self._take(kind)
                if full:
                    reason = "full"
                elif now >= self.deadline(kind):
                    reason = "quota"
                else:
                    break
                out.append(self._pop(kind, count, now, reason))
        out.sort(key=lambda b: b.items[0].arrival)
        return out

    def flush(self, now: float) -> list[Batch]:
        """Dispatches everything queued regardless of quota (e.g. at shutdown)."""
        out = []
        for kind, q in self._queues.items():
            while q:
                out.append(self._pop(kind, self._take(kind)[0], now, "flush"))
        out.sort(key=lambda b: b.items[0].arrival)
        return out


# ---- retrieval: fixed-step rounds -------------------------------------------------------------
def round_phases(num_levels: int) -> list[str]:
    """One prefill then `num_levels` beam forwards. A retrieve round over ND semantic-ID levels has
    ND - 1 of them: level 0 is chosen from the prefill's logits, and the last level's tokens are
    never forwarded."""
    if num_levels < 0:
        raise ValueError("num_levels must be non-negative")
    return ["prefill"] + ["beam"] * num_levels


class RoundHooks(Protocol):
    """What an executor supplies to run a retrieve batch as a fixed-step round.

    prepare(step, phase): host-side work for `step` that does not read step - 1's device output
    (reusing the fixed-size beam buffers, pre-allocating KV slots, positions, the trie level's
    child tables); runs while the previous step's device work is in flight.
    launch(step, phase, prepared): enqueues the step's device work and returns a handle without
    waiting (on CUDA: kernels on a stream).
    finish(step, phase, handle): waits for the step and consumes its output (beam selection).
    """

    def prepare(self, step: int, phase: str) -> object: ...

    def launch(self, step: int, phase: str, prepared: object) -> object: ...

    def finish(self, step: int, phase: str, handle: object) -> None: ...


def run_fixed_round(hooks: RoundHooks, num_levels: int, overlap: bool = True) -> None:
    """Runs prefill + num_levels beam steps. With overlap, the order is
    prepare(0) launch(0) prepare(1) finish(0) launch(1) prepare(2) finish(1) ... so step i + 1's
    preparation overlaps step i's device work; without, prepare(i) launch(i) finish(i) in turn."""
    for _ in fixed_round_steps(hooks, num_levels, overlap):
        pass


def fixed_round_steps(hooks: RoundHooks, num_levels: int, overlap: bool = True):
    """run_fixed_round one phase at a time: a generator that yields each phase's index after its
    finish, so a caller can run other work (another round's phases) between them."""
    phases = round_phases(num_levels)
    if not overlap:
        for i, ph in enumerate(phases):
            hooks.finish(i, ph, hooks.launch(i, ph, hooks.prepare(i, ph)))
            yield i
        return
    prepared = hooks.prepare(0, phases[0])
    for i, ph in enumerate(phases):
        handle = hooks.launch(i, ph, prepared)
        if i + 1 < len(phases):
            prepared = hooks.prepare(i + 1, phases[i + 1])
        hooks.finish(i, ph, handle)
        yield i


def round_time(host_s: list[float], device_s: list[float], overlap: bool = True) -> float:
    """Modelled wall time of a round given each step's host preparation and device time (launch
    and finish taken as instantaneous): h0 + sum_i max(d_i, h_{i+1}) + d_last with overlap,
    sum(h) + sum(d) without."""
    if len(host_s) != len(device_s) or not host_s:
        raise ValueError("need one host and one device time per step")
    if not overlap:
        return sum(host_s) + sum(device_s)
    n = len(host_s)
    return host_s[0] + sum(max(device_s[i], host_s[i + 1]) for i in range(n - 1)) + device_s[-1]


def run_to_end(steps):
    """Drives a phase generator (one that yields after each phase and returns its batch's
    results, as RetrieveExecutor.run_steps) to its end, alone; returns its value. A phase that
    yields a negative number waits for another generator's round, which no one would advance here:
    RuntimeError."""
    while True:
        try:
            phase = next(steps)
        except StopIteration as done:
            return done.value
        if phase is not None and phase < 0:
            steps.close()
            raise RuntimeError("a batch waits for another batch's round: drive them in turn (TaskQueue)")

