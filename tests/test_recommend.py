"""One-call recommendation: /v1/recommend and Engine.recommend equal retrieve and
then rank of the retrieved candidates, called separately on the same catalog version."""

import httpx
import numpy as np
import pytest

from tests.test_rec_server import write_catalog


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    return write_catalog(tmp_path_factory.mktemp("rec") / "catalog.jsonl", n=30, semantic=True)


@pytest.fixture(scope="module")
def engine(model, catalog):
    from sgrec import Engine

    return Engine(model, device="cpu", dtype="float32", max_total_tokens=4096, item_catalog=catalog,
                  max_rank_candidates=20)


def two_calls(retrieve, rank, user, bw, n, top_k=None, rank_args=None, **filters) -> list[tuple]:
    got = retrieve(user, bw, n, **filters)
    ids = [it["item"] for it in got["items"]]
    if not ids:
        return []
    paths = {it["item"]: (it["score"], it["semantic_id"]) for it in got["items"]}
    ranked = rank(user, ids, top_k, **(rank_args or {}))
    return [(x["item"], x["score"], *paths[x["item"]]) for x in ranked["ranking"]]


def as_rows(answer) -> list[tuple]:
    return [(x["item"], x["score"], x["retrieve_score"], x["semantic_id"]) for x in answer["items"]]


def same(a: list[tuple], b: list[tuple]) -> None:
    """Same items and paths; rank scores within 1e-5 and retrieve scores (each the sum of a path's ND
    log-probs) within ND x 1e-5: ARCHITECTURE.md's invariant 1 per log-prob (one call computes the prompt,
    the other finds it in the radix cache)."""
    assert [x[0] for x in a] == [x[0] for x in b] and [x[3] for x in a] == [x[3] for x in b]
    for x, y in zip(a, b):
        assert abs(x[1] - y[1]) <= 1e-5 and abs(x[2] - y[2]) <= len(x[3]) * 1e-5


CASES = [  # user, beam width, candidates, top_k, rank stage, filters, the prefixes the rank stage may use
    # no prefix given: auto, which picks user- or item-as-prefix by the cache's state (§5.3), never none
    ({"token_ids": [5, 6, 7, 8]}, 8, 6, None, {}, {}, {"user", "item"}),
    ({"id": "u2", "token_ids": [40, 41]}, 16, 10, 3, {"prefix": "user"}, {"exclude_items": ["i0", "i1"]}, {"user"}),
    ({"id": "u3", "token_ids": [90, 91, 92]}, 8, 8, None, {"prefix": "item", "score_by": "semantic_id"},
     {"include_items": [f"i{k}" for k in range(0, 30, 2)]}, {"item"}),
    ({"token_ids": [7]}, 4, 4, 2, {"prefix": "none", "instruction": [3, 4]}, {}, {"none"}),
]


@pytest.mark.parametrize("user, bw, n, top_k, rank_args, filters, prefix", CASES)
def test_engine_recommend_equals_retrieve_then_rank(engine, user, bw, n, top_k, rank_args, filters, prefix):
    def retrieve(u, bw, n, **f):
        return engine.retrieve(u, beam_width=bw, num_items=n, **f)

    def rank(u, ids, k, **a):
        return engine.rank(u, ids, top_k=k, **a)

    want = two_calls(retrieve, rank, user, bw, n, top_k, rank_args, **filters)
    got = engine.recommend(user, {"beam_width": bw, "num_candidates": n}, rank_args, top_k, **filters)
    assert len(want) == (top_k or n) and got["meta_info"]["catalog_version"] == 0
    same(as_rows(got), want)
    assert got["meta_info"]["retrieve"]["prompt_tokens"] == len(user["token_ids"])
    assert got["meta_info"]["rank"]["prefix"] in prefix
    engine.check_memory()


@pytest.mark.parametrize("kwargs, message", [
    ({"retrieve": {"beam_width": 0}}, "retrieve.beam_width must be a positive integer"),
    ({"retrieve": {"beam_width": 4, "num_candidates": 5}}, "retrieve.num_candidates (5) must not exceed beam_width"),
    ({"retrieve": {"num_candidates": 21}}, "retrieve.num_candidates 21 exceeds --max-rank-candidates 20"),
    ({"retrieve": {"width": 4}}, "unknown field(s): retrieve.width"),
    ({"rank": {"prefix": "sideways"}}, "rank.prefix must be one of"),
    ({"rank": {"items": ["i1"]}}, "unknown field(s): rank.items"),
    ({"rank": "item"}, "rank must be an object"),
    ({"top_k": 0}, "top_k must be a positive integer"),
    ({"exclude_items": "i1"}, "exclude_items must be a list"),
    ({"filter": {"genre": {"eq": "x"}}}, "filter.genre: no catalog item has the attribute"),
])
def test_bad_recommend_input_names_the_field(engine, kwargs, message):
    with pytest.raises(ValueError) as e:
        engine.recommend({"token_ids": [5, 6]}, **kwargs)
    assert message in str(e.value)


def test_server_recommend_equals_the_two_calls(start_server, model, catalog):
    srv = start_server(model, "--max-total-tokens", "4096", "--item-catalog", catalog, "--max-rank-candidates", "20")

    def post(path, body):
        r = httpx.post(srv.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def retrieve(u, bw, n, **f):
        return post("/v1/retrieve", {"user": u, "beam_width": bw, "num_items": n, **f})

    def rank(u, ids, k, **a):
        return post("/v1/rank", {"user": u, "items": ids, "top_k": k, **a})

    for user, bw, n, top_k, rank_args, filters, prefix in CASES:
        want = two_calls(retrieve, rank, user, bw, n, top_k, rank_args, **filters)
        got = post("/v1/recommend", {"user": user, "retrieve": {"beam_width": bw, "num_candidates": n},
                                     "rank": rank_args, "top_k": top_k, **filters})
        same(as_rows(got), want)
        assert got["meta_info"]["catalog_version"] == 0 and "id" in got["meta_info"]
        assert got["meta_info"]["rank"]["prefix"] in prefix
    r = httpx.post(srv.url + "/v1/recommend", json={"user": {"token_ids": [5]}, "rank": {"prefix": 1}}, timeout=60)
    assert r.status_code == 400 and "rank.prefix must be one of" in r.json()["message"]


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: the default (bfloat16 on AVX-512-BF16 / AMX CPUs)
def test_updates_follow_the_served_trie_and_filters_see_them(model, catalog, monkeypatch, dtype):
    """Catalog versions in-process (Scheduler.prepare_catalog / commit_catalog, what every rank runs):
    an update's trie follows from the served one (no trie built from the catalog's paths: counted)
    and equals the one built from scratch; a filter on new attributes sees the new values."""
    from sgrec import Engine
    from sgrec.beam.trie import SemanticIdTrie
    from tests.test_catalog_updates import same_trie

    e = Engine(model, device="cpu", dtype=dtype, max_total_tokens=4096, item_catalog=catalog)
    sched, user = e.scheduler, {"token_ids": [5, 6, 7, 8]}
    before = e.retrieve(user, beam_width=8, num_items=6)
    top = [it["item"] for it in before["items"][:3]]
    upd = [{"id": it.id, "token_ids": list(it.token_ids), "id_token": it.id_token,
            "semantic_id": list(it.semantic_id), "attrs": {"hidden": True}} for it in sched.catalog.lookup(top)]
    builds = []
    init = SemanticIdTrie.__init__
    monkeypatch.setattr(SemanticIdTrie, "__init__", lambda self, *a, **k: builds.append(1) or init(self, *a, **k))
    records = [{"version": 1, "op": "upsert", "items": upd},
               {"version": 2, "op": "upsert", "items": [{"id": "fresh", "token_ids": [3], "semantic_id": [1, 2, 0]}]},
               {"version": 3, "op": "delete", "ids": [top[0], "fresh"]}]
    for rec in records:
        prepared, trie = sched.prepare_catalog(rec)
        assert not builds and trie[0] is not sched.retriever.trie
        sched.commit_catalog(prepared, trie)
        monkeypatch.undo()
        ref, rows = SemanticIdTrie.from_catalog(sched.catalog, sched.retriever.vocab_size)
        assert sched.retriever.trie.layered and sched.retriever._trie_rows is None  # the CPU's default
        got, got_rows = sched.retriever.trie.dense(sched.catalog)
        same_trie(got, ref)
        assert np.array_equal(got_rows, rows)
        monkeypatch.setattr(SemanticIdTrie, "__init__", lambda self, *a, **k: builds.append(1) or init(self, *a, **k))
        if rec["version"] == 1:
            after = e.retrieve(user, beam_width=8, num_items=6, filter={"hidden": {"not_in": [True]}})
            assert after["meta_info"]["catalog_version"] == 1
            excluded = e.retrieve(user, beam_width=8, num_items=6, exclude_items=top)  # the same items, by id
            assert [it["item"] for it in after["items"]] == [it["item"] for it in excluded["items"]]
            assert not set(top) & {it["item"] for it in after["items"]} and len(after["items"]) == 6
    e.check_memory()


def test_the_rank_stage_reuses_the_users_kv_from_the_retrieve_stage(engine):
    """One request, a user never seen: with user-as-prefix, the rank stage reads the user's KV that
    the retrieve stage of the same request put in the radix cache (computed once)."""
    user = {"id": "fresh-user", "token_ids": [301, 302, 303, 304, 305, 306]}
    got = engine.recommend(user, {"beam_width": 8, "num_candidates": 5}, {"prefix": "user"})
    assert got["meta_info"]["retrieve"]["cached_tokens"] == 0
    assert got["meta_info"]["rank"]["prefix"] == "user"
    assert got["meta_info"]["rank"]["cached_tokens"] == len(user["token_ids"])
