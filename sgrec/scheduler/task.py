"""Rank and retrieve requests inside the scheduler: queued, then run to completion in one step by
their executor (they compute one forward per request or a fixed number of beam steps, never decode)."""

from __future__ import annotations

from dataclasses import dataclass

from sgrec.managers.io_struct import ReqOutput, TaskReq, abort_reason


@dataclass
class Task:
    msg: TaskReq
    finish_reason: dict | None = None
    result: dict | None = None
    last_node: object = None  # holds no KV between steps (the scheduler's release path skips it)
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


def run_task(task: Task, executors: dict) -> None:
    """Runs the task's executor; bad input (ValueError) is a 400, a full KV pool (RuntimeError) a 503."""
    executor = executors.get(task.msg.kind)
    if executor is None:
        need = {"rank": "an item catalog (--item-catalog)",
                "retrieve": "an item catalog (--item-catalog) whose items carry semantic_id"}
        task.finish_reason = abort_reason(f"{task.msg.kind} requests need {need.get(task.msg.kind, 'a known kind')}",
                                          400)
        return
    try:
        task.result = executor(**task.msg.payload)
    except ValueError as e:
        task.finish_reason = abort_reason(str(e), 400)
        return
    except RuntimeError as e:
        task.finish_reason = abort_reason(str(e), 503)
        return
    meta = task.result.get("meta_info", {})
    task.cached_tokens = int(meta.get("cached_tokens", 0))
    task.finish_reason = {"type": "stop", "matched": None}
