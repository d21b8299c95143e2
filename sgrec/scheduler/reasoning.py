"""Think-then-retrieve: a retrieve or recommend request with `reason` first decodes free text, then
runs its beams after it, in one request.

The reasoning is an ordinary generation request (`Req`, with `reasoning` set): it is admitted,
batched, chunked, retracted and cached as every other, and its tokens are not streamed. It stops at
the marker (the first of its stop_token_ids) or at its budget. Then `then_task` makes the request's
task: the retrieve prompt becomes the user's tokens, the reasoning and the marker (appended when
the reasoning did not end with it), whose KV the radix tree holds from the generation but for the
last tokens; with `also_without`, the task also runs the user's tokens and the marker alone. The
task runs in the retrieve (or recommend) batches, on the catalog version current then, and
`run_with_reasoning` reports the reasoning in `meta_info.reasoning` (`text`, `token_ids`,
`finish_reason`, `marker_appended`) and the beams without it in `items_without_reasoning`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

from sgrec.managers.io_struct import TaskReq


@dataclass
class Reasoning:
    """What a reasoning request does once it finishes: the task it turns into."""

    msg: TaskReq
    marker: int
    also_without: bool


def prompt_of(kind: str, payload: dict) -> list[int]:
    """The retrieve prompt of a retrieve or recommend payload."""
    return payload["input_ids"] if kind == "retrieve" else payload["retrieve"]["input_ids"]


def with_prompt(kind: str, payload: dict, ids: list[int]) -> dict:
    """The payload with its retrieve prompt replaced (a copy; the rest shared)."""
    if kind == "retrieve":
        return {**payload, "input_ids": ids}
    return {**payload, "retrieve": {**payload["retrieve"], "input_ids": ids}}


def then_task(r: Reasoning, output_ids: list[int], finish_reason: dict) -> TaskReq:
    """The task after a finished reasoning: its prompt extended by the reasoning and the marker."""
    msg = r.msg
    appended = not output_ids or output_ids[-1] != r.marker
    prompt = list(prompt_of(msg.kind, msg.payload))
    payload = with_prompt(msg.kind, {k: v for k, v in msg.payload.items() if k != "reason"},
                          prompt + list(output_ids) + ([r.marker] if appended else []))
    payload["reasoning"] = {"token_ids": list(output_ids), "finish_reason": finish_reason, "marker_appended": appended}
    if r.also_without:
        payload["without_ids"] = prompt + [r.marker]
    return TaskReq(rid=msg.rid, kind=msg.kind, input_ids=msg.input_ids, payload=payload)


def run_with_reasoning(kind: str, run_steps: Callable[[list[dict]], Generator], payloads: list[dict],
                       decode: Callable[[list[int]], str]) -> Generator:
    """run_steps (a kind's phases, see TaskKind) over the payloads as their executor takes them,
    each reasoning's answer completed: meta_info.reasoning, and items_without_reasoning from its
    `without_ids` run in the same batch. A generator of the same phases."""
    plain = [{k: v for k, v in p.items() if k not in ("reasoning", "without_ids")} for p in payloads]
    extra = {}
    for i, p in enumerate(payloads):
        if "without_ids" in p:
            extra[i] = len(plain)
            plain.append(with_prompt(kind, plain[i], p["without_ids"]))
    results = yield from run_steps(plain)
    out = results[: len(payloads)]
    for i, p in enumerate(payloads):
        if "reasoning" not in p or isinstance(out[i], Exception):
            continue
        if i in extra:
            alone = results[extra[i]]
            if isinstance(alone, Exception):
                out[i] = alone
                continue
            out[i]["items_without_reasoning"] = alone["items"]
        rs = p["reasoning"]
        ids = rs["token_ids"] if rs["marker_appended"] else rs["token_ids"][:-1]  # the text stops before the marker
        out[i]["meta_info"]["reasoning"] = {"text": decode(ids), **rs}
    return out
