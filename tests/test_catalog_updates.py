"""Catalog updates as plain code: a new version from a batch equals the catalog built
from the expected items (columns, attributes, filters); a batch is all or nothing; the journal's
torn last line is dropped and any other bad line named; versions, rollbacks and replay. Versions
share storage and cost what changed: the trie follows an update without a rebuild and
equals the one built from scratch."""

import json
import random

import numpy as np
import pytest
import torch

import sgrec.beam.layered
from sgrec.beam.layered import LayeredTrie
from sgrec.beam.trie import SemanticIdTrie
from sgrec.catalog import Catalog, CatalogError, Item
from sgrec.catalog.attrs import AttrColumn, AttrTable
from sgrec.catalog import journal
from sgrec.catalog.update import UpdateError, apply_update, canonical_lines, parse_items
from sgrec.catalog.versions import CatalogVersions, UnknownVersionError, replay
from tests.test_catalog import VOCAB, as_rows, mixed_items, same_items
from tests.test_retrieve_filters import passes, random_filter


def expected_after(items: list[Item], upserts: list[Item], delete: list[str]) -> list[Item]:
    """The obviously-right result: items in order without the deleted and replaced ones, then the
    batch's items (replacements and new ones) in the batch's order."""
    gone = set(delete) | {u.id for u in upserts}
    return [it for it in items if it.id not in gone] + list(upserts)


def live_ids(cat: Catalog) -> list[str]:
    return [it.id for it in cat.items]


def test_take_and_concat_equal_the_catalog_of_those_items():
    rng = random.Random(1)
    items = mixed_items(rng, 200)
    cat = Catalog(items)
    rows = rng.sample(range(200), 120)
    same_items(cat.take(rows), [items[r] for r in rows])
    more = [Item(f"new{k}", it.token_ids, it.id_token, it.semantic_id, it.meta, it.attrs)
            for k, it in enumerate(mixed_items(random.Random(2), 50))]
    joined = cat.take(rows).concat(Catalog(more))
    same_items(joined, [items[r] for r in rows] + more)
    assert joined.index == {it.id: k for k, it in enumerate([items[r] for r in rows] + more)}


@pytest.mark.parametrize("seed", range(4))
def test_updates_equal_the_catalog_built_from_the_expected_items(seed):
    rng = random.Random(seed)
    items = mixed_items(rng, 150)
    cat = Catalog(items)
    for _ in range(5):
        ids = [it.id for it in items]
        delete = rng.sample(ids, rng.randint(0, 10)) + ["missing"]
        fresh = mixed_items(random.Random(rng.random()), 30)
        upserts = [Item(rng.choice(ids) if rng.random() < 0.5 else f"n{rng.random()}", *_body(it))
                   for it in fresh]
        upserts = list({u.id: u for u in upserts}.values())  # one per id
        upserts = [u for u in upserts if u.id not in delete]
        cat = apply_update(cat, parse_items(as_rows(upserts), None, VOCAB)).catalog
        res = apply_update(cat, None, delete)
        assert res.unknown == 1 and res.deleted == len(set(delete) - {"missing"})
        cat = res.catalog
        items = expected_after(expected_after(items, upserts, []), [], delete)
        same_items(cat, items)
        again = [Item(i, *_body(it)) for i, it in zip(rng.sample([it.id for it in items], 5),
                                                         mixed_items(random.Random(rng.random()), 5))]
        res = apply_update(cat, Catalog(again))  # replacements only
        assert res.replaced == 5
        # the storage is shared, not copied (the ids' unless they had to grow past their room)
        room = len(cat._bufs["id_flat"].data)
        assert np.shares_memory(res.catalog.ids.flat, cat.ids.flat) or len(res.catalog.ids.flat) > room
        assert np.shares_memory(res.catalog.token_flat, cat.token_flat)
        assert np.shares_memory(res.catalog.attrs.columns["year"].data, cat.attrs.columns["year"].data)
        old_items = list(cat.items)
        cat, items = res.catalog, expected_after(items, again, [])
        same_items(cat, items)
        same_items(Catalog(old_items), old_items)  # the old version reads as before
        ref = Catalog(items)  # filters see the new rows, never a dead one
        for _ in range(10):
            spec = {k: v for k, v in random_filter(rng).items() if k in ref.attrs.columns}
            if "adult" in ref.attrs.columns and rng.random() < 0.5:
                spec["adult"] = {"eq": rng.random() < 0.5}  # a bool column
            assert cat.filter_mask(spec)[cat.live_rows()].tolist() == ref.filter_mask(spec).tolist() == [
                passes(it.attrs, spec) for it in items]
            assert not cat.filter_mask(spec)[~cat.alive_mask()].any()


def _body(it: Item):
    return it.token_ids, it.id_token, it.semantic_id, it.meta, it.attrs


def test_changed_ids_and_counts():
    cat = Catalog([Item("a", (1,), None, (1, 2)), Item("b", (2,), None, (1, 3)), Item("c", (3,), None, (2, 2))])
    res = apply_update(cat, parse_items([{"id": "b", "token_ids": [9]}, {"id": "d", "token_ids": [4]}]), ["a", "zz"])
    assert res.changed == {"a", "b", "d"}
    assert res.counts() == {"inserted": 1, "replaced": 1, "deleted": 1, "unknown_ids": 1}
    assert live_ids(res.catalog) == ["c", "b", "d"] and res.catalog.get("b").token_ids == (9,)
    assert res.removed_rows.tolist() == [0, 1] and res.added_from == 3 and res.catalog.num_rows == 5
    same_tokens = apply_update(cat, parse_items([{"id": "b", "token_ids": [2], "attrs": {"x": 1}}]))
    assert same_tokens.changed == set() and same_tokens.replaced == 1  # its item KV stays valid
    assert live_ids(cat) == ["a", "b", "c"] and cat.get("b").token_ids == (2,)  # the old version is untouched
    assert cat.index.get("d") is None and len(cat) == 3


def same_trie(a: SemanticIdTrie, b: SemanticIdTrie) -> None:
    for name in ("depth", "num_nodes", "max_children", "num_duplicate_paths"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("child_ptr", "child_tok", "child_key", "count", "level_tokens", "level_col"):
        assert all(torch.equal(x, y) for x, y in zip(getattr(a, name), getattr(b, name))), name
    assert torch.equal(a.row_leaf, b.row_leaf) and torch.equal(a.leaf_item, b.leaf_item)


def same_on_device(trie: LayeredTrie) -> None:
    """A LayeredTrie's beam-step arrays on its device (the upper levels, the level columns and the
    leaf level's DeviceLeaves) equal its host arrays, array for array."""
    host = lambda ts: [t.cpu().numpy() for t in ts]  # noqa: E731
    for name, arrays in (("child_ptr", trie.ptrs), ("child_tok", trie.toks), ("child_key", trie.keys)):
        assert all(np.array_equal(a, b) for a, b in zip(host(getattr(trie, name)), arrays, strict=True)), name
    assert all(np.array_equal(a, np.flatnonzero(c)) for a, c in zip(host(trie.level_tokens), trie.tok_count))
    for name, a in trie.leaves.arrays().items():
        assert np.array_equal(a, getattr(trie, name)), name


@pytest.mark.parametrize("kind", ["dense", "layered, compacted each time", "layered, never compacted",
                                  "layered on a device, compacted each time", "layered on a device, never compacted"])
@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_the_trie_follows_updates_and_equals_the_one_built_from_scratch(seed, nd, kind, monkeypatch):
    """Each trie's `updated` (what a rank runs per update: SemanticIdTrie's, LayeredTrie's, the
    versions that cost what changed) against SemanticIdTrie.from_catalog after every update, array
    for array (a LayeredTrie's `dense`), and a LayeredTrie reader for reader: small paths so that
    nodes are shared, emptied and made again (a parent emptied and refilled by one update),
    repeated paths, items without a semantic ID, branches from older versions; the LayeredTrie
    compacted after every update (in place, as ranks that share a trie do) or never; on a device
    (here the CPU: DeviceLeaves extended per version, as on a GPU), its device arrays equal its host
    arrays after every version, and an older version's stay as they were."""
    layered = kind != "dense"
    device = "cpu" if "device" in kind else None
    compact = 0 if "each" in kind else 10**9
    monkeypatch.setattr(sgrec.beam.layered, "COMPACT_MIN", compact)
    monkeypatch.setattr(sgrec.beam.layered, "COMPACT_FRACTION", 0 if compact == 0 else 1.0)
    rng = random.Random(seed)

    def path():
        return [rng.randrange(3), rng.randrange(4), rng.randrange(3)][:nd]

    def line(i):
        return {"id": i, "token_ids": [5], **({"semantic_id": path()} if rng.random() < 0.9 else {})}

    cat = Catalog([Item(f"i{k}", (5,), None, tuple(path())) for k in range(25)])
    trie, rows = LayeredTrie.from_catalog(cat, VOCAB, device) if layered else SemanticIdTrie.from_catalog(cat, VOCAB)
    if layered:
        trie.background = False  # compact in `updated` (as ranks that share their tries do)
        assert rows is None and (trie.leaves is None) == (device is None)
        same_readers(trie, cat)
    versions = [(cat, trie, rows)]
    for step in range(10):
        cat, trie, rows = versions[-1] if rng.random() < 0.8 else rng.choice(versions)  # sometimes a branch
        live = list(cat.index)
        delete = rng.sample(live, rng.randint(0, min(5, len(live) - 1)))
        ups = [line(rng.choice(live) if rng.random() < 0.4 else f"n{step}_{j}") for j in range(rng.randint(0, 6))]
        ups = list({u["id"]: u for u in ups if u["id"] not in delete}.values())
        res = apply_update(cat, parse_items(ups, None, VOCAB) if ups else None, delete)
        if res.added_from is None or not res.catalog.semantic_rows().size:
            continue
        ref, ref_rows = SemanticIdTrie.from_catalog(res.catalog, VOCAB)
        got, got_rows = trie.updated(rows, res.catalog, res.removed_rows, res.added_from)
        if layered:
            assert got_rows is None and (not got.tail_tok.size if compact == 0 else got.base_tok is trie.base_tok)
            same_readers(got, res.catalog)
            if device:
                same_on_device(got)
            dense, dense_rows = got.dense(res.catalog)
        else:
            dense, dense_rows = got, got_rows
        assert np.array_equal(dense_rows, ref_rows)
        same_trie(dense, ref)
        fresh, _ = SemanticIdTrie.from_catalog(res.catalog.compacted(), VOCAB)  # the rows renumbered from 0
        same_trie(SemanticIdTrie(res.catalog.semantic_ids[dense_rows], VOCAB), fresh)
        versions.append((res.catalog, got, got_rows))
    if layered:
        same_readers(versions[1][1], versions[1][0])  # an older version is left as it was
    if device:
        same_on_device(versions[1][1])


@pytest.mark.parametrize("layered", [False, True], ids=["dense", "layered"])
def test_the_trie_follows_updates_on_a_large_catalog(layered):
    """As above with 60,000 items (ids past the small tables SemanticIdTrie.updated reads per
    bucket of ids), repeated paths, and updates that empty and create nodes at every level; the
    LayeredTrie with its default compaction (none here: the changes stay under its threshold)."""
    rng = np.random.default_rng(1)
    n = 60_000
    cat = Catalog.from_columns([f"i{k}" for k in range(n)], np.full(n, 5, np.int32), np.arange(n + 1), np.full(n, -1),
                               rng.integers(0, [40, 60, 50], (n, 3)).astype(np.int32), np.ones(n, bool), AttrTable(n))
    trie, rows = (LayeredTrie if layered else SemanticIdTrie).from_catalog(cat, VOCAB)
    base = getattr(trie, "base_tok", None)
    for step in range(4):
        live = cat.live_rows()
        delete = [cat.ids[r] for r in rng.choice(live, 300, replace=False)]
        ups = [{"id": cat.ids[r] if k % 2 else f"n{step}_{k}", "token_ids": [5],
                "semantic_id": rng.integers(0, [45, 60, 55]).tolist()} for k, r in enumerate(rng.choice(live, 200))]
        ups = list({u["id"]: u for u in ups if u["id"] not in delete}.values())
        res = apply_update(cat, parse_items(ups, None, VOCAB), delete)
        trie, rows = trie.updated(rows, res.catalog, res.removed_rows, res.added_from)
        got, got_rows = trie.dense(res.catalog) if layered else (trie, rows)
        if layered:
            assert trie.tail_tok.size and trie.base_tok is base  # the base shared, the changes in the tail
        ref, ref_rows = SemanticIdTrie.from_catalog(res.catalog, VOCAB)
        assert np.array_equal(got_rows, ref_rows)
        same_trie(got, ref)
        cat = res.catalog
    if layered:
        same_readers(trie, cat)


def same_readers(got: LayeredTrie, cat: Catalog) -> None:
    """Every reader of a LayeredTrie (what beam search and filters call) against the SemanticIdTrie
    built from scratch: each node's children (tokens, in order), leaves by their items and counts,
    each row's path, filter counts, a leaf's rows, child lookups."""
    ref, rows = SemanticIdTrie.from_catalog(cat, VOCAB)
    D = ref.depth
    slot_of = {}  # the layered leaf id (slot) of each dense leaf id
    for d in range(D):
        nodes = torch.arange(ref.num_nodes[d])
        for trie in (got, ref):
            start, count = trie.runs(d, nodes)
            pos = torch.cat([torch.arange(int(s), int(s + c)) for s, c in zip(start, count)])
            toks, kids = trie.child_at(d, pos)
            parent = torch.repeat_interleave(nodes, count)
            assert torch.equal(trie.child_nodes(d, parent, toks), kids)
            if trie is got:
                got_toks, got_kids = toks, kids
        assert torch.equal(got_toks, toks)  # the same children in the same order
        if d < D - 1:
            assert torch.equal(got_kids, kids)  # the upper levels' ids are the dense ones
        else:
            slot_of = dict(zip(kids.tolist(), got_kids.tolist()))
    leaves = np.arange(ref.num_nodes[D])
    slots = np.array([slot_of[x] for x in leaves.tolist()])
    assert np.array_equal(got.leaf_items(torch.from_numpy(slots)).numpy(), rows[ref.leaf_item.numpy()])
    assert np.array_equal(got.leaf_count(slots), ref.count[D].numpy())
    assert got.num_nodes == ref.num_nodes and got.num_duplicate_paths == ref.num_duplicate_paths
    on_path, ref_path = got.path_nodes(rows, cat), ref.path_nodes(np.arange(rows.size))
    assert all(np.array_equal(a, b) for a, b in zip(on_path[:D], ref_path[:D]))
    assert np.array_equal(on_path[D], slots[ref_path[D]])
    ok = (np.random.default_rng(len(rows)).random(cat.num_rows) < 0.5) & cat.alive_mask()  # as filter_mask's
    for d, (a, b) in enumerate(zip(got.filter_counts(ok), ref.filter_counts(ok[rows]))):
        if d:
            assert torch.equal(a[torch.from_numpy(slots)] if d == D else a, b), d
    sample = leaves[:: max(1, leaves.size // 20)]
    for leaf in sample.tolist():
        assert got.rows_of_leaf(slot_of[leaf], cat) == rows[ref.rows_of_leaf(leaf)].tolist()
    got_leaf, got_rows = got.rows_of_leaves(slots[sample], cat)
    ref_leaf, ref_rows = ref.rows_of_leaves(sample)
    assert sorted(zip(got_leaf.tolist(), got_rows.tolist())) == sorted(zip(slots[ref_leaf].tolist(),
                                                                           rows[ref_rows].tolist()))
    for d in range(1, D + 1):
        nodes = slots if d == D else np.arange(ref.num_nodes[d])
        assert np.array_equal(got.node_count(d, nodes), ref.count[d].numpy())


class _HeldCompactor:
    """sgrec.beam.layered.compactor's stand-in: each compaction waits until the test runs it."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn):
        from concurrent.futures import Future

        fut = Future()
        self.jobs.append((fut, fn))
        return fut

    def run(self):
        for fut, fn in self.jobs:
            fut.set_result(fn())
        self.jobs.clear()


def test_a_layered_trie_compacts_in_the_background_and_replays_the_updates_made_meanwhile(monkeypatch):
    """Past the threshold an update hands the compaction to the background thread and returns at
    once; versions made while it runs keep their tails and record their updates; once it is done,
    each update replays CATCH_UP of them on the compacted trie, and the one that replays the last
    serves it. Every version equals the trie built from scratch, before, during and after; a
    failed compaction leaves the tails serving."""
    held = _HeldCompactor()
    monkeypatch.setattr(sgrec.beam.layered, "compactor", held)
    monkeypatch.setattr(sgrec.beam.layered, "COMPACT_MIN", 30)
    monkeypatch.setattr(sgrec.beam.layered, "CATCH_UP", 2)  # the log of 3 updates takes two updates to replay
    rng = random.Random(3)

    def path():
        return [rng.randrange(4), rng.randrange(5), rng.randrange(6)]

    cat = Catalog([Item(f"i{k}", (5,), None, tuple(path())) for k in range(60)])
    trie, _ = LayeredTrie.from_catalog(cat, VOCAB)
    phases = []
    for step in range(14):
        live = list(cat.index)
        ups = [{"id": rng.choice(live) if j % 2 else f"n{step}_{j}", "token_ids": [5], "semantic_id": path()}
               for j in range(4)]
        ups = list({u["id"]: u for u in ups}.values())
        res = apply_update(cat, parse_items(ups, None, VOCAB), [rng.choice(live)])
        before = trie
        trie, _ = trie.updated(None, res.catalog, res.removed_rows, res.added_from)
        cat = res.catalog
        dense, dense_rows = trie.dense(cat)
        ref, ref_rows = SemanticIdTrie.from_catalog(cat, VOCAB)
        same_trie(dense, ref)
        assert np.array_equal(dense_rows, ref_rows)
        same_readers(trie, cat)
        if trie._job is None and before._job is None:
            pass  # under the threshold
        elif trie._job is None:
            phases.append("replayed")
            assert trie.base_tok is not before.base_tok and trie.written < before.written  # the new base
            assert len(before._job[2]) + 1 <= sgrec.beam.layered.CATCH_UP  # what was left, and this update
        elif trie._job is not None and before._job is None:
            phases.append("started")
            assert len(held.jobs) == 1 and trie.tail_tok.size  # nothing compacted yet: the version as it is
        elif trie._job[1] is None:
            phases.append("recorded")
            assert len(trie._job[2]) == len(before._job[2]) + 1 and trie._job[0] is before._job[0]
        else:  # catching up: CATCH_UP replayed, this one recorded
            phases.append("caught up")
            assert len(trie._job[2]) == len(before._job[2]) + 1 - sgrec.beam.layered.CATCH_UP
        if phases[-3:] == ["started", "recorded", "recorded"]:
            held.run()  # done: the next updates replay
    assert phases.count("started") >= 2 and "replayed" in phases, phases

    failing = _HeldCompactor()  # a compaction that fails: logged, the tails go on, the next threshold tries again
    monkeypatch.setattr(sgrec.beam.layered, "compactor", failing)
    held.run()
    while trie._job is None or trie._job[0].done():  # the held one caught up first
        res = apply_update(cat, parse_items([{"id": f"f{cat.num_rows}", "token_ids": [5], "semantic_id": path()}],
                                            None, VOCAB))
        trie, cat = trie.updated(None, res.catalog, res.removed_rows, res.added_from)[0], res.catalog
    failing.jobs[0][0].set_exception(MemoryError("no room"))
    failing.jobs.clear()
    res = apply_update(cat, parse_items([{"id": "g", "token_ids": [5], "semantic_id": path()}], None, VOCAB))
    trie, _ = trie.updated(None, res.catalog, res.removed_rows, res.added_from)
    same_trie(trie.dense(res.catalog)[0], SemanticIdTrie.from_catalog(res.catalog, VOCAB)[0])
    assert trie._job is not None and len(failing.jobs) == 1  # still past the threshold: a new one started


def test_a_layered_trie_update_costs_what_it_changed():
    """The regression guard for the O(k) versions: a LayeredTrie update of 10 items on a
    200,000-item catalog allocates its parents' run pointers (O(parents at the level above the
    leaves): 400 here), the changed runs and counts, and now and then room for its tails, never an
    array over the leaves or rows (SemanticIdTrie.updated makes half a dozen, 8 bytes per leaf
    each). Counted with tracemalloc (numpy reports its buffers), so it holds on any machine."""
    import tracemalloc

    n = 200_000
    rng = np.random.default_rng(0)
    cat = Catalog.from_columns([f"i{k}" for k in range(n)], np.full(n, 5, np.int32), np.arange(n + 1), np.full(n, -1),
                               rng.integers(0, [20, 20, 500], (n, 3)).astype(np.int32), np.ones(n, bool), AttrTable(n))
    trie, _ = LayeredTrie.from_catalog(cat, VOCAB)
    assert trie.num_nodes[2] == 400 and trie.num_nodes[3] > 100_000  # 400 parents
    cat = apply_update(cat, parse_items([{"id": "first", "token_ids": [5], "semantic_id": [1, 2, 3]}], None,
                                        VOCAB)).catalog  # the first: the columns move into growing storage
    trie, _ = trie.updated(None, cat, np.zeros(0, np.int64), n)
    tracemalloc.start()
    for step in range(5):
        ups = [{"id": f"i{rng.integers(n)}" if j % 2 else f"n{step}_{j}", "token_ids": [5],
                "semantic_id": rng.integers(0, [20, 20, 500]).tolist()} for j in range(10)]
        res = apply_update(cat, parse_items(ups, None, VOCAB), [f"i{rng.integers(n)}"])
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        got, _ = trie.updated(None, res.catalog, res.removed_rows, res.added_from)
        peak = tracemalloc.get_traced_memory()[1] - before
        assert peak < 4 * trie.num_nodes[3], peak  # half of one int64 array over the leaves; dense: 6 or more
        cat, trie = res.catalog, got
        last = peak
    tracemalloc.stop()
    dense, rows = trie.dense(cat)  # the same update on a SemanticIdTrie: the guard tells them apart
    res = apply_update(cat, parse_items(ups, None, VOCAB), [f"i{rng.integers(n)}"])
    tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    dense.updated(rows, res.catalog, res.removed_rows, res.added_from)
    assert tracemalloc.get_traced_memory()[1] - before > 10 * max(last, 4 * trie.num_nodes[3])
    tracemalloc.stop()


def test_an_update_costs_what_it_changed():
    """Memory allocated by an update of a few items, past the first (which moves the loaded columns
    into storage that grows): about the batch plus one bit per row (the dead rows), never a copy of
    a column. Counted with tracemalloc (numpy reports its buffers), so it holds on any machine."""
    import tracemalloc

    n = 200_000
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 7, n)
    ptr = np.concatenate([[0], np.cumsum(lens)])
    attrs = AttrTable(n, {"year": AttrColumn("num", n, rng.integers(1950, 2026, n).astype(np.float64),
                                             present=np.ones(n, bool)),
                          "genre": AttrColumn("str", n, rng.integers(0, 3, n).astype(np.int32), values=["a", "b", "c"])})
    cat = Catalog.from_columns([f"item{i}" for i in range(n)], rng.integers(3, VOCAB, ptr[-1]).astype(np.int32), ptr,
                               rng.integers(3, VOCAB, n), rng.integers(0, VOCAB, (n, 3)).astype(np.int32),
                               np.ones(n, bool), attrs)

    def batch(k):
        return parse_items([{"id": f"item{rng.integers(n)}" if j % 2 else f"new{rng.random()}", "token_ids": [5, 6],
                             "semantic_id": [1, 2, 3], "attrs": {"year": 2000, "genre": "d"}} for j in range(k)],
                           None, VOCAB)

    cat = apply_update(cat, batch(10)).catalog  # the first: the columns move into growing storage
    tracemalloc.start()
    for _ in range(5):
        b = batch(10)
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        res = apply_update(cat, b, [f"item{rng.integers(n)}"])
        assert res.catalog.num_rows == cat.num_rows + 10
        peak = tracemalloc.get_traced_memory()[1] - before
        assert peak < n // 8 + 64 * 1024, peak  # one bit per row and the batch; a column is >= 800 KB
        cat = res.catalog
    tracemalloc.stop()


@pytest.mark.parametrize("batch, message", [
    ([{"id": "x", "token_ids": [1]}, {"id": "y"}], "items[1] ('y'): give exactly one of items[1].text and items[1].token_ids"),
    ([{"id": "x", "token_ids": [1]}, {"id": "x", "token_ids": [2]}], "items[1] ('x'): duplicate item id"),
    ([{"id": "x", "token_ids": [1]}, {"id": "z", "token_ids": [VOCAB + 5]}], "items[1] ('z'): items[1].token_ids holds"),
    ([{"id": "x", "token_ids": [1], "attrs": {"year": [1]}}], "items[0] ('x'): attrs.year must be"),
    ([], "items must be a non-empty list"),
    ("x", "items must be a non-empty list"),
])
def test_a_bad_batch_names_its_first_bad_item(batch, message):
    with pytest.raises(UpdateError) as e:
        parse_items(batch, None, VOCAB)
    assert message in str(e.value)


@pytest.mark.parametrize("batch, message", [
    ([{"id": "x", "token_ids": [1], "semantic_id": [1, 2]}], "semantic_id has 2 tokens here but 3"),
    ([{"id": "x", "token_ids": [1], "attrs": {"genre": "Drama"}}], "attrs.genre is str here but strs"),
])
def test_a_batch_that_does_not_fit_the_catalog_changes_nothing(batch, message):
    cat = Catalog([Item("a", (1,), None, (1, 2, 3), attrs={"genre": ["Comedy"]}), Item("b", (2,))])
    with pytest.raises(UpdateError, match=message):
        apply_update(cat, parse_items(batch, None, VOCAB))
    with pytest.raises(UpdateError, match="every item"):
        apply_update(cat, None, ["a", "b"])
    same_items(cat, [Item("a", (1,), None, (1, 2, 3), attrs={"genre": ["Comedy"]}), Item("b", (2,))])


# ---- the journal ----------------------------------------------------------------------------
def write_journal(path, records, tail: bytes = b""):
    with open(path, "wb") as f:
        for r in records:
            f.write((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n")
        f.write(tail)
    return str(path)


RECS = [{"version": 1, "op": "upsert", "items": [{"id": "n", "token_ids": [5]}]},
        {"version": 2, "op": "delete", "ids": ["a"]},
        {"version": 3, "op": "rollback", "to": 1}]


def test_journal_round_trip_and_fsynced_appends(tmp_path):
    path = str(tmp_path / "j")
    j = journal.Journal(path)
    for r in RECS:
        j.append(r)
    with pytest.raises(CatalogError, match="held by another process"):
        journal.Journal(path).append(RECS[0])  # one writer at a time
    j.close()
    assert journal.read(path) == (0, RECS, None)
    assert journal.last_version(path) == 3
    assert journal.read(str(tmp_path / "none")) == (0, [], None)


def test_a_torn_last_line_is_dropped_with_a_warning_and_repaired(tmp_path):
    path = write_journal(tmp_path / "j", RECS[:2], tail=b'{"version": 3, "op": "rollb')
    base, recs, warning = journal.read(path)
    assert recs == RECS[:2] and "j:3: dropped a torn last journal record" in warning
    assert journal.repair(path) == warning
    assert journal.read(path) == (0, RECS[:2], None)
    journal.Journal(path).append(RECS[2])  # appends after the repair land on their own line
    assert journal.read(path) == (0, RECS, None)


@pytest.mark.parametrize("lines, message", [
    ([RECS[0], b'{"version": 2, "op": "del', RECS[2]], "j:2: corrupt journal record: unexpected end of data"),
    ([RECS[0], RECS[2]], "j:2: corrupt journal record: version 3 where 2 was due"),
    ([RECS[1]], "j:1: corrupt journal record: version 2 where 1 was due"),
    ([RECS[0], {"version": 2, "op": "drop", "ids": ["a"]}], "j:2: corrupt journal record: unknown op 'drop'"),
    ([RECS[0], {"version": 2, "op": "rollback", "to": 2}], "'to' must be an earlier version"),
    ([RECS[0], {"version": 2, "op": "base"}], "a base record may only be the first line"),
])
def test_any_other_bad_journal_line_is_named(tmp_path, lines, message):
    path = write_journal(tmp_path / "j", lines)
    with pytest.raises(CatalogError, match=message.replace("(", r"\(")):
        journal.read(path)


def test_a_base_record_numbers_the_catalog_file(tmp_path):
    path = write_journal(tmp_path / "j", [{"version": 7, "op": "base"},
                                          {"version": 8, "op": "delete", "ids": ["a"]}])
    assert journal.read(path)[:2] == (7, [{"version": 8, "op": "delete", "ids": ["a"]}])
    assert journal.last_version(path) == 8


# ---- versions --------------------------------------------------------------------------------
def base_catalog() -> Catalog:
    return Catalog([Item("a", (1,), None, (1, 2)), Item("b", (2,), None, (1, 3))])


def test_versions_rollback_returns_the_very_catalog_and_the_ids_changed_since():
    v = CatalogVersions(base_catalog(), keep=3)
    v0 = v.current
    v.commit(v.prepare({"version": 1, "op": "upsert", "items": [{"id": "c", "token_ids": [3], "semantic_id": [2, 2]}]}))
    v1 = v.current
    v.commit(v.prepare({"version": 2, "op": "delete", "ids": ["a"]}))
    p = v.prepare({"version": 3, "op": "rollback", "to": 1})
    assert p.applied.catalog is v1 and p.applied.changed == {"a"}
    v.commit(p)
    assert v.kept() == [1, 2, 3] and v.current is v1
    with pytest.raises(UnknownVersionError, match="not kept"):
        v.prepare({"version": 4, "op": "rollback", "to": 0})  # trimmed (keep=3)
    with pytest.raises(UpdateError, match="not the next one"):
        v.prepare({"version": 9, "op": "delete", "ids": ["a"]})
    p = v.prepare({"version": 4, "op": "rollback", "to": 2})
    assert p.applied.changed == {"a"}  # 3 changed a back; 2 -> 4 is 3's change
    assert live_ids(v0) == ["a", "b"]


def test_replay_equals_the_live_versions_and_keeps_rollback_targets(tmp_path):
    rng = random.Random(5)
    items = mixed_items(rng, 60)
    live = CatalogVersions(Catalog(items), keep=100)  # the obviously-right state: every version kept
    recs = []
    for n in range(1, 12):
        if n in (6, 11):
            rec = {"version": n, "op": "rollback", "to": 1 if n == 6 else 4}  # 1 and 4: outside the window
        elif n % 3 == 0:
            rec = {"version": n, "op": "delete", "ids": rng.sample(live_ids(live.current), 3)}
        else:
            ups = [Item(f"u{n}_{k}", *_body(it)) for k, it in enumerate(mixed_items(random.Random(n), 4))]
            rec = {"version": n, "op": "upsert", "items": canonical_lines(Catalog(ups))}
        recs.append(rec)
        live.commit(live.prepare(rec, VOCAB))
    path = write_journal(tmp_path / "j", recs)
    got = replay(Catalog(items), path, keep=2, vocab_size=VOCAB)
    assert got.kept() == [10, 11]
    assert got.current is got.catalogs[11]
    same_items(got.current, list(live.catalogs[4].items))
    same_items(got.catalogs[10], list(live.catalogs[10].items))
    bad = write_journal(tmp_path / "bad", [{"version": 1, "op": "rollback", "to": 0},
                                           {"version": 2, "op": "upsert", "items": [{"id": "x", "token_ids": [1],
                                                                                     "semantic_id": [1]}]}])
    with pytest.raises(CatalogError, match="bad: record of version 2: semantic_id has 1 tokens here but 3"):
        replay(Catalog(items), bad, vocab_size=VOCAB)


# ---- compaction --------------------------------------------------------------------------------
from sgrec.catalog import compact as compaction  # noqa: E402
from sgrec.catalog import load_catalog  # noqa: E402
from sgrec.catalog.jsonl import write as write_catalog_file  # noqa: E402


@pytest.fixture(params=["jsonl", "npz", "parquet"])
def journaled(tmp_path, request):
    """A catalog file of each form with a journal of three updates, and the items they lead to."""
    from sgrec.catalog import binary, parquet

    items = mixed_items(random.Random(7), 40)
    path = str(tmp_path / f"cat.{request.param}")
    write = {"npz": binary.save, "parquet": parquet.write}.get(request.param)
    (write(Catalog(items), path) if write else write_catalog_file(items, path))
    recs = [{"version": 1, "op": "upsert", "items": canonical_lines(Catalog(mixed_items(random.Random(8), 3)[:1]))},
            {"version": 2, "op": "delete", "ids": ["it3", "it4"]},
            {"version": 3, "op": "upsert", "items": [{"id": "zz", "token_ids": [1, 2], "semantic_id": [3, 4, 5]}]}]
    write_journal(path + ".journal", recs)
    return path, list(replay(Catalog(items), path + ".journal", vocab_size=VOCAB).current.items)


def test_compact_writes_the_current_version_and_empties_the_journal(journaled):
    path, want = journaled
    assert compaction.compact(path, vocab_size=VOCAB) == (3, len(want))
    same_items(load_catalog(path, vocab_size=VOCAB), want)
    assert journal.read(path + ".journal") == (3, [], None)
    journal.Journal(path + ".journal").append({"version": 4, "op": "delete", "ids": ["zz"]})  # numbering goes on
    got = replay(load_catalog(path, vocab_size=VOCAB), path + ".journal", vocab_size=VOCAB)
    assert got.version == 4 and "zz" not in got.current


def test_compact_refuses_while_a_server_holds_the_journal(journaled):
    path, _ = journaled
    j = journal.Journal(path + ".journal")
    j.append({"version": 4, "op": "delete", "ids": ["it5"]})
    with pytest.raises(CatalogError, match="held by another process"):
        compaction.compact(path, vocab_size=VOCAB)
    j.close()


@pytest.mark.parametrize("crash_after", ["catalog_tmp", "journal_tmp", "catalog_renamed", "journal_tmp_torn"])
def test_an_interrupted_compaction_is_finished_or_dropped(journaled, crash_after, monkeypatch):
    """A crash at each point of compact: `finish` (what the server runs at start-up) leaves a pair of
    files that replays to the same items as before the compaction."""
    path, want = journaled
    replace = compaction.os.replace
    steps = []

    def crashing_replace(src, dst):
        steps.append(dst)
        if crash_after == "catalog_renamed" and len(steps) == 2:
            raise KeyboardInterrupt  # the process dies between the two renames
        return replace(src, dst)

    def crashing_write(p, write):
        write(p)
        is_journal = p.endswith(".journal.compact-tmp")
        if crash_after == "journal_tmp_torn" and is_journal:
            with open(p, "rb+") as f:
                f.truncate(10)
        if crash_after == "catalog_tmp" and not is_journal or crash_after.startswith("journal_tmp") and is_journal:
            raise KeyboardInterrupt

    monkeypatch.setattr(compaction.os, "replace", crashing_replace)
    monkeypatch.setattr(compaction, "_write_synced", crashing_write)
    with pytest.raises(KeyboardInterrupt):
        compaction.compact(path, vocab_size=VOCAB)
    monkeypatch.undo()
    done = compaction.finish(path, path + ".journal")
    rolled_forward = crash_after in ("journal_tmp", "catalog_renamed")
    assert done is not None and done.startswith("finished" if rolled_forward else "dropped")
    got = replay(load_catalog(path, vocab_size=VOCAB), path + ".journal", vocab_size=VOCAB)
    assert got.version == 3
    same_items(got.current, want)
    assert journal.read(path + ".journal")[0] == (3 if rolled_forward else 0)
    assert compaction.finish(path, path + ".journal") is None  # nothing left over
