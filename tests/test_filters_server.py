"""Exposure filters and catalogs beyond the vocabulary on a real server: /v1/retrieve, /v1/rank and
the /generate beam form honour exclude_items / include_items / filter; bad filters are 400s naming
the field; items without id_token are retrieved and ranked by semantic ID."""

import json
import random

import pytest

from tests.test_retrieve_filters import passes

N = 40


def write_catalog(path) -> tuple[str, dict]:
    """40 items on 3-level paths; items 0-9 have no id_token, items 35-39 no semantic_id."""
    rng = random.Random(7)
    rows = {}
    with open(path, "w") as f:
        for k in range(N):
            row = {"id": f"i{k}", "token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(1, 4))],
                   "attrs": {"genre": rng.sample(["a", "b", "c"], rng.randint(1, 2)), "year": 1990 + k % 10,
                             "kids": k % 3 == 0}}
            if k >= 10:
                row["id_token"] = rng.randrange(3, 500)
            if k < 35:
                row["semantic_id"] = [480 + k // 9, 490 + (k // 3) % 3, 500 + k % 3]
            rows[row["id"]] = row
            f.write(json.dumps(row) + "\n")
    return str(path), rows


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    return write_catalog(tmp_path_factory.mktemp("fcat") / "catalog.jsonl")


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, catalog):
    return start_server(tiny_model_dir("llama"), "--max-total-tokens", "4096", "--item-catalog", catalog[0],
                        "--max-beam-width", "64", "--max-filter-items", "50")


USER = {"id": "u1", "token_ids": [7, 8, 9, 10]}


def retrieve(server, **kw):
    r = server.client.post("/v1/retrieve", json={"user": USER, "beam_width": 64, "num_items": 10, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_retrieve_returns_items_without_id_tokens(server, catalog):
    out = retrieve(server, num_items=35)
    got = [x["item"] for x in out["items"]]
    assert sorted(got) == sorted(f"i{k}" for k in range(35))  # every retrievable item, with or without id_token
    assert out["meta_info"]["exhausted"] is False and out["meta_info"]["ignored_exclusions"] == 0


def test_retrieve_filters_exclude_include_and_attributes(server, catalog):
    rows = catalog[1]
    base = [x["item"] for x in retrieve(server)["items"]]
    seen = base[:4] + ["gone"]  # an exposure log naming an item that has left the catalog
    out = retrieve(server, exclude_items=seen)
    got = [x["item"] for x in out["items"]]
    assert len(got) == 10 and not set(got) & set(seen) and len(set(got)) == 10
    assert out["meta_info"]["ignored_exclusions"] == 1
    spec = {"genre": {"in": ["a"]}, "year": {"gte": 1993, "lt": 1998}, "kids": {"eq": False}}
    allowed = [k for k, r in rows.items() if "semantic_id" in r and passes(r["attrs"], spec)]
    out = retrieve(server, filter=spec, num_items=len(allowed))  # exactly num_items allowed: all of them
    assert sorted(x["item"] for x in out["items"]) == sorted(allowed) and out["meta_info"]["exhausted"] is False
    out = retrieve(server, filter=spec, exclude_items=allowed[:1], num_items=len(allowed))
    assert sorted(x["item"] for x in out["items"]) == sorted(allowed[1:]) and out["meta_info"]["exhausted"] is True
    out = retrieve(server, include_items=["i1", "i2", "i36"], num_items=5)  # i36 has no semantic ID
    assert sorted(x["item"] for x in out["items"]) == ["i1", "i2"] and out["meta_info"]["exhausted"] is True


def same_items(a: dict, b: dict) -> bool:
    """The same items in the same order, scores within 1e-5: the second request may find the user's
    prompt in the radix cache, and reuse equals recompute within 1e-5 in float32 (ARCHITECTURE.md)."""
    return ([(x["item"], x["semantic_id"]) for x in a["items"]] == [(x["item"], x["semantic_id"]) for x in b["items"]]
            and all(abs(x["score"] - y["score"]) <= 1e-5 for x, y in zip(a["items"], b["items"])))


def test_a_bare_value_is_equality(server, catalog):
    """{"genre": "a"} is {"genre": {"eq": "a"}} (MongoDB-style): the same items, for each attribute kind."""
    rows = catalog[1]
    for attr, value in (("genre", "a"), ("year", 1995), ("kids", True)):
        allowed = [k for k, r in rows.items() if "semantic_id" in r and passes(r["attrs"], {attr: {"eq": value}})]
        eq = retrieve(server, filter={attr: {"eq": value}}, num_items=len(allowed))
        bare = retrieve(server, filter={attr: value}, num_items=len(allowed))
        assert sorted(x["item"] for x in eq["items"]) == sorted(allowed), attr
        assert same_items(bare, eq), attr
    mixed = retrieve(server, filter={"genre": "a", "year": {"gte": 1995}}, num_items=3)
    eq = retrieve(server, filter={"genre": {"eq": "a"}, "year": {"gte": 1995}}, num_items=3)
    assert same_items(mixed, eq)
    ranked = server.client.post("/v1/rank", json={"user": USER, "items": ["i10", "i11", "i12"],
                                                  "filter": {"kids": False}})
    assert ranked.status_code == 200 and {x["item"] for x in ranked.json()["ranking"]} == {"i10", "i11"}


def test_generate_beam_form_honours_filters(server):
    body = {"input_ids": [7, 8, 9, 10], "sampling_params": {"beam_width": 16, "n": 5}, "constrain_to_catalog": True}
    full = server.client.post("/generate", json=body).json()["meta_info"]["beam_results"]
    drop = [b["meta_info"]["item"] for b in full[:2]]
    r = server.client.post("/generate", json={**body, "exclude_items": drop})
    assert r.status_code == 200, r.text
    got = [b["meta_info"]["item"] for b in r.json()["meta_info"]["beam_results"]]
    assert len(got) == 5 and not set(got) & set(drop) and len(set(got)) == 5
    empty = server.client.post("/generate", json={**body, "include_items": []})  # no item allowed: was a 500
    assert empty.status_code == 200, empty.text
    out = empty.json()
    assert (out["text"], out["output_ids"], out["meta_info"]["beam_results"]) == ("", [], [])
    assert out["meta_info"]["finish_reason"] == {"type": "stop"}


def test_rank_filters_drop_candidates(server):
    cands = [f"i{k}" for k in range(10, 20)]
    r = server.client.post("/v1/rank", json={"user": USER, "items": cands, "exclude_items": ["i10", "gone"],
                                             "filter": {"kids": {"eq": False}}})
    assert r.status_code == 200, r.text
    out = r.json()
    want = {f"i{k}" for k in range(11, 20) if k % 3 != 0}
    assert {x["item"] for x in out["ranking"]} == want
    assert out["meta_info"]["filtered_items"] == 10 - len(want) and out["meta_info"]["ignored_exclusions"] == 1
    alone = server.client.post("/v1/rank", json={"user": USER, "items": sorted(want)}).json()
    assert {x["item"]: x["score"] for x in alone["ranking"]} == pytest.approx(
        {x["item"]: x["score"] for x in out["ranking"]}, abs=1e-5)
    none_left = server.client.post("/v1/rank", json={"user": USER, "items": ["i11"], "include_items": ["i12"]})
    assert none_left.status_code == 200 and none_left.json()["ranking"] == []


def test_rank_items_without_id_token(server):
    ok = server.client.post("/v1/rank", json={"user": USER, "items": ["i0", "i1", "i20"]})
    assert ok.status_code == 200 and ok.json()["meta_info"]["score_by"] == "semantic_id"
    r = server.client.post("/v1/rank", json={"user": USER, "items": ["i0", "i20"], "score_by": "id_token"})
    assert r.status_code == 400 and "'i0'" in r.json()["message"] and "id_token" in r.json()["message"]
    r = server.client.post("/v1/rank", json={"user": USER, "items": ["i0", "i36"]})  # neither form fits both
    assert r.status_code == 400 and "'i36'" in r.json()["message"]


@pytest.mark.parametrize("route,extra,message", [
    ("/v1/retrieve", {"include_items": ["i1", "nope"]}, "'nope'"),
    ("/v1/rank", {"include_items": ["nope"]}, "'nope'"),
    ("/v1/retrieve", {"filter": {"color": {"eq": "red"}}}, "filter.color: no catalog item has the attribute"),
    ("/v1/rank", {"filter": {"year": {"eq": "1995"}}}, "filter.year.eq must be a number"),
    ("/v1/retrieve", {"filter": {"genre": {"gt": 1}}}, "filter.genre.gt: a range needs a numeric attribute"),
    ("/v1/retrieve", {"filter": {"kids": {"eq": 1}}}, "filter.kids.eq must be a bool"),
    ("/v1/retrieve", {"filter": ["kids"]}, "filter must be an object"),
    ("/v1/retrieve", {"filter": {"genre": ["a"]}}, "filter.genre must be a string, a number, a bool (equality) or an"),
    ("/v1/rank", {"filter": {"year": {"gte": 1990, "between": [1, 2]}}}, "filter.year.between: unknown predicate"),
    ("/v1/retrieve", {"filter": {"year": "1995"}}, "filter.year.eq must be a number"),
    ("/v1/retrieve", {"filter": {"kids": None}}, "filter.kids must be a string, a number, a bool (equality)"),
    ("/v1/retrieve", {"exclude_items": [f"x{i}" for i in range(51)]}, "exclude_items: 51 ids exceed --max-filter-items 50"),
    ("/v1/rank", {"include_items": "i1"}, "include_items must be a list of item id strings"),
    ("/v1/retrieve", {"exclude_items": [1]}, "exclude_items must be a list of item id strings"),
])
def test_bad_filters_are_400_naming_the_field(server, route, extra, message):
    body = {"user": USER, **({"items": ["i20", "i21"]} if route == "/v1/rank" else {"beam_width": 4, "num_items": 2})}
    r = server.client.post(route, json={**body, **extra})
    assert r.status_code == 400, r.text
    assert message in r.json()["message"]
    assert server.client.get("/health").status_code == 200
