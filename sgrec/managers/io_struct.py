"""Messages between the tokenizer manager and the schedulers, and their one codec.

Every message is a small dataclass encoded as orjson: {"type": ClassName, **fields}. Decoding
only ever builds the dataclasses registered here (never unpickles anything from a socket) and
rejects anything else with a ValueError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: dict  # validated SamplingParams fields
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    extra_key: str | None = None
    # prefill-only requests (max_new_tokens 0): keep KV for this many leading tokens (the part worth
    # caching, e.g. a score request's query); None = as much of the prompt as fits
    cache_prefix_len: int | None = None
    # prefill-only requests: token_ids_logprob's logprobs normalised over those ids only, from their
    # logits alone (the output layer's rows of those ids); what a softmax over the labels needs
    # (score with apply_softmax), at len(token_ids_logprob) / vocabulary of the output layer's cost
    label_columns_only: bool = False


@dataclass
class TaskReq:
    """A rank or retrieve request: run to completion in one scheduler step by its executor."""

    rid: str
    kind: str  # "rank" | "retrieve"
    input_ids: list[int]  # the user's tokens (the prompt's start)
    payload: dict  # the executor's keyword arguments (JSON-able)


@dataclass
class ReqOutput:
    """What changed for one request since its previous ReqOutput (deltas for lists)."""

    rid: str
    new_output_ids: list[int]
    finish_reason: dict | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    # logprob deltas: [logprob|None, token_id] pairs, or rows of such pairs (None rows allowed)
    input_token_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_ids_logprobs: list = field(default_factory=list)
    output_token_ids_logprobs: list = field(default_factory=list)
    result: dict | None = None  # a finished TaskReq's answer


@dataclass
class BatchReqOutput:
    outputs: list[ReqOutput]


@dataclass
class AbortReq:
    rid: str
    message: str = "Request aborted by the client"


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheResult:
    success: bool
    dp_rank: int = 0


PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class PauseReq:
    """/pause_generation (mode: one of PAUSE_MODES) or /continue_generation (mode None): while
    paused a scheduler takes requests and control messages but runs no batch."""

    mode: str | None


@dataclass
class PauseResult:
    dp_rank: int
    paused: bool


@dataclass
class SchedulerStats:
    """Periodic load report of one scheduler (DP rank)."""

    dp_rank: int
    num_running_reqs: int
    num_queue_reqs: int
    token_usage: float  # used KV slots / pool size, cached tokens included
    kv_used: int
    kv_total: int
    kv_cached: int
    last_gen_throughput: float
    forward_threads: int = 1  # the threads of its forward now (fewer while catalog updates arrive)
    hicache: dict | None = None  # the lower tiers' counters (radix/hicache.py HiCache.stats), None without them


@dataclass
class SchedulerReady:
    dp_rank: int
    max_total_num_tokens: int
    context_len: int
    vocab_size: int
    max_input_len: int
    catalog: dict | None = None  # the catalog's facts (GET /v1/catalog), None without one
    sizes: dict | None = None  # the server arguments sized by the device (ServerArgs.sized_for)
    encoder: bool = False  # an encoder-decoder model (managers.generate.Limits')


@dataclass
class CatalogTraffic:
    """An update request reached the front (before its body is validated): the ranks' forwards leave
    a thread to update work for a while (--catalog-update-cores)."""


@dataclass
class CatalogUpdateReq:
    """Phase one of a catalog update: build the next version (a journal record) off the step."""

    uid: str
    record: dict


@dataclass
class CatalogCommitReq:
    """Phase two: serve the prepared version from the next step on (commit), or drop it."""

    uid: str
    commit: bool = True


@dataclass
class CatalogReply:
    uid: str
    dp_rank: int
    stage: str  # "prepared" | "committed" | "failed"
    status_code: int = 200
    message: str = ""
    info: dict | None = None  # prepared: the update's counts; committed: the catalog's facts


QUEUE_FULL = "The request queue is full."  # the 503 message of --max-queued-requests (SGLang's)


def abort_reason(message: str, status_code: int) -> dict:
    """The finish_reason of a request that ended with an error (SGLang's shape)."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        TokenizedGenerateReq, TaskReq, ReqOutput, BatchReqOutput, AbortReq, FlushCacheReq, FlushCacheResult,
        PauseReq, PauseResult, SchedulerStats, SchedulerReady, CatalogTraffic, CatalogUpdateReq, CatalogCommitReq, CatalogReply,
    )
}


def encode(msg: Any) -> bytes:
    """orjson serializes nested dataclasses itself: no deep copy (dataclasses.asdict) of big payloads."""
    return orjson.dumps({"type": type(msg).__name__, **{f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}})


_CHECKS = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "list[int]": lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
    "None": lambda v: v is None,
}


def _build(cls: type, obj: Any) -> Any:
    """cls(**obj) with every field of the JSON type its annotation names (a message from a buggy or
    hostile peer is rejected here, not deep inside the scheduler)."""
    if not isinstance(obj, dict):
        raise ValueError(f"malformed {cls.__name__} message: not an object")
    for f in dataclasses.fields(cls):
        if f.name in obj and f.type != "list[ReqOutput]":
            if not any(_CHECKS[t.strip()](obj[f.name]) for t in f.type.split("|")):
                raise ValueError(f"malformed {cls.__name__} message: field {f.name!r} is not {f.type}")
    try:
        return cls(**obj)
    except TypeError as e:
        raise ValueError(f"malformed {cls.__name__} message: {e}") from None


def decode(data: bytes) -> Any:
    """The message in `data`; ValueError for anything but a well-typed registered message."""
    obj = orjson.loads(data)
    if not isinstance(obj, dict) or obj.get("type") not in _TYPES:
        raise ValueError("malformed message: no known 'type'")
    cls = _TYPES[obj.pop("type")]
    if cls is BatchReqOutput:
        outs = obj.get("outputs")
        if not isinstance(outs, list) or set(obj) != {"outputs"}:
            raise ValueError("malformed BatchReqOutput message: needs a list of outputs")
        return BatchReqOutput([_build(ReqOutput, o) for o in outs])
    return _build(cls, obj)
