"""Rank and retrieve requests inside the scheduler (xGR §7, RecOS §3).

They never decode: a rank request is one forward, a retrieve request one fixed-step round (prefill
plus one forward per semantic-ID level). `TaskQueue` batches them by kind under a token budget
(`BatchFormer`: dispatched when full or when the oldest request has waited its quota).

A kind runs a batch as phases (`TaskKind.run_steps`: a generator that yields after each phase and
returns the results; a retrieve batch's phases are its round's prefill and beam levels). By
default each dispatched batch runs whole in the step that dispatched it, as one work unit of the
multi-stream executor (`MultiStreamScheduler`: CUDA streams on a GPU with --num-streams > 1, else
inline on one stream), and the requests that arrive meanwhile form the next batch. With
--interleave-rounds on one stream, the queue keeps the dispatched batches under way and advances
each by one phase per scheduler step, starting the batches that fall due in between: the next
batch's prefill goes while the current batch's beam levels are under way, and a generation step
can run between two phases. (Several streams run batches whole: the beam-step graphs keep one set
of static buffers.) A batch ends by reading its results on the host, so the KV slots it frees are
never read by a kernel still in flight. Inside a retrieve batch, with several streams, each beam
step's attention stages are units too (`stage_units`). A batch runs on one catalog version: `hold`
starts no new batch, so a catalog commit waits only for the batches under way (`in_flight`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

from sgrec.managers.io_struct import ReqOutput, TaskReq, abort_reason
from sgrec.policy.batching import Batch, BatchFormer, batch_former_from_args, run_to_end
from sgrec.policy.streams import (
    MultiStreamScheduler, StreamBackend, UnitCost, UnitRunner, WorkUnit, make_backend, tensor_pool_from_args,
)

NEEDS = {"rank": "an item catalog (--item-catalog)",
         "retrieve": "an item catalog (--item-catalog) whose items carry semantic_id",
         "recommend": "an item catalog (--item-catalog) whose items carry semantic_id"}


@dataclass
class Task:
    msg: TaskReq
    finish_reason: dict | None = None
    result: dict | None = None
    last_node: object = None  # holds no KV between steps (the scheduler's release path skips it)
    state_slot: object = None  # nor a state
    cached_tokens: int = 0

    @property
    def rid(self) -> str:
        return self.msg.rid

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def make_output(self) -> ReqOutput:
        return ReqOutput(rid=self.rid, new_output_ids=[], finish_reason=self.finish_reason,
                         prompt_tokens=len(self.msg.input_ids), cached_tokens=self.cached_tokens, result=self.result)

    def finish(self, outcome: dict | Exception) -> None:
        """A result dict, or the error the executor gave: ValueError (bad input) is a 400,
        RuntimeError (no room in the KV pool) a 503."""
        if isinstance(outcome, ValueError):
            self.finish_reason = abort_reason(str(outcome), 400)
        elif isinstance(outcome, RuntimeError):
            self.finish_reason = abort_reason(str(outcome), 503)
        elif isinstance(outcome, Exception):
            raise outcome
        else:
            self.result = outcome
            self.cached_tokens = int(outcome.get("meta_info", {}).get("cached_tokens", 0))
            self.finish_reason = {"type": "stop", "matched": None}


@dataclass
class TaskKind:
    """How the scheduler runs one kind: `run_steps(payloads)` -> a generator that yields after each
    phase and returns, per payload, a result dict or the exception it raised (`at_once` makes one
    of a function that runs the batch in one go); `tokens(payload)`: the request's size in the
    batch token budget."""

    run_steps: Callable[[list[dict]], Generator]
    tokens: Callable[[dict], int]


def at_once(run_batch: Callable[[list[dict]], list]) -> Callable[[list[dict]], Generator]:
    """A kind's run_steps for a batch run in one phase."""
    def steps(payloads: list[dict]) -> Generator:
        yield from ()
        return run_batch(payloads)

    return steps


@dataclass
class _Running:
    """A dispatched batch under way: its tasks, its phases, and the time spent in them."""

    batch: Batch
    tasks: list[Task]
    steps: Generator
    busy_s: float = 0.0


def stream_backend(args, device) -> StreamBackend:
    """CUDA streams on a GPU when --num-streams > 1, else the inline executor (one stream)."""
    if str(device).startswith("cuda") and args.num_streams > 1:
        return make_backend("cuda", args.num_streams)
    return make_backend("inline")


def stage_units(args, backend: StreamBackend) -> UnitRunner | None:
    """With several streams, a batched beam step's attention stages run as work units on them (their
    partial results held in --stream-pool-mb pools until their events are done); on one stream the
    stages run in place (the same operations, without the units' bookkeeping)."""
    if backend.num_streams < 2:
        return None
    return UnitRunner(backend, tensor_pool_from_args(args, backend.num_streams))


class TaskQueue:
    def __init__(self, args, kinds: dict[str, TaskKind], backend: StreamBackend,
                 clock: Callable[[], float] = time.monotonic):
        self.kinds = kinds
        self.batcher: BatchFormer = batch_former_from_args(args)
        self.clock = clock
        self.backend = backend
        self.queued: dict[str, Task] = {}  # rid -> task waiting in the batcher
        self.batches_run = 0  # batches dispatched
        self._finished: list[Task] = []  # refused on arrival, reported at the next run
        self.running: list[_Running] = []  # batches under way, oldest first (an internal error aborts them)
        self.hold = False  # start no new batch (a catalog commit waits for the ones under way)
        # a phase per step (--interleave-rounds, one stream), else each batch whole in its step
        self.phases = args.interleave_rounds and backend.num_streams == 1

    def __len__(self) -> int:
        """Tasks not started yet (queued, or refused and not yet reported)."""
        return len(self.queued) + len(self._finished)

    @property
    def in_flight(self) -> bool:
        """A batch is under way: it has run a phase and not yet its last."""
        return bool(self.running)

    def num_running(self) -> int:
        return sum(len(r.tasks) for r in self.running)

    def tasks(self) -> list[Task]:
        return [*self.queued.values(), *self._finished, *(t for r in self.running for t in r.tasks)]

    def add(self, msg: TaskReq, task: Task | None = None) -> Task:
        """Queues msg as `task` (a new Task by default)."""
        task = Task(msg) if task is None else task
        kind = self.kinds.get(msg.kind)
        if kind is None:
            task.finish_reason = abort_reason(f"{msg.kind} requests need {NEEDS.get(msg.kind, 'a known kind')}", 400)
            self._finished.append(task)
            return task
        try:
            n = kind.tokens(msg.payload)
        except (KeyError, TypeError, ValueError) as e:
            task.finish(ValueError(f"Invalid {msg.kind} request: {e}"))
            self._finished.append(task)
            return task
        # a request larger than the budget is dispatched alone (a batch of one)
        self.batcher.add(msg.rid, msg.kind, max(1, min(n, self.batcher.max_batch_tokens)), self.clock())
        self.queued[msg.rid] = task
        return task

    def remove(self, rid: str) -> Task | None:
        task = self.queued.pop(rid, None)
        if task is not None:
            self.batcher.remove(rid)
        return task

    def clear(self) -> list[Task]:
        """Every task, queued or under way, taken out; the batches under way are closed (their rounds
        release what they hold)."""
        out = self.tasks()
        for rid in list(self.queued):
            self.batcher.remove(rid)
        for r in self.running:
            r.steps.close()
        self.queued.clear()
        self._finished, self.running = [], []
        return out

    def next_deadline(self) -> float | None:
        """When the queue next has work: 0 when a batch is under way or one is full (or a refused
        request waits to be reported), else when the oldest request of a kind reaches its quota;
        None: nothing queued."""
        if self._finished or self.running or (self.batcher.has_full() and not self.hold):
            return 0.0
        return self.batcher.next_deadline()

    def run_step(self) -> tuple[bool, list[Task]]:
        """Starts the batches due now (full, or their oldest request at its quota; none while
        `hold`), then runs every batch under way by one phase (`phases`), or whole. Returns whether
        it ran anything and the tasks that finished."""
        done, self._finished = self._finished, []
        for b in () if self.hold else self.batcher.poll(self.clock()):
            tasks = [self.queued.pop(it.rid) for it in b.items]
            self.running.append(_Running(b, tasks, self.kinds[b.kind].run_steps([t.msg.payload for t in tasks])))
            self.batches_run += 1
        if not self.running:
            return bool(done), done
        ended = self._run_phase() if self.phases else self._run_whole()
        for r in ended:
            self.running.remove(r)
            done += r.tasks
        return True, done

    def _run_phase(self) -> list[_Running]:
        """One phase of every batch under way, oldest first; returns those that ended."""
        ended = []
        for r in list(self.running):
            t0 = time.perf_counter()
            try:
                next(r.steps)
            except StopIteration as end:
                self._finish(r, end.value, time.perf_counter() - t0)
                ended.append(r)
            else:
                r.busy_s += time.perf_counter() - t0
        return ended

    def _run_whole(self) -> list[_Running]:
        """Every batch under way to its end, each one work unit on the streams (in turn on one)."""
        units = []
        for i, r in enumerate(self.running):
            cost = UnitCost(self.batcher.exec_s.get(r.batch.kind, 0.0),
                            min(1.0, r.batch.num_tokens / self.batcher.max_batch_tokens))
            units.append(WorkUnit(f"batch{i}", cost, group=r.batch.kind, fn=self._whole(r)))
        streams = MultiStreamScheduler(self.backend, policy="depvalue")  # drained here: no state to keep
        streams.submit(units)
        streams.run_until_idle()
        return list(self.running)

    def _whole(self, r: _Running) -> Callable[[], None]:
        def run() -> None:
            t0 = time.perf_counter()
            results = run_to_end(r.steps)
            self._finish(r, results, time.perf_counter() - t0)

        return run

    def _finish(self, r: _Running, outcomes: list, last_s: float) -> None:
        for t, o in zip(r.tasks, outcomes):
            if isinstance(o, dict):
                o.setdefault("meta_info", {})["batch_size"] = len(r.tasks)  # requests run together
            t.finish(o)
        self.batcher.observe(r.batch.kind, r.busy_s + last_s)  # the batch's own phases, not the others' between
