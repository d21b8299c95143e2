"""Multi-stream execution of independent work units (RecOS §3, xGR §7).

A `WorkUnit` is a piece of device work (a batch, or one stage of a batch such as the shared or
unshared attention stage) with a profiled cost: execution time and occupancy, the share of the
device it can fill (RecOS measures it as the kernels' grid size; occupancy = grid / SMs, at most 1).

- `WorkloadMonitor` keeps, per stream, the queue of launched units that have not completed. A
  stream's expected completion time is the sum of its queued units' times (RecOS §3.3), and the
  occupancy expected at a time t is the sum over the units expected to be running at t.
- `select_stream` is RecOS's rule for computation ops (§3.4): an idle stream if any; else the
  stream with the earliest expected completion, unless starting the unit there would push the
  expected occupancy past the threshold, in which case the second earliest.
- `dep_values` ranks the units of a DAG: DepValue(v) = 1 + sum over children c of
  DepValue(c) / indegree(c) (RecOS §3.2); among ready units the highest goes first.
- `MultiStreamScheduler` launches units whose dependencies have completed, with one of four
  policies: `single` (one stream, FIFO), `per_query` (each group of units, e.g. a query, on one
  stream chosen round-robin), `topo` (submission order + RecOS stream selection) and `depvalue`
  (DepValue order + RecOS stream selection: RecOS's full method, what sgrec runs).
- `StreamTensorPool` keeps tensors produced on a stream until the event recorded after their last
  use has completed; a pool is checked when it holds more than its threshold (--stream-pool-mb).

Three backends behind `StreamBackend`: `CudaStreams` (torch.cuda streams and events; only when CUDA
is available), `InlineStreams` (CPU, one stream, runs each unit when launched) and `SimStreams` (a
virtual clock: units take their profiled time and run concurrently while their occupancies fit in
the device). Nothing here reads the wall clock except `InlineStreams`/`CudaStreams.now`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

EPS = 1e-9
POLICIES = ("single", "per_query", "topo", "depvalue")


@dataclass(frozen=True)
class UnitCost:
    time_s: float  # profiled execution time
    occupancy: float  # share of the device it can occupy, in (0, 1]

    def __post_init__(self) -> None:
        if self.time_s < 0:
            raise ValueError("time_s must be non-negative")
        if not 0 < self.occupancy <= 1:
            raise ValueError("occupancy must be in (0, 1]")


@dataclass
class WorkUnit:
    name: str  # unique among the units submitted to one scheduler
    cost: UnitCost
    deps: tuple[str, ...] = ()  # names of units that must complete first
    group: str = ""  # the query / batch it belongs to
    fn: Callable[[], object] | None = None  # the device work (enqueued on the current stream)


# ---- events and backends --------------------------------------------------------------------
class Event(ABC):
    """Recorded on a stream after a unit's work; done() is True once that work has completed."""

    result: object = None

    @abstractmethod
    def done(self) -> bool: ...


class DoneEvent(Event):
    def __init__(self, result: object = None):
        self.result = result

    def done(self) -> bool:
        return True


class StreamBackend(ABC):
    num_streams: int

    @abstractmethod
    def now(self) -> float:
        """Seconds on the backend's clock (virtual for the simulator)."""

    @abstractmethod
    def launch(self, unit: WorkUnit, stream: int, wait_for: Sequence[Event] = ()) -> Event:
        """Enqueues unit.fn on `stream` after the events in wait_for; returns the event recorded after it."""

    @abstractmethod
    def wait_any(self, events: Sequence[Event]) -> None:
        """Returns once at least one of `events` is done (all of them may be)."""

    def synchronize(self) -> None:
        """Waits for all launched work."""


class InlineStreams(StreamBackend):
    """CPU: one stream; a unit runs to completion when launched."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.num_streams = 1
        self._clock = clock

    def now(self) -> float:
        return self._clock()

    def launch(self, unit: WorkUnit, stream: int, wait_for: Sequence[Event] = ()) -> Event:
        if stream != 0:
            raise ValueError(f"InlineStreams has one stream; got stream {stream}")
        if not all(e.done() for e in wait_for):
            raise RuntimeError(f"{unit.name}: inline launch waits on an event that is not done")
        return DoneEvent(unit.fn() if unit.fn is not None else None)

    def wait_any(self, events: Sequence[Event]) -> None:
        if events and not any(e.done() for e in events):
            raise RuntimeError("InlineStreams: an event is pending, but inline work is done when launched")


class CudaEvent(Event):
    def __init__(self, event, result: object = None):
        self.event = event
        self.result = result

    def done(self) -> bool:
        return bool(self.event.query())


class CudaStreams(StreamBackend):
    """num_streams torch.cuda streams; cross-stream dependencies become stream.wait_event."""

    def __init__(self, num_streams: int, device=None, poll_s: float = 20e-6):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CudaStreams needs CUDA; use InlineStreams or SimStreams on CPU")
        if num_streams < 1:
            raise ValueError("num_streams must be at least 1")
        self._torch = torch
        self.num_streams = num_streams
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.streams = [torch.cuda.Stream(device=self.device) for _ in range(num_streams)]
        self.poll_s = poll_s

    def now(self) -> float:
        return time.perf_counter()

    def launch(self, unit: WorkUnit, stream: int, wait_for: Sequence[Event] = ()) -> Event:
        torch = self._torch
        s = self.streams[stream]
        s.wait_stream(torch.cuda.current_stream(self.device))  # what the launching stream queued comes first
        for e in wait_for:
            if isinstance(e, CudaEvent):
                s.wait_event(e.event)
            elif not e.done():
                raise RuntimeError(f"{unit.name}: cannot wait on a pending non-CUDA event")
        with torch.cuda.stream(s):
            result = unit.fn() if unit.fn is not None else None
            ev = torch.cuda.Event()
            ev.record(s)
        return CudaEvent(ev, result)

    def wait_any(self, events: Sequence[Event]) -> None:
        while events and not any(e.done() for e in events):
            time.sleep(self.poll_s)

    def synchronize(self) -> None:
        for s in self.streams:
            s.synchronize()


class SimEvent(Event):
    def __init__(self, sim: "SimStreams"):
        self._sim = sim
        self.completed_at: float | None = None

    def done(self) -> bool:
        return self.completed_at is not None and self.completed_at <= self._sim.now() + EPS


@dataclass
class _SimItem:
    unit: WorkUnit
    stream: int
    wait_for: tuple[Event, ...]
    event: SimEvent
    start: float | None = None
    end: float | None = None


class SimStreams(StreamBackend):
    """Virtual-clock device: each stream runs its units in launch order; the head unit starts when
    its stream is free, its wait_for events are done and its occupancy fits next to the running
    units (sum <= capacity; a unit that does not fit waits, holding its stream, as a kernel waits
    for free SMs). A unit takes exactly its profiled time. unit.fn, if any, runs at launch."""

    def __init__(self, num_streams: int, capacity: float = 1.0):
        if num_streams < 1:
            raise ValueError("num_streams must be at least 1")
        self.num_streams = num_streams
        self.capacity = capacity
        self._now = 0.0
        self._queues: list[deque[_SimItem]] = [deque() for _ in range(num_streams)]
        self._running: list[_SimItem] = []
        self.trace: list[tuple[str, int, float, float]] = []  # (name, stream, start, end), by start

    def now(self) -> float:
        return self._now

    def launch(self, unit: WorkUnit, stream: int, wait_for: Sequence[Event] = ()) -> Event:
        if not 0 <= stream < self.num_streams:
            raise ValueError(f"stream {stream} out of range [0, {self.num_streams})")
        item = _SimItem(unit, stream, tuple(wait_for), SimEvent(self))
        item.event.result = unit.fn() if unit.fn is not None else None
        self._queues[stream].append(item)
        self._start_ready()
        return item.event

    def occupancy(self) -> float:
        return sum(it.unit.cost.occupancy for it in self._running)

    def _start_ready(self) -> None:
        started = True
        while started:
            started = False
            for q in self._queues:
                if not q or q[0].start is not None:
                    continue
                head = q[0]
                if not all(e.done() for e in head.wait_for):
                    continue
                if self._running and self.occupancy() + head.unit.cost.occupancy > self.capacity + EPS:
                    continue
                head.start, head.end = self._now, self._now + head.unit.cost.time_s
                head.event.completed_at = head.end
                self._running.append(head)
                self.trace.append((head.unit.name, head.stream, head.start, head.end))
                started = True

    def _complete_due(self) -> None:
        due = [it for it in self._running if it.end <= self._now + EPS]
        for it in due:
            self._running.remove(it)
            assert self._queues[it.stream][0] is it
            self._queues[it.stream].popleft()
        self._start_ready()

    def advance(self) -> bool:
        """Moves the clock to the next completion; False when nothing is running."""
        self._complete_due()
        if not self._running:
            return False
        self._now = max(self._now, min(it.end for it in self._running))
        self._complete_due()
        return True

    def wait_any(self, events: Sequence[Event]) -> None:
        while events and not any(e.done() for e in events):
            if not self.advance():
                raise RuntimeError("SimStreams: waiting on events that can never complete")

    def synchronize(self) -> None:
        while self.advance():
            pass


def make_backend(kind: str, num_streams: int = 1) -> StreamBackend:
    """kind: cuda, inline, sim or auto (cuda when available, else inline)."""
    if kind == "auto":
        import torch

        kind = "cuda" if torch.cuda.is_available() else "inline"
    if kind == "cuda":
        return CudaStreams(num_streams)
    if kind == "inline":
        return InlineStreams()
    if kind == "sim":
        return SimStreams(num_streams)
    raise ValueError(f"Unknown stream backend {kind!r}; choose one of cuda, inline, sim, auto")


# ---- workload monitor and stream selection ----------------------------------------------------
class WorkloadMonitor:
    """Per stream, the launched units whose events are not done yet (RecOS §3.3)."""

    def __init__(self, num_streams: int):
        self.queues: list[deque[tuple[WorkUnit, Event]]] = [deque() for _ in range(num_streams)]

    @property
    def num_streams(self) -> int:
        return len(self.queues)

    def launched(self, stream: int, unit: WorkUnit, event: Event) -> None:
        self.queues[stream].append((unit, event))

    def poll(self) -> list[tuple[int, WorkUnit, Event]]:
        """Drops completed units (a stream runs in order, so from the front); returns them."""
        done = []
        for s, q in enumerate(self.queues):
            while q and q[0][1].done():
                unit, ev = q.popleft()
                done.append((s, unit, ev))
        return done

    def is_idle(self, stream: int) -> bool:
        return not self.queues[stream]

    def completion_time(self, stream: int) -> float:
        """Expected seconds until the stream drains: the sum of its queued units' times."""
        return sum(u.cost.time_s for u, _ in self.queues[stream])

    def occupancy_at(self, t: float, exclude: int | None = None) -> float:
        """Expected occupancy t seconds from now: the units expected to be running then, one per
        stream, placing each stream's queue back to back from now."""
        total = 0.0
        for s, q in enumerate(self.queues):
            if s == exclude:
                continue
            start = 0.0
            for u, _ in q:
                end = start + u.cost.time_s
                if start <= t + EPS < end:
                    total += u.cost.occupancy
                    break
                start = end
        return total


def select_stream(monitor: WorkloadMonitor, unit: WorkUnit, occupancy_threshold: float = 1.0) -> int:
    """RecOS stream selection for a computation unit (ties go to the lower stream index)."""
    for s in range(monitor.num_streams):
        if monitor.is_idle(s):
            return s
    order = sorted(range(monitor.num_streams), key=lambda s: (monitor.completion_time(s), s))
    first = order[0]
    if len(order) == 1:
        return first
    t = monitor.completion_time(first)
    if monitor.occupancy_at(t, exclude=first) + unit.cost.occupancy > occupancy_threshold + EPS:
        return order[1]
    return first


def dep_values(units: Iterable[WorkUnit]) -> dict[str, float]:
    """DepValue(v) = 1 + sum over v's children c of DepValue(c) / indegree(c) (RecOS §3.2).
    Raises ValueError on an unknown dependency or a cycle."""
    units = list(units)
    by_name = {u.name: u for u in units}
    if len(by_name) != len(units):
        raise ValueError("unit names must be unique")
    children: dict[str, list[str]] = {u.name: [] for u in units}
    for u in units:
        for d in u.deps:
            if d not in by_name:
                raise ValueError(f"{u.name} depends on unknown unit {d!r}")
            children[d].append(u.name)
    # reverse topological order: Kahn's algorithm on out-degrees
    out = {n: len(c) for n, c in children.items()}
    stack = [n for n, k in out.items() if k == 0]
    value: dict[str, float] = {}
    while stack:
        n = stack.pop()
        value[n] = 1.0 + sum(value[c] / len(by_name[c].deps) for c in children[n])
        for d in by_name[n].deps:
            out[d] -= 1
            if out[d] == 0:
                stack.append(d)
    if len(value) != len(units):
        raise ValueError("the units' dependencies form a cycle")
    return value


# ---- the scheduler ----------------------------------------------------------------------------
@dataclass
class _Pending:
    unit: WorkUnit
    seq: int
    waiting_on: set[str] = field(default_factory=set)


class MultiStreamScheduler:
    """Launches units whose dependencies have completed (RecOS: once an op finishes, its
    dependents enter the ready queue).

    single: every unit on stream 0 in ready order (first come, first launched).
    per_query: a group's units all on one stream, groups assigned round-robin.
    topo: ready units in topological (submission) order, on the stream from `select_stream`.
    sgrec: the ready unit with the highest DepValue first (ties: submission order), on the stream
    from `select_stream`.
    With topo and sgrec a unit is held on the host while its chosen stream already has
    `max_queued` units, so a more critical unit that becomes ready later can still overtake it.
    """

    def __init__(self, backend: StreamBackend, policy: str = "depvalue", occupancy_threshold: float = 1.0,
                 max_queued: int = 2, on_launch: Callable[[str, int, Event], None] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"Unknown policy {policy!r}; choose one of {POLICIES}")
        if max_queued < 1:
            raise ValueError("max_queued must be at least 1")
        self.backend = backend
        self.policy = policy
        self.occupancy_threshold = occupancy_threshold
        self.max_queued = max_queued
        self.monitor = WorkloadMonitor(backend.num_streams)
        self._seq = itertools.count()
        self._pending: dict[str, _Pending] = {}  # submitted, some dependency not complete
        self._ready: list[tuple[float, int, str]] = []  # heap of (-priority, seq, name)
        self._units: dict[str, WorkUnit] = {}
        self._dep_value: dict[str, float] = {}
        self._children: dict[str, list[str]] = {}
        self._group_stream: dict[str, int] = {}
        self._next_group_stream = 0
        self.events: dict[str, Event] = {}  # name -> event, for launched units
        self.completed: dict[str, float] = {}  # name -> backend time when seen complete
        self.launch_order: list[tuple[str, int]] = []  # (name, stream)
        self.on_launch = on_launch  # called with (name, stream, event) right after each launch

    def submit(self, units: Sequence[WorkUnit]) -> None:
        """Adds a DAG of units (dependencies inside `units` or already submitted)."""
        units = list(units)
        clash = [u.name for u in units if u.name in self._units]
        if clash:
            raise ValueError(f"unit {clash[0]!r} already submitted")
        inside = {u.name for u in units}
        # units submitted earlier stand in as sources, so that dep_values knows every name
        earlier = {d for u in units for d in u.deps if d not in inside and d in self._units}
        values = dep_values(units + [WorkUnit(d, UnitCost(0.0, 1.0)) for d in sorted(earlier)])
        for u in units:
            self._units[u.name] = u
            self._dep_value[u.name] = values[u.name]
            self._children.setdefault(u.name, [])
        for u in units:
            waiting = {d for d in u.deps if d not in self.completed}
            for d in u.deps:
                self._children[d].append(u.name)
            p = _Pending(u, next(self._seq), waiting)
            if waiting:
                self._pending[u.name] = p
            else:
                self._push_ready(p)

    def dep_value(self, name: str) -> float:
        return self._dep_value[name]

    def _push_ready(self, p: _Pending) -> None:
        prio = self._dep_value[p.unit.name] if self.policy == "depvalue" else 0.0
        heapq.heappush(self._ready, (-prio, p.seq, p.unit.name))

    def _stream_for(self, unit: WorkUnit) -> int | None:
        if self.policy == "single":
            return 0
        if self.policy == "per_query":
            if unit.group not in self._group_stream:
                self._group_stream[unit.group] = self._next_group_stream % self.backend.num_streams
                self._next_group_stream += 1
            return self._group_stream[unit.group]
        s = select_stream(self.monitor, unit, self.occupancy_threshold)  # topo, sgrec
        return s if len(self.monitor.queues[s]) < self.max_queued else None

    def poll(self) -> list[str]:
        """Records completed units and releases their dependents; returns the completed names."""
        names = []
        for _, unit, _ in self.monitor.poll():
            self.completed[unit.name] = self.backend.now()
            names.append(unit.name)
            for c in self._children[unit.name]:
                p = self._pending.get(c)
                if p is not None:
                    p.waiting_on.discard(unit.name)
                    if not p.waiting_on:
                        del self._pending[c]
                        self._push_ready(p)
        return names

    def dispatch(self) -> list[str]:
        """Launches ready units in priority order until the policy holds one back."""
        launched = []
        while self.poll() or self._ready:  # completions seen between launches release dependents
            if not self._ready:
                continue
            _, _, name = self._ready[0]
            unit = self._units[name]
            stream = self._stream_for(unit)
            if stream is None:
                break
            heapq.heappop(self._ready)
            ev = self.backend.launch(unit, stream)
            self.monitor.launched(stream, unit, ev)
            self.events[name] = ev
            self.launch_order.append((name, stream))
            if self.on_launch is not None:
                self.on_launch(name, stream, ev)
            launched.append(name)
        return launched

    @property
    def idle(self) -> bool:
        return not (self._pending or self._ready or any(self.monitor.queues))

    def step(self) -> list[str]:
        """poll, dispatch, then wait until some launched unit completes; returns the completed names."""
        self.poll()
        self.dispatch()
        inflight = [ev for q in self.monitor.queues for _, ev in q]
        if not inflight:
            if self._pending or self._ready:
                raise RuntimeError("units are waiting but none is running: a dependency was never submitted")
            return []
        self.backend.wait_any(inflight)
        return self.poll()

    def run_until_idle(self) -> None:
        while not self.idle:
            self.step()


# ---- per-stream tensor pool -------------------------------------------------------------------
DEFAULT_POOL_BYTES = 64 << 20


def _nbytes(tensor) -> int:
    try:
        return int(tensor.numel()) * int(tensor.element_size())
    except AttributeError:
        raise TypeError("pass nbytes for objects that are not tensors") from None


def tensor_pool_from_args(args, num_streams: int,
                          release: Callable[[object], None] | None = None) -> "StreamTensorPool":
    """From ServerArgs: --stream-pool-mb (MB of 2**20 bytes) per stream."""
    return StreamTensorPool(num_streams, int(args.stream_pool_mb * (1 << 20)), release)


class StreamTensorPool:
    """RecOS §3.5: a tensor handed to the pool of the stream that used it stays referenced until
    the event recorded after that use is done. A stream's pool is checked (done entries released,
    oldest first) when it holds more than threshold_bytes; `collect` can also be called any time."""

    def __init__(self, num_streams: int, threshold_bytes: int = DEFAULT_POOL_BYTES,
                 release: Callable[[object], None] | None = None):
        if threshold_bytes < 0:
            raise ValueError("threshold_bytes must be non-negative")
        self.threshold_bytes = threshold_bytes
        self._release = release
        self._pools: list[deque[tuple[object, int, Event]]] = [deque() for _ in range(num_streams)]
        self._bytes = [0] * num_streams
        self.released_bytes = 0

    def add(self, stream: int, tensor, event: Event, nbytes: int | None = None) -> None:
        n = _nbytes(tensor) if nbytes is None else int(nbytes)
        self._pools[stream].append((tensor, n, event))
        self._bytes[stream] += n
        if self._bytes[stream] > self.threshold_bytes:
            self.collect(stream)

    def collect(self, stream: int | None = None) -> int:
        """Releases every entry whose event is done (on one stream, or all); returns bytes freed."""
        freed = 0
        for s in range(len(self._pools)) if stream is None else (stream,):
            kept: deque = deque()
            for tensor, n, ev in self._pools[s]:
                if ev.done():
                    if self._release is not None:
                        self._release(tensor)
                    freed += n
                else:
                    kept.append((tensor, n, ev))
            self._pools[s] = kept
            self._bytes[s] = sum(n for _, n, _ in kept)
        self.released_bytes += freed
        return freed

    def pending_bytes(self, stream: int | None = None) -> int:
        return sum(self._bytes) if stream is None else self._bytes[stream]

    def __len__(self) -> int:
        return sum(len(p) for p in self._pools)


# ---- running a DAG of units to completion ---------------------------------------------------
def _tensors(obj) -> list:
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors(x)]
    return []


class UnitRunner:
    """Runs a DAG of units to completion (a fresh MultiStreamScheduler per call, so nothing grows
    between calls). The tensors a unit returns go to the pool of the stream it ran on, with the
    event recorded after it, as soon as it is launched: they stay referenced until that event is
    done, whatever the caller drops meanwhile."""

    def __init__(self, backend: StreamBackend, pool: StreamTensorPool | None = None, policy: str = "depvalue"):
        self.backend = backend
        self.pool = pool
        self.policy = policy

    def run(self, units: Sequence[WorkUnit]) -> dict[str, object]:
        def keep(name: str, stream: int, ev: Event) -> None:
            if self.pool is not None:
                for t in _tensors(ev.result):
                    self.pool.add(stream, t, ev)

        ms = MultiStreamScheduler(self.backend, self.policy, on_launch=keep)
        ms.submit(units)
        ms.run_until_idle()
        return {name: ev.result for name, ev in ms.events.items()}
