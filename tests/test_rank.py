"""Bipartite-attention ranking: layouts, exactness of both caches, permutation invariance, the
§5.3 prefix rule, HRCS Algorithm 1, bad inputs and KV accounting."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sgrec.catalog import Catalog, Item, UnknownItemError
from sgrec.items import hrcs
from sgrec.radix.tree import RadixCache
from sgrec.rank import budget
from sgrec import layout as L
from sgrec.rank.executor import RankCapacityError, RankExecutor
from sgrec.rank.policy import CacheMeta, select_prefix
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs

TOL = 1e-5
HEADER = [5, 6, 7, 8]
INSTR = [9, 10, 11]
MODELS = [("llama", 0), ("qwen2", 1), ("qwen3", 2)]


def make_catalog(n: int = 24, seed: int = 0, vocab: int = 512) -> Catalog:
    rng = random.Random(seed)
    return Catalog(
        Item(f"i{k}", tuple(rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))), rng.randrange(3, vocab))
        for k in range(n)
    )


def ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


class Setup:
    """A RankExecutor on its own runner and tree: `kw` are ServerArgs, `executor_kw` RankExecutor's."""

    def __init__(self, path: str, catalog: Catalog, pool: int = 2048, header=HEADER,
                 executor_kw: dict | None = None, dtype: str = "float32", **kw):
        self.args = ServerArgs(model_path=path, device="cpu", dtype=dtype, max_total_tokens=pool, **kw)
        self.runner = ModelRunner(self.args)
        self.alloc = self.runner.kv_pool.allocator
        self.tree = RadixCache(self.alloc)
        self.catalog = catalog
        self.ex = RankExecutor(self.runner, self.tree, catalog, self.args, header_ids=header, **(executor_kw or {}))

    def scratch(self, kind: str, user, cands, instr=INSTR) -> torch.Tensor:
        lay = L.build(kind, self.ex.header_ids, user, [self.catalog.get(c).token_ids for c in cands], instr)
        return self.ex.score_layout(lay, cands)

    def check_accounting(self) -> None:
        self.tree.check_integrity()
        assert self.tree.protected_size() == 0
        assert all(e.pins == 0 for e in self.ex.store.entries.values())
        held = torch.cat([self.tree.all_values(), self.ex.store.all_values()])
        assert len(torch.unique(held)) == len(held), "a slot is owned twice"
        assert self.alloc.available_size() + self.tree.total_size() + self.ex.total_size() == self.alloc.size


def scores_of(out: dict, cands) -> torch.Tensor:
    by_id = {r["item"]: r["score"] for r in out["ranking"]}
    return torch.tensor([by_id[c] for c in cands])


@pytest.fixture(scope="module")
def catalog():
    return make_catalog()


# ---- the layout ----------------------------------------------------------------------------
def test_user_as_prefix_layout_hand_computed():
    lay = L.user_as_prefix([1, 2], [[3, 4, 5], [6]], [7, 8])
    assert lay.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert lay.positions == [0, 1, 2, 3, 4, 2, 5, 6]  # items start at u=2; Instr at u + max len 3
    T = True
    F = False
    expect = [
        [T, F, F, F, F, F, F, F],  # U causal
        [T, T, F, F, F, F, F, F],
        [T, T, T, F, F, F, F, F],  # item 0 sees U and itself causally
        [T, T, T, T, F, F, F, F],
        [T, T, T, T, T, F, F, F],
        [T, T, F, F, F, T, F, F],  # item 1 sees U and itself, never item 0
        [T, T, T, T, T, T, T, F],  # Instr sees everything before it
        [T, T, T, T, T, T, T, T],
    ]
    assert lay.mask().tolist() == expect
    assert lay.mask([6, 3], [0, 5, 3]).tolist() == [[T, T, T], [T, F, T]]


def test_item_as_prefix_layout_hand_computed():
    lay = L.item_as_prefix([1], [[3, 4], [6, 7, 8]], [2, 2], [9])
    assert lay.token_ids == [1, 3, 4, 6, 7, 8, 2, 2, 9]
    assert lay.positions == [0, 1, 2, 1, 2, 3, 4, 5, 6]  # items at h=1; U at h + 3; Instr after U
    m = lay.mask()
    assert m[1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert m[4].tolist() == [1, 0, 0, 1, 1, 0, 0, 0, 0]  # item 1 sees H and itself only
    assert m[7].tolist() == [1, 1, 1, 1, 1, 1, 1, 1, 0]  # U sees H, all items, itself causally
    assert m[8].all()
    no_header = L.item_as_prefix([], [[3], [4, 5]], [2], [9])
    assert no_header.positions == [0, 0, 1, 2, 3]  # items reset to position 0


@pytest.mark.parametrize("seed", range(4))
def test_bipartite_mask_equals_the_dense_mask(seed):
    """RankLayout.bipartite(cols) (two integers per column: what the triton backend's kernel reads)
    stands for exactly RankLayout.mask(rows, cols) when the rows are the last columns, whatever the
    cached columns before them (any subset, in any order); and it is not always causal."""
    rng = random.Random(seed)
    items = [ids(rng.randint(1, 5), seed * 10 + j) for j in range(rng.randint(1, 5))]
    for lay in (L.user_as_prefix(ids(6, seed), items, INSTR), L.item_as_prefix(HEADER, items, ids(5, seed), INSTR)):
        T = len(lay)
        cached = rng.sample(range(T - 1), rng.randint(0, T - 1))  # any subset, shuffled
        rows = [r for r in range(T) if r not in cached]
        cols = cached + rows
        bm = lay.bipartite(cols)
        assert bm.order.tolist() == cols
        assert torch.equal(bm.dense(len(rows)), lay.mask(rows, cols))
    assert not torch.equal(lay.mask(), torch.ones(T, T, dtype=torch.bool).tril()) or len(items) == 1


# ---- exactness -----------------------------------------------------------------------------
@pytest.mark.parametrize("arch,seed", MODELS)
def test_cached_user_kv_equals_scratch(tiny_model_dir, catalog, arch, seed):
    s = Setup(tiny_model_dir(arch, seed=seed), catalog)
    user = ids(37, seed)
    for rep, cands in enumerate([["i3", "i1", "i7", "i12", "i0"], ["i5", "i3", "i20", "i9"]]):
        ref = s.scratch("user", user, cands)
        out = s.ex.run("u", user, cands, INSTR, prefix="user")
        assert out["meta_info"]["cached_tokens"] == (len(user) if rep else 0)
        assert (scores_of(out, cands) - ref).abs().max().item() <= TOL
    longer = user + ids(9, seed + 50)  # the profile grew: a partial hit, the new suffix computed
    ref = s.scratch("user", longer, ["i2", "i4"])
    out = s.ex.run("u", longer, ["i2", "i4"], INSTR, prefix="user")
    assert out["meta_info"]["cached_tokens"] == len(user)
    assert (scores_of(out, ["i2", "i4"]) - ref).abs().max().item() <= TOL
    s.check_accounting()


@pytest.mark.parametrize("arch,seed", MODELS)
@pytest.mark.parametrize("budget", [None, 20])  # whole catalog precomputed / lazy with evictions
def test_cached_item_kv_equals_scratch(tiny_model_dir, catalog, arch, seed, budget):
    s = Setup(tiny_model_dir(arch, seed=seed), catalog, item_cache_tokens=budget)
    s.ex.precompute()
    user = ids(23, seed + 1)
    for k in range(4):
        cands = random.Random(k).sample([it.id for it in catalog.items], 8)
        ref = s.scratch("item", user, cands)
        out = s.ex.run(f"u{k}", user, cands, INSTR, prefix="item")
        assert out["meta_info"]["prefix"] == "item"
        assert out["meta_info"]["cached_tokens"] >= len(HEADER)  # the header is always read from the store
        assert (scores_of(out, cands) - ref).abs().max().item() <= TOL
        assert s.ex.store.total_size() <= s.ex.store.budget
        s.check_accounting()
    assert s.ex.store.hits > 0  # cached item KV was actually used, not only recomputed
    if budget is None:
        item_toks = sum(len(catalog.get(c).token_ids) for c in cands)
        assert out["meta_info"]["cached_tokens"] == len(HEADER) + item_toks


def test_layouts_differ_and_cache_is_read(tiny_model_dir, catalog):
    """The checks above can fail: the two layouts give different scores, and corrupting cached KV
    changes what a cached run returns."""
    s = Setup(tiny_model_dir("llama", seed=0), catalog)
    s.ex.precompute()
    user, cands = ids(30, 3), ["i1", "i2", "i3", "i4"]
    assert (s.scratch("user", user, cands) - s.scratch("item", user, cands)).abs().max() > 1e-3
    ref = s.scratch("item", user, cands)
    slots = s.ex.store.entries["i2"].slots
    for layer in range(s.runner.kv_pool.num_layers):
        s.runner.kv_pool.k_buffer[layer][slots] += 1.0
    out = s.ex.run("u", user, cands, INSTR, prefix="item")
    assert (scores_of(out, cands) - ref).abs().max() > 1e-4


def test_matches_hf_transformers_with_explicit_mask(tiny_model_dir, hf_model, catalog):
    """Both layouts equal HF transformers run on the same tokens, positions and 4-D mask."""
    path = tiny_model_dir("qwen2", seed=1)
    s = Setup(path, catalog)
    model = hf_model(path)
    user, cands = ids(15, 4), ["i6", "i0", "i11"]
    for kind in L.KINDS:
        lay = L.build(kind, HEADER, user, [catalog.get(c).token_ids for c in cands], INSTR)
        bias = torch.zeros(len(lay), len(lay))
        bias.masked_fill_(~lay.mask(), torch.finfo(torch.float32).min)
        with torch.no_grad():
            logits = model(torch.tensor([lay.token_ids]), attention_mask=bias[None, None],
                           position_ids=torch.tensor([lay.positions])).logits[0, -1].float()
        ref = torch.softmax(logits[[catalog.get(c).id_token for c in cands]], dim=0)
        assert (s.scratch(kind, user, cands) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("prefix", ["user", "item", "none"])
def test_permuting_candidates_permutes_nothing(tiny_model_dir, catalog, prefix):
    s = Setup(tiny_model_dir("qwen3", seed=2), catalog)
    s.ex.precompute()
    user = ids(19, 9)
    cands = ["i0", "i4", "i8", "i15", "i16", "i23"]
    base = scores_of(s.ex.run("u", user, cands, INSTR, prefix=prefix), cands)
    for k in range(3):
        perm = cands[:]
        random.Random(k).shuffle(perm)
        out = s.ex.run("u", user, perm, INSTR, prefix=prefix)
        assert (scores_of(out, cands) - base).abs().max().item() <= TOL
    assert abs(base.sum().item() - 1.0) < 1e-5
    s.check_accounting()


def test_top_k_orders_by_score(tiny_model_dir, catalog):
    s = Setup(tiny_model_dir("llama", seed=0), catalog)
    cands = [f"i{k}" for k in range(10)]
    out = s.ex.run("u", ids(12, 1), cands, INSTR, prefix="none", top_k=3)
    full = s.ex.run("u", ids(12, 1), cands, INSTR, prefix="none")
    assert [r["item"] for r in out["ranking"]] == [r["item"] for r in full["ranking"][:3]]
    vals = [r["score"] for r in full["ranking"]]
    assert vals == sorted(vals, reverse=True)
    assert out["meta_info"] == {"prefix": "none", "prompt_tokens": full["meta_info"]["prompt_tokens"],
                                "cached_tokens": 0, "computed_tokens": full["meta_info"]["prompt_tokens"],
                                "score_by": "id_token", "filtered_items": 0, "ignored_exclusions": 0}


# ---- the §5.3 rule and the meta service ------------------------------------------------------
def test_select_prefix_rule_on_constructed_states():
    # tau_u >= tau_i and f_u above the coldest cached user -> user
    assert select_prefix("auto", 800, 500, f_user=3.0, cached_freqs=[5.0, 2.0, 9.0]) == "user"
    # not above the coldest (ties lose) -> item
    assert select_prefix("auto", 800, 500, f_user=2.0, cached_freqs=[5.0, 2.0, 9.0]) == "item"
    assert select_prefix("auto", 800, 500, f_user=1.0, cached_freqs=[5.0, 2.0]) == "item"
    # fewer user tokens than item tokens -> item, however hot
    assert select_prefix("auto", 499, 500, f_user=100.0, cached_freqs=[1.0]) == "item"
    assert select_prefix("auto", 499, 500, f_user=100.0, user_cached=True, fits_without_eviction=True) == "item"
    # no cached user: the minimum over an empty set
    assert select_prefix("auto", 500, 500, f_user=0.5, cached_freqs=[]) == "user"
    # already cached, or room without replacing anyone -> user
    assert select_prefix("auto", 900, 100, f_user=1.0, cached_freqs=[4.0], user_cached=True) == "user"
    assert select_prefix("auto", 900, 100, f_user=1.0, cached_freqs=[4.0], fits_without_eviction=True) == "user"
    # baselines
    assert select_prefix("greedy", 900, 100, f_user=0.0, cached_freqs=[4.0]) == "user"
    assert select_prefix("greedy", 99, 100) == "item"
    assert [select_prefix(p, 1, 1000) for p in ("user", "item", "none")] == ["user", "item", "none"]
    with pytest.raises(ValueError):
        select_prefix("bogus", 1, 1)


def test_meta_window_frequency_decays():
    now = [0.0]
    meta = CacheMeta(window_s=10.0, clock=lambda: now[0])
    assert meta.record_user("a") == 1.0
    now[0] = 10.0
    assert meta.record_user("a") == pytest.approx(1.0 + math.exp(-1.0))
    now[0] = 20.0
    assert meta.user_freq("a") == pytest.approx((1.0 + math.exp(-1.0)) * math.exp(-1.0))
    assert meta.user_freq("nobody") == 0.0
    meta.record_items(["x", "y", "x"])
    assert (meta.item_count("x"), meta.item_count("y"), meta.item_count("z")) == (2, 1, 0)


def test_meta_tracks_cached_users_through_eviction():
    from sgrec.mem.kv_pool import TokenAllocator

    alloc = TokenAllocator(64)
    tree = RadixCache(alloc)
    now = [0.0]
    meta = CacheMeta(window_s=100.0, clock=lambda: now[0])
    for user, toks, n in (("a", [1, 2, 3], 3), ("b", [4, 5], 1)):
        for _ in range(n):
            meta.record_user(user)
        tree.insert(toks, alloc.alloc(len(toks)))
        meta.set_cached(user, tree.match_prefix(toks).last_node, len(toks), toks)
    assert sorted(meta.cached_users()) == ["a", "b"]
    assert meta.is_cached("a", 3, [1, 2, 3]) and not meta.is_cached("a", 3, [1, 2, 9])
    assert sorted(meta.cached_freqs()) == [1.0, 3.0]
    assert meta.cached_freqs(exclude="b") == [3.0]
    tree.reset()  # evicted: no longer counted as cached
    assert meta.cached_users() == [] and not meta.is_cached("a", 3)


def test_auto_policy_in_executor(tiny_model_dir):
    """A long user with no cached user to beat takes user-as-prefix and keeps it; a long user colder
    than every cached user falls back to item-as-prefix; a short user always gets item-as-prefix."""
    cat = make_catalog(6, seed=1)
    s = Setup(tiny_model_dir("llama", seed=0), cat, pool=162, item_cache_tokens=60)
    s.ex.precompute()
    cands = [it.id for it in cat.items]
    tau_i = sum(len(it.token_ids) for it in cat.items)
    long_a, long_b, long_c = ids(tau_i + 40, 1), ids(tau_i + 41, 2), ids(tau_i + 42, 3)
    assert s.ex.run("short", ids(3, 4), cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "item"
    for _ in range(3):
        assert s.ex.run("a", long_a, cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "user"
    out = s.ex.run("a", long_a, cands, INSTR, prefix="auto")
    assert out["meta_info"]["cached_tokens"] == len(long_a)
    # b: first request, f_b = 1 < f_a, the coldest cached user -> item
    assert s.ex.run("b", long_b, cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "item"
    # greedy ignores hotness
    assert s.ex.run("c", long_c, cands, INSTR, prefix="greedy")["meta_info"]["prefix"] == "user"
    s.check_accounting()


def test_user_value_weights_frequency_by_tokens_saved():
    now = [0.0]
    meta = CacheMeta(window_s=10.0, clock=lambda: now[0])
    assert meta.user_value("nobody") == 0.0
    meta.record_user("a")
    meta.record_user("a")
    assert meta.user_value("a") == 2.0  # nothing noted: the whole prefix counts
    meta.note_reuse("a", 100, 40)
    assert meta.user_value("a") == pytest.approx(2.0 * 0.6)
    assert meta.user_value("a", item_reuse=100) == 0.0 and meta.user_value("a", tokens=50, item_reuse=40) == 0.4
    now[0] = 10.0
    assert meta.user_value("a") == pytest.approx(2.0 * math.exp(-1.0) * 0.6)
    meta.note_reuse("a", 30, 40)  # item-as-prefix reuses more than the whole prefix
    assert meta.user_value("a") == 0.0


def test_auto_replaces_by_tokens_saved_not_frequency_alone(tiny_model_dir):
    """Two cached returning users, a (prefix barely longer than its candidates' cached tokens: caching
    it saves little over item-as-prefix) slightly hotter than b (long). A third user c, on its second
    request, is less frequent than both, but its prefix saves more per token than a's: it replaces a
    (under plain frequencies it would replace nobody and get item-as-prefix)."""
    cat = make_catalog(6, seed=1)
    cands = [it.id for it in cat.items]
    tau_i = sum(len(it.token_ids) for it in cat.items)
    h = tau_i + len(HEADER)
    long_u, short_u, hot_u = ids(4 * h, 1), ids(h + 2, 2), ids(2 * h, 3)
    now = [0.0]
    su = Setup(tiny_model_dir("llama", seed=0), cat, pool=1024, item_cache_tokens=60,
               executor_kw=dict(meta=CacheMeta(600.0, clock=lambda: now[0]),
                                user_cache_tokens=len(long_u) + len(hot_u) + 1))
    ex, tree = su.ex, su.tree
    ex.precompute()
    for t, (u, toks) in enumerate([("b", long_u), ("a", short_u), ("b", long_u), ("a", short_u)]):
        now[0] = float(t)
        assert ex.run(u, toks, cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "user"
    assert ex.meta.is_cached("a", len(short_u)) and ex.meta.is_cached("b", len(long_u))
    assert ex.meta.user_freq("a") > ex.meta.user_freq("b") > 1.0
    now[0] = 4.0
    assert ex.run("c", hot_u, cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "item"  # f_c = 0
    now[0] = 5.0
    assert ex.run("c", hot_u, cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "user"
    assert ex.meta.is_cached("c", len(hot_u)) and ex.meta.is_cached("b", len(long_u))
    assert not ex.meta.is_cached("a", len(short_u))
    tree.check_integrity()


def test_auto_compares_user_tokens_with_cached_item_tokens(tiny_model_dir):
    """tau_i of the rule is what item-as-prefix would reuse: with only part of the catalog cached, a
    user shorter than all candidates' tokens but longer than their cached tokens gets user-as-prefix;
    with the whole catalog cached the same request gets item-as-prefix."""
    cat = make_catalog(6, seed=1)
    cands = [it.id for it in cat.items]
    tau_i = sum(len(it.token_ids) for it in cat.items)
    first2 = sum(len(it.token_ids) for it in cat.items[:2])
    assert first2 + 1 < tau_i
    part = Setup(tiny_model_dir("llama", seed=0), cat, pool=256, item_cache_tokens=len(HEADER) + first2)
    assert part.ex.precompute() == 2  # catalog order (nothing accessed yet): i0, i1
    assert part.ex._reusable_item_tokens(cat.items) == first2
    full = Setup(tiny_model_dir("llama", seed=0), cat, pool=256, item_cache_tokens=60)
    full.ex.precompute()
    user = ids(first2 + 1, 7)
    assert full.ex.run("u", user, cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "item"
    out = part.ex.run("u", user, cands, INSTR, prefix="auto")
    assert out["meta_info"]["prefix"] == "user"
    assert (scores_of(out, cands) - part.scratch("user", user, cands)).abs().max().item() <= TOL
    assert part.ex.run("v", ids(first2 - 1, 8), cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "item"
    part.check_accounting()
    full.check_accounting()


def test_precompute_fills_the_hottest_items_first(tiny_model_dir):
    """A partial item budget keeps the hottest items: a given order (a past period's counts), else the
    store's hotness (the meta service's counts, seeded from a past period or live)."""
    cat = make_catalog(6, seed=1)
    hot = [cat.items[5], cat.items[3]]
    budget_tokens = len(HEADER) + sum(len(it.token_ids) for it in hot)
    s = Setup(tiny_model_dir("llama", seed=0), cat, pool=256, item_cache_tokens=budget_tokens)
    assert s.ex.precompute(order=hot + [it for it in cat.items if it not in hot]) == 2
    assert set(s.ex.store.entries) == {"i5", "i3"}
    s = Setup(tiny_model_dir("llama", seed=0), cat, pool=256, item_cache_tokens=budget_tokens)
    s.ex.meta.seed_items({"i5": 9, "i3": 4, "i0": 1})
    s.ex.meta.record_items(["i0", "i3"])
    assert (s.ex.meta.item_count("i5"), s.ex.meta.item_count("i3"), s.ex.meta.item_count("i0")) == (9, 5, 2)
    assert s.ex.precompute() == 2 and set(s.ex.store.entries) == {"i5", "i3"}
    # an item accessed more often than a stored one replaces it when a request computes it
    s.ex.meta.record_items(["i1"] * 6)
    out = s.ex.run("u", ids(2, 1), ["i1", "i5"], INSTR, prefix="item")
    assert out["meta_info"]["cached_tokens"] == len(HEADER) + len(cat.get("i5").token_ids)
    if len(cat.get("i1").token_ids) <= len(cat.get("i3").token_ids):
        assert set(s.ex.store.entries) == {"i5", "i1"}
    s.check_accounting()


def test_split_budget_hand_computed():
    """Items a, b, c of 2 tokens, header 1; past: u (10 tokens) 4 times with [a, b], v (3) once with
    [a, c]; 13 tokens. Reused tokens by item budget: 0 -> 30 (u cached, no header), 1-2 -> 32
    (header + u), 3 -> 36 (header + a, u in the other 10), 4 -> 15 (u no longer fits), 5-6 -> 23
    (header + a + b), 7 -> 25 (the catalog). Best: 3."""
    items = {"a": 2, "b": 2, "c": 2}
    past = [("u", 10, ["a", "b"])] * 4 + [("v", 3, ["a", "c"])]
    assert budget.hottest_items(items, {"a": 5, "b": 4, "c": 1}) == ["a", "b", "c"]
    got = {b: budget.reused_tokens(13, b, 1, items, past) for b in range(8)}
    assert got == {0: 30, 1: 32, 2: 32, 3: 36, 4: 15, 5: 23, 6: 23, 7: 25}
    assert budget.split_budget(13, 1, items, past) == 3
    # hot items, no returning user: the whole catalog (never more), however large the budget
    assert budget.split_budget(100, 1, items, [("u", 10, ["a"]), ("v", 10, ["b"])]) == 7
    assert budget.split_budget(100, 1, items, []) == 7


# ---- HRCS ----------------------------------------------------------------------------------
def test_algorithm1_hand_computed():
    const = lambda s, p: 0.5  # noqa: E731
    f = [1, 1, 5, 3]  # sorted and normalised inside: 0.5, 0.3, 0.1, 0.1
    # R_max = 0.1*0.5 * 1000 * (2-1) / (10 * 5 * 2) = 0.5: CDF 0.5 reaches 1 - 0.5 at i = 1
    r = hrcs.compute_replication_ratio(1000, f, 100, 5, 0.1, 10, 2, const)
    assert (r.r_max, r.num_replicated, r.ratio, r.prefill_time) == (pytest.approx(0.5), 1, 0.25, 0.5)
    # alpha 0.04 -> R_max 0.2: CDF 0.5, 0.8 -> i = 2
    r = hrcs.compute_replication_ratio(1000, f, 100, 5, 0.04, 10, 2, const)
    assert (r.r_max, r.ratio) == (pytest.approx(0.2), 0.5)
    # one worker: nothing may be remote, everything is replicated
    assert hrcs.compute_replication_ratio(1000, f, 100, 5, 0.1, 10, 1, const).ratio == 1.0
    # the prefill time is asked for (tau_u, c * tau_i)
    seen = []
    hrcs.compute_replication_ratio(1000, f, 100, 5, 0.1, 10, 4, lambda s, p: seen.append((s, p)) or 0.1)
    assert seen == [(100, 50)]


def test_prefill_time_polynomial_fit_and_placement():
    truth = lambda s, p: 0.002 + 3e-5 * s + 1e-6 * p + 2e-8 * s * s + 5e-9 * s * p  # noqa: E731
    samples = [(s, p, truth(s, p)) for s in (16, 64, 256, 1024) for p in (0, 100, 1000)]
    model = hrcs.PrefillTimeModel.fit(samples)
    assert model(500, 300) == pytest.approx(truth(500, 300), rel=1e-6)
    rel = hrcs.PrefillTimeModel.fit(samples, relative=True)  # exact data: same polynomial either way
    assert rel(500, 300) == pytest.approx(truth(500, 300), rel=1e-6)
    with pytest.raises(ValueError):
        hrcs.PrefillTimeModel.fit(samples[:3])

    items = ["a", "b", "c", "d", "e", "f"]
    freqs = [1, 9, 1, 4, 2, 3]
    pl = hrcs.plan_placement(items, freqs, 2 / 6, 2)
    assert pl.replicated == {"b", "d"}
    assert pl.owner == {"f": 0, "e": 1, "a": 0, "c": 1}  # round-robin by descending frequency
    assert pl.owns(0, "b") and pl.owns(1, "b") and pl.owns(0, "f") and not pl.owns(1, "f")
    # ranks that derived a different ratio agree on the owner of every item both shard
    other = hrcs.plan_placement(items, freqs, 3 / 6, 2)
    assert other.replicated == {"b", "d", "f"}
    assert all(other.owner[i] == pl.owner[i] for i in other.owner)
    plan = hrcs.make_plan(items, [2] * 6, freqs, 100, 1000, 10, 2, 0.1, 3, 2, lambda s, p: 1.0)
    # R_max = 0.1 * 1 * 1000 * 1 / (3 * 2 * 2) = 8.33 >= 1: the first item already satisfies the CDF
    assert plan.replication.num_replicated == 1
    assert plan.per_rank_items == [1 + 2, 1 + 3]  # d (position 1) -> rank 1, f -> 0, e -> 1, a -> 0, c -> 1
    assert plan.per_rank_bytes == [6 * 100, 8 * 100]
    assert plan.remote_fraction == pytest.approx((1 - 9 / 20) * 0.5)


def test_catalog_placement_as_arrays_equals_the_id_plan():
    """plan_catalog's array placement (no dict per item) against plan_placement over the same live
    items and frequencies: the same owner for every item and rank, dead rows and later items too."""
    from sgrec.catalog.update import apply_update

    rng = random.Random(5)
    items = [Item(f"it{k}", (3 + k % 7,), meta={"popularity": rng.randrange(5)} if k % 3 else {})
             for k in range(60)]
    cat = apply_update(Catalog(items), None, [f"it{k}" for k in range(0, 60, 7)]).catalog  # dead rows
    live = [cat.ids[r] for r in cat.live_rows().tolist()]
    freqs = hrcs.catalog_freqs(cat)
    assert freqs.tolist() == [float(cat.meta.get(r, {}).get("popularity", 0)) + 1 for r in cat.live_rows().tolist()]
    sizes = []
    for n, gbps, alpha in ((2, 0.01, 1.0), (3, 0.01, 5.0), (4, 1.0, 1.0), (2, 1.0, 0.0)):
        pl, rep = hrcs.plan_catalog(cat, n, lambda s, p: 1e-3, 100, 100, 10.0, gbps, alpha)
        ref = hrcs.plan_placement(live, freqs.tolist(), rep.ratio, n)
        sizes.append(len(ref.replicated))
        assert pl.replicated == ref.replicated and pl.owner == ref.owner
        for rank in range(n):
            assert pl.items_of(rank) == ref.items_of(rank)
            assert all(pl.owns(rank, i) == ref.owns(rank, i) for i in [*live, "it0", "new"])
    assert max(sizes) == len(live) and len({k for k in sizes if 0 < k < len(live)}) >= 2  # all; some


def test_hrcs_cli_prints_plan(capsys):
    hrcs.main(["--bandwidth-tokens", "5000", "--tau-u", "100", "--tau-i", "5", "-c", "10", "-N", "4",
               "--num-items", "50", "--prefill-time", "0.1"])
    out = capsys.readouterr().out
    assert "replication ratio r" in out and "expected remote fraction" in out and out.count("MiB") == 4


def test_non_owned_items_are_recomputed_not_kept(tiny_model_dir, catalog):
    s = Setup(tiny_model_dir("qwen2", seed=1), catalog, dp_size=2)
    ids_all = [it.id for it in catalog.items]
    s.ex.placement = hrcs.plan_placement(ids_all, [1.0] * len(ids_all), 0.25, 2)
    s.ex.precompute()
    owned = [i for i in ids_all if s.ex.placement.owns(0, i)]
    assert sorted(s.ex.store.entries) == sorted(owned) and len(owned) < len(ids_all)
    cands = ids_all[:10]
    user = ids(11, 2)
    out = s.ex.run("u", user, cands, INSTR, prefix="item")
    assert (scores_of(out, cands) - s.scratch("item", user, cands)).abs().max().item() <= TOL
    assert sorted(s.ex.store.entries) == sorted(owned)
    s.check_accounting()


# ---- bad inputs and accounting --------------------------------------------------------------
def test_bad_inputs_are_value_errors(tiny_model_dir, catalog):
    s = Setup(tiny_model_dir("llama", seed=0), catalog, max_rank_candidates=5)
    s.ex.precompute()
    free_before = s.alloc.available_size()
    user = ids(5, 1)
    with pytest.raises(UnknownItemError, match="nope"):
        s.ex.run("u", user, ["i1", "nope"], INSTR)
    cases = [
        (dict(item_ids=[]), "non-empty"),
        (dict(item_ids=["i1", "i2", "i3", "i4", "i5", "i6"]), "max-rank-candidates"),
        (dict(item_ids=["i1", "i2", "i1"]), "duplicate"),
        (dict(prefix="both"), "prefix"),
        (dict(top_k=0), "top_k"),
        (dict(instruction_ids=[]), "instruction"),
        (dict(user_ids=[1, 10**6]), "token id"),
    ]
    for bad, msg in cases:
        kw = {**dict(user_key="u", user_ids=user, item_ids=["i1", "i2"], instruction_ids=INSTR), **bad}
        with pytest.raises(ValueError, match=msg):
            s.ex.run(**kw)
    assert s.alloc.available_size() == free_before
    s.check_accounting()


def test_kv_accounting_balances_and_flushes(tiny_model_dir, catalog):
    s = Setup(tiny_model_dir("qwen3", seed=2), catalog, pool=400, item_cache_tokens=40)
    s.ex.precompute()
    rng = random.Random(5)
    users = {f"u{k}": ids(rng.randint(5, 60), k) for k in range(6)}
    for step in range(14):
        key = rng.choice(list(users))
        cands = rng.sample([it.id for it in catalog.items], rng.randint(1, 10))
        prefix = ["auto", "user", "item", "none", "greedy"][step % 5]
        s.ex.run(key, users[key], cands, INSTR, prefix=prefix)
        s.check_accounting()
    s.tree.reset()
    s.ex.store.reset()
    assert s.alloc.available_size() == s.alloc.size


def test_capacity_error_leaves_no_leak(tiny_model_dir, catalog):
    s = Setup(tiny_model_dir("llama", seed=0), catalog, pool=64, item_cache_tokens=30)
    s.ex.precompute()
    with pytest.raises(RankCapacityError):
        s.ex.run("u", ids(80, 1), ["i1", "i2"], INSTR, prefix="user")
    s.check_accounting()
    out = s.ex.run("u", ids(8, 1), ["i1", "i2"], INSTR, prefix="item")  # still serves what fits
    assert len(out["ranking"]) == 2
    s.check_accounting()


# ---- hard user-cache budget and §5.3 replacement ---------------------------------------------
def test_user_cache_cap_and_lowest_frequency_replacement(tiny_model_dir):
    """With user_cache_tokens the tree never exceeds the cap. auto: a first request (f_u = 0, no
    room) gets item-as-prefix; a returning user above the coldest cached user replaces the
    lowest-frequency user (§5.3), not the least recently used one. greedy: LRU order."""
    cat = make_catalog(4, seed=2)
    cands = [it.id for it in cat.items][:2]
    tau_i = sum(len(cat.get(c).token_ids) for c in cands)
    n = max(20, tau_i)
    user = {k: [100 + 50 * j + t % 40 for t in range(n)] for j, k in enumerate("abc")}
    for policy, survivor, victim in (("auto", "a", "b"), ("greedy", "b", "a")):
        now = [0.0]
        su = Setup(tiny_model_dir("llama", seed=0), cat, pool=512, item_cache_tokens=64,
                   executor_kw=dict(meta=CacheMeta(60.0, clock=lambda: now[0]), user_cache_tokens=2 * n + 5))
        ex, tree, runner = su.ex, su.tree, su.runner
        ex.precompute()
        seq = [("a", "user"), ("a", "user"), ("a", "user"), ("b", "user"), ("c", "item"), ("c", "user")]
        for t, (u, expect) in enumerate(seq):
            now[0] = float(t)
            out = ex.run(u, user[u], cands, INSTR, prefix=policy)
            if policy == "auto":
                assert out["meta_info"]["prefix"] == expect, (t, u)
            assert tree.total_size() <= 2 * n + 5
        assert ex.meta.is_cached(survivor, n) and not ex.meta.is_cached(victim, n) and ex.meta.is_cached("c", n)
        tree.check_integrity()
        assert runner.kv_pool.allocator.available_size() + tree.total_size() + ex.total_size() == 512


def test_auto_uses_prior_frequency():
    """f_u counts the requests before this one: a user's first request has f_u = 0 and loses to any
    cached user; with nobody cached (or room under the cap) it still gets user-as-prefix."""
    now = [0.0]
    meta = CacheMeta(window_s=60.0, clock=lambda: now[0])
    assert meta.user_freq("x") == 0.0
    meta.record_user("x")
    now[0] = 60.0
    assert meta.user_freq("x") == pytest.approx(math.exp(-1.0))
    assert select_prefix("auto", 900, 100, f_user=0.0, cached_freqs=[0.01]) == "item"
    assert select_prefix("auto", 900, 100, f_user=0.0, cached_freqs=[]) == "user"


def test_bounded_cache_rule_beats_every_replaced_user():
    # with a bounded cache f_u must beat every user it would replace; none to replace -> user
    assert select_prefix("auto", 900, 100, f_user=2.0, cached_freqs=[1.0, 5.0], replaced_freqs=[1.0, 3.0]) == "item"
    assert select_prefix("auto", 900, 100, f_user=4.0, cached_freqs=[1.0, 5.0], replaced_freqs=[1.0, 3.0]) == "user"
    assert select_prefix("auto", 900, 100, f_user=0.0, cached_freqs=[1.0], replaced_freqs=[]) == "user"
    # a prefix longer than the whole user cache can never be reused
    assert select_prefix("auto", 900, 100, f_user=9.0, cached_freqs=[], replaced_freqs=[], cacheable=False) == "item"
    assert select_prefix("auto", 900, 100, f_user=9.0, user_cached=True, cacheable=False) == "user"


def test_auto_uncapped_caches_new_users_while_the_pool_has_room(tiny_model_dir):
    """No user-cache cap: a first request (f_u = 0) still takes user-as-prefix while free slots beyond
    the reserve hold it (nobody is replaced); on a nearly full pool it falls back to item."""
    cat = make_catalog(6, seed=1)
    cands = [it.id for it in cat.items]
    tau_i = sum(len(it.token_ids) for it in cat.items)
    s = Setup(tiny_model_dir("llama", seed=0), cat, pool=2048, item_cache_tokens=60)
    s.ex.precompute()
    assert s.ex.run("a", ids(tau_i + 5, 1), cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "user"
    assert s.ex.run("b", ids(tau_i + 6, 2), cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "user"
    assert s.ex.meta.is_cached("a", tau_i + 5) and s.ex.meta.is_cached("b", tau_i + 6)
    s.check_accounting()
    # pool 140: after a is cached, b's prompt and prefix would leave less than USER_FREE_RESERVE of the
    # pool free, so b (f_b = 0, below a) must replace someone -> item-as-prefix, nothing cached for b
    s = Setup(tiny_model_dir("llama", seed=0), cat, pool=140, item_cache_tokens=60)
    s.ex.precompute()
    assert s.ex.run("a", ids(tau_i + 5, 1), cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "user"
    assert s.ex.run("b", ids(tau_i + 6, 2), cands, INSTR, prefix="auto")["meta_info"]["prefix"] == "item"
    assert s.ex.meta.is_cached("a", tau_i + 5) and not s.ex.meta.is_cached("b", tau_i + 6)
    s.check_accounting()


# ---- batches (one forward for several rank requests) -------------------------------------
@pytest.mark.parametrize("arch,seed", MODELS[:2])
def test_batch_equals_one_by_one(tiny_model_dir, catalog, arch, seed):
    """run_batch over requests of every prefix policy, a repeated user, a cached user and a bad
    request == the same requests run alone from the same cache state (scores <= 1e-5, equal
    meta), with the accounting balanced after."""
    rng = random.Random(seed)
    users = {f"u{k}": ids(rng.randint(4, 40), 10 + k) for k in range(4)}
    all_ids = [it.id for it in catalog.items]
    reqs = []
    for k, prefix in enumerate(["user", "item", "none", "auto", "greedy", "user", "item"]):
        key = f"u{k % 4}"
        reqs.append(dict(user_key=key, user_ids=users[key], item_ids=rng.sample(all_ids, rng.randint(1, 8)),
                         instruction_ids=INSTR, prefix=prefix, top_k=None if k % 3 else 3))
    reqs.insert(3, dict(user_key="bad", user_ids=[1, 2], item_ids=["i1", "nope"], instruction_ids=INSTR))

    def fresh_setup():
        s = Setup(tiny_model_dir(arch, seed=seed), catalog, pool=4096, item_cache_tokens=60)
        s.ex.precompute()
        s.ex.run("u1", users["u1"], all_ids[:3], INSTR, prefix="user")  # u1's prefix cached before the batch
        return s

    s = fresh_setup()
    batched = s.ex.run_batch(reqs)
    s.check_accounting()
    for kw, got in zip(reqs, batched):
        alone_setup = fresh_setup()  # the cache as the batch saw it
        try:
            want = alone_setup.ex.run(**kw)
        except ValueError as e:
            assert isinstance(got, ValueError) and str(got) == str(e)
            continue
        assert got["meta_info"] == want["meta_info"]
        assert [r["item"] for r in got["ranking"]] == [r["item"] for r in want["ranking"]]
        assert max(abs(a["score"] - b["score"]) for a, b in zip(got["ranking"], want["ranking"])) <= TOL
    assert batched[0]["meta_info"]["cached_tokens"] == 0 and batched[1]["meta_info"]["prefix"] == "item"
    assert batched[2]["meta_info"]["prefix"] == "none"
    assert batched[6]["meta_info"]["cached_tokens"] == len(users["u1"])  # request 5: u1 from the cache


def test_batch_too_big_for_the_pool_runs_one_by_one(tiny_model_dir, catalog):
    """Requests that do not fit in one forward together run one forward each; one that never fits
    gets its RankCapacityError, the others their results, and nothing leaks."""
    s = Setup(tiny_model_dir("llama", seed=0), catalog, pool=64, item_cache_tokens=0)
    reqs = [dict(user_key=f"u{k}", user_ids=ids(n, k), item_ids=["i1", "i2"], instruction_ids=INSTR, prefix="user")
            for k, n in enumerate([30, 80, 30])]
    out = s.ex.run_batch(reqs)
    assert isinstance(out[1], RankCapacityError)
    for kw, got in zip(reqs[::2], out[::2]):
        want = s.ex.run(**kw)
        assert max(abs(a["score"] - b["score"]) for a, b in zip(got["ranking"], want["ranking"])) <= TOL
    s.check_accounting()
    s.tree.reset()
    assert s.alloc.available_size() == s.alloc.size


def test_forward_time_per_token_is_measured(tiny_model_dir, catalog):
    """The executor times its own forwards (the cross-rank fetch cost model's recompute cost): what a
    token adds to a forward, the fixed cost of a forward apart (sgrec.mem.cost)."""
    s = Setup(tiny_model_dir("llama", seed=0), catalog, pool=1024)
    assert s.ex.token_time is None
    s.ex.run("u", ids(20, 1), ["i1", "i2", "i3"], INSTR, prefix="none")
    first = s.ex.token_time
    assert first is not None and 0 < first < 1.0 and s.ex.forward_cost.calls >= 1
    for _ in range(60):  # forwards of 100 and 1000 tokens: 20 ms fixed, 0.1 ms a token
        for n in (100, 1000):
            s.ex._observe_forward(0.02 + 1e-4 * n, n)
    assert s.ex.token_time == pytest.approx(1e-4, rel=1e-3)  # not the mean per token (1.2e-4 to 3e-4)
    assert s.ex.forward_cost.predict(500) == pytest.approx(0.07, rel=1e-3)
