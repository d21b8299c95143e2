"""Candidate order never matters: for the same user, candidate set and cache
state, every permutation of the candidates gives bit-identical scores, in float32 and bfloat16 (the
default on CPUs with native bf16 matmuls), in every prefix mode, both score_by forms, with the item
cache on and off; through RankExecutor, Engine.rank / Engine.recommend and the HTTP routes.

The cause it guards against: the attention of the instruction (and, item-as-prefix, the user) sums
over every candidate's columns, and that sum's rounding follows the column order; in bfloat16 one
rounding step (2^-8 relative) was enough to swap close scores. The executor now lays candidates out
in one canonical order (by id); `test_raw_layout_order_changes_scores` shows the difference
the canonical order removes is real on these models."""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from sgrec import layout as L
from tests.test_rank import INSTR, Setup, ids, scores_of
from tests.test_rank_semantic import logliks_of, make_sem_catalog

DTYPES = ["float32", "bfloat16"]
PREFIXES = ["user", "item", "none", "auto"]
CANDS = ["s0", "s3", "s4", "s7", "s9", "s10", "s12", "s14", "s16", "s17"]


@pytest.fixture(scope="module")
def catalog():
    return make_sem_catalog()


@pytest.fixture(scope="module")
def setups(tiny_model_dir, catalog):
    """setups(dtype, item_cache) -> one Setup per combination (qwen3), item KV precomputed when on."""
    made: dict = {}

    def get(dtype: str, item_cache: bool) -> Setup:
        if (dtype, item_cache) not in made:
            s = Setup(tiny_model_dir("qwen3", seed=2), catalog, dtype=dtype,
                      **({} if item_cache else {"item_cache_tokens": 0}))
            s.ex.precompute()
            made[dtype, item_cache] = s
        return made[dtype, item_cache]

    return get


def permutations(cands: list[str], n: int = 3) -> list[list[str]]:
    out = [cands[::-1]]
    for k in range(n):
        p = cands[:]
        random.Random(k).shuffle(p)
        out.append(p)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("item_cache", [True, False])
@pytest.mark.parametrize("score_by", ["id_token", "semantic_id"])
@pytest.mark.parametrize("prefix", PREFIXES)
def test_every_permutation_gives_identical_scores(setups, dtype, item_cache, score_by, prefix):
    s = setups(dtype, item_cache)
    user, key = ids(29, 11), f"u-{prefix}-{score_by}"

    def run(cands):
        return s.ex.run(key, user, cands, INSTR, prefix=prefix, score_by=score_by)

    run(CANDS)  # the first call of a user may fill caches (user prefix, item KV): same state from here on
    base = run(CANDS)
    for perm in permutations(CANDS):
        out = run(perm)
        assert out["meta_info"] == base["meta_info"]
        assert torch.equal(scores_of(out, CANDS), scores_of(base, CANDS))
        if score_by == "semantic_id":
            assert torch.equal(logliks_of(out, CANDS), logliks_of(base, CANDS))
        # the ranking is sorted by score; ties (none here) would keep the caller's order
        assert [r["score"] for r in out["ranking"]] == sorted((r["score"] for r in out["ranking"]), reverse=True)
    if item_cache and prefix == "item":
        assert base["meta_info"]["cached_tokens"] > 0
    s.check_accounting()


def test_ties_keep_the_callers_order(setups):
    """Two candidates with the same tokens and id token score the same: they come in the caller's
    order, whichever that is (the canonical layout order is internal)."""
    from sgrec.catalog import Catalog, Item
    from tests.test_rank import Setup as S

    s = setups("bfloat16", True)
    twin = Catalog([Item("b", (40, 41), 77), Item("a", (40, 41), 77), Item("c", (50,), 78)])
    t = S(s.args.model_path, twin, dtype="bfloat16")
    for order in (["a", "b", "c"], ["b", "a", "c"], ["c", "b", "a"]):
        ranking = t.ex.run("u", ids(9, 2), order, INSTR, prefix="none", score_by="id_token")["ranking"]
        twins = [r["item"] for r in ranking if r["item"] in ("a", "b")]
        assert twins == [i for i in order if i in ("a", "b")]
        assert ranking[0]["score"] == ranking[1]["score"] or ranking[1]["score"] == ranking[2]["score"]


def test_raw_layout_order_changes_scores(setups, catalog):
    """The check above can fail: the same candidates laid out in two orders (no canonical order)
    give different scores for some layout on this model (both dtypes differed on an AVX2 EPYC; a
    summation order is only required to matter in one of them here)."""
    user = ids(29, 11)
    differs = set()
    for dtype in DTYPES:
        s = setups(dtype, False)
        for kind in L.KINDS:
            for perm in permutations(CANDS):
                a = s.scratch(kind, user, CANDS)
                b = s.scratch(kind, user, perm)
                by_b = dict(zip(perm, b.tolist()))
                if a.tolist() != [by_b[c] for c in CANDS]:
                    differs.add(dtype)
    assert differs


# ---- Engine and HTTP (bfloat16, the default on AVX-512-BF16 / AMX CPUs) ----------------------
@pytest.fixture(scope="module")
def catalog_path(tmp_path_factory):
    from tests.test_rec_server import write_catalog

    return write_catalog(tmp_path_factory.mktemp("order") / "catalog.jsonl", n=30, semantic=True)


def score_map(out: dict, field: str = "ranking") -> dict:
    return {r["item"]: r["score"] for r in out[field]}


def test_engine_rank_and_recommend_in_bf16(tiny_model_dir, catalog_path):
    from sgrec import Engine

    e = Engine(tiny_model_dir("llama"), device="cpu", dtype="bfloat16", max_total_tokens=4096,
               item_catalog=catalog_path, max_rank_candidates=20)
    user = {"id": "u1", "token_ids": list(range(20, 50))}
    got = e.recommend(user, {"beam_width": 16, "num_candidates": 12}, {"prefix": "item"})
    cands = [it["item"] for it in got["items"]]
    assert len(cands) == 12
    for prefix in PREFIXES:
        e.rank(user, cands, prefix=prefix)  # fills what this mode caches
        base = score_map(e.rank(user, cands, prefix=prefix))
        for perm in permutations(cands):
            assert score_map(e.rank(user, perm, prefix=prefix)) == base
        if prefix == "item":  # recommend's rank stage: the retrieved order, the same bits
            assert {it["item"]: it["score"] for it in got["items"]} == base
    e.check_memory()


def test_rank_route_in_bf16(start_server, tiny_model_dir, catalog_path):
    srv = start_server(tiny_model_dir("llama"), "--dtype", "bfloat16", "--max-total-tokens", "4096",
                       "--item-catalog", catalog_path, "--max-rank-candidates", "20")
    user = {"id": "u9", "token_ids": list(range(60, 95))}
    cands = [f"i{k}" for k in (2, 5, 8, 11, 13, 17, 21, 24, 26, 29)]

    def rank(items, **kw):
        r = httpx.post(srv.url + "/v1/rank", json={"user": user, "items": items, **kw}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    for prefix in PREFIXES:
        for score_by in ("id_token", "semantic_id"):
            rank(cands, prefix=prefix, score_by=score_by)
            base = score_map(rank(cands, prefix=prefix, score_by=score_by))
            for perm in permutations(cands, 2):
                assert score_map(rank(perm, prefix=prefix, score_by=score_by)) == base
    body = {"user": user, "retrieve": {"beam_width": 16, "num_candidates": 10}, "rank": {"prefix": "none"}}
    r = httpx.post(srv.url + "/v1/recommend", json=body, timeout=120)
    assert r.status_code == 200, r.text
    rec = r.json()
    retrieved = [it["item"] for it in rec["items"]]
    assert score_map(rec, "items") == score_map(rank(retrieved[::-1], prefix="none"))
