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


# ---- /v1/rank --------------------------------------------------------------------------------
def write_catalog(path, n=30, seed=0, semantic=False):
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for k in range(n):
            item = {"id": f"i{k}", "token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(1, 5))],
                    "id_token": rng.randrange(3, 500), "title": f"item {k}"}
            if semantic:
                item["semantic_id"] = [k // 9, (k // 3) % 3, k % 3]
            f.write(json.dumps(item) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def catalog_path(tmp_path_factory):
    return write_catalog(tmp_path_factory.mktemp("cat") / "catalog.jsonl")


@pytest.fixture(scope="module")
def rank_server(start_server, model, catalog_path):
    return start_server(model, "--max-total-tokens", "4096", "--item-catalog", catalog_path,
                        "--max-rank-candidates", "20")


def test_engine_rank_layouts_agree_with_recompute(model, catalog_path):
    from sgrec import Engine

    e = Engine(model, device="cpu", dtype="float32", max_total_tokens=4096, item_catalog=catalog_path)
    user = {"id": "u1", "token_ids": list(range(20, 60))}
    cands = [f"i{k}" for k in (3, 7, 1, 12, 25)]
    from sgrec.managers.rec import DEFAULT_INSTRUCTION
    from sgrec import layout as L

    ex, instr = e.scheduler.rank_executor, e.tokenizer.encode(DEFAULT_INSTRUCTION, add_special_tokens=False)
    for prefix in ("user", "item"):  # each layout through the caches == the same layout from scratch
        lay = L.build(L.USER_PREFIX if prefix == "user" else L.ITEM_PREFIX, ex.header_ids, user["token_ids"],
                      [ex.catalog.get(c).token_ids for c in cands], instr)
        ref = dict(zip(cands, ex.score_layout(lay, cands).tolist()))
        for _ in range(2):  # the second call reads the cache
            out = e.rank(user, cands, prefix=prefix)
            assert out["meta_info"]["prefix"] == prefix
            got = {r["item"]: r["score"] for r in out["ranking"]}
            assert max(abs(got[c] - ref[c]) for c in cands) <= 1e-5
    assert out["meta_info"]["cached_tokens"] > 0
    assert [r["score"] for r in out["ranking"]] == sorted((r["score"] for r in out["ranking"]), reverse=True)
    assert abs(sum(r["score"] for r in out["ranking"]) - 1) < 1e-5
    with pytest.raises(ValueError, match="Unknown item"):
        e.rank(user, ["i1", "nope"])
    e.check_memory()


def test_rank_route(rank_server):
    body = {"user": {"id": "u7", "token_ids": list(range(30, 70))}, "items": ["i1", "i2", "i5", "i9"],
            "prefix": "user", "top_k": 3}
    r = rank_server.client.post("/v1/rank", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["ranking"]) == 3 and {x["item"] for x in out["ranking"]} <= {"i1", "i2", "i5", "i9"}
    meta = out["meta_info"]
    assert meta["prefix"] == "user" and meta["e2e_latency"] > 0
    assert meta["prompt_tokens"] == meta["cached_tokens"] + meta["computed_tokens"]
    again = rank_server.client.post("/v1/rank", json=body).json()
    assert again["meta_info"]["cached_tokens"] >= 40 - 1
    assert [x["item"] for x in again["ranking"]] == [x["item"] for x in out["ranking"]]
    text = rank_server.client.post("/v1/rank", json={"user": {"id": "u8", "text": "likes sci-fi"}, "items": ["i3", "i4"]})
    assert text.status_code == 200 and text.json()["meta_info"]["prefix"] in ("user", "item")


@pytest.mark.parametrize("body,message", [
    ({"user": {"id": "u", "token_ids": [5, 6]}, "items": ["i1", "zzz"]}, "Unknown item"),
    ({"user": {"id": "u", "token_ids": [5, 6]}, "items": []}, "non-empty list"),
    ({"user": {"id": "u", "token_ids": [5, 6]}, "items": [f"i{k}" for k in range(21)]}, "max-rank-candidates"),
    ({"user": {"id": "u", "token_ids": [5, 6]}, "items": ["i1", "i1"]}, "duplicate"),
    ({"user": {"id": "u"}, "items": ["i1"]}, "exactly one of"),
    ({"user": {"id": "u", "token_ids": [5]}, "items": ["i1"], "prefix": "sideways"}, "prefix must be"),
    ({"user": {"id": "u", "token_ids": [5]}, "items": ["i1"], "top_k": 0}, "top_k"),
    ({"user": {"id": "u", "token_ids": [5]}, "items": ["i1"], "bogus": 1}, "unknown field"),
])
def test_rank_bad_input_is_400(rank_server, body, message):
    r = rank_server.client.post("/v1/rank", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["message"]


def test_rank_without_catalog_is_400(server):
    r = server.client.post("/v1/rank", json={"user": {"id": "u", "token_ids": [5]}, "items": ["i1"]})
    assert r.status_code == 400 and "--item-catalog" in r.json()["message"]


def test_rank_kv_free_after_flush(rank_server):
    assert wait_until(lambda: kv_idle_and_free(rank_server), timeout=30)


# ---- /v1/retrieve ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sem_catalog_path(tmp_path_factory):
    return write_catalog(tmp_path_factory.mktemp("semcat") / "catalog.jsonl", n=27, seed=1, semantic=True)


def test_engine_retrieve_equals_naive_reference(model, sem_catalog_path):
    from sgrec import Engine
    from sgrec.beam import naive_retrieve

    e = Engine(model, device="cpu", dtype="float32", max_total_tokens=4096, item_catalog=sem_catalog_path)
    user = {"id": "u1", "token_ids": list(range(40, 90))}
    for _ in range(2):  # the second request hits the prompt cache
        out = e.retrieve(user, beam_width=8, num_items=5)
    ref = naive_retrieve(e.runner, e.scheduler.catalog, user["token_ids"], 8, 8, 5)
    assert [x["item"] for x in out["items"]] == [x["item"] for x in ref.items]
    assert max(abs(a["score"] - b["score"]) for a, b in zip(out["items"], ref.items)) <= 1e-4
    paths = {tuple(it.semantic_id): it.id for it in e.scheduler.catalog.items}
    assert all(paths[tuple(x["semantic_id"])] == x["item"] for x in out["items"])
    assert out["meta_info"]["cached_tokens"] == len(user["token_ids"]) - 1
    e.check_memory()


@pytest.fixture(scope="module")
def retrieve_server(start_server, model, sem_catalog_path):
    return start_server(model, "--max-total-tokens", "4096", "--item-catalog", sem_catalog_path,
                        "--max-beam-width", "16")


def test_retrieve_route(retrieve_server):
    r = retrieve_server.client.post("/v1/retrieve", json={"user": {"id": "u3", "token_ids": [7, 8, 9, 10]},
                                                          "beam_width": 16, "num_items": 4})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["items"]) == 4 and len({x["item"] for x in out["items"]}) == 4
    assert [x["score"] for x in out["items"]] == sorted((x["score"] for x in out["items"]), reverse=True)
    assert out["meta_info"]["e2e_latency"] > 0
    rank = retrieve_server.client.post("/v1/rank", json={"user": {"id": "u3", "token_ids": [7, 8, 9]},
                                                        "items": [x["item"] for x in out["items"]]})
    assert rank.status_code == 200


@pytest.mark.parametrize("body,message", [
    ({"user": {"id": "u", "token_ids": [5]}, "beam_width": 17}, "max-beam-width"),
    ({"user": {"id": "u", "token_ids": [5]}, "beam_width": 4, "num_items": 5}, "must not exceed"),
    ({"user": {"id": "u", "token_ids": [5]}, "beam_width": 0}, "positive integer"),
    ({"user": {"id": "u", "token_ids": [5]}, "top_k": "a"}, "positive integer"),
    ({"user": {"id": "u", "token_ids": [99999]}}, "user.token_ids must be token ids in [0, "),
])
def test_retrieve_bad_input_is_400(retrieve_server, body, message):
    r = retrieve_server.client.post("/v1/retrieve", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["message"]


def test_retrieve_needs_semantic_ids(rank_server):
    r = rank_server.client.post("/v1/retrieve", json={"user": {"id": "u", "token_ids": [5, 6]}, "beam_width": 4, "num_items": 2})
    assert r.status_code == 400 and "semantic_id" in r.json()["message"]


def test_generate_beam_width_constrained_to_catalog(retrieve_server):
    body = {"input_ids": [7, 8, 9, 10], "sampling_params": {"beam_width": 8, "n": 3}, "constrain_to_catalog": True}
    r = retrieve_server.client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    beams = out["meta_info"]["beam_results"]
    ref = retrieve_server.client.post("/v1/retrieve", json={"user": {"token_ids": [7, 8, 9, 10]}, "beam_width": 8,
                                                            "num_items": 3}).json()["items"]
    assert [b["meta_info"]["item"] for b in beams] == [x["item"] for x in ref]
    assert [b["output_ids"] for b in beams] == [x["semantic_id"] for x in ref]
    assert all(abs(b["meta_info"]["sequence_score"] - x["score"] / 3) < 1e-5 for b, x in zip(beams, ref))
    assert out["output_ids"] == beams[0]["output_ids"] and out["meta_info"]["completion_tokens"] == 9
    unconstrained = retrieve_server.client.post("/generate", json={**body, "constrain_to_catalog": False})
    assert unconstrained.status_code == 400 and "constrain_to_catalog" in unconstrained.json()["error"]["message"]


def test_engine_generate_beam_width(model, sem_catalog_path):
    from sgrec import Engine

    e = Engine(model, device="cpu", dtype="float32", max_total_tokens=2048, item_catalog=sem_catalog_path)
    out = e.generate(input_ids=[7, 8, 9, 10], sampling_params={"beam_width": 4, "n": 2}, constrain_to_catalog=True)
    assert len(out["meta_info"]["beam_results"]) == 2
    with pytest.raises(ValueError, match="constrain_to_catalog"):
        e.generate(input_ids=[7, 8], sampling_params={"beam_width": 4})


# ---- request limits ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limits_server(start_server, model):
    return start_server(model, "--max-total-tokens", "1024", "--max-request-bytes", "2000",
                        "--max-batch-size", "3", "--max-n", "2")


def test_request_limits(limits_server):
    c = limits_server.client
    big = {"input_ids": [5] * 1000, "sampling_params": {"max_new_tokens": 1}}
    r = c.post("/generate", json=big)
    assert r.status_code == 413 and "max-request-bytes" in r.json()["message"]

    def chunks():  # no Content-Length: the body is counted as it streams in
        for _ in range(30):
            yield b" " * 100

    r = c.post("/generate", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = c.post("/generate", json={"input_ids": [[5, 6]] * 4, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "max-batch-size" in r.text
    r = c.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1, "n": 3}})
    assert r.status_code == 400 and "max-n" in r.text
    r = c.post("/v1/score", json={"query": [5], "items": [[6]] * 4, "label_token_ids": [1]})
    assert r.status_code == 400 and "max-batch-size" in r.text
    ok = c.post("/generate", json={"input_ids": [[5, 6]] * 3, "sampling_params": {"max_new_tokens": 1, "n": 2}})
    assert ok.status_code == 200 and len(ok.json()) == 6


def test_dp_ranks_fetch_cold_items_from_their_owner(start_server, model, catalog_path):
    """--dp-size 2 with HRCS: each rank holds the hot items and its shard of the cold ones; a rank
    fetches the KV of a cold item it does not own from the owner. Scores equal one rank's."""
    from sgrec import Engine

    srv = start_server(model, "--max-total-tokens", "4096", "--item-catalog", catalog_path, "--dp-size", "2")
    items = [f"i{k}" for k in range(20)]
    user = {"id": "u", "token_ids": list(range(30, 50))}
    ref = Engine(model, device="cpu", dtype="float32", max_total_tokens=4096, item_catalog=catalog_path)
    want = {x["item"]: x["score"] for x in ref.rank(user, items, prefix="item")["ranking"]}
    fetched = 0
    for key in ("a", "b", "c", "d", "e", "f"):  # routing keys spread the requests over both ranks
        r = srv.client.post("/v1/rank", json={"user": user, "items": items, "prefix": "item", "routing_key": key})
        assert r.status_code == 200, r.text
        out = r.json()
        fetched += out["meta_info"].get("fetched_tokens", 0)
        assert max(abs(x["score"] - want[x["item"]]) for x in out["ranking"]) <= 1e-5
    assert fetched > 0
