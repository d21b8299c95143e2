"""The packaged demo recommender (sgrec.demo): loads offline, ranks deterministically with the
same numbers as the training forward, beats popularity by far on a fixed held-out slice (ranking
in both layouts, retrieval), and retrieves only catalog items."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from sgrec import demo
from sgrec.demo import item_id

# The artifacts are committed and CI (the CI environment variable set) can download the recbole
# wheel, so there a missing input fails the tests instead of skipping them.
IN_CI = bool(os.environ.get("CI"))

pytestmark = pytest.mark.skipif(not demo.available() and not IN_CI,
                                reason="demo artifacts missing (python -m sgrec.demo.train)")

# A fixed user (hand-picked movie ids, not a MovieLens user) and 100 fixed candidates.
USER = [1, 50, 181, 172, 174, 127, 98, 56, 100, 7, 117, 121, 405, 222, 258]
CANDIDATES = [item_id(m) for m in range(201, 301)]

# The first 100 users, "popular" candidates. Measured (packaged seed-0 model, trained on
# user-as-prefix prompts only; CPU float32, 2026-11-21): Recall@10 user-as-prefix 0.45,
# item-as-prefix 0.35, popularity 0.12 (NDCG@10 0.248 / 0.188 / 0.051). The thresholds leave a
# margin of 7+ users either way.
SLICE_USERS = 100
MIN_RECALL10 = {"user": 0.38, "item": 0.28}
MAX_POP_RECALL10 = 0.15
# Retrieval (xBeam, beam width 32, top 10 of all 1,682 movies), the first 300 users. Measured:
# Recall@10 0.073 (22 users), the 10 most popular movies 0.027 (8 users).
RETRIEVE_USERS = 300
MIN_RETRIEVE_RECALL10 = 0.05


@pytest.fixture(scope="module")
def engine():
    from sgrec.demo.evaluate import open_engine

    return open_engine()


@pytest.fixture(scope="module")
def vocab(engine):
    from sgrec.demo.evaluate import engine_vocab

    return engine_vocab(engine)


@pytest.fixture(scope="module")
def split():
    from sgrec.data.movielens import wheel_path
    from sgrec.demo.data import load_split

    if not IN_CI:
        try:
            wheel_path()  # only fetching the data may skip; reading and splitting it must work
        except (RuntimeError, OSError) as e:  # no cached recbole wheel and no network
            pytest.skip(f"MovieLens-100K unavailable: {e}")
    return load_split()


def test_artifacts_small_and_catalog_consistent():
    total = sum(os.path.getsize(os.path.join(demo.ARTIFACT_DIR, f)) for f in os.listdir(demo.ARTIFACT_DIR))
    assert total < 20 * 2**20
    rows = [json.loads(line) for line in open(demo.catalog_path())]
    assert len(rows) == 1682
    paths = {tuple(r["semantic_id"]) for r in rows}
    assert len(paths) == len(rows) and {len(p) for p in paths} == {4}
    assert all(r["token_ids"] == [r["id_token"]] and r["title"] for r in rows)


def test_loads_offline():
    code = ("import sgrec, sgrec.demo as d; e = sgrec.Engine(model_path=d.model_path(), item_catalog=d.catalog_path(), "
            "device='cpu', dtype='float32'); print(len(e.scheduler.catalog), e.runner.config.vocab_size)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/nonexistent-hf-home",
           "SGREC_CACHE_DIR": "/nonexistent-sgrec-cache"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "1682"


def test_tokenizer_round_trips_prompts(engine, vocab):
    from sgrec.demo.data import retrieve_text, user_text

    assert engine.tokenizer.encode(user_text(USER)) == vocab.user_ids(USER)
    assert engine.tokenizer.encode(retrieve_text(USER)) == vocab.retrieve_ids(USER)
    assert vocab.rank_instr == tuple(engine.tokenizer.encode(demo.RANK_INSTRUCTION, add_special_tokens=False))


@pytest.mark.parametrize("prefix", ["user", "item"])
def test_rankings_deterministic_and_match_training_forward(engine, vocab, prefix):
    from sgrec.demo.data import user_text
    from sgrec.demo.train import forward_hidden
    from sgrec import layout as L

    user = {"id": "fixed-user", "token_ids": vocab.user_ids(USER)}
    runs = [engine.rank(user=user, items=CANDIDATES, prefix=prefix) for _ in range(2)]  # 2nd: warm caches
    runs.append(engine.rank(user={"id": "fixed-user", "text": user_text(USER)}, items=list(reversed(CANDIDATES)),
                            prefix=prefix))
    got = [[(r["item"], r["score"]) for r in out["ranking"]] for out in runs]
    assert all(out["meta_info"]["prefix"] == prefix for out in runs)
    assert [i for i, _ in got[0]] == [i for i, _ in got[1]] == [i for i, _ in got[2]]
    for g in got[1:]:
        assert max(abs(a[1] - b[1]) for a, b in zip(got[0], g)) < 1e-5
    # the training forward (HF weights, sgrec.layout masks/positions) gives the same scores
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(demo.model_path()).float().eval()
    cat = engine.scheduler.catalog
    toks = [cat.get(i).id_token for i in CANDIDATES]
    lay = L.build(prefix, (), vocab.user_ids(USER), [[t] for t in toks], list(vocab.rank_instr))
    with torch.no_grad():
        h = forward_hidden(model, torch.tensor([lay.token_ids]), torch.tensor([lay.positions]), lay.mask()[None])
        ref = torch.softmax(h[0, -1] @ model.model.embed_tokens.weight[toks].T, 0)
    score = dict(got[0])
    assert max(abs(score[i] - float(ref[j])) for j, i in enumerate(CANDIDATES)) < 1e-4


def test_quality_far_above_popularity(engine, vocab, split):
    from sgrec.demo.evaluate import metrics, popularity_rank, rank_user

    users = split.users[:SLICE_USERS]
    pop = metrics([popularity_rank(split, u, "popular") for u in users])
    assert pop["Recall@10"] <= MAX_POP_RECALL10
    for prefix in ("user", "item"):
        m = metrics([rank_user(engine, vocab, split, u, "popular", prefix)[1] for u in users])
        assert m["Recall@10"] >= MIN_RECALL10[prefix], (prefix, m, pop)
        assert m["NDCG@10"] > 3 * pop["NDCG@10"], (prefix, m, pop)


def test_retrieval_above_popularity(engine, vocab, split):
    from sgrec.demo.evaluate import evaluate_retrieval

    res = evaluate_retrieval(engine, vocab, split, split.users[:RETRIEVE_USERS], beam_widths=(32,))
    pop, beam = res["popularity"], res["xBeam BW=32"]
    assert beam["invalid_items"] == 0
    assert beam["Recall@10"] >= MIN_RETRIEVE_RECALL10 and beam["Recall@10"] > 1.5 * pop["Recall@10"], res
    fresh = res["xBeam BW=32, seen excluded"]  # the user's rated movies excluded inside the search
    assert fresh["invalid_items"] == 0 and fresh["seen_items"] == 0 and beam["seen_items"] > 0, res
    assert fresh["Recall@10"] >= MIN_RETRIEVE_RECALL10, res


def test_every_retrieved_item_exists(engine, vocab, split):
    from sgrec.demo.evaluate import seen_items

    cat = engine.scheduler.catalog
    for u in split.users[:5]:
        hist, _ = split.test_case(u)
        out = engine.retrieve(user={"id": f"u{u}", "token_ids": vocab.retrieve_ids(hist)}, beam_width=32, num_items=10)
        assert len(out["items"]) == 10
        for r in out["items"]:
            assert r["item"] in cat and list(cat.get(r["item"]).semantic_id) == list(r["semantic_id"])
        seen = seen_items(split, u)
        fresh = engine.retrieve(user={"id": f"u{u}", "token_ids": vocab.retrieve_ids(hist)}, beam_width=32,
                                num_items=10, exclude_items=seen)
        assert len(fresh["items"]) == 10 and not {r["item"] for r in fresh["items"]} & set(seen)
