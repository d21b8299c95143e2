"""Exposure filters inside beam search (exclude_items, include_items, attribute filters): every
filtered search equals the unfiltered search over a catalog with the filtered items removed, on a
catalog as loaded and on one changed by updates (dead rows, the trie that followed them)
against the catalog of the same items built from scratch."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgrec.beam import RetrieveExecutor, naive_retrieve
from sgrec.beam.filters import build_filter, FilterCache
from sgrec.catalog import Catalog, Item, UnknownItemError
from sgrec.catalog.update import apply_update
from sgrec.radix.tree import RadixCache
from tests.test_beam import assert_balanced, make_runner

GENRES = ["a", "b", "c", "d"]
LANGS = ["en", "fr", "de"]


def passes(attrs: dict, spec: dict | None) -> bool:
    """The filter semantics written out plainly (the reference for sgrec.catalog.attrs)."""
    for name, pred in (spec or {}).items():
        v = attrs.get(name)
        for op, x in pred.items():
            if op == "eq":
                ok = v is not None and (x in v if isinstance(v, list) else v == x and type(v) is type(x))
            elif op in ("in", "not_in"):
                hit = v is not None and any((w in v) if isinstance(v, list) else (v == w and type(v) is type(w))
                                            for w in x)
                ok = hit if op == "in" else not hit
            else:
                ok = v is not None and {"gt": v > x, "gte": v >= x, "lt": v < x, "lte": v <= x}[op]
            if not ok:
                return False
    return True


def make_catalog(rng: random.Random, n: int, nd: int, vocab: int, codes: int, dup: float) -> Catalog:
    items, paths = [], []
    for i in range(n):
        if paths and rng.random() < dup:
            path = rng.choice(paths)  # a repeated path: the leaf has several items
        else:
            path = tuple(rng.randrange(vocab - codes, vocab) for _ in range(nd))
        paths.append(path)
        attrs = {"genre": rng.sample(GENRES, rng.randint(0, 2)), "flag": rng.random() < 0.5}
        if rng.random() < 0.8:
            attrs["year"] = rng.randint(1990, 1999)
        if rng.random() < 0.7:
            attrs["lang"] = rng.choice(LANGS)
        items.append(Item(f"i{i}", (1, 2), None, path, attrs=attrs))
    return Catalog(items)


def updated_executor(runner, tree, rng: random.Random, cat: Catalog, nd: int, codes: int, dup: float
                     ) -> tuple[RetrieveExecutor, Catalog]:
    """An executor serving `cat` after 1-3 random updates (deletes, replacements, new items), each
    served as a rank serves it: the trie follows the update (RetrieveExecutor.updated_trie)."""
    V = runner.config.vocab_size
    ex = RetrieveExecutor(runner, tree, cat)
    for step in range(rng.randint(1, 3)):
        live = [it.id for it in cat.items]
        delete = rng.sample(live, rng.randint(0, len(live) // 3))
        fresh = list(make_catalog(rng, rng.randint(1, 8), nd, V, codes, dup).items)
        ups = [Item(rng.choice(live) if rng.random() < 0.4 else f"u{step}_{k}", it.token_ids, None, it.semantic_id,
                    attrs=it.attrs) for k, it in enumerate(fresh)]
        ups = list({u.id: u for u in ups if u.id not in delete}.values())
        res = apply_update(cat, Catalog(ups) if ups else None, delete)
        if res.added_from is None:
            continue
        ex.use_catalog(res.catalog, ex.updated_trie(res))
        cat = res.catalog
    return ex, cat


def random_filter(rng: random.Random) -> dict:
    choices = [
        ("genre", lambda: {"eq": rng.choice(GENRES)}),
        ("genre", lambda: {"not_in": rng.sample(GENRES, rng.randint(1, 2))}),
        ("year", lambda: {"gte": rng.randint(1990, 1996), "lt": rng.randint(1994, 2001)}),
        ("year", lambda: {"in": rng.sample(range(1990, 2000), 4)}),
        ("lang", lambda: {"in": rng.sample(LANGS, rng.randint(1, 2))}),
        ("lang", lambda: {"not_in": [rng.choice(LANGS)]}),
        ("flag", lambda: {"eq": rng.random() < 0.5}),
    ]
    spec = {}
    for name, make in rng.sample(choices, rng.randint(1, 3)):
        spec.setdefault(name, {}).update(make())
    return spec


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return make_runner(tiny_model_dir("llama"))


@pytest.fixture
def tree(runner):
    t = RadixCache(runner.kv_pool.allocator)
    yield t
    t.reset()


def reduced(cat: Catalog, allowed) -> Catalog | None:
    keep = [it for it in cat.items if allowed(it)]
    return Catalog(keep) if any(it.semantic_id is not None for it in keep) else None


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6), nd=st.sampled_from([2, 3]), n=st.integers(5, 60),
       kinds=st.sets(st.sampled_from(["exclude", "include", "filter"]), min_size=1), updated=st.booleans())
def test_filtered_search_equals_search_over_the_reduced_catalog(runner, seed, nd, n, kinds, updated):
    rng = random.Random(seed)
    V = runner.config.vocab_size
    codes, dup = rng.randint(2, 4), rng.choice([0.0, 0.2])
    cat = make_catalog(rng, n, nd, V, codes, dup)
    tree = RadixCache(runner.kv_pool.allocator)
    executor = RetrieveExecutor(runner, tree, cat)
    if updated:
        executor, cat = updated_executor(runner, tree, rng, cat, nd, codes, dup)
    ids = [it.id for it in cat.items]
    exclude = rng.sample(ids, rng.randint(0, len(ids) // 2)) + ["gone-1", "gone-2"] if "exclude" in kinds else None
    include = rng.sample(ids, rng.randint(1, len(ids))) if "include" in kinds else None
    spec = random_filter(rng) if "filter" in kinds else None
    bw = rng.randint(1, 16)
    top_k, num_items = rng.randint(1, 8), rng.randint(1, bw)
    user = [rng.randrange(V) for _ in range(rng.randint(1, 12))]

    def allowed(it: Item) -> bool:
        return (exclude is None or it.id not in exclude) and (include is None or it.id in include) \
            and passes(it.attrs, spec)

    got = executor.run(user, bw, top_k, num_items, exclude_items=exclude, include_items=include, filter=spec)
    assert_balanced(runner, tree)
    tree.reset()
    small = reduced(cat, allowed)
    by_id = {it.id: it for it in cat.items}
    returned = [x["item"] for x in got.items]
    assert len(set(returned)) == len(returned)  # no item twice
    assert all(allowed(by_id[i]) for i in returned)
    assert got.meta["ignored_exclusions"] == (2 if exclude is not None else 0)
    items = 0 if small is None else sum(it.semantic_id is not None for it in small.items)
    assert got.meta["exhausted"] == (items < num_items)
    assert len(returned) == min(num_items, items)  # num_items whenever that many allowed items exist
    if small is None:
        return
    ref = naive_retrieve(runner, small, user, bw, top_k, num_items)
    assert returned == [x["item"] for x in ref.items]
    assert [x["semantic_id"] for x in got.items] == [x["semantic_id"] for x in ref.items]
    for a, b in zip(got.items, ref.items):
        assert abs(a["score"] - b["score"]) <= 1e-4
    tree = RadixCache(runner.kv_pool.allocator)
    fast_ref = RetrieveExecutor(runner, tree, small).run(user, bw, top_k, num_items)
    tree.reset()
    assert [x["item"] for x in fast_ref.items] == returned
    for a, b in zip(got.items, fast_ref.items):
        assert abs(a["score"] - b["score"]) <= 1e-5


def test_a_filter_leaving_exactly_num_items_returns_them_all(runner, tree):
    rng = random.Random(3)
    V = runner.config.vocab_size
    cat = make_catalog(rng, 300, 3, V, codes=8, dup=0.0)
    ex = RetrieveExecutor(runner, tree, cat)
    user = [5, 6, 7, 8]
    ids = [it.id for it in cat.items]
    for k in (1, 7, 10):
        keep = rng.sample(ids, k)
        # BW 16, top_k 1: without the widening rule a narrow pool would return fewer
        got = ex.run(user, 16, 1, 10, exclude_items=[i for i in ids if i not in keep])
        assert sorted(x["item"] for x in got.items) == sorted(keep[:10]) if k <= 10 else True
        assert len(got.items) == min(k, 10)
        assert got.meta["exhausted"] == (k < 10)
        got_inc = ex.run(user, 16, 1, 10, include_items=keep)
        assert [x["item"] for x in got_inc.items] == [x["item"] for x in got.items]
    nothing = ex.run(user, 16, 4, 10, include_items=[])
    assert nothing.items == [] and nothing.meta["exhausted"] is True


def test_exclusion_cost_does_not_scan_the_catalog(runner, tree):
    """Exclusions touch only their own paths: the filter holds blocked nodes, never a per-catalog array."""
    rng = random.Random(4)
    V = runner.config.vocab_size
    cat = make_catalog(rng, 2000, 3, V, codes=12, dup=0.0)
    ex = RetrieveExecutor(runner, tree, cat)
    ids = [it.id for it in cat.items]
    f = build_filter(ex.trie, ex._trie_rows, cat, FilterCache(), exclude=ids[:10])
    assert all(d is None for d in f.dense) and all(a is None for a in f.allowed)
    assert all(b is None or b.numel() <= 10 for b in f.blocked)
    by_path: dict[tuple, set] = {}
    for it in cat.items:
        by_path.setdefault(it.semantic_id, set()).add(it.id)
    emptied = [p for p, its in by_path.items() if its <= set(ids[:10])]  # every item of the path excluded
    assert f.blocked[3].numel() == len(emptied) > 0 and f.leaves == len(by_path) - len(emptied)
    # every blocked node has no allowed leaf left; their parents stay unless emptied
    for d in range(1, 4):
        kept = f.keep(d, torch.arange(ex.trie.num_nodes[d]))
        assert int((~kept).sum()) == f.blocked[d].numel()


def test_bad_filters_are_value_errors_naming_the_field(runner, tree):
    rng = random.Random(5)
    cat = make_catalog(rng, 30, 2, runner.config.vocab_size, codes=4, dup=0.0)
    ex = RetrieveExecutor(runner, tree, cat)
    with pytest.raises(UnknownItemError, match="nope"):
        ex.run([1, 2], 4, 4, 2, include_items=["i1", "nope"])
    cases = [
        ({"color": {"eq": "red"}}, "filter.color: no catalog item has the attribute"),
        ({"year": {"eq": "1995"}}, "filter.year.eq must be a number"),
        ({"year": {"gte": True}}, "filter.year.gte must be a number"),
        ({"genre": {"gt": 3}}, "filter.genre.gt: a range needs a numeric attribute"),
        ({"genre": {"in": "a"}}, "filter.genre.in must be a list of strings"),
        ({"genre": {"eq": ["a"]}}, "filter.genre.eq must be a string"),  # found by the conformance test
        ({"genre": {"not_in": [["a"]]}}, "filter.genre.not_in must be a list of strings"),
        ({"flag": {"eq": 1}}, "filter.flag.eq must be a bool"),
        ({"lang": {"like": "e"}}, "filter.lang.like: unknown predicate 'like'"),
        ({"lang": []}, "filter.lang must be a string, a number, a bool"),  # {} is no predicate, not an error
        (["lang"], "filter must be an object"),
    ]
    for spec, msg in cases:
        with pytest.raises(ValueError, match=msg.replace(".", r"\.")):
            ex.run([1, 2], 4, 4, 2, filter=spec)
    res = ex.run([1, 2], 4, 4, 2, exclude_items=["x", "y", "i0"])
    assert res.meta["ignored_exclusions"] == 2
