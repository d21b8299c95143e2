"""Recommendation routes on a real server process: /v1/score (SGLang's ScoringRequest)."""

import math

import httpx
import pytest

from tests.test_server import kv_idle_and_free, wait_until


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(start_server, model):
    return start_server(model, "--max-total-tokens", "2048", "--schedule-policy", "srjf", "--max-input-len", "300")


def generate_label_logprobs(srv, ids, labels):
    r = srv.client.post("/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True, "token_ids_logprob": labels})
    assert r.status_code == 200, r.text
    return [lp for lp, _, _ in r.json()["meta_info"]["output_token_ids_logprobs"][0]]


def test_score_matches_sglang_definition(server):
    query, items, labels = [11, 12, 13, 14, 15], [[20, 21], [30], [40, 41, 42]], [3, 99, 400]
    r = server.client.post("/v1/score", json={"query": query, "items": items, "label_token_ids": labels})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "scoring" and body["model"] == "default" and body["pooled_hidden_states"] is None
    assert body["usage"]["prompt_tokens"] == sum(len(query) + len(i) for i in items)
    assert body["usage"]["completion_tokens"] == 0 and body["token_logprobs"] is None
    for item, row in zip(items, body["scores"]):
        want = [math.exp(x) for x in generate_label_logprobs(server, query + item, labels)]
        assert max(abs(a - b) for a, b in zip(row, want)) <= 1e-5
    r = server.client.post("/v1/score", json={"query": "a user who", "items": [" likes", " hates"],
                                              "label_token_ids": [5, 6], "apply_softmax": True, "temperature": 2.0})
    assert r.status_code == 200 and all(abs(sum(row) - 1) < 1e-9 for row in r.json()["scores"])


@pytest.mark.parametrize("body,message", [
    ({"items": ["a"]}, "label_token_ids is required"),
    ({"items": ["a"], "label_token_ids": [1, 1]}, "duplicate"),
    ({"items": ["a"], "label_token_ids": "x"}, "wrong type"),
    ({"items": ["a"], "label_token_ids": [1], "apply_softmax": "yes"}, "wrong type"),
    ({"items": ["a"], "label_token_ids": [1], "return_pooled_hidden_states": True}, "not supported"),
    ({"query": [1] * 299, "items": [[2, 3]], "label_token_ids": [1]}, "maximum input length"),
    ([1, 2], "JSON object"),
])
def test_score_bad_input_is_400_openai_error(server, body, message):
    r = server.client.post("/v1/score", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400 and message in err["message"]


def test_prefill_only_generate_over_max_input_len_is_400(server):
    r = server.client.post("/generate", json={"input_ids": [5] * 301, "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 400 and "maximum input length (300 tokens)" in r.text


def test_concurrent_scores_all_answer_and_free_kv(server):
    import concurrent.futures as cf

    def one(i):
        return httpx.post(server.url + "/v1/score", json={
            "query": [7] * (10 + i), "items": [[8] * (i % 5 + 1), [9] * 3], "label_token_ids": [1, 2]}, timeout=60)

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(16)))
    assert all(r.status_code == 200 and len(r.json()["scores"]) == 2 for r in results)
    assert wait_until(lambda: kv_idle_and_free(server), timeout=30)
