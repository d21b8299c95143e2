"""Validation and tokenization of rank and retrieve requests (shared by the server and Engine).

Both name a user: `{"id": "u42", "text": "..." | "token_ids": [...]}`. The user's text is
tokenized like a prompt (special tokens added: it starts the sequence); instruction text is
tokenized without them. Item ids are checked against the catalog by the scheduler's executor.
"""

from __future__ import annotations

import contextlib
import uuid
import zlib

from sgrec.catalog.item import check_token_ids, plain_token_ids
from sgrec.managers.generate import RequestBuilder, is_int
from sgrec.managers.io_struct import TaskReq
from sgrec.sampling import SamplingParams
from sgrec.tokenizer import Tokenizer

DEFAULT_INSTRUCTION = "\nNext item:"
RANK_FIELDS = {"user", "items", "instruction", "prefix", "top_k", "score_by", "rid", "routing_key", "model"}
SCORE_BY = ("auto", "id_token", "semantic_id")  # how rank scores candidates (sgrec.rank.semantic)


def parse_user(user, tokenizer: Tokenizer, builder: RequestBuilder) -> tuple[str, list[int]]:
    """(user key, user token ids) of a request's `user` object."""
    if not isinstance(user, dict):
        raise ValueError("user must be an object: {\"id\": ..., \"text\" | \"token_ids\": ...}")
    unknown = set(user) - {"id", "text", "token_ids"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join('user.' + k for k in sorted(unknown))}")
    if ("text" in user) == ("token_ids" in user):
        raise ValueError("user needs exactly one of user.text and user.token_ids")
    if "text" in user:
        if not isinstance(user["text"], str) or not user["text"]:
            raise ValueError("user.text must be a non-empty string")
        ids = tokenizer.encode(user["text"])
    else:
        ids = user["token_ids"]
        vocab = builder.limits.vocab_size
        if not (isinstance(ids, list) and plain_token_ids(ids, vocab)):  # else the exact checks, token by token
            if not isinstance(ids, list) or not ids or not all(is_int(t) for t in ids):
                raise ValueError("user.token_ids must be a non-empty list of token ids")
            if not all(0 <= t < vocab for t in ids):
                raise ValueError(f"user.token_ids must be token ids in [0, {vocab})")
    builder.check_prompt(ids)
    key = user.get("id")
    if key is None:
        key = f"anon-{zlib.crc32(repr(ids).encode()):08x}"
    if not isinstance(key, str) or not key:
        raise ValueError("user.id must be a non-empty string")
    return key, list(ids)


def _check_body(obj, fields: set[str]) -> str:
    """A JSON object with only known fields; returns its request id (given or new)."""
    if not isinstance(obj, dict):
        raise ValueError("The request body must be a JSON object")
    unknown = set(obj) - fields
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    for name in ("rid", "routing_key", "model"):
        if obj.get(name) is not None and not isinstance(obj[name], str):
            raise ValueError(f"{name} must be a string")
    return obj.get("rid") or uuid.uuid4().hex


FILTER_FIELDS = {"exclude_items", "include_items", "filter"}
DEFAULT_MAX_FILTER_ITEMS = 100000


def parse_filters(obj: dict, max_filter_items: int) -> dict:
    """The request's exclude_items / include_items (lists of item ids) and filter (an object of
    attribute predicates, checked against the catalog by the executor), as payload keys."""
    out = {}
    for name in ("exclude_items", "include_items"):
        v = obj.get(name)
        if v is None:
            continue
        if not isinstance(v, list) or not all(isinstance(i, str) for i in v):
            raise ValueError(f"{name} must be a list of item id strings")
        if len(v) > max_filter_items:
            raise ValueError(f"{name}: {len(v)} ids exceed --max-filter-items {max_filter_items}")
        out[name] = v
    spec = obj.get("filter")
    if spec is not None:
        if not isinstance(spec, dict):
            raise ValueError("filter must be an object: {attribute: {op: value}}")
        out["filter"] = spec
    return out


def build_rank_task(obj, tokenizer: Tokenizer, builder: RequestBuilder, max_candidates: int,
                    max_filter_items: int = DEFAULT_MAX_FILTER_ITEMS) -> TaskReq:
    rid = _check_body(obj, RANK_FIELDS | FILTER_FIELDS)
    user_key, user_ids = parse_user(obj.get("user"), tokenizer, builder)
    items = obj.get("items")
    if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
        raise ValueError("items must be a non-empty list of item id strings")
    if len(items) > max_candidates:
        raise ValueError(f"{len(items)} candidate items exceed --max-rank-candidates {max_candidates}")
    instr = obj.get("instruction", DEFAULT_INSTRUCTION)
    if isinstance(instr, str) and instr:
        instr_ids = tokenizer.encode(instr, add_special_tokens=False)
    elif isinstance(instr, list) and instr and all(is_int(t) for t in instr):
        instr_ids = instr
    else:
        raise ValueError("instruction must be a non-empty string or a non-empty list of token ids")
    check_token_ids(instr_ids, "instruction", builder.limits.vocab_size)
    prefix = obj.get("prefix")
    if prefix is not None and prefix not in ("auto", "user", "item", "none", "greedy"):
        raise ValueError(f"prefix must be one of auto, user, item, none, greedy; got {prefix!r}")
    top_k = obj.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    score_by = obj.get("score_by")
    if score_by is not None and (not isinstance(score_by, str) or score_by not in SCORE_BY):
        raise ValueError(f"score_by must be one of {', '.join(SCORE_BY)}; got {score_by!r}")
    payload = {"user_key": user_key, "user_ids": user_ids, "item_ids": items, "instruction_ids": list(instr_ids),
               "prefix": prefix, "top_k": top_k, "score_by": score_by, **parse_filters(obj, max_filter_items)}
    return TaskReq(rid=rid, kind="rank", input_ids=user_ids, payload=payload)


# think-then-retrieve: `reason` {"max_tokens", "until", "also_without", and these sampling fields}
REASON_FIELDS = {"max_tokens", "until", "also_without"}
REASON_SAMPLING = {"temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty", "sampling_seed", "stop", "stop_token_ids", "min_new_tokens", "ignore_eos",
                   "logit_bias"}


def parse_reason(reason, user_ids: list[int], tokenizer: Tokenizer, builder: RequestBuilder) -> dict | None:
    """A retrieve or recommend request's `reason` as its payload: the reasoning's wire sampling
    params (max_new_tokens = max_tokens, the marker first of stop_token_ids), the marker's token id
    and also_without. ValueError naming the field."""
    if reason is None:
        return None
    lim = builder.limits
    if lim.encoder:
        raise ValueError("reason needs a decoder-only model (an encoder-decoder's input is not decoded into)")
    if not isinstance(reason, dict):
        raise ValueError("reason must be an object: {\"max_tokens\": N, \"until\": MARKER, ...sampling fields}")
    unknown = sorted(set(reason) - REASON_FIELDS - REASON_SAMPLING)
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join('reason.' + k for k in unknown)}; a reasoning takes "
                         f"{', '.join(sorted(REASON_FIELDS | REASON_SAMPLING))}")
    missing = [k for k in ("max_tokens", "until") if reason.get(k) is None]
    if missing:
        raise ValueError(f"reason needs {' and '.join('reason.' + k for k in missing)}: "
                         f"{{\"max_tokens\": N, \"until\": MARKER, ...}}")
    max_tokens, until = reason["max_tokens"], reason["until"]
    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"reason.max_tokens must be a positive integer, got {max_tokens!r}")
    room = lim.max_new_tokens(len(user_ids) + 1) - 1  # the retrieve prompt (user, reasoning, marker) below the context
    if max_tokens > room:
        raise ValueError(f"reason.max_tokens ({max_tokens}) exceeds what the user's {len(user_ids)} tokens and the "
                         f"marker leave of the model's context ({lim.context_len} tokens): at most {max(room, 0)}")
    if is_int(until):
        if not 0 <= until < lim.vocab_size:
            raise ValueError(f"reason.until: token id {until} is out of the vocabulary range [0, {lim.vocab_size})")
        marker = until
    elif isinstance(until, str) and until:
        marker = tokenizer.token_id(until)
        if marker is None:
            raise ValueError(f"reason.until {until!r} is not one token of the vocabulary")
    else:
        raise ValueError(f"reason.until must be the marker token: its text or its id, got {until!r}")
    also = reason.get("also_without", False)
    if not isinstance(also, bool):
        raise ValueError(f"reason.also_without must be true or false, got {also!r}")
    sp = SamplingParams.from_dict({**{k: v for k, v in reason.items() if k in REASON_SAMPLING},
                                   "max_new_tokens": max_tokens}, lim.vocab_size, "reason")
    sp.stop_token_ids = [marker, *(t for t in sp.stop_token_ids if t != marker)]
    return {"sampling_params": sp.to_wire(), "marker": marker, "also_without": also}


DEFAULT_BEAM_WIDTH = 128  # capped at --max-beam-width
DEFAULT_NUM_ITEMS = 10  # capped at the beam width
RETRIEVE_FIELDS = {"user", "beam_width", "top_k", "num_items", "reason", "rid", "routing_key", "model"}


def build_retrieve_task(obj, tokenizer: Tokenizer, builder: RequestBuilder, max_beam_width: int,
                        max_filter_items: int = DEFAULT_MAX_FILTER_ITEMS) -> TaskReq:
    rid = _check_body(obj, RETRIEVE_FIELDS | FILTER_FIELDS)
    _, user_ids = parse_user(obj.get("user"), tokenizer, builder)
    beam_width = obj.get("beam_width", min(DEFAULT_BEAM_WIDTH, max_beam_width))
    top_k = obj.get("top_k", beam_width)
    num_items = obj.get("num_items", min(DEFAULT_NUM_ITEMS, beam_width) if is_int(beam_width) else DEFAULT_NUM_ITEMS)
    for name, v in (("beam_width", beam_width), ("top_k", top_k), ("num_items", num_items)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if beam_width > max_beam_width:
        raise ValueError(f"beam_width {beam_width} exceeds --max-beam-width {max_beam_width}")
    if num_items > beam_width:
        raise ValueError(f"num_items ({num_items}) must not exceed beam_width ({beam_width})")
    payload = {"input_ids": user_ids, "beam_width": beam_width, "top_k": top_k, "num_items": num_items,
               **parse_filters(obj, max_filter_items)}
    reason = parse_reason(obj.get("reason"), user_ids, tokenizer, builder)
    if reason is not None:
        payload["reason"] = reason
    return TaskReq(rid=rid, kind="retrieve", input_ids=user_ids, payload=payload)


BEAM_SAMPLING_KEYS = {"beam_width", "n", "max_new_tokens"}
# the /generate fields the catalog beam form reads; any other field is a 400, not silently ignored
BEAM_FIELDS = {"text", "input_ids", "sampling_params", "rid", "routing_key", "constrain_to_catalog", "stream",
               "return_logprob", "exclude_items", "include_items", "filter"}


def is_beam_generate(obj) -> bool:
    """A native /generate asking for beam search (sampling_params.beam_width > 1)."""
    sp = obj.get("sampling_params") if isinstance(obj, dict) else None
    return isinstance(sp, dict) and sp.get("beam_width") not in (None, 0, 1)


def check_no_filters(obj: dict) -> None:
    """A /generate that is not the catalog beam form must not carry item filters (they would do nothing)."""
    for name in sorted(FILTER_FIELDS):
        if obj.get(name) is not None:
            raise ValueError(f"{name} works only with catalog beam search: sampling_params with "
                             "sampling_params.beam_width above 1, and \"constrain_to_catalog\": true")


def build_beam_generate_task(obj, tokenizer: Tokenizer, builder: RequestBuilder, max_beam_width: int,
                             max_filter_items: int = DEFAULT_MAX_FILTER_ITEMS) -> TaskReq:
    """SGLang's native beam form, constrained to the catalog's semantic-ID paths: one prompt,
    `n` (default 1) best paths out of `beam_width` beams; exclude_items / include_items / filter
    as on /v1/retrieve."""
    for name in sorted(set(obj) - BEAM_FIELDS):
        raise ValueError(f"`{name}` cannot be used with beam_width (catalog beam search)")
    if obj.get("constrain_to_catalog") is not True:
        raise ValueError("beam search (sampling_params.beam_width) is supported only with "
                         "\"constrain_to_catalog\": true: beams over the catalog's semantic-ID paths")
    sp = obj["sampling_params"]
    unknown = set(sp) - BEAM_SAMPLING_KEYS
    if unknown:
        raise ValueError(f"{', '.join('sampling_params.' + k for k in sorted(unknown))} cannot be used with "
                         "beam_width")
    mnt = sp.get("max_new_tokens", 0)
    if not is_int(mnt) or mnt < 0:
        raise ValueError(f"sampling_params.max_new_tokens must be a non-negative integer, got {mnt!r}")
    rid = obj.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise ValueError("rid must be a non-empty string (one prompt with beam_width)")
    for name in ("stream", "return_logprob"):
        if obj.get(name, False) is not False:
            raise ValueError(f"beam search does not support {name} (it must be false), got {obj[name]!r}")
    if obj.get("routing_key") is not None and not isinstance(obj["routing_key"], str):
        raise ValueError("routing_key must be a string")
    text, ids = obj.get("text"), obj.get("input_ids")
    if (text is None) == (ids is None):
        raise ValueError("give exactly one of text and input_ids (one prompt) with beam_width")
    user = {"text": text} if text is not None else {"token_ids": ids}
    beam_width, n = sp["beam_width"], sp.get("n", 1)
    if not is_int(n) or n < 1:
        raise ValueError(f"sampling_params.n must be a positive integer, got {n!r}")
    filters = {k: obj[k] for k in FILTER_FIELDS if obj.get(k) is not None}
    # the retrieve builder's errors, with its fields named as this body names them
    with _renamed({"user.text": "text", "user.token_ids": "input_ids", "beam_width": "sampling_params.beam_width",
                   "top_k": "sampling_params.beam_width", "num_items": "sampling_params.n"}):
        return build_retrieve_task({"user": user, "beam_width": beam_width, "top_k": beam_width, "num_items": n,
                                    "rid": obj.get("rid"), **filters}, tokenizer, builder, max_beam_width,
                                   max_filter_items)


RECOMMEND_FIELDS = {"user", "retrieve", "rank", "top_k", "reason", "rid", "routing_key", "model"}
RECOMMEND_RETRIEVE = {"beam_width", "num_candidates", "top_k"}
RECOMMEND_RANK = {"instruction", "prefix", "score_by"}
DEFAULT_NUM_CANDIDATES = 50  # capped at the beam width and --max-rank-candidates


def _stage(obj: dict, name: str, fields: set[str]) -> dict:
    stage = obj.get(name)
    if stage is None:
        return {}
    if not isinstance(stage, dict):
        raise ValueError(f"{name} must be an object with {', '.join(sorted(fields))}")
    unknown = set(stage) - fields
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(f'{name}.{k}' for k in sorted(unknown))}")
    return stage


@contextlib.contextmanager
def _renamed(names: dict[str, str]):
    """A builder's ValueError with the field it starts with (`beam_width must ...`, `user.text must
    ...`) named as the calling body names it: its full path there."""
    try:
        yield
    except ValueError as e:
        msg = str(e)
        field = max((f for f in names if msg.startswith((f + " ", f + ".", f + ":"))), key=len, default=None)
        if field is not None:
            msg = names[field] + msg[len(field):]
        raise ValueError(msg) from None


def _in_stage(stage: str, fields: set[str]):
    """A stage builder's ValueError with its field named as the recommend body names it."""
    return _renamed({f: f"{stage}.{'num_candidates' if f == 'num_items' else f}" for f in fields})


def build_recommend_task(obj, tokenizer: Tokenizer, builder: RequestBuilder, max_beam_width: int,
                         max_candidates: int, max_filter_items: int = DEFAULT_MAX_FILTER_ITEMS) -> TaskReq:
    """/v1/recommend: candidates by retrieve (xBeam, with the request's filters), ranked by rank
    (bipartite attention), in one task. The user is tokenized once; each stage's payload is what
    its own route would send, so the answer equals the two calls."""
    rid = _check_body(obj, RECOMMEND_FIELDS | FILTER_FIELDS)
    ret, rk = _stage(obj, "retrieve", RECOMMEND_RETRIEVE), _stage(obj, "rank", RECOMMEND_RANK)
    user_key, user_ids = parse_user(obj.get("user"), tokenizer, builder)
    user = {"id": user_key, "token_ids": user_ids}  # tokenized: the stages reuse the ids
    beam_width = ret.get("beam_width", min(DEFAULT_BEAM_WIDTH, max_beam_width))
    n = ret.get("num_candidates", min(DEFAULT_NUM_CANDIDATES, max_candidates,
                                      beam_width if is_int(beam_width) else DEFAULT_NUM_CANDIDATES))
    if is_int(n) and n > max_candidates:
        raise ValueError(f"retrieve.num_candidates {n} exceeds --max-rank-candidates {max_candidates}")
    retrieve_obj = {"user": user, "num_items": n, **{k: v for k, v in ret.items() if k != "num_candidates"},
                    **{k: obj[k] for k in FILTER_FIELDS if k in obj}}
    with _in_stage("retrieve", {"beam_width", "top_k", "num_items"}):
        retrieve = build_retrieve_task(retrieve_obj, tokenizer, builder, max_beam_width, max_filter_items)
    with _in_stage("rank", RECOMMEND_RANK):
        rank = build_rank_task({"user": user, "items": ["-"], "top_k": obj.get("top_k"), **rk},
                               tokenizer, builder, max_candidates, max_filter_items)
    rank.payload.pop("item_ids")  # filled with the retrieved candidates when the task runs
    payload = {"retrieve": retrieve.payload, "rank": rank.payload}
    reason = parse_reason(obj.get("reason"), user_ids, tokenizer, builder)
    if reason is not None:
        payload["reason"] = reason
    return TaskReq(rid=rid, kind="recommend", input_ids=user_ids, payload=payload)


def beam_generate_response(state, tokenizer: Tokenizer) -> dict:
    """SGLang's /generate beam response: the best path on top, every path in meta_info.beam_results."""
    beams = []
    for x in state.result["items"]:
        nd = len(x["semantic_id"])
        beams.append({"text": tokenizer.decode(x["semantic_id"]), "output_ids": x["semantic_id"],
                      "meta_info": {"finish_reason": {"type": "length", "length": nd},
                                    "sequence_score": x["score"] / nd, "item": x["item"]}})
    meta = task_response(state)["meta_info"]
    # no path at all (the filters allow no item): an empty generation that stopped at once
    top = beams[0] if beams else {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "stop"}}}
    return {"text": top["text"], "output_ids": top["output_ids"], "meta_info": {
        "id": state.msg.rid, "finish_reason": top["meta_info"]["finish_reason"],
        "prompt_tokens": len(state.msg.input_ids), "completion_tokens": sum(len(b["output_ids"]) for b in beams),
        "cached_tokens": meta.get("cached_tokens", 0), "e2e_latency": meta.get("e2e_latency"),
        "beam_results": beams,
    }}


def task_response(state) -> dict:
    """The HTTP/Engine body of a finished task: the executor's result plus request facts."""
    out = dict(state.result or {})
    meta = dict(out.get("meta_info") or {})
    meta["id"] = state.msg.rid
    if state.finish_time is not None:
        meta["e2e_latency"] = state.finish_time - state.created
    out["meta_info"] = meta
    return out
