"""Think-then-retrieve (`reason` on /v1/retrieve, /v1/recommend and sgrec.Engine): one request equals
/generate (stopping at the marker, the same budget and sampling) followed by /v1/retrieve on the
prompt, the generated tokens and the marker when it was appended."""

import concurrent.futures as cf

import pytest

from tests.test_recommend import as_rows, catalog, engine, model, same, two_calls  # noqa: F401 (fixtures)

BUDGET = 12


def greedy(generate, ids: list[int], marker: int, budget: int = BUDGET, **sampling) -> dict:
    return generate(ids, {"max_new_tokens": budget, "temperature": 0, "stop_token_ids": [marker], **sampling})


def after_reasoning(ids: list[int], out: dict, marker: int) -> list[int]:
    """The two-call path's retrieve prompt: the prompt, the generated tokens, the marker if missing."""
    gen = out["output_ids"]
    return ids + gen + ([] if gen and gen[-1] == marker else [marker])


def rows(answer: dict, key: str = "items") -> list[tuple]:
    return [(x["item"], x["score"], x["semantic_id"]) for x in answer[key]]


def same_items(a: list[tuple], b: list[tuple], exact: bool = False) -> None:
    """Same items and paths; scores (sums of ND log-probs) within ND x 1e-5 (ARCHITECTURE.md's
    invariant 1: one path reads the reasoning's KV from decode steps, the other prefills it), or bit
    for bit under --enable-deterministic-inference."""
    assert [x[0] for x in a] == [x[0] for x in b] and [x[2] for x in a] == [x[2] for x in b]
    for x, y in zip(a, b):
        assert x[1] == y[1] if exact else abs(x[1] - y[1]) <= len(x[2]) * 1e-5


def engine_generate(engine):
    return lambda ids, sp: engine.generate(input_ids=ids, sampling_params=sp)


def marker_inside(engine, ids: list[int]) -> int:
    """A token greedy decoding emits third (and not before), so the reasoning stops on it."""
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0})["output_ids"]
    assert out[2] not in out[:2], out  # the tiny model's greedy run: pick another prompt if this fails
    return out[2]


@pytest.mark.parametrize("user, stops_on_marker", [
    ({"token_ids": list(range(20, 40))}, False),  # the budget runs out: the marker is appended
    ({"id": "u7", "token_ids": [7, 8, 9, 10, 11]}, True),  # the reasoning ends on the marker
])
def test_engine_retrieve_with_reasoning_equals_generate_then_retrieve(engine, user, stops_on_marker):
    ids = user["token_ids"]
    marker = marker_inside(engine, ids) if stops_on_marker else 499
    gen = greedy(engine_generate(engine), ids, marker)
    assert (gen["meta_info"]["finish_reason"]["type"] == "stop") is stops_on_marker
    want = engine.retrieve({"token_ids": after_reasoning(ids, gen, marker)}, beam_width=8, num_items=5)
    engine.flush_cache()  # the one-request path computes the reasoning itself
    got = engine.retrieve(user, beam_width=8, num_items=5,
                          reason={"max_tokens": BUDGET, "until": marker, "temperature": 0})
    same_items(rows(got), rows(want))
    rs = got["meta_info"]["reasoning"]
    assert rs["token_ids"] == gen["output_ids"] and rs["finish_reason"] == gen["meta_info"]["finish_reason"]
    assert rs["marker_appended"] is not stops_on_marker
    text_ids = gen["output_ids"][:-1] if stops_on_marker else gen["output_ids"]
    assert rs["text"] == engine.tokenizer.decode(text_ids)
    # every beam read the reasoning's KV from the radix tree: all of it but its last token (sampled,
    # never fed) and the appended marker
    prompt = len(after_reasoning(ids, gen, marker))
    assert got["meta_info"]["prompt_tokens"] == prompt
    assert got["meta_info"]["cached_tokens"] == prompt - (1 if stops_on_marker else 2)
    assert "items_without_reasoning" not in got
    engine.check_memory()


def test_engine_reasoning_also_without(engine):
    user, marker = {"token_ids": [30, 31, 32, 33]}, 321
    got = engine.retrieve(user, beam_width=8, num_items=4,
                          reason={"max_tokens": 6, "until": marker, "temperature": 0, "also_without": True})
    gen = greedy(engine_generate(engine), user["token_ids"], marker, budget=6)
    with_ = engine.retrieve({"token_ids": after_reasoning(user["token_ids"], gen, marker)}, beam_width=8, num_items=4)
    alone = engine.retrieve({"token_ids": user["token_ids"] + [marker]}, beam_width=8, num_items=4)
    same_items(rows(got), rows(with_))
    same_items(rows(got, "items_without_reasoning"), rows(alone))
    assert rows(got) != rows(got, "items_without_reasoning")  # the reasoning changed the beams
    engine.check_memory()


def test_engine_sampled_reasoning_is_the_seeded_generation(engine):
    """A sampled reasoning is the generation with the same seed: the same tokens, the same items after."""
    user, marker = {"token_ids": [50, 51, 52]}, 400
    sp = {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 11}
    gen = engine.generate(input_ids=user["token_ids"],
                          sampling_params={"max_new_tokens": 8, "stop_token_ids": [marker], **sp})
    got = engine.retrieve(user, beam_width=8, num_items=5, reason={"max_tokens": 8, "until": marker, **sp})
    assert got["meta_info"]["reasoning"]["token_ids"] == gen["output_ids"]
    want = engine.retrieve({"token_ids": after_reasoning(user["token_ids"], gen, marker)}, beam_width=8, num_items=5)
    same_items(rows(got), rows(want))


def test_engine_recommend_with_reasoning_equals_the_two_calls(engine):
    """The retrieve stage runs after the reasoning; the rank stage ranks for the user as given."""
    user, marker = {"id": "u9", "token_ids": [60, 61, 62, 63]}, 450
    gen = greedy(engine_generate(engine), user["token_ids"], marker, budget=5)
    extended = {"token_ids": after_reasoning(user["token_ids"], gen, marker)}

    def retrieve(u, bw, n, **f):
        return engine.retrieve(extended, beam_width=bw, num_items=n, **f)

    want = two_calls(retrieve, lambda u, ids, k, **a: engine.rank(u, ids, top_k=k, **a), user, 8, 6,
                     exclude_items=["i3"])
    got = engine.recommend(user, {"beam_width": 8, "num_candidates": 6}, exclude_items=["i3"],
                           reason={"max_tokens": 5, "until": marker, "temperature": 0})
    same(as_rows(got), want)
    assert got["meta_info"]["reasoning"]["token_ids"] == gen["output_ids"]
    engine.check_memory()


# ---- the server, in the dtype it picks by default -------------------------------------------

@pytest.fixture(scope="module")
def server(start_server, model, catalog):
    # --dtype auto (bfloat16 on CPUs with native bf16 matmuls); deterministic inference makes each
    # request's outputs independent of its batch and of whether its prompt was cached: bit for bit
    return start_server(model, "--dtype", "auto", "--enable-deterministic-inference", "--max-total-tokens", "4096",
                        "--item-catalog", catalog)


def http_generate(srv):
    def gen(ids, sp):
        r = srv.client.post("/generate", json={"input_ids": ids, "sampling_params": sp})
        assert r.status_code == 200, r.text
        return r.json()
    return gen


def http_retrieve(srv, body: dict) -> dict:
    r = srv.client.post("/v1/retrieve", json=body)
    assert r.status_code == 200, r.text
    return r.json()


USERS = [[k, k + 1, k + 2, k + 3, 200 + k] for k in range(3, 83, 10)]  # 8 users


def test_server_one_request_equals_two_calls_concurrently(server):
    marker = 499
    want = []
    for ids in USERS:
        gen = greedy(http_generate(server), ids, marker, budget=10)
        got = http_retrieve(server, {"user": {"token_ids": after_reasoning(ids, gen, marker)}, "beam_width": 8,
                                     "num_items": 5})
        want.append((gen, got))
    assert server.client.post("/flush_cache").status_code == 200

    def one(ids):
        return http_retrieve(server, {"user": {"token_ids": ids}, "beam_width": 8, "num_items": 5,
                                      "reason": {"max_tokens": 10, "until": marker, "temperature": 0}})

    with cf.ThreadPoolExecutor(len(USERS)) as pool:  # their reasonings decode in one batch
        answers = list(pool.map(one, USERS))
    for (gen, two), got in zip(want, answers):
        same_items(rows(got), rows(two), exact=True)
        assert got["meta_info"]["reasoning"]["token_ids"] == gen["output_ids"]
        assert got["meta_info"]["catalog_version"] == two["meta_info"]["catalog_version"]
    assert server.client.get("/health").status_code == 200


def test_server_marker_as_text_and_recommend(server, model):
    from transformers import AutoTokenizer

    marker = 321
    text = AutoTokenizer.from_pretrained(model).convert_ids_to_tokens(marker)
    by_id = http_retrieve(server, {"user": {"token_ids": USERS[0]}, "beam_width": 8, "num_items": 5,
                                   "reason": {"max_tokens": 4, "until": marker, "temperature": 0}})
    by_text = http_retrieve(server, {"user": {"token_ids": USERS[0]}, "beam_width": 8, "num_items": 5,
                                     "reason": {"max_tokens": 4, "until": text, "temperature": 0}})
    assert rows(by_id) == rows(by_text)
    assert by_id["meta_info"]["reasoning"] == by_text["meta_info"]["reasoning"]
    r = server.client.post("/v1/recommend", json={"user": {"token_ids": USERS[1]}, "retrieve": {"num_candidates": 4},
                                                  "reason": {"max_tokens": 4, "until": marker, "also_without": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["items"]) == 4 and len(body["items_without_reasoning"]) == 4
    assert len(body["meta_info"]["reasoning"]["token_ids"]) <= 4


@pytest.mark.parametrize("reason, message", [
    ({"max_tokens": 4}, "reason needs reason.until"),
    ({"until": 5}, "reason needs reason.max_tokens"),
    ({"max_tokens": 4, "until": "two words"}, "reason.until 'two words' is not one token of the vocabulary"),
    ({"max_tokens": 4, "until": 10 ** 7}, "reason.until: token id 10000000 is out of the vocabulary range"),
    ({"max_tokens": 0, "until": 5}, "reason.max_tokens must be a positive integer"),
    ({"max_tokens": 5000, "until": 5}, "reason.max_tokens (5000) exceeds what the user's 5 tokens"),
    ({"max_tokens": 4, "until": 5, "also_without": "yes"}, "reason.also_without must be true or false"),
    ({"max_tokens": 4, "until": 5, "temperature": -1}, "reason.temperature must be non-negative"),
    ({"max_tokens": 4, "until": 5, "min_new_tokens": 9}, "reason.min_new_tokens must be in [0, max_new_tokens]"),
    ({"max_tokens": 4, "until": 5, "beam_width": 2}, "unknown field(s): reason.beam_width"),
    ([4, 5], "reason must be an object"),
])
@pytest.mark.parametrize("route", ["/v1/retrieve", "/v1/recommend"])
def test_server_bad_reason_is_a_400_naming_the_field(server, route, reason, message):
    r = server.client.post(route, json={"user": {"token_ids": USERS[0]}, "reason": reason})
    assert r.status_code == 400 and message in r.json()["message"], r.text
    assert server.client.get("/health").status_code == 200
