"""Schemathesis against the server's own /openapi.json, every route (benchmarks/fuzz.py).

CI's run is bounded by examples, not time: a fixed seed, derandomized generation and a fixed number
of examples per operation, so every machine, fast or slow, sends the same cases and gets the same
verdict. The time-bounded 10-minute run is `python benchmarks/fuzz.py` (docs/reliability.md)."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ_EXAMPLES = 60  # per operation, derandomized: the same cases on every machine
# The only schema-valid bodies the server may answer 400 (positive_data_acceptance, ST202): what
# makes them wrong is data, not shape (benchmarks/fuzz.py DATA_DEPENDENT_400S, docs/reliability.md)
ALLOWED_400S = {
    "an item id the catalog does not hold (items, include_items)",
    "a filter on an attribute no catalog item has, or a value of another kind than the attribute's",
    "an item text the tokenizer turns into no tokens",
    "an attribute value of another kind than the catalog's items have",
    "a semantic ID of another length than the catalog's",
    "a token id past the model's vocabulary (the OpenAI models do not carry the vocabulary size)",
    "a prompt longer than the model's context (its token count depends on the tokenizer and chat template)",
    "a reasoning budget past what the prompt leaves of the context (its token count depends on the tokenizer)",
    "a reasoning marker text that is not one token (the schema does not carry the vocabulary)",
    "best_of other than n (JSON Schema cannot require two fields' values to be equal)",
    "per-item label lists other in number than the items (JSON Schema cannot relate two arrays' lengths)",
    "more items asked for than beams (JSON Schema cannot compare two fields' values)",
    "min_tokens above max_tokens (JSON Schema cannot compare two fields' values)",
}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_openapi_document_has_a_body_schema_for_every_post_route(start_server, tiny_model_dir):
    srv = start_server(tiny_model_dir("llama"), "--max-total-tokens", "1024", "--max-n", "3",
                       "--max-beam-width", "7", "--max-batch-size", "5")
    doc = srv.client.get("/openapi.json").json()
    posts = {p for p, ops in doc["paths"].items() if "post" in ops and "requestBody" not in ops.get("get", {})}
    bodies = {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/score", "/v1/rank", "/v1/retrieve",
              "/v1/recommend", "/v1/catalog/items", "/v1/catalog/delete", "/v1/catalog/rollback"}
    assert bodies <= posts
    for path in bodies:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in doc["components"]["schemas"]
        assert {"400", "413", "503"} <= set(doc["paths"][path]["post"]["responses"])
    comps = doc["components"]["schemas"]
    assert comps["SamplingParams"]["properties"]["n"]["maximum"] == 3  # the server's own limits
    assert comps["RetrieveRequest"]["properties"]["beam_width"]["maximum"] == 7
    assert comps["PlainGenerateReqInput"]["properties"]["text"]["anyOf"][0]["anyOf"][1]["maxItems"] == 5
    assert "422" not in json.dumps(doc["paths"])  # FastAPI's validation never answers here


@pytest.mark.parametrize("name,body,valid", [  # the rules between fields that the handlers enforce
    ("ScoringRequest", {"items": ["a"], "label_token_ids": [1], "temperature": 2}, False),
    ("ScoringRequest", {"items": ["a"], "label_token_ids": [1], "temperature": 2, "apply_softmax": True}, True),
    ("ScoringRequest", {"items": ["a"], "label_token_ids": [1], "temperature": 1.0}, True),
    ("CatalogItemsRequest", {"items": [{"id": "x", "text": "a", "token_ids": [1]}]}, False),
    ("CatalogItemsRequest", {"items": [{"id": "x", "text": "a", "token_ids": None}]}, True),
    ("CatalogItemsRequest", {"items": [{"id": "x", "text": None}]}, False),
    ("GenerateReqInput", {"input_ids": [1], "exclude_items": []}, False),
    ("GenerateReqInput", {"input_ids": [1], "exclude_items": None, "filter": None}, True),
    ("GenerateReqInput", {"input_ids": [1], "sampling_params": {"beam_width": 2}}, False),
    ("GenerateReqInput", {"input_ids": [1], "sampling_params": {"beam_width": 2}, "constrain_to_catalog": True,
                          "exclude_items": ["m1"], "filter": {"genre": "drama", "year": {"gte": 1990}}}, True),
    ("GenerateReqInput", {"text": "a", "input_ids": [1], "sampling_params": {"beam_width": 2},
                          "constrain_to_catalog": True}, False),
    ("RetrieveRequest", {"user": {"text": "a"}, "filter": {"genre": ["drama"]}}, False),
    ("CompletionRequest", {"prompt": ""}, False),
    ("CompletionRequest", {"prompt": [[]]}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "a"}], "input_ids": []}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user"}]}, False),  # content unless assistant
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": None}]}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "assistant"}, {"role": "user", "content": "a"}]}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "tool", "content": "a"}]}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, False),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2,
                               "logprobs": True}, True),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 0}, True),
])
def test_openapi_document_states_the_rules_between_fields(name, body, valid):
    from fastapi import FastAPI
    from jsonschema import Draft202012Validator

    from sgrec.entrypoints.openapi import SchemaLimits, build_openapi
    doc = build_openapi(FastAPI(), SchemaLimits(vocab_size=100, max_n=3, max_batch_size=5, max_rank_candidates=9,
                                                max_beam_width=7))
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    assert Draft202012Validator(schema).is_valid(body) is valid


@pytest.mark.slow
def test_fuzz_all_routes_bounded(tmp_path):
    fuzz = load_script("fuzz")
    assert {why for _, _, why in fuzz.DATA_DEPENDENT_400S} == ALLOWED_400S
    assert "positive_data_acceptance" in fuzz.CHECKS and "max_response_time" not in fuzz.CHECKS  # no wall clock
    res = fuzz.fuzz(max_examples=FUZZ_EXAMPLES, seed=20261126, workers=1, api_key="ci-fuzz-key",
                    workdir=str(tmp_path))
    summary = {k: v for k, v in res.items() if k != "schemathesis_output"}
    # every operation but /pause_generation (benchmarks/fuzz.py excludes it: it would stall the others)
    assert res["operations"] == 25 and res["test_cases"] > 24 * 50, summary
    assert res["failures"] == [] and res["errors"] == [], res.get("schemathesis_output", summary)
    assert all(r["reason"] in ALLOWED_400S for r in res["data_dependent_400s"]), summary
    assert res["health_after"] == 200 and res["schedulers_alive"], summary
    assert res["kv_after_drain"] == {"kv_used": 0, "kv_total": 8192, "running": 0, "queued": 0}, summary
    assert res["threads_after"] <= res["threads_before"] + fuzz.THREAD_SLACK, summary
    assert res["tracebacks_in_log"] == 0, summary
    assert res["ok"], summary
