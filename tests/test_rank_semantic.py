"""Ranking by semantic-ID path: the path rows, in the rank forward itself, equal the
one-candidate-at-a-time reference in every prefix mode, are order invariant, batch with id-token
requests, pick score_by, and leave the KV accounting balanced."""

from __future__ import annotations

import random

import pytest
import torch

from sgrec.catalog import Catalog, Item, jsonl
from sgrec import layout as L
from sgrec.rank import semantic
from sgrec.runner import ModelRunner
from tests.test_rank import INSTR, MODELS, TOL, Setup, ids, scores_of

ND = 3


def make_sem_catalog(n: int = 18, seed: int = 0) -> Catalog:
    """Items s0..s{n-1} with id_token and a 3-token path; paths share prefixes (3 first tokens, 2
    second tokens under each), token lengths 1..6. Plus n0, n1 (no id_token) and z0 (neither)."""
    rng = random.Random(seed)

    def toks():
        return tuple(rng.randrange(3, 500) for _ in range(rng.randint(1, 6)))

    items = [Item(f"s{k}", toks(), rng.randrange(3, 500), (100 + k % 3, 200 + (k // 3) % 2, 300 + k))
             for k in range(n)]
    items += [Item("n0", toks(), None, (100, 200, 400)), Item("n1", toks(), None, (101, 201, 401))]
    items.append(Item("z0", toks(), None, None))
    return Catalog(items)


@pytest.fixture(scope="module")
def catalog():
    return make_sem_catalog()


def setup(tiny_model_dir, catalog, arch="llama", seed=0, **kw) -> Setup:
    kw.setdefault("item_cache_tokens", 80)
    return Setup(tiny_model_dir(arch, seed=seed), catalog, **kw)


def reference(s: Setup, kind: str, user, cands, instr=INSTR) -> torch.Tensor:
    """Per-candidate path log-likelihoods, one candidate at a time from scratch."""
    lay = L.build(kind, s.ex.header_ids, user, [s.catalog.get(c).token_ids for c in cands], instr)
    return s.ex.score_semantic_layout(lay, [s.catalog.get(c).semantic_id for c in cands])


def logliks_of(out: dict, cands) -> torch.Tensor:
    by_id = {r["item"]: r["log_likelihood"] for r in out["ranking"]}
    return torch.tensor([by_id[c] for c in cands], dtype=torch.float64)


def ll_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Raw path log-likelihoods are float32 sums of size ~30 (ulp ~4e-6): TOL plus 1e-6 relative."""
    return bool(((got - want).abs() <= TOL + 1e-6 * want.abs()).all())


def check_against_reference(out: dict, ref: torch.Tensor, cands) -> None:
    assert ll_close(logliks_of(out, cands), ref), (logliks_of(out, cands) - ref).abs().max()
    want = torch.softmax(ref, dim=0).float()
    assert (scores_of(out, cands) - want).abs().max().item() <= TOL


def distinct_prefixes(s: Setup, cands) -> int:
    paths = [s.catalog.get(c).semantic_id for c in cands]
    return sum(len({p[:l] for p in paths}) for l in range(1, ND))


@pytest.fixture
def forwards(monkeypatch):
    """(tokens computed, rows whose hidden states are kept for logits) of every model forward."""
    calls: list[tuple[int, int]] = []
    hidden = ModelRunner.hidden

    def counting(self, batch, rows):
        calls.append((batch.input_ids.numel(), len(rows)))
        return hidden(self, batch, rows)

    monkeypatch.setattr(ModelRunner, "hidden", counting)
    return calls


CANDS = ["s0", "s3", "s6", "s1", "s4", "s9", "s2", "s14", "n0", "n1"]


# ---- exactness -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,seed", MODELS)
def test_path_rows_equal_per_item_reference(tiny_model_dir, catalog, arch, seed, forwards):
    """prefix none: the log-likelihoods and scores == the reference's; ONE forward computes the
    layout and one row per distinct prefix (never one per item), with logits at the layout's last
    token and at each path row."""
    s = setup(tiny_model_dir, catalog, arch, seed)
    user = ids(21, seed)
    cands = CANDS[:-2]  # all with id_token too: the two scorings differ
    out = s.ex.run("u", user, cands, INSTR, prefix="none", score_by="semantic_id")
    rows = distinct_prefixes(s, cands)
    assert out["meta_info"]["score_by"] == "semantic_id"
    assert out["meta_info"]["path_tokens"] == rows < len(cands) * (ND - 1)
    assert forwards == [(out["meta_info"]["prompt_tokens"] + rows, 1 + rows)]
    check_against_reference(out, reference(s, "user", user, cands), cands)
    assert abs(scores_of(out, cands).sum().item() - 1) < 1e-5
    by_id = s.ex.run("u", user, cands, INSTR, prefix="none", score_by="id_token")
    assert by_id["meta_info"]["score_by"] == "id_token" and "log_likelihood" not in by_id["ranking"][0]
    assert (scores_of(by_id, cands) - scores_of(out, cands)).abs().max() > 1e-3
    s.check_accounting()


@pytest.mark.parametrize("mutant", ["position", "layout", "own_prefix"])
def test_comparison_catches_wrong_path_rows(tiny_model_dir, catalog, monkeypatch, mutant):
    """The reference comparison can fail: path rows one position late, rows that see only the
    layout's last token, or rows that do not see their own earlier path tokens give other
    log-likelihoods."""
    s = setup(tiny_model_dir, catalog)
    user, cands = ids(15, 3), ["s0", "s3", "s4", "s6"]
    ref = reference(s, "user", user, cands)
    real = semantic.path_rows

    def wrong(trie, last_pos, layout_cols):
        toks, pos, mask = real(trie, last_pos, layout_cols)
        if mutant == "position":
            pos = [p + 1 for p in pos]
        elif mutant == "layout":
            mask[:, : layout_cols - 1] = False
        else:
            mask[:, layout_cols:] = torch.eye(len(toks), dtype=torch.bool)
        return toks, pos, mask

    monkeypatch.setattr(semantic, "path_rows", wrong)
    out = s.ex.run("u", user, cands, INSTR, prefix="none", score_by="semantic_id")
    assert (logliks_of(out, cands) - ref).abs().max() > 1e-3
    s.check_accounting()


def test_shuffled_candidates_score_the_same(tiny_model_dir, catalog):
    s = setup(tiny_model_dir, catalog, "qwen3", 2)
    s.ex.precompute()
    user = ids(17, 4)
    base = s.ex.run("u", user, CANDS, INSTR, prefix="none")
    assert base["meta_info"]["score_by"] == "semantic_id"  # auto: n0, n1 have no id_token
    for k in range(3):
        perm = CANDS[:]
        random.Random(k).shuffle(perm)
        out = s.ex.run("u", user, perm, INSTR, prefix="none")
        assert (scores_of(out, CANDS) - scores_of(base, CANDS)).abs().max().item() <= TOL
        assert ll_close(logliks_of(out, CANDS), logliks_of(base, CANDS))
        s.check_accounting()


@pytest.mark.parametrize("prefix", ["user", "item", "none", "auto", "greedy"])
def test_every_prefix_mode_equals_its_uncached_form(tiny_model_dir, catalog, prefix):
    """The second call reads the caches (user prefix from the tree, header and items from the item
    store) and still equals the reference of the same layout from scratch."""
    s = setup(tiny_model_dir, catalog, "qwen2", 1)
    s.ex.precompute()
    user = ids(40, 5)
    cands = ["s5", "s0", "n1", "s11", "s8", "n0", "s16"]
    for rep in range(2):
        out = s.ex.run("u", user, cands, INSTR, prefix=prefix, score_by="semantic_id")
        meta = out["meta_info"]
        kind = L.ITEM_PREFIX if meta["prefix"] == L.ITEM_PREFIX else L.USER_PREFIX
        check_against_reference(out, reference(s, kind, user, cands), cands)
        if rep and prefix != "none":
            assert meta["cached_tokens"] > 0
        if prefix in ("user", "item", "none"):
            assert meta["prefix"] == prefix
        s.check_accounting()


def test_item_cache_partial_budget_and_partial_user_hit(tiny_model_dir, catalog):
    """Lazy item KV with evictions, and a user prefix that grew (partial tree hit)."""
    s = setup(tiny_model_dir, catalog, "llama", 0, item_cache_tokens=14)
    user = ids(25, 6)
    for k in range(3):
        cands = random.Random(k).sample(CANDS, 6)
        out = s.ex.run("u", user, cands, INSTR, prefix="item", score_by="semantic_id")
        check_against_reference(out, reference(s, "item", user, cands), cands)
        s.check_accounting()
    s.ex.run("v", user, CANDS[:3], INSTR, prefix="user")
    longer = user + ids(7, 60)
    out = s.ex.run("v", longer, CANDS[:5], INSTR, prefix="user", score_by="semantic_id")
    assert out["meta_info"]["cached_tokens"] == len(user)
    check_against_reference(out, reference(s, "user", longer, CANDS[:5]), CANDS[:5])
    s.check_accounting()


# ---- batches ---------------------------------------------------------------------------------
def test_semantic_and_id_token_requests_in_one_batch(tiny_model_dir, catalog, forwards):
    """run_batch of semantic and id-token requests (several prefix modes) == each alone from the
    same cache state; the layouts and every path row of both semantic requests run in one forward."""
    reqs = [
        dict(user_key="a", user_ids=ids(30, 1), item_ids=CANDS[:6], instruction_ids=INSTR, prefix="user",
             score_by="semantic_id"),
        dict(user_key="b", user_ids=ids(12, 2), item_ids=CANDS[2:8], instruction_ids=INSTR, prefix="item"),
        dict(user_key="c", user_ids=ids(9, 3), item_ids=CANDS[4:], instruction_ids=INSTR, prefix="none", top_k=2),
        dict(user_key="d", user_ids=ids(5, 4), item_ids=["s1", "z0"], instruction_ids=INSTR),  # a ValueError
    ]

    def fresh():
        s = setup(tiny_model_dir, catalog, "qwen2", 1, pool=4096)
        s.ex.precompute()
        s.ex.run("a", reqs[0]["user_ids"], ["s0"], INSTR, prefix="user")  # a's prefix cached before
        return s

    s = fresh()
    forwards.clear()
    got = s.ex.run_batch(reqs)
    rows = [distinct_prefixes(s, reqs[i]["item_ids"]) for i in (0, 2)]
    computed = sum(g["meta_info"]["computed_tokens"] for g in got[:3])
    assert forwards == [(computed + sum(rows), 3 + sum(rows))]
    s.check_accounting()
    assert [g["meta_info"]["score_by"] for g in got[:3]] == ["semantic_id", "id_token", "semantic_id"]
    assert got[0]["meta_info"]["cached_tokens"] == len(reqs[0]["user_ids"])
    assert isinstance(got[3], ValueError) and "'z0'" in str(got[3])
    for kw, g in zip(reqs[:3], got):
        want = fresh().ex.run(**kw)
        assert g["meta_info"] == want["meta_info"]
        assert [r["item"] for r in g["ranking"]] == [r["item"] for r in want["ranking"]]
        for a, b in zip(g["ranking"], want["ranking"]):
            assert abs(a["score"] - b["score"]) <= TOL
            if "log_likelihood" in b:
                assert ll_close(torch.tensor(a["log_likelihood"]), torch.tensor(b["log_likelihood"]))


# ---- score_by ---------------------------------------------------------------------------------
def test_score_by_choice_and_errors(tiny_model_dir, catalog):
    s = setup(tiny_model_dir, catalog)
    s.ex.precompute()
    user = ids(8, 1)
    assert s.ex.run("u", user, ["s0", "s1"], INSTR)["meta_info"]["score_by"] == "id_token"
    assert s.ex.run("u", user, ["s0", "n0"], INSTR, score_by="auto")["meta_info"]["score_by"] == "semantic_id"
    free = s.alloc.available_size()
    cases = [
        (dict(item_ids=["s0", "n0"], score_by="id_token"), "items: 'n0' has no id_token; use score_by semantic_id"),
        (dict(item_ids=["n1", "s0", "n0"], score_by="id_token"), "'n1', 'n0' have no id_token"),
        (dict(item_ids=["s0", "z0"], score_by="semantic_id"), "items: 'z0' has no semantic_id"),
        (dict(item_ids=["s0", "z0", "n0"]), "'z0' has neither id_token nor semantic_id"),
        (dict(item_ids=["s0", "z0"], score_by="id_token"), "'z0' has no id_token"),
        (dict(item_ids=["s0"], score_by="logits"), "score_by must be one of"),
    ]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            s.ex.run(**{**dict(user_key="u", user_ids=user, instruction_ids=INSTR), **bad})
    s.check_accounting()
    assert s.alloc.available_size() == free
    mixed = Catalog([Item("a", (5,), 7, None), Item("b", (6,), None, (1, 2, 3))])
    msg = "no score_by fits every candidate: 'a' has no semantic_id, 'b' has no id_token"
    with pytest.raises(ValueError, match=msg):
        semantic.resolve_score_by(mixed.lookup(["a", "b"]), None)


# ---- KV accounting ------------------------------------------------------------------------------
def test_kv_accounting_under_pressure(tiny_model_dir, catalog):
    """A small pool (evictions), every mode and score_by, balanced after every call."""
    s = setup(tiny_model_dir, catalog, "qwen3", 2, pool=300, item_cache_tokens=40)
    s.ex.precompute()
    rng = random.Random(7)
    users = {f"u{k}": ids(rng.randint(5, 50), k) for k in range(5)}
    for step in range(12):
        key = rng.choice(list(users))
        cands = rng.sample(CANDS, rng.randint(1, 8))
        prefix = ["auto", "user", "item", "none", "greedy"][step % 5]
        s.ex.run(key, users[key], cands, INSTR, prefix=prefix, score_by="semantic_id")
        s.check_accounting()
    s.tree.reset()
    s.ex.store.reset()
    assert s.alloc.available_size() == s.alloc.size


@pytest.mark.parametrize("prefix", ["user", "item"])
def test_path_scoring_failure_frees_everything(tiny_model_dir, catalog, monkeypatch, prefix):
    """An error while scoring the paths (after the forward) leaves no slot, lock or pin behind."""
    s = setup(tiny_model_dir, catalog)
    s.ex.precompute()
    user = ids(20, 1)
    s.ex.run("u", user, ["s0"], INSTR, prefix=prefix)  # something cached to lock / pin

    def boom(trie, logits0, path_logits):
        raise RuntimeError("path scoring failed")

    monkeypatch.setattr(semantic, "path_logliks", boom)
    with pytest.raises(RuntimeError, match="path scoring failed"):
        s.ex.run("u", user + [7, 8], CANDS, INSTR, prefix=prefix)
    s.check_accounting()


# ---- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sem_rank_server(start_server, tiny_model_dir, tmp_path_factory, catalog):
    path = tmp_path_factory.mktemp("semrank") / "catalog.jsonl"
    jsonl.write(catalog.items, str(path))
    return start_server(tiny_model_dir("llama"), "--max-total-tokens", "2048", "--item-catalog", str(path))


def test_rank_route_semantic_id(sem_rank_server):
    srv = sem_rank_server
    body = {"user": {"id": "u1", "token_ids": list(range(30, 60))}, "items": ["s0", "s3", "s4", "n0"]}
    r = srv.client.post("/v1/rank", json={**body, "score_by": "semantic_id", "prefix": "user"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["score_by"] == "semantic_id" and out["meta_info"]["path_tokens"] == 5
    assert len(out["ranking"]) == 4 and abs(sum(x["score"] for x in out["ranking"]) - 1) < 1e-5
    assert all(x["log_likelihood"] < 0 for x in out["ranking"])
    auto = srv.client.post("/v1/rank", json={**body, "prefix": "user"}).json()  # auto: n0 has no id_token
    assert auto["meta_info"]["score_by"] == "semantic_id" and auto["meta_info"]["cached_tokens"] > 0
    first = {x["item"]: x["score"] for x in out["ranking"]}
    assert max(abs(x["score"] - first[x["item"]]) for x in auto["ranking"]) <= TOL
    bad = srv.client.post("/v1/rank", json={**body, "score_by": "id_token"})
    assert bad.status_code == 400 and "'n0' has no id_token" in bad.json()["message"]
    bad = srv.client.post("/v1/rank", json={**body, "score_by": "path"})
    assert bad.status_code == 400 and "score_by" in bad.json()["message"]
