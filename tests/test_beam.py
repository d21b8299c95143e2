"""xBeam generative retrieval: every fast path against the obviously-right slow one."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from sgrec.beam import KVCacheFullError, RetrieveExecutor, SemanticIdTrie, naive_retrieve
from sgrec.beam.attention import BeamBatchMeta, BeamStepMeta, UnsharedKV, staged_attention
from sgrec.beam.search import (
    apply_schedule_, inplace_schedule, per_beam_topk, reorder_rows_, select_beams, select_beams_full_sort,
    select_global,
)
from sgrec.beam.trie import children_logp
from sgrec.catalog import Catalog, Item
from sgrec.mem.kv_pool import KVPool
from sgrec.model.attention import SeqLayout, TorchBackend
from sgrec.radix.tree import RadixCache
from sgrec.model.cpu_linear import PackedLinear, packing_available
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs

TOL = 1e-4
POOL = 40000


# ---- helpers ------------------------------------------------------------------------------------
def random_catalog(rng: random.Random, n: int, nd: int, vocab: int, codes: int | None = None) -> Catalog:
    """n random distinct paths (tokens from `codes` values per level if given, else the whole vocab)."""
    pick = (lambda: rng.randrange(vocab)) if codes is None else (lambda: rng.randrange(vocab - codes, vocab))
    assert n <= (codes or vocab) ** nd
    paths: set[tuple[int, ...]] = set()
    while len(paths) < n:
        paths.add(tuple(pick() for _ in range(nd)))
    order = list(paths)
    rng.shuffle(order)
    return Catalog([Item(f"i{i}", (1,), 1, p) for i, p in enumerate(order)])


def sparse_catalog(rng: random.Random, roots: int, nd: int, vocab: int, p_single: float = 0.75) -> Catalog:
    """A catalog where most prefixes have exactly one child."""
    paths = [()]
    for _ in range(nd):
        nxt = []
        for pre in paths:
            width = 1 if (pre and rng.random() < p_single) else (roots if not pre else rng.randint(2, 5))
            for t in rng.sample(range(vocab), width):
                nxt.append(pre + (t,))
        paths = nxt
    return Catalog([Item(f"s{i}", (1,), 1, p) for i, p in enumerate(paths)])


def make_runner(path: str, pool: int = POOL) -> ModelRunner:
    return ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32", max_total_tokens=pool))


def assert_balanced(runner: ModelRunner, tree: RadixCache) -> None:
    tree.check_integrity()
    alloc = runner.kv_pool.allocator
    assert tree.protected_size() == 0
    assert alloc.available_size() + tree.total_size() == alloc.size


def assert_same(fast, slow) -> None:
    assert [x["item"] for x in fast.items] == [x["item"] for x in slow.items]
    assert [x["semantic_id"] for x in fast.items] == [x["semantic_id"] for x in slow.items]
    for a, b in zip(fast.items, slow.items):
        assert abs(a["score"] - b["score"]) <= TOL


@pytest.fixture(scope="module")
def runners(tiny_model_dir):
    cache = {}

    def get(arch: str = "llama", **overrides) -> ModelRunner:
        key = (arch, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = make_runner(tiny_model_dir(arch, **overrides))
        return cache[key]

    return get


@pytest.fixture
def new_tree():
    """new_tree(runner, **kw) -> RadixCache on the runner's pool; reset after the test, so a failing
    test does not leave KV behind for the next one on the shared runner."""
    trees = []

    def make(runner: ModelRunner, **kw) -> RadixCache:
        trees.append(RadixCache(runner.kv_pool.allocator, **kw))
        return trees[-1]

    yield make
    for t in trees:
        t.reset()


# ---- trie and masks -----------------------------------------------------------------------------
def test_trie_children_and_masks():
    rng = random.Random(1)
    V = 64
    cat = sparse_catalog(rng, 7, 3, V)
    paths = {it.semantic_id for it in cat.items}
    trie, rows = SemanticIdTrie.from_catalog(cat, V)
    assert trie.depth == 3 and trie.num_nodes[-1] == len(paths)
    first = sorted({p[0] for p in paths})

    # walk every prefix: the sparse children lists equal the catalog's, and children_logp equals the
    # dense -inf-masked log_softmax over the vocabulary
    nodes, prefixes = torch.zeros(1, dtype=torch.int64), [()]
    for d in range(trie.depth):
        want = [sorted({p[d] for p in paths if p[:d] == pre}) for pre in prefixes]
        r, t, _ = trie.children(d, nodes)
        got = [t[r == i].tolist() for i in range(len(prefixes))]
        assert got == want
        logits = torch.randn(len(prefixes), V)
        mask = torch.full((len(prefixes), V), float("-inf"))
        for i, w in enumerate(want):
            mask[i, w] = 0.0
        dense = torch.log_softmax(logits + mask, dim=-1)
        logp, toks = children_logp(logits, trie, d, nodes)
        for i, w in enumerate(want):
            assert toks[i, : len(w)].tolist() == w and bool(torch.isneginf(logp[i, len(w):]).all())
            assert torch.allclose(logp[i, : len(w)], dense[i, w], atol=1e-6)
        par = torch.repeat_interleave(nodes, torch.tensor([len(w) for w in want]))
        nodes = trie.child_nodes(d, par, torch.tensor([x for w in want for x in w]))
        prefixes = [pre + (x,) for pre, w in zip(prefixes, want) for x in w]
    leaves = trie.leaf_items(nodes).tolist()
    assert [cat.items[rows[i]].semantic_id for i in leaves] == prefixes
    with pytest.raises(RuntimeError):
        bad = next(t for t in range(V) if t not in first)
        trie.child_nodes(0, torch.zeros(1, dtype=torch.int64), torch.tensor([bad]))


def test_trie_duplicate_paths_map_to_first_item():
    trie = SemanticIdTrie([[1, 2], [1, 3], [1, 2]], vocab_size=8)
    assert trie.num_duplicate_paths == 1
    assert trie.leaf_item.tolist() == [0, 1]


# ---- selection ----------------------------------------------------------------------------------
def _brute_top(cand, tok, m, V):
    pool = [(-float(cand[b, j]), b, int(tok[b, j])) for b in range(cand.shape[0]) for j in range(cand.shape[1])
            if math.isfinite(float(cand[b, j]))]
    top = sorted(pool)[:m]
    top.sort(key=lambda x: (x[1], x[2]))
    return [b for _, b, _ in top], [t for _, _, t in top], [-s for s, _, _ in top]


@pytest.mark.parametrize("seed", range(6))
def test_select_beams_equals_full_sort(seed):
    g = torch.Generator().manual_seed(seed)
    V = 50
    for n, k, m in [(1, 40, 32), (7, 5, 10), (32, 16, 32), (16, 50, 16), (3, 4, 100), (64, 8, 1)]:
        logits = torch.randn(n, V, generator=g) * (3.0 if seed % 2 else 0.3)
        if seed >= 3:
            logits = torch.round(logits)  # many exact ties
        logits[torch.rand(n, V, generator=g) < 0.3] = float("-inf")
        logits[:, 0] = 0.0  # every row keeps a valid token
        vals, toks = per_beam_topk(torch.log_softmax(logits, -1), k)
        cand = torch.round(torch.randn(n, 1, generator=g)) + vals
        p, t, s, ranked = select_beams(cand, toks, m, V)
        rp, rt, rs = select_beams_full_sort(cand, toks, m, V)
        bp, bt, bs = _brute_top(cand, toks, m, V)
        assert p.tolist() == rp.tolist() == bp and t.tolist() == rt.tolist() == bt
        assert s.tolist() == rs.tolist() == bs
        assert ranked <= int(torch.isfinite(cand).sum())


@pytest.mark.parametrize("seed", range(6))
def test_global_selection_equals_per_beam_then_global(seed):
    """select_global (one pass, no per-row cap) == per-beam top-K then global top-m whenever K >= m,
    ties included (by path), and == the brute-force sort."""
    g = torch.Generator().manual_seed(seed)
    V = 50
    for n, m in [(1, 32), (7, 10), (32, 32), (16, 16), (3, 100), (64, 1), (5, 49)]:
        logits = torch.randn(n, V, generator=g) * (3.0 if seed % 2 else 0.3)
        if seed >= 3:
            logits = torch.round(logits)  # many exact ties
        logits[torch.rand(n, V, generator=g) < 0.3] = float("-inf")
        logits[:, 0] = 0.0
        scores = torch.round(torch.randn(n, 1, generator=g)) + torch.log_softmax(logits, -1)
        perm = torch.argsort(torch.rand(n, V, generator=g), dim=1)  # columns in any token order
        p, t, s = select_global(scores.gather(1, perm), perm, m, V)
        vals, toks = per_beam_topk(scores, V)  # K = V >= m: no cap
        bp, bt, bs = _brute_top(vals, toks, m, V)
        assert p.tolist() == bp and t.tolist() == bt and s.tolist() == bs


def test_per_beam_topk_breaks_ties_at_the_kth_place_by_column():
    """Values tied across a row's k-th place go to the lower columns (the smaller tokens), as the
    naive reference's stable sort and the Triton trie step choose: the kept columns of every row are
    the first k of a stable descending sort."""
    g = torch.Generator().manual_seed(0)
    logp = torch.round(torch.randn(64, 40, generator=g))  # many ties
    logp[torch.rand(64, 40, generator=g) < 0.2] = float("-inf")
    logp[:, 7] = 0.5  # every row keeps a valid entry
    for k in (1, 3, 10, 39, 40):
        vals, cols = per_beam_topk(logp, k)
        srt = torch.sort(logp, dim=-1, descending=True, stable=True)
        assert torch.equal(vals, srt.values[:, :k])
        finite = torch.isfinite(vals)
        for row in range(64):
            assert sorted(cols[row][finite[row]].tolist()) == sorted(srt.indices[row, :k][finite[row]].tolist())


def test_select_beams_terminates_early():
    n, k, m = 64, 64, 64
    tok = torch.arange(k).repeat(n, 1)
    # steep rows: the top m is every row's first candidate; one column is scanned
    cand = -torch.arange(n, dtype=torch.float32)[:, None] * 0.01 - torch.arange(k, dtype=torch.float32) * 10
    p, t, s, ranked = select_beams(cand, tok, m, k)
    assert ranked == m and p.tolist() == list(range(n)) and t.tolist() == [0] * n
    # one dominant beam: its row is scanned to the end, the others stop at once
    cand = -torch.arange(n, dtype=torch.float32)[:, None] * 10 - torch.arange(k, dtype=torch.float32) * 0.01
    p, t, s, ranked = select_beams(cand, tok, m, k)
    assert ranked == m and p.tolist() == [0] * m and t.tolist() == list(range(k))


# ---- in-place reorder ---------------------------------------------------------------------------
def random_parents(rng: random.Random, n_old: int, m: int) -> torch.Tensor:
    return torch.tensor(sorted(rng.randrange(n_old) for _ in range(m)))


def test_inplace_schedule_sequential_equals_copy():
    rng = random.Random(3)
    for _ in range(300):
        n_old = rng.randint(1, 40)
        m = rng.randint(1, 40)
        parents = random_parents(rng, n_old, m)
        rows = list(range(max(n_old, m)))
        want = [rows[p] for p in parents.tolist()]
        dst, src, direction = inplace_schedule(parents)
        buf = list(rows)
        for d, s in zip(dst.tolist(), src.tolist()):  # one write at a time, in schedule order
            buf[d] = buf[s]
        assert buf[:m] == want
        assert direction.tolist() == [(p > i) - (p < i) for i, p in enumerate(parents.tolist())]


def test_naive_write_order_would_be_wrong():
    # the test above can fail: writing in plain ascending order overwrites row 1 before row 2 reads it
    parents = [0, 0, 1]
    buf = [10, 11, 12]
    for i, p in enumerate(parents):
        buf[i] = buf[p]
    assert buf != [10, 10, 11]
    with pytest.raises(ValueError):
        inplace_schedule(torch.tensor([1, 0]))


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_inplace_update_equals_copy_based(chunk):
    rng = random.Random(chunk)
    g = torch.Generator().manual_seed(chunk)
    rows, cols = 24, 3
    pool = KVPool(rows * cols + 10, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    slots = pool.allocator.alloc(rows * cols)
    slots = slots[torch.randperm(slots.numel(), generator=g)].view(rows, cols)  # slots in no order
    kv = UnsharedKV(pool, slots, chunk=chunk)
    for _ in range(30):
        for layer in range(2):
            pool.k_buffer[layer].normal_(generator=g)
            pool.v_buffer[layer].normal_(generator=g)
        n_old, m, c = rng.randint(1, rows), rng.randint(1, rows), rng.randint(1, cols)
        parents = random_parents(rng, n_old, m)
        want = [(pool.k_buffer[L][slots[parents, :c]].clone(), pool.v_buffer[L][slots[parents, :c]].clone())
                for L in range(2)]
        untouched = [pool.k_buffer[L][slots[m:]].clone() for L in range(2)]
        kv.reorder_(parents, c)
        for L in range(2):
            assert torch.equal(pool.k_buffer[L][slots[:m, :c]], want[L][0])
            assert torch.equal(pool.v_buffer[L][slots[:m, :c]], want[L][1])
            assert torch.equal(pool.k_buffer[L][slots[m:]], untouched[L])
        # the token buffer path too
        toks = torch.randint(0, 100, (rows, cols), generator=g)
        ref = toks[parents, :c].clone()
        reorder_rows_(toks[:, :c], parents, chunk)
        assert torch.equal(toks[:m, :c], ref)


def test_apply_schedule_chunked_reads_before_writes():
    buf = torch.arange(6.0)[:, None]
    dst, src, _ = inplace_schedule(torch.tensor([1, 2, 2, 3, 3, 5]))
    apply_schedule_(buf, dst, src, chunk=2)
    assert buf.flatten().tolist() == [1, 2, 2, 3, 3, 5]


# ---- staged attention ---------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("P,s", [(1, 1), (37, 2), (300, 3), (0, 2), (5, 0)])
def test_staged_attention_equals_plain(hq, hkv, P, s):
    g = torch.Generator().manual_seed(P * 10 + s)
    n, D, slots = 9, 8, 400
    k_buf = torch.randn(slots, hkv, D, generator=g) * 2
    v_buf = torch.randn(slots, hkv, D, generator=g)
    q = torch.randn(n, hq, D, generator=g) * 2
    perm = torch.randperm(slots - 1, generator=g) + 1
    shared = perm[:P]
    unshared = perm[P:P + n * s].view(n, s)
    out = staged_attention(q, k_buf, v_buf, shared, unshared, scale=D**-0.5)
    for b in range(n):
        idx = torch.cat([shared, unshared[b]])
        ref = F.scaled_dot_product_attention(
            q[b][:, None, :], k_buf[idx].transpose(0, 1), v_buf[idx].transpose(0, 1), scale=D**-0.5,
            enable_gqa=hq != hkv,
        )  # [Hq, 1, D]
        assert torch.allclose(out[b], ref.reshape(-1), atol=1e-5, rtol=1e-5)


def test_children_logp_from_the_level_columns_only_equals_all_columns():
    """A beam step computes only trie.logit_columns(depth) (the level's distinct tokens); reading
    each child's logit from those columns gives children_logp of the full logits, bit for bit."""
    rng = random.Random(4)
    V = 500
    cat = random_catalog(rng, 300, 3, V, codes=60)
    trie, _ = SemanticIdTrie.from_catalog(cat, V)
    nodes = torch.zeros(1, dtype=torch.int64)
    for d in range(trie.depth):
        cols = trie.logit_columns(d)
        want_cols = sorted({it.semantic_id[d] for it in cat.items})
        assert cols is not None and cols.tolist() == want_cols
        logits = torch.randn(nodes.numel(), V)
        full, toks = children_logp(logits, trie, d, nodes)
        part, toks2 = children_logp(logits[:, cols], trie, d, nodes, restricted=True)
        assert torch.equal(toks, toks2) and torch.equal(full, part)
        keep = torch.isfinite(full)  # every valid child becomes a beam of the next level
        nodes = trie.child_nodes(d, nodes[keep.nonzero()[:, 0]], toks[keep])
    wide, _ = SemanticIdTrie.from_catalog(random_catalog(rng, 400, 2, 64), 64)
    assert wide.logit_columns(0) is None  # over half the vocabulary: the whole output layer


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_of_some_columns_equal_those_of_all_columns(tiny_model_dir, pack, tied):
    """compute_logits(hidden, columns) == compute_logits(hidden)[:, columns] within float32
    rounding, also with the output layer prepacked for oneDNN (vocabulary 4,500 x 64: packed)."""
    if pack and not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN weight packing is not available in this torch build")
    path = tiny_model_dir("llama", vocab_size=4500, tie_word_embeddings=tied)
    runner = ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32", max_total_tokens=64,
                                                disable_weight_packing=not pack))
    model = runner.model
    assert isinstance(model.lm_head, PackedLinear) == pack
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, runner.config.hidden_size, generator=g)
    cols = torch.randperm(4500, generator=g)[:700]
    got, want = model.compute_logits(hidden, cols), model.compute_logits(hidden)[:, cols]
    assert got.shape == (9, 700) and (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_beam_step_logits_equal_plain_backend(new_tree, runners, arch):
    """A whole model step through StagedBeamBackend == the runner's plain backend over each beam's
    concatenated KV (prompt slots + its own slots)."""
    runner = runners(arch)
    V, alloc = runner.config.vocab_size, runner.kv_pool.allocator
    g = torch.Generator().manual_seed(3)
    P, n, s = 33, 12, 3
    ids = torch.randint(0, V, (P,), generator=g).tolist()
    prompt = alloc.alloc(P)
    own = alloc.alloc(n * s).view(n, s)
    try:
        runner.forward(runner.make_batch(ids, list(range(P)), prompt, [SeqLayout(0, P, prompt)]), [P - 1])
        ex = RetrieveExecutor(runner, new_tree(runner), random_catalog(random.Random(0), 20, 2, V))
        toks = torch.randint(0, V, (n, s), generator=g)
        for step in range(s):  # fill each beam's own tokens, then compare the last step
            staged = ex._beam_forward(toks[:, step], torch.full((n,), P + step), own[:, step].contiguous(),
                                      BeamStepMeta(prompt, own[:, : step + 1]))
        seqs = [SeqLayout(b, 1, torch.cat([prompt, own[b]])) for b in range(n)]
        plain = runner.forward(runner.make_batch(toks[:, -1].tolist(), [P + s - 1] * n, own[:, -1], seqs),
                               list(range(n)))
        assert (staged - plain).abs().max() <= TOL
    finally:
        alloc.free(prompt)
        alloc.free(own.reshape(-1))


# ---- the executor against the naive reference ----------------------------------------------------
@pytest.mark.parametrize(
    "arch,overrides,seed,bw,top_k,num_items,nd,n_items",
    [
        ("llama", {}, 0, 8, 8, 8, 3, 300),
        ("qwen2", {}, 1, 32, 5, 10, 3, 2000),
        ("qwen3", {}, 2, 64, 64, 20, 3, 1500),
        ("llama", {"num_key_value_heads": 1}, 3, 16, 100, 16, 4, 800),
        ("llama", {}, 4, 128, 16, 50, 2, 1200),
        ("qwen2", {}, 5, 1, 3, 1, 3, 100),
        ("llama", {}, 6, 20, 20, 5, 1, 30),
        ("qwen2", {}, 7, 300, 300, 40, 2, 6000),  # k >= BW >= GLOBAL_SELECT_MIN_K: the global selection
    ],
)
def test_matches_naive_reference(new_tree, runners, arch, overrides, seed, bw, top_k, num_items, nd, n_items):
    runner = runners(arch, **overrides)
    V = runner.config.vocab_size
    rng = random.Random(seed)
    cat = random_catalog(rng, n_items, nd, V, codes=None if seed % 2 else 40)
    tree = new_tree(runner)
    ex = RetrieveExecutor(runner, tree, cat)
    ids = [rng.randrange(V) for _ in range(rng.randint(1, 60))]
    slow = naive_retrieve(runner, cat, ids, bw, top_k, num_items)
    fast = ex.run(ids, bw, top_k, num_items)
    assert len(fast.items) == min(num_items, n_items) and len(slow.items) == len(fast.items)
    assert_same(fast, slow)
    again = ex.run(ids, bw, top_k, num_items)  # from the prefix cache
    assert again.meta["cached_tokens"] == len(ids) - 1
    assert_same(again, slow)
    tree.reset()
    assert_balanced(runner, tree)


def test_matches_naive_with_cached_prefix_and_chunked_prefill(new_tree, tiny_model_dir):
    path = tiny_model_dir("qwen3")
    runner = ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32",
                                                max_total_tokens=POOL, chunked_prefill_size=16))
    rng = random.Random(11)
    V = runner.config.vocab_size
    cat = random_catalog(rng, 1000, 3, V, codes=60)
    tree = new_tree(runner)
    ex = RetrieveExecutor(runner, tree, cat)
    history = [rng.randrange(V) for _ in range(70)]
    ex.run(history[:40], 16, 16, 4)
    res = ex.run(history, 48, 48, 12, )  # extends the cached 40-token history
    assert res.meta["cached_tokens"] == 40
    assert_same(res, naive_retrieve(runner, cat, history, 48, 48, 12))
    assert_balanced(runner, tree)


# ---- invariants ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed,roots,nd,bw", [(0, 30, 3, 512), (1, 30, 2, 300), (2, 30, 4, 512), (3, 30, 3, 7),
                                              (4, 400, 3, 512), (5, 200, 4, 512)])
def test_every_returned_path_is_in_catalog(new_tree, runners, seed, roots, nd, bw):
    runner = runners("llama")
    V = runner.config.vocab_size
    rng = random.Random(100 + seed)
    cat = sparse_catalog(rng, roots, nd, V, p_single=0.8)
    valid = {it.semantic_id: it.id for it in cat.items}
    tree = new_tree(runner)
    ex = RetrieveExecutor(runner, tree, cat)
    ids = [rng.randrange(V) for _ in range(20)]
    res = ex.run(ids, bw, bw, bw)
    assert len(res.items) == min(bw, len(valid))
    for it in res.items:
        assert valid[tuple(it["semantic_id"])] == it["item"]
    assert len({it["item"] for it in res.items}) == len(res.items)
    scores = [it["score"] for it in res.items]
    assert scores == sorted(scores, reverse=True)
    if bw >= len(valid):  # exhaustive: the scores are a distribution over the whole catalog
        assert abs(sum(math.exp(s) for s in scores) - 1.0) < 1e-4
    else:
        assert sum(math.exp(s) for s in scores) <= 1.0 + 1e-4
        k = min(bw, 64)
        assert_same(ex.run(ids, bw, bw, k), naive_retrieve(runner, cat, ids, bw, bw, k))
    tree.reset()
    assert_balanced(runner, tree)


def test_kv_accounting_and_prefix_cache(new_tree, runners):
    runner = runners("llama")
    V = runner.config.vocab_size
    rng = random.Random(5)
    cat = random_catalog(rng, 500, 3, V, codes=50)
    tree = new_tree(runner)
    ex = RetrieveExecutor(runner, tree, cat)
    alloc = runner.kv_pool.allocator
    user = [rng.randrange(V) for _ in range(30)]
    free_at_steps = []  # the pool while each beam step runs: prompt once + BW x (ND - 1) slots, no more
    forward = ex._beam_forward
    ex._beam_forward = lambda *a: (free_at_steps.append(alloc.available_size()), forward(*a))[1]
    first = ex.run(user, 64, 64, 10, extra_key="u1")
    ex._beam_forward = forward
    assert first.meta["cached_tokens"] == 0
    assert first.meta["shared_kv_tokens"] == len(user)
    assert first.meta["unshared_kv_tokens"] == min(64, ex.trie.max_beams) * (3 - 1)
    assert len(free_at_steps) == 3 - 1
    assert alloc.size - min(free_at_steps) == len(user) + first.meta["unshared_kv_tokens"]
    assert tree.total_size() == len(user) and tree.protected_size() == 0
    assert alloc.available_size() == alloc.size - len(user)
    second = ex.run(user, 64, 64, 10, extra_key="u1")
    assert second.meta["cached_tokens"] == len(user) - 1
    assert tree.total_size() == len(user)
    assert_same(second, first)
    assert ex.run(user, 64, 64, 10, extra_key="u2").meta["cached_tokens"] == 0  # namespaced
    longer = ex.run(user + [7, 8, 9], 64, 64, 10, extra_key="u1")
    assert longer.meta["cached_tokens"] == len(user)
    assert_balanced(runner, tree)
    tree.reset()
    assert alloc.available_size() == alloc.size


def test_radix_disabled_frees_everything(new_tree, runners):
    runner = runners("llama")
    V = runner.config.vocab_size
    cat = random_catalog(random.Random(6), 200, 3, V)
    tree = new_tree(runner, disable=True)
    ex = RetrieveExecutor(runner, tree, cat)
    ids = list(range(3, 23))
    a, b = ex.run(ids, 32, 8, 8), ex.run(ids, 32, 8, 8)
    assert b.meta["cached_tokens"] == 0
    assert_same(a, b)
    assert runner.kv_pool.allocator.available_size() == runner.kv_pool.allocator.size


def test_bad_arguments(new_tree, runners):
    runner = runners("llama")
    V = runner.config.vocab_size
    cat = random_catalog(random.Random(7), 50, 3, V)
    tree = new_tree(runner)
    ex = RetrieveExecutor(runner, tree, cat, max_beam_width=64)
    for kw in [dict(beam_width=0), dict(beam_width=65), dict(top_k=0), dict(num_items=0),
               dict(num_items=9), dict(beam_width=True), dict(top_k=2.5)]:
        args = dict(input_ids=[5, 6], beam_width=8, top_k=4, num_items=4) | kw
        with pytest.raises(ValueError):
            ex.run(**args)
    for ids in ([], [V], [-1], ["a"]):
        with pytest.raises(ValueError):
            ex.run(ids, 8, 4, 4)
    no_sem = RetrieveExecutor(runner, tree, Catalog([Item("a", (1,), 1)]))
    with pytest.raises(ValueError, match="semantic_id"):
        no_sem.run([5, 6], 8, 4, 4)
    assert_balanced(runner, tree)


def test_pool_too_small_is_a_clear_error(new_tree, tiny_model_dir):
    runner = make_runner(tiny_model_dir("llama"), pool=120)
    V = runner.config.vocab_size
    cat = random_catalog(random.Random(8), 400, 3, V, codes=40)
    tree = new_tree(runner)
    ex = RetrieveExecutor(runner, tree, cat)
    ids = list(range(3, 43))
    ok = ex.run(ids, 32, 8, 4)  # 40 + 32 x 2 slots fit
    with pytest.raises(KVCacheFullError, match="beam_width"):
        ex.run(list(range(50, 90)), 64, 8, 4)  # 40 + 64 x 2 do not, even after evicting the cache
    assert isinstance(KVCacheFullError("x"), RuntimeError)
    assert_balanced(runner, tree)
    assert_same(ex.run(ids, 32, 8, 4), ok)  # still serves after the error


# ---- batched rounds (xGR §7: several requests' beams in one forward per level) -------------------
@pytest.mark.parametrize("arch,chunk", [("llama", 2048), ("qwen3", 24)])
def test_batched_round_equals_one_by_one(new_tree, tiny_model_dir, arch, chunk):
    """run_batch over requests with different prompts, widths, top-k, item counts, a cached prefix,
    a repeated prompt and a bad one == each request run alone (and the naive reference), with every
    slot and lock back where it was; chunk 24 splits the packed prefill (one prompt is chunked alone)."""
    runner = ModelRunner(ServerArgs.from_kwargs(model_path=tiny_model_dir(arch), device="cpu", dtype="float32",
                                                max_total_tokens=POOL, chunked_prefill_size=chunk))
    V = runner.config.vocab_size
    rng = random.Random(21)
    cat = random_catalog(rng, 900, 3, V, codes=40)
    hist = [rng.randrange(V) for _ in range(50)]
    reqs = [dict(input_ids=hist[:30], beam_width=16, top_k=16, num_items=8, extra_key="u1"),
            dict(input_ids=[rng.randrange(V) for _ in range(9)], beam_width=64, top_k=5, num_items=20),
            dict(input_ids=hist, beam_width=32, top_k=32, num_items=32, extra_key="u1"),  # extends request 0's
            dict(input_ids=[1, 2, V], beam_width=8, top_k=8, num_items=8),  # bad token id
            dict(input_ids=hist[:30], beam_width=16, top_k=16, num_items=8, extra_key="u1"),  # == request 0
            dict(input_ids=[7], beam_width=1, top_k=3, num_items=1)]
    alone_tree = new_tree(runner)
    alone_ex = RetrieveExecutor(runner, alone_tree, cat)
    alone = []
    for kw in reqs:
        try:
            alone.append(alone_ex.run(**kw))
        except ValueError as e:
            alone.append(e)
    alone_tree.reset()
    tree = new_tree(runner)
    ex = RetrieveExecutor(runner, tree, cat)
    ex.run(hist[:20], 8, 8, 4, extra_key="u1")  # a cached prefix for requests 0, 2 and 4
    batched = ex.run_batch(reqs)
    for kw, a, b in zip(reqs, alone, batched):
        if isinstance(a, Exception):
            assert isinstance(b, ValueError) and str(b) == str(a)
            continue
        assert_same(b, a)
        assert_same(b, naive_retrieve(runner, cat, kw["input_ids"], kw["beam_width"], kw["top_k"], kw["num_items"]))
    assert batched[0].meta["cached_tokens"] == 20 and batched[2].meta["cached_tokens"] == 20
    assert tree.total_size() == 50 + 9 + 1  # hist (one path), request 1's prompt, request 5's
    assert_balanced(runner, tree)
    tree.reset()


def test_batched_round_splits_when_the_pool_is_short(new_tree, tiny_model_dir):
    """Requests that fit only one at a time run in consecutive rounds; one that never fits gets its
    KVCacheFullError while the others are served."""
    runner = make_runner(tiny_model_dir("llama"), pool=200)
    V = runner.config.vocab_size
    cat = random_catalog(random.Random(8), 400, 3, V, codes=40)
    ex = RetrieveExecutor(runner, new_tree(runner, disable=True), cat)
    a, b = list(range(3, 43)), list(range(50, 90))
    reqs = [dict(input_ids=a, beam_width=32, top_k=8, num_items=4),  # 40 + 64 slots each: not both at once
            dict(input_ids=list(range(100, 140)), beam_width=128, top_k=8, num_items=4),  # 40 + 256: never
            dict(input_ids=b, beam_width=32, top_k=8, num_items=4)]
    out = ex.run_batch(reqs)
    assert isinstance(out[1], KVCacheFullError) and "beam_width" in str(out[1])
    assert_same(out[0], ex.run(a, 32, 8, 4))
    assert_same(out[2], ex.run(b, 32, 8, 4))
    assert runner.kv_pool.allocator.available_size() == runner.kv_pool.allocator.size


def test_attention_stages_as_work_units_equal_in_place(new_tree, runners):
    """A batched beam step whose attention stages run as work units (shared and unshared stage per
    request, a merge after both; results held in the stream tensor pool) == the in-place stages,
    bit for bit, and the whole retrieve batch gives the same items."""
    from sgrec.policy.streams import InlineStreams, StreamTensorPool, UnitRunner

    runner = runners("llama")
    V = runner.config.vocab_size
    rng = random.Random(31)
    cat = random_catalog(rng, 600, 3, V, codes=40)
    pool = StreamTensorPool(1, threshold_bytes=0)
    plain = RetrieveExecutor(runner, new_tree(runner), cat)
    units = RetrieveExecutor(runner, new_tree(runner), cat, units=UnitRunner(InlineStreams(), pool))
    reqs = [dict(input_ids=[rng.randrange(V) for _ in range(rng.randint(5, 40))], beam_width=bw, top_k=bw, num_items=6)
            for bw in (8, 32, 16)]
    kept, runner.backend = runner.backend, TorchBackend()  # the staged stages in place, not the C kernel auto may pick
    try:
        a, b = plain.run_batch(reqs), units.run_batch(reqs)
    finally:
        runner.backend = kept
    for x, y in zip(a, b):
        assert [i["item"] for i in x.items] == [i["item"] for i in y.items]
        assert [i["score"] for i in x.items] == [i["score"] for i in y.items]  # the same operations
    assert pool.released_bytes > 0 and len(pool) == 0  # stage results passed through the pool
    # one step by hand, bit for bit: two requests' groups, rows 0-2 and 3-7
    from sgrec.beam.attention import StagedBeamBackend

    perm = torch.randperm(200, generator=torch.Generator().manual_seed(1))
    groups = [BeamStepMeta(perm[:12], perm[12:18].view(3, 2)), BeamStepMeta(perm[18:27], perm[27:37].view(5, 2))]
    meta = BeamBatchMeta(groups)
    assert meta.rows() == [(0, 3), (3, 8)]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 4, 8, generator=g)
    k_buf, v_buf = torch.randn(200, 2, 8, generator=g), torch.randn(200, 2, 8, generator=g)
    ref = torch.cat([staged_attention(q[a0:b0], k_buf, v_buf, m.shared_idx, m.unshared_idx, 0.3)
                     for m, (a0, b0) in zip(groups, meta.rows())])
    assert torch.equal(StagedBeamBackend(UnitRunner(InlineStreams()))._as_units(q, k_buf, v_buf, meta, 0.3), ref)


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen3_5", "float32"),
                                        ("t5", "float32")])
def test_two_batches_driven_a_phase_at_a_time_equal_each_batch_alone(tiny_model_dir, arch, dtype):
    """RetrieveExecutor.run_steps: two batches' rounds advanced one phase in turn on one executor
    (how a scheduler interleaves the next batch's prefill with a round's beam steps) return what
    each batch's run_batch returns alone, bit for bit (every forward computes the same rows), in
    every model family; on a pool that holds one round at a time, the second batch waits (its
    generator yields, holding nothing) until the first round is released instead of being refused;
    the pool is whole after."""
    from sgrec.beam.encdec import make_retriever

    rng = random.Random(21)
    path = tiny_model_dir(arch)
    V = 512
    cat = random_catalog(rng, 120, 3, V, codes=10)
    batches = [[dict(input_ids=[rng.randrange(V) for _ in range(n)], beam_width=bw, top_k=4, num_items=bw)
                for n, bw in pair] for pair in (((30, 6), (22, 4)), ((41, 8), (17, 5)))]
    need = sum(len(r["input_ids"]) + r["beam_width"] * 2 for r in batches[1])  # the larger batch's KV slots

    def executor(pool: int) -> RetrieveExecutor:
        runner = ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype=dtype, max_total_tokens=pool))
        states = runner.memory.states if runner.memory.states.size else None
        return make_retriever(runner, RadixCache(runner.memory.allocator, states=states), cat)

    alone = [executor(4 * need).run_batch(b) for b in batches]
    for pool, waits in ((4 * need, False), (need + 8, True)):  # room for both rounds at once, or for one
        ex = executor(pool)
        gens = [ex.run_steps(b) for b in batches]
        out: list = [None, None]
        phases = [[], []]
        while any(o is None for o in out):
            for i, g in enumerate(gens):
                if out[i] is None:
                    try:
                        phases[i].append(next(g))
                    except StopIteration as done:
                        out[i] = done.value
        assert (-1 in phases[1]) == waits and phases[0] == [0, 1]  # -1: a wait for the pool
        for got, want in zip(out, alone):
            for a, b in zip(got, want):
                assert a.items == b.items  # items, semantic IDs and scores, bit for bit
        assert ex.rounds_under_way == 0
        assert_balanced(ex.runner, ex.tree)
    g = ex.run_steps(batches[0])  # a round under way that nobody drives: run_batch cannot wait for it
    assert next(g) == 0
    with pytest.raises(RuntimeError, match="drive them in turn"):
        ex.run_batch(batches[1])
    g.close()  # its round's KV released
    assert ex.rounds_under_way == 0
    assert_balanced(ex.runner, ex.tree)
