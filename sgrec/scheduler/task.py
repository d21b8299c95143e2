"""Rank and retrieve requests inside the scheduler (xGR §7, RecOS §3).

They never decode: a rank request is one forward, a retrieve request one fixed-step round (prefill
plus one forward per semantic-ID level). `TaskQueue` batches them by kind under a token budget
(`BatchFormer`: dispatched when full or when the oldest request has waited its quota), and runs
each dispatched batch as one work unit of the multi-stream executor (`MultiStreamScheduler`: CUDA
streams on a GPU with --num-streams > 1, else inline on one stream). A batch's unit ends by reading
its results on the host, so the KV slots it frees are never read by a kernel still in flight.
Inside a retrieve batch, with several streams, each beam step's attention stages are units too
(`stage_units`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sgrec.managers.io_struct import ReqOutput, TaskReq, abort_reason
from sgrec.policy.batching import Batch, BatchFormer, batch_former_from_args
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
    """How the scheduler runs one kind: `run_batch(payloads)` -> per payload a result dict or the
    exception it raised; `tokens(payload)`: the request's size in the batch token budget."""

    run_batch: Callable[[list[dict]], list]
    tokens: Callable[[dict], int]


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
        self.batches_run = 0
        self._finished: list[Task] = []  # refused on arrival, reported at the next run
        self.inflight: list[Task] = []  # in a batch being run (an internal error aborts them)

    def __len__(self) -> int:
        return len(self.queued) + len(self._finished)

    def tasks(self) -> list[Task]:
        return [*self.queued.values(), *self._finished, *self.inflight]

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
        out = self.tasks()
        for rid in list(self.queued):
            self.batcher.remove(rid)
        self.queued.clear()
        self._finished, self.inflight = [], []
        return out

    def next_deadline(self) -> float | None:
        """When the next batch falls due: 0 when one is full (or a refused request waits to be
        reported), else when the oldest request of a kind reaches its quota; None: nothing queued."""
        return 0.0 if self._finished or self.batcher.has_full() else self.batcher.next_deadline()

    def run_due(self) -> list[Task]:
        """Runs every batch due now (full, or its oldest request at its quota); returns the tasks
        that finished."""
        done, self._finished = self._finished, []
        batches = self.batcher.poll(self.clock())
        if not batches:
            return done
        units = []
        for b in batches:
            tasks = [self.queued.pop(it.rid) for it in b.items]
            self.inflight += tasks
            cost = UnitCost(self.batcher.exec_s.get(b.kind, 0.0), min(1.0, b.num_tokens / self.batcher.max_batch_tokens))
            units.append(WorkUnit(f"batch{self.batches_run}", cost, group=b.kind, fn=self._unit(b, tasks)))
            self.batches_run += 1
        streams = MultiStreamScheduler(self.backend, policy="depvalue")  # drained here: no state to keep
        streams.submit(units)
        streams.run_until_idle()
        done += self.inflight
        self.inflight = []
        return done

    def _unit(self, batch: Batch, tasks: list[Task]) -> Callable[[], None]:
        def run() -> None:
            t0 = time.perf_counter()
            outcomes = self.kinds[batch.kind].run_batch([t.msg.payload for t in tasks])
            for t, o in zip(tasks, outcomes):
                if isinstance(o, dict):
                    o.setdefault("meta_info", {})["batch_size"] = len(tasks)  # requests run together
                t.finish(o)
            self.batcher.observe(batch.kind, time.perf_counter() - t0)

        return run
