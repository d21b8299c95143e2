"""Schemathesis against the server's own /openapi.json, every route (benchmarks/fuzz.py).

CI's run is bounded by examples, not time: a fixed seed, derandomized generation and a fixed number
of examples per operation, so every machine, fast or slow, sends the same cases and gets the same
verdict. The time-bounded 10-minute run is `python benchmarks/fuzz.py` (RELIABILITY.md)."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ_EXAMPLES = 120  # per operation, derandomized: the same cases on every machine (about 100 s here)


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
    assert comps["GenerateReqInput"]["properties"]["text"]["anyOf"][0]["anyOf"][1]["maxItems"] == 5
    assert "422" not in json.dumps(doc["paths"])  # FastAPI's validation never answers here


@pytest.mark.slow
def test_fuzz_all_routes_bounded(tmp_path):
    fuzz = load_script("fuzz")
    res = fuzz.fuzz(max_examples=FUZZ_EXAMPLES, seed=0, workers=1, api_key="ci-fuzz-key", workdir=str(tmp_path))
    summary = {k: v for k, v in res.items() if k != "schemathesis_output"}
    assert res["operations"] == 24 and res["test_cases"] > 24 * 100, summary
    assert res["failures"] == [] and res["errors"] == [], res.get("schemathesis_output", summary)
    assert res["health_after"] == 200 and res["schedulers_alive"], summary
    assert res["kv_after_drain"] == {"kv_used": 0, "kv_total": 8192, "running": 0, "queued": 0}, summary
    assert res["threads_after"] <= res["threads_before"] + fuzz.THREAD_SLACK, summary
    assert res["tracebacks_in_log"] == 0, summary
    assert res["ok"], summary
