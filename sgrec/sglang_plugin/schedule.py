"""`--schedule-policy srjf` inside SGLang: PrefillOnly's shortest-remaining-job-first with continuous
JCT calibration, ordered by sgrec's own policy (`sgrec.policy.prefill_only.order_prefill_only`).

SGLang has no registry of schedule policies, so three hooks:

  ServerArgs.add_cli_args                    after: `srjf` becomes a choice of --schedule-policy
  SchedulePolicy._validate_and_adjust_policy around: "srjf" gives the policy an `SrjfOrder` and
                                             SGLang's cache-aware slot SHORTEST_PREFILL_FIRST (so
                                             the scheduler treats the queue as prefix-matched and
                                             keeps chunks short for shorter waiting requests)
  SchedulePolicy.calc_priority               around: for an srjf policy, re-match every waiting
                                             request against the radix tree (SGLang's own
                                             `_compute_prefix_matches`: the calibration) and sort
                                             the queue by sgrec's SRJF rank

A job is a request's prefill: n_input = prompt + already generated tokens, cached = the prefix the
tree holds now, jct = uncached tokens (PrefillOnly's proxy), minus `fairness` x seconds queued
(SGREC_JCT_FAIRNESS, default 500 as sgrec's --jct-fairness). Requests that SGLang's in-batch prefix
check defers (they share a new prefix with an earlier waiting request) go after the rest, each part
in SRJF order.
"""

from __future__ import annotations

import os
import time

from sgrec.policy.prefill_only import jct_uncached_tokens, order_prefill_only

NAME = "srjf"
SCHEDULE_POLICY = "sglang.srt.managers.schedule_policy.SchedulePolicy"
FAIRNESS_ENV = "SGREC_JCT_FAIRNESS"
DEFAULT_FAIRNESS = 500.0


class _Job:
    __slots__ = ("arrival", "n_input", "cached_on_arrival", "cached")

    def __init__(self, req) -> None:
        self.arrival = req.time_stats.wait_queue_entry_time
        self.n_input = len(req.origin_input_ids) + len(req.output_ids)
        self.cached = min(req.num_matched_prefix_tokens, self.n_input)
        self.cached_on_arrival = self.cached


def fairness_from_env() -> float:
    raw = os.environ.get(FAIRNESS_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_FAIRNESS
    except ValueError:
        raise ValueError(f"{FAIRNESS_ENV} must be a number, got {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"{FAIRNESS_ENV} must be non-negative, got {raw!r}")
    return value


class SrjfOrder:
    """Sorts SGLang's waiting queue (Req objects whose prefix was just matched) by SRJF."""

    def __init__(self, fairness: float | None = None, clock=time.perf_counter) -> None:
        self.fairness = fairness_from_env() if fairness is None else fairness
        self.clock = clock  # the clock of Req.time_stats.wait_queue_entry_time

    def sort(self, waiting_queue: list, deferred: set = frozenset()) -> None:
        jobs = [_Job(r) for r in waiting_queue]
        order = order_prefill_only(jobs, NAME, self.clock(), lambda j: j.cached, self.fairness, jct_uncached_tokens)
        ranked = [waiting_queue[i] for i in order]
        waiting_queue[:] = [r for r in ranked if r.rid not in deferred] + [r for r in ranked if r.rid in deferred]


# ---- hooks ------------------------------------------------------------------------------------------
def after_add_cli_args(result, parser):
    for action in parser._actions:
        if action.dest == "schedule_policy" and action.choices is not None and NAME not in action.choices:
            action.choices = [*action.choices, NAME]
            if action.help:
                action.help += f" '{NAME}': sgrec's shortest-remaining-job-first (PrefillOnly)."
    return result


def around_validate_policy(original, policy_obj, policy: str, tree_cache):
    if policy != NAME:
        return original(policy_obj, policy, tree_cache)
    from sglang.srt.managers.schedule_policy import CacheAwarePolicy

    policy_obj.sgrec_srjf = SrjfOrder()
    return CacheAwarePolicy.SHORTEST_PREFILL_FIRST


def around_calc_priority(original, policy_obj, waiting_queue, running_batch=None, processed_tokens=0):
    srjf = getattr(policy_obj, "sgrec_srjf", None)
    if srjf is None:
        return original(policy_obj, waiting_queue, running_batch, processed_tokens)
    deferred = policy_obj._compute_prefix_matches(waiting_queue, policy_obj.policy)
    srjf.sort(waiting_queue, deferred)


HOOKS = [
    ("sglang.srt.server_args.ServerArgs.add_cli_args", after_add_cli_args, "after"),
    (f"{SCHEDULE_POLICY}._validate_and_adjust_policy", around_validate_policy, "around"),
    (f"{SCHEDULE_POLICY}.calc_priority", around_calc_priority, "around"),
]
