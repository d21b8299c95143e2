"""The score request (SGLang 0.5.23's /v1/score and Engine.score, CausalLM pointwise scoring).

Each item becomes one prefill-only prompt: `query + item` (or `item + query` with item_first), as
text tokenized like a normal prompt, or as token ids concatenated with nothing added. The score of
a label is read from the next-token distribution after the whole prompt: exp(logprob), or a
softmax over the labels' logprobs divided by `temperature` with apply_softmax. The shared part
(the query, or the item with item_first) is the prompt's prefix that the radix tree keeps; the
rest of each prompt's KV is discarded (PrefillOnly §5.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sgrec.managers.generate import RequestBuilder, wrong_type_field
from sgrec.managers.io_struct import TokenizedGenerateReq
from sgrec.tokenizer import Tokenizer


@dataclass
class ScoreResult:
    scores: list[list[float]]
    prompt_tokens: int = 0
    pooled_hidden_states: None = None
    token_logprobs: list[list[float]] | None = None


@dataclass
class ScorePlan:
    prompts: list[list[int]]
    prefix_lens: list[int]  # leading tokens of each prompt worth caching
    labels: list[list[int]]
    apply_softmax: bool = False
    temperature: float = 1.0
    return_token_logprobs: bool = False
    rids: list[str] = field(default_factory=list)

    def messages(self, rid_prefix: str) -> list[TokenizedGenerateReq]:
        self.rids = [f"{rid_prefix}_{i}" for i in range(len(self.prompts))]
        return [
            TokenizedGenerateReq(
                rid=rid, input_ids=ids, sampling_params={"max_new_tokens": 0},
                return_logprob=True, logprob_start_len=-1, token_ids_logprob=labels, cache_prefix_len=keep,
                # a softmax over the labels needs their logits only; exp(logprob) and the raw token
                # logprobs need the whole vocabulary's normaliser
                label_columns_only=self.apply_softmax and not self.return_token_logprobs,
            )
            for rid, ids, labels, keep in zip(self.rids, self.prompts, self.labels, self.prefix_lens)
        ]

    def result(self, label_logprobs: list[list[tuple[float, int]]]) -> ScoreResult:
        """label_logprobs[i]: (logprob, token id) pairs of item i's labels (its
        output_token_ids_logprobs[0])."""
        scores, raw = [], []
        for labels, pairs in zip(self.labels, label_logprobs):
            got = {tok: lp for lp, tok in pairs}
            lps = [got.get(t, float("-inf")) for t in labels]
            raw.append(lps)
            scores.append(_to_scores(lps, self.apply_softmax, self.temperature))
        return ScoreResult(
            scores=scores,
            prompt_tokens=sum(len(p) for p in self.prompts),
            token_logprobs=raw if self.return_token_logprobs else None,
        )


def _to_scores(lps: list[float], apply_softmax: bool, temperature: float) -> list[float]:
    if not apply_softmax:
        return [math.exp(x) if x != float("-inf") else 0.0 for x in lps]
    top = max(lps)
    weights = [math.exp((x - top) / temperature) for x in lps]
    total = sum(weights)
    return [w / total for w in weights]


def _is_token_list(x) -> bool:
    return isinstance(x, list) and all(type(t) is int for t in x)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_score(
    tokenizer: Tokenizer,
    vocab_size: int,
    query=None,
    items=None,
    label_token_ids=None,
    apply_softmax: bool = False,
    item_first: bool = False,
    temperature: float = 1.0,
    return_token_logprobs: bool = False,
) -> ScorePlan:
    """Validates a score request (SGLang's rules and messages) and builds its prompts. ValueError
    on bad input. An empty `items` list gives a plan with no prompts."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature <= 0:
        raise ValueError("temperature must be finite and greater than zero")
    if temperature != 1.0 and not apply_softmax:
        raise ValueError("temperature requires apply_softmax=True")
    for name, flag in (("apply_softmax", apply_softmax), ("item_first", item_first),
                       ("return_token_logprobs", return_token_logprobs)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a boolean")
    if label_token_ids is None:
        raise ValueError("label_token_ids is required for generation (CausalLM) models.")
    if items is None:
        raise ValueError("items must be provided")
    item_list = [items] if isinstance(items, str) else items
    text_items = isinstance(item_list, list) and all(isinstance(i, str) for i in item_list)
    id_items = isinstance(item_list, list) and all(_is_token_list(i) for i in item_list)
    if not (text_items or id_items):
        raise ValueError("items must be a string, a list of strings or a list of token-id lists")
    for i, ids in enumerate(item_list if id_items else []):
        _check_ids(ids, vocab_size, f"items[{i}]")
    if query is not None and not isinstance(query, str):
        if not _is_token_list(query):
            raise ValueError("query must be a string, a list of token ids or null")
        _check_ids(query, vocab_size, "query", allow_empty=True)
    # every field is checked before an empty `items` returns: one field's check never depends on another
    labels = _labels(label_token_ids, len(item_list), vocab_size)
    plan = ScorePlan([], [], [], apply_softmax, float(temperature), return_token_logprobs)
    if not item_list:
        return plan
    if query is None:
        query = [] if id_items else ""
    if isinstance(query, str) and text_items:
        q_ids = tokenizer.encode(query) if query else []
        for item in item_list:
            ids = tokenizer.encode(f"{item}{query}" if item_first else f"{query}{item}")
            shared = tokenizer.encode(item) if item_first else q_ids
            plan.prompts.append(ids)
            plan.prefix_lens.append(_common_prefix(shared, ids) if shared else 0)
    elif _is_token_list(query) and id_items:
        for item in item_list:
            plan.prompts.append(list(item) + list(query) if item_first else list(query) + list(item))
            plan.prefix_lens.append(len(item) if item_first else len(query))
    else:
        raise ValueError(
            "Invalid combination of query and items: give a text query with text items, or a token-id "
            "query with token-id items"
        )
    plan.labels = labels
    return plan


SCORE_FIELDS = {
    "query": (str, list, type(None)),
    "items": (str, list, type(None)),
    "label_token_ids": (list, type(None)),
    "apply_softmax": (bool,),
    "item_first": (bool,),
    "temperature": (int, float),
    "return_token_logprobs": (bool,),
    "model": (str, type(None)),
    "routing_key": (str, type(None)),
}
# SGLang fields for other model kinds or modes; accepted only at their defaults
UNSUPPORTED_SCORE_FIELDS = ("return_pooled_hidden_states", "score_extraction_token", "embed_override_token_id",
                            "query_embed_overrides", "item_embed_overrides")


def build_score_request(obj, tokenizer: Tokenizer, builder: RequestBuilder) -> ScorePlan:
    """A /v1/score JSON body -> ScorePlan, every prompt checked against the server's limits."""
    if not isinstance(obj, dict):
        raise ValueError("The request body must be a JSON object")
    if (name := wrong_type_field(obj, SCORE_FIELDS)) is not None:
        raise ValueError(f"{name} has the wrong type ({type(obj[name]).__name__})")
    for name in UNSUPPORTED_SCORE_FIELDS:
        if obj.get(name) not in (None, False):
            raise ValueError(f"{name} is not supported by sgrec (CausalLM pointwise scoring only)")
    plan = build_score(
        tokenizer, builder.limits.vocab_size, obj.get("query"), obj.get("items"), obj.get("label_token_ids"),
        obj.get("apply_softmax", False), obj.get("item_first", False), obj.get("temperature", 1.0),
        obj.get("return_token_logprobs", False),
    )
    check_plan(plan, builder)
    return plan


def check_plan(plan: ScorePlan, builder: RequestBuilder) -> None:
    """The server's limits: --max-batch-size items, each prompt within the context and --max-input-len."""
    if len(plan.prompts) > builder.limits.max_batch_size:
        raise ValueError(f"{len(plan.prompts)} items exceed --max-batch-size {builder.limits.max_batch_size}")
    for ids in plan.prompts:
        builder.check_prompt(ids)


def score_response(result: ScoreResult, model: str) -> dict:
    """SGLang's ScoringResponse body."""
    return {
        "scores": result.scores,
        "pooled_hidden_states": None,
        "token_logprobs": result.token_logprobs,
        "model": model,
        "usage": {
            "prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None,
        },
        "object": "scoring",
    }


def _check_ids(ids: list[int], vocab_size: int, name: str, allow_empty: bool = False) -> None:
    if not ids and not allow_empty:
        raise ValueError(f"{name} must not be an empty token-id list")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{name}: token id {bad} is out of the vocabulary range [0, {vocab_size})")


def _labels(label_token_ids, num_items: int, vocab_size: int) -> list[list[int]]:
    """One label list per item (a shared list repeated). All lists are checked, also with no items."""
    if not isinstance(label_token_ids, list) or not label_token_ids:
        raise ValueError("label_token_ids must be a nonempty list")
    nested = isinstance(label_token_ids[0], list)
    lists = label_token_ids if nested else [label_token_ids]
    for labels in lists:
        if not isinstance(labels, list) or not labels:
            raise ValueError("label_token_ids: each item must have a nonempty candidate list")
        if any(type(t) is not int or t < 0 for t in labels):
            raise ValueError("label_token_ids must contain nonnegative integers")
        if len(set(labels)) != len(labels):
            raise ValueError("label_token_ids must not contain duplicate tokens")
        for t in labels:
            if t >= vocab_size:
                raise ValueError(f"label_token_ids: Token ID {t} is out of vocabulary (vocab size: {vocab_size})")
    if nested and num_items and len(label_token_ids) != num_items:
        raise ValueError("label_token_ids must have one list per item")
    return [list(x) for x in lists] if nested else [list(label_token_ids)] * num_items
