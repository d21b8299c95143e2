"""The server's OpenAPI document (/openapi.json): request-body schemas and error responses.

The handlers read raw JSON and validate it themselves (SGLang's error shapes and messages), so
FastAPI cannot infer their bodies. This module states them: the OpenAI routes reuse the pydantic
models that validate them; the native and recommendation routes get JSON Schemas written from the
same rules the handlers enforce, including the server's limits (--max-n, --max-batch-size,
--max-rank-candidates, --max-beam-width, the vocabulary). Schemathesis fuzzes against this
document (benchmarks/fuzz.py), so a body the schema rejects must be a 4xx and a body it accepts
must never be a 5xx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from sgrec.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from sgrec.managers.io_struct import PAUSE_MODES
from sgrec.managers.rec import REASON_SAMPLING

REF = "#/components/schemas/{model}"
ERROR_STATUSES = {
    "400": "Bad input (schema, range or limit)",
    "413": "Request body larger than --max-request-bytes",
    "503": "Queue full (--max-queued-requests) or the server is shutting down",
}


@dataclass
class SchemaLimits:
    vocab_size: int
    max_n: int
    max_batch_size: int
    max_rank_candidates: int
    max_beam_width: int
    max_filter_items: int = 100000
    semantic_id_codes: bool = False  # --semantic-id-tokens: updates give semantic IDs as codes
    embedding_dim: int | None = None  # --semantic-id-codebooks: their dimension
    context_len: int | None = None  # the model's context (bounds reason.max_tokens)


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _one_or_list(schema: dict, max_items: int | None = None) -> dict:
    many: dict[str, Any] = {"type": "array", "items": schema, "minItems": 1}
    if max_items is not None:
        many["maxItems"] = max_items
    return {"anyOf": [schema, many]}


def _token_ids(lim: SchemaLimits, min_items: int = 1) -> dict:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": lim.vocab_size - 1},
            "minItems": min_items}


def sampling_params_schema(lim: SchemaLimits) -> dict:
    """SamplingParams.from_dict's types and ranges (unknown keys are a 400)."""
    num = {"type": "number"}
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "max_new_tokens": {"type": "integer", "minimum": 0},
            "min_new_tokens": {"type": "integer", "minimum": 0},
            "n": {"type": "integer", "minimum": 1, "maximum": lim.max_n},
            "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1},
                                         {"type": "array", "items": {"type": "string", "minLength": 1},
                                          "maxItems": 32}]}),
            "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                    "maximum": lim.vocab_size - 1}}),
            "temperature": {**num, "minimum": 0},
            "top_p": {**num, "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {"anyOf": [{"type": "integer", "const": -1}, {"type": "integer", "minimum": 1}]},
            "min_p": {**num, "minimum": 0, "maximum": 1},
            "frequency_penalty": {**num, "minimum": -2, "maximum": 2},
            "presence_penalty": {**num, "minimum": -2, "maximum": 2},
            "repetition_penalty": {**num, "exclusiveMinimum": 0, "maximum": 2},
            "ignore_eos": {"type": "boolean"},
            "skip_special_tokens": {"type": "boolean"},
            "spaces_between_special_tokens": {"type": "boolean"},
            "no_stop_trim": {"type": "boolean"},
            "logit_bias": _nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                                     "additionalProperties": num}),
            "sampling_seed": _nullable({"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 64) - 1}),
            "beam_width": {"enum": [None, 0, 1]},  # more: the catalog beam form (BeamGenerateReqInput)
            "stream_interval": _nullable({"type": "integer"}),
            # SGLang's keys sgrec does not implement: accepted only unset
            **{k: {"enum": [None, ""]} for k in ("regex", "json_schema", "ebnf", "structural_tag")},
            "stop_regex": {"anyOf": [{"enum": [None, ""]}, {"type": "array", "maxItems": 0}]},
            "custom_params": _nullable({"type": "object", "maxProperties": 0}),
            "watermark": {"enum": [None, False]},
            "choice": {"type": "null"},
        },
    }


def _exactly_one(a: str, a_schema: dict, b: str, b_schema: dict) -> list[dict]:
    """Exactly one of two optional keys, null counting as absent (the handlers' rule)."""
    return [{"required": [a], "properties": {a: a_schema, b: {"type": "null"}}},
            {"required": [b], "properties": {b: b_schema, a: {"type": "null"}}}]


def generate_schema(lim: SchemaLimits) -> dict:
    """/generate: SGLang's GenerateReqInput, or the catalog beam form (BeamGenerateReqInput)."""
    return {"anyOf": [{"$ref": REF.format(model="PlainGenerateReqInput")},
                      {"$ref": REF.format(model="BeamGenerateReqInput")}]}


def plain_generate_schema(lim: SchemaLimits) -> dict:
    """SGLang's GenerateReqInput as sgrec accepts it (unknown top-level keys are ignored); no item
    filters (they need the beam form)."""
    text = {"type": "string", "minLength": 1}
    ids = _token_ids(lim)
    return {
        "type": "object",
        "anyOf": [{"required": ["text"]}, {"required": ["input_ids"]}],
        "properties": {
            # null is "not given" (as SGLang's Optional fields): the other input is used
            "text": _nullable(_one_or_list(text, lim.max_batch_size)),
            "input_ids": _nullable({"anyOf": [ids, {"type": "array", "items": ids, "minItems": 1,
                                                    "maxItems": lim.max_batch_size}]}),
            "sampling_params": _nullable(_one_or_list({"$ref": "#/components/schemas/SamplingParams"})),
            "return_logprob": _one_or_list({"type": "boolean"}),
            "logprob_start_len": _one_or_list({"type": "integer", "minimum": -1}),
            "top_logprobs_num": _one_or_list({"type": "integer", "minimum": 0}),
            # one list for every prompt, or one per prompt (null: none for that prompt)
            "token_ids_logprob": _nullable({"anyOf": [_token_ids(lim, 0), {"type": "array",
                                                                            "items": _nullable(_token_ids(lim, 0))}]}),
            "return_text_in_logprobs": {"type": "boolean"},
            "stream": {"type": "boolean"},
            "rid": _nullable(_one_or_list({"type": "string", "minLength": 1})),
            "extra_key": _nullable({"type": "string"}),
            "routing_key": _nullable({"type": "string"}),
            "constrain_to_catalog": {"type": "boolean"},
            **{name: {"type": "null"} for name in filter_properties(lim)},
        },
    }


def beam_generate_schema(lim: SchemaLimits) -> dict:
    """The native beam form over the catalog (sgrec.managers.rec.build_beam_generate_task): one
    prompt, sampling_params.beam_width above 1, "constrain_to_catalog": true, the exposure filters."""
    text, ids = {"type": "string", "minLength": 1}, _token_ids(lim)
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["sampling_params", "constrain_to_catalog"],
        "anyOf": _exactly_one("text", text, "input_ids", ids),
        "properties": {
            "text": _nullable(text),
            "input_ids": _nullable(ids),
            "sampling_params": {"type": "object", "additionalProperties": False, "required": ["beam_width"],
                                "properties": {
                                    "beam_width": {"type": "integer", "minimum": 2, "maximum": lim.max_beam_width},
                                    "n": {"type": "integer", "minimum": 1, "maximum": lim.max_beam_width},
                                    "max_new_tokens": {"type": "integer", "minimum": 0}}},
            "constrain_to_catalog": {"const": True},
            "stream": {"const": False},
            "return_logprob": {"const": False},
            "rid": _nullable({"type": "string", "minLength": 1}),
            "routing_key": _nullable({"type": "string"}),
            **filter_properties(lim),
        },
    }


SCALAR = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}
FILTER_SCHEMAS = {
    "ItemFilter": {
        "type": "object",
        "description": "Attribute predicates, all ANDed: {attribute: {op: value}}, a bare value meaning eq; "
                       "an attribute no item has is a 400",
        "additionalProperties": {"anyOf": [{"$ref": "#/components/schemas/ItemPredicate"}, SCALAR]},
    },
    "ItemPredicate": {
        "type": "object",
        "additionalProperties": False,
        "description": "eq (a string list: contains), in / not_in (any / none in common), numeric ranges",
        "properties": {
            "eq": SCALAR,
            "in": {"type": "array", "items": SCALAR},
            "not_in": {"type": "array", "items": SCALAR},
            **{op: {"type": "number"} for op in ("gt", "gte", "lt", "lte")},
        },
    },
}


def filter_properties(lim: SchemaLimits) -> dict:
    """exclude_items / include_items / filter: the exposure filters of rank, retrieve and beam /generate."""
    ids = {"type": "array", "items": {"type": "string"}, "maxItems": lim.max_filter_items}
    return {"exclude_items": _nullable(ids), "include_items": _nullable(ids),
            "filter": _nullable({"$ref": "#/components/schemas/ItemFilter"})}


def score_schema(lim: SchemaLimits) -> dict:
    """SGLang's /v1/score body (CausalLM pointwise scoring)."""
    ids = _token_ids(lim)
    return {
        "type": "object",
        "required": ["items", "label_token_ids"],
        # a temperature other than 1 needs the softmax
        "if": {"required": ["temperature"], "properties": {"temperature": {"type": "number", "not": {"const": 1}}}},
        "then": {"required": ["apply_softmax"], "properties": {"apply_softmax": {"const": True}}},
        "properties": {
            "query": _nullable({"anyOf": [{"type": "string"}, _token_ids(lim, 0)]}),
            "items": {"anyOf": [{"type": "string"},
                                {"type": "array", "items": {"type": "string"}, "maxItems": lim.max_batch_size},
                                {"type": "array", "items": ids, "maxItems": lim.max_batch_size}]},
            "label_token_ids": {"anyOf": [{**ids, "uniqueItems": True},
                                          {"type": "array", "items": {**ids, "uniqueItems": True}, "minItems": 1}]},
            "apply_softmax": {"type": "boolean"},
            "item_first": {"type": "boolean"},
            "temperature": {"type": "number", "exclusiveMinimum": 0},
            "return_token_logprobs": {"type": "boolean"},
            "model": _nullable({"type": "string"}),
            "routing_key": _nullable({"type": "string"}),
        },
    }


def rec_request_fields(lim: SchemaLimits) -> dict:
    """The fields every recommendation request shares: the exposure filters, rid, routing_key, model."""
    return {**filter_properties(lim), "rid": _nullable({"type": "string"}),
            "routing_key": _nullable({"type": "string"}), "model": _nullable({"type": "string"})}


def _user_schema(lim: SchemaLimits) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "oneOf": [{"required": ["text"]}, {"required": ["token_ids"]}],
        "properties": {
            "id": _nullable({"type": "string", "minLength": 1}),  # null or absent: an anonymous user
            "text": {"type": "string", "minLength": 1},
            "token_ids": _token_ids(lim),
        },
    }


def rank_schema(lim: SchemaLimits) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["user", "items"],
        "properties": {
            "user": {"$ref": "#/components/schemas/RecUser"},
            "items": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                      "maxItems": lim.max_rank_candidates, "uniqueItems": True},
            "instruction": {"anyOf": [{"type": "string", "minLength": 1}, _token_ids(lim)]},
            "prefix": _nullable({"type": "string", "enum": ["auto", "user", "item", "none", "greedy"]}),
            "top_k": _nullable({"type": "integer", "minimum": 1}),
            "score_by": _nullable({"type": "string", "enum": ["auto", "id_token", "semantic_id"]}),
            **rec_request_fields(lim),
        },
    }


def reason_schema(lim: SchemaLimits) -> dict:
    """Think-then-retrieve's `reason` (sgrec.managers.rec.parse_reason): decode up to max_tokens,
    stop at the `until` marker, then retrieve after them."""
    sp = sampling_params_schema(lim)["properties"]
    return _nullable({
        "type": "object", "additionalProperties": False, "required": ["max_tokens", "until"],
        "properties": {
            "max_tokens": {"type": "integer", "minimum": 1,
                           **({} if lim.context_len is None else {"maximum": lim.context_len - 2})},
            "until": {"anyOf": [{"type": "string", "minLength": 1},
                                {"type": "integer", "minimum": 0, "maximum": lim.vocab_size - 1}]},
            "also_without": {"type": "boolean"},
            **{name: sp[name] for name in sorted(REASON_SAMPLING)},
        },
    })


def retrieve_schema(lim: SchemaLimits) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["user"],
        "properties": {
            "user": {"$ref": "#/components/schemas/RecUser"},
            "beam_width": {"type": "integer", "minimum": 1, "maximum": lim.max_beam_width},
            "top_k": {"type": "integer", "minimum": 1},
            "num_items": {"type": "integer", "minimum": 1, "maximum": lim.max_beam_width},
            "reason": reason_schema(lim),
            **rec_request_fields(lim),
        },
    }


def recommend_schema(lim: SchemaLimits) -> dict:
    """/v1/recommend: retrieve's and rank's fields, each stage's in its own object."""
    rank, ret = rank_schema(lim)["properties"], retrieve_schema(lim)["properties"]
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["user"],
        "properties": {
            "user": {"$ref": "#/components/schemas/RecUser"},
            "retrieve": _nullable({"type": "object", "additionalProperties": False, "properties": {
                "beam_width": ret["beam_width"], "top_k": ret["top_k"],
                "num_candidates": {"type": "integer", "minimum": 1,
                                   "maximum": min(lim.max_beam_width, lim.max_rank_candidates)}}}),
            "rank": _nullable({"type": "object", "additionalProperties": False, "properties": {
                name: rank[name] for name in ("instruction", "prefix", "score_by")}}),
            "top_k": rank["top_k"],
            "reason": reason_schema(lim),
            **rec_request_fields(lim),
        },
    }


def catalog_item_schema(lim: SchemaLimits) -> dict:
    """One item of POST /v1/catalog/items: the catalog's JSON Lines line (sgrec.catalog.jsonl)."""
    text, ids = {"type": "string", "minLength": 1}, _token_ids(lim)
    return {
        "type": "object",
        "required": ["id"],
        "anyOf": _exactly_one("text", text, "token_ids", ids),
        "properties": {
            "id": {"type": "string", "minLength": 1},
            "text": _nullable(text),
            "token_ids": _nullable(ids),
            "id_token": _nullable({"anyOf": [{"type": "integer", "minimum": 0, "maximum": lim.vocab_size - 1},
                                             {"type": "string", "minLength": 1}]}),
            "semantic_id": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
                                     if lim.semantic_id_codes else _token_ids(lim)),
            "attrs": _nullable({"type": "object"}),
            **({} if lim.embedding_dim is None else {"embedding": _nullable({
                "type": "array", "items": {"type": "number"}, "minItems": lim.embedding_dim,
                "maxItems": lim.embedding_dim,
                "description": "without semantic_id: the codebooks assign it (answered under `assigned`)"})}),
        },
        "description": "exactly one of text and token_ids; any other key is kept as the item's meta"
                       + ("; semantic_id holds one code per level (--semantic-id-tokens)" if lim.semantic_id_codes
                          else ""),
    }


CONTROL_SCHEMAS = {  # the admin routes' bodies (optional: none means every default)
    "PauseGenerationReqInput": {
        "type": "object", "additionalProperties": False,
        "properties": {"mode": {"enum": list(PAUSE_MODES), "default": "abort"}}},
    "ContinueGenerationReqInput": {
        "type": "object", "additionalProperties": False,
        "properties": {"torch_empty_cache": {"type": "boolean"}}},
}


CATALOG_SCHEMAS = {
    "CatalogItemsRequest": lambda lim: {
        "type": "object", "required": ["items"],
        "properties": {"items": {"type": "array", "items": catalog_item_schema(lim), "minItems": 1}}},
    "CatalogDeleteRequest": lambda lim: {
        "type": "object", "required": ["ids"],
        "properties": {"ids": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}}},
    "CatalogRollbackRequest": lambda lim: {
        "type": "object", "required": ["version"],
        "properties": {"version": {"type": "integer", "minimum": 0, "maximum": 2 ** 63 - 1}}},
}


ERROR_SCHEMA = {
    "type": "object",
    "description": "OpenAI's error object on /v1 routes; {\"error\": ...} on native routes",
}


def _body(schema_name: str) -> dict:
    return {"required": schema_name not in CONTROL_SCHEMAS, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema_name}"}}}}


def _error(why: str) -> dict:
    return {"description": why, "content": {"application/json": {"schema": ERROR_SCHEMA}}}


UNAUTHORIZED = _error("Missing or wrong API key (--api-key)")


SSE_EVENT = {"type": "object", "required": ["data"],  # one event: a JSON chunk, or [DONE] last
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}
STREAMING_OK = {"description": "The result; with \"stream\": true, server-sent events ending with data: [DONE]",
                "content": {"application/json": {"schema": {}}, "text/event-stream": {"schema": SSE_EVENT}}}
JSON_OK = {"description": "The result", "content": {"application/json": {"schema": {}}}}
BODIES = {  # path -> (component name, streams)
    "/generate": ("GenerateReqInput", True),
    "/v1/completions": ("CompletionRequest", True),
    "/v1/chat/completions": ("ChatCompletionRequest", True),
    "/v1/score": ("ScoringRequest", False),
    "/v1/rank": ("RankRequest", False),
    "/v1/retrieve": ("RetrieveRequest", False),
    "/v1/recommend": ("RecommendRequest", False),
    "/v1/catalog/items": ("CatalogItemsRequest", False),
    "/v1/catalog/delete": ("CatalogDeleteRequest", False),
    "/v1/catalog/rollback": ("CatalogRollbackRequest", False),
    "/pause_generation": ("PauseGenerationReqInput", False),
    "/continue_generation": ("ContinueGenerationReqInput", False),
}
CATALOG_ERRORS = {"404": "A rollback to a catalog version that is not kept",
                  "500": "The update could not be made durable (journal write failed)"}
TEXT = {"content": {"text/plain": {"schema": {"type": "string"}}}}
_UNHEALTHY = {"description": "Not serving (a scheduler died, or the health generation failed)"}
_NOT_FLUSHED = {"description": "Requests are running or waiting: nothing flushed", **TEXT}
OTHER_RESPONSES = {  # (path, method) -> the statuses and bodies of the routes without a request body
    ("/health", "get"): {"200": {"description": "Serving (a one-token generation succeeded)"}, "503": _UNHEALTHY},
    ("/health_generate", "get"): {"200": {"description": "Serving"}, "503": _UNHEALTHY},
    ("/ready", "get"): {"200": {"description": "Serving"}, "503": {"description": "A scheduler died"}},
    ("/flush_cache", "get"): {"200": {"description": "Flushed", **TEXT}, "400": _NOT_FLUSHED},
    ("/flush_cache", "post"): {"200": {"description": "Flushed", **TEXT}, "400": _NOT_FLUSHED},
    ("/metrics", "get"): {"200": {"description": "Prometheus text format", **TEXT},
                          "404": {"description": "Metrics are off (--enable-metrics)", **TEXT}},
    ("/v1/models/{model_id}", "get"): {"404": {"description": "No such model",
                                                "content": {"application/json": {"schema": ERROR_SCHEMA}}}},
    ("/v1/catalog", "get"): {"404": {"description": "No item catalog (--item-catalog)",
                                     "content": {"application/json": {"schema": ERROR_SCHEMA}}}},
}


# An OpenAI route's sampling field -> the native sampling_params key it becomes, whose range applies
OPENAI_SAMPLING = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens", "n": "n", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "logit_bias": "logit_bias", "seed": "sampling_seed",
    "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
}
UNSET = {"enum": [None, "", [], {}, False]}  # what check_unsupported lets through for an unimplemented key
OPENAI_RULES = {  # each model's own checks (protocol.py check_unsupported and validators), as schemas
    "_common": {
        **{k: UNSET for k in ("regex", "ebnf", "json_schema", "stop_regex", "lora_path", "custom_logit_processor",
                              "custom_params", "return_hidden_states", "session_params")},
        "response_format": _nullable({"type": "object", "properties": {"type": {"const": "text"}}}),
    },
    "CompletionRequest": {
        "max_tokens": _nullable({"type": "integer", "minimum": 1}),
        "logprobs": _nullable({"type": "integer", "minimum": 0}),
        "suffix": {"enum": [None, ""]},
    },
    "ChatCompletionRequest": {
        "tools": {"enum": [None, []]}, "functions": {"enum": [None, []]},
        "function_call": {"enum": [None, "none"]}, "tool_choice": {"enum": [None, "none", "auto"]},
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
    },
}


def openai_schema(name: str, schema: dict, lim: SchemaLimits) -> dict:
    """A pydantic model's schema with the checks it makes after parsing: the native sampling ranges of
    the fields it passes on (SamplingParams.from_dict) and its own refusals (OPENAI_RULES)."""
    native = sampling_params_schema(lim)["properties"]
    props = schema["properties"]
    for field, key in OPENAI_SAMPLING.items():
        if field in props:
            props[field] = _nullable(native[key])
    props.update({k: v for k, v in {**OPENAI_RULES["_common"], **OPENAI_RULES[name]}.items() if k in props})
    if name == "ChatCompletionRequest":  # top_logprobs above 0 needs logprobs
        schema["if"] = {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer",
                                                                                      "minimum": 1}}}
        schema["then"] = {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
    return schema


def build_openapi(app: FastAPI, lim: SchemaLimits, secured=None) -> dict:
    """The document; `secured(path, method)`: whether the route needs an API key (None: none does)."""
    auth = secured is not None
    secured = secured or (lambda path, method: False)
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="sgrec: SGLang-compatible serving for generative recommendation")
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema(ref_template=REF)
        comps.update(schema.pop("$defs", {}))
        comps[model.__name__] = openai_schema(model.__name__, schema, lim)
    comps.update({
        "SamplingParams": sampling_params_schema(lim), "GenerateReqInput": generate_schema(lim),
        "PlainGenerateReqInput": plain_generate_schema(lim), "BeamGenerateReqInput": beam_generate_schema(lim),
        **FILTER_SCHEMAS,
        "ScoringRequest": score_schema(lim), "RecUser": _user_schema(lim), "RankRequest": rank_schema(lim),
        "RetrieveRequest": retrieve_schema(lim), "RecommendRequest": recommend_schema(lim),
        **{name: make(lim) for name, make in CATALOG_SCHEMAS.items()}, **CONTROL_SCHEMAS,
    })
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            op.get("responses", {}).pop("422", None)  # FastAPI's own validation never runs here
            if path in BODIES:
                name, streams = BODIES[path]
                op["requestBody"] = _body(name)
                op["responses"] = {"200": STREAMING_OK if streams else JSON_OK,
                                   **{code: _error(why) for code, why in ERROR_STATUSES.items()}}
                if path.startswith("/v1/catalog/"):
                    op["responses"].update({code: _error(why) for code, why in CATALOG_ERRORS.items()})
            else:
                op["responses"].update(OTHER_RESPONSES.get((path, method), {}))
            if secured(path, method):
                op["responses"]["401"] = UNAUTHORIZED
                op["security"] = [{"bearer": []}]
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def install_openapi(app: FastAPI, lim: SchemaLimits, secured=None) -> None:
    """Replaces FastAPI's generated document with build_openapi's (built once, on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, lim, secured)
        return app.openapi_schema

    app.openapi = openapi
