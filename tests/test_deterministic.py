"""--enable-deterministic-inference: the batch-invariant extend kernel gives a row
the same bits whatever else is computed with it, and the server gives a request the same outputs
whatever else is batched with it, however its prefill is chunked and whatever it found cached."""

from __future__ import annotations

import pytest
import torch

from sgrec.model import native
from sgrec.model.attention import NativeBackend
from sgrec import layout as L
from tests.kernel_refs import bipartite_reference, rank_case, rank_layouts, run_backends
from tests.test_native_kernels import big_rank_layouts, causal_case

needs_kernels = pytest.mark.skipif(native.load() is None, reason="no C compiler builds sgrec's CPU kernels here")
HQ, HKV, D = 6, 2, 24


def det() -> NativeBackend:
    return NativeBackend(deterministic=True)


# ---- the kernel ---------------------------------------------------------------------------------
class Views:
    """Several views of layouts in one extend batch. Every token of a layout has fixed q/k/v values
    (drawn per layout token), so two views of one layout (other tokens cached, other batch mates)
    compute the same rows from the same numbers. A view is (layout, values, cached layout offsets);
    `rows()` gives each view's output rows by layout offset."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.views = dtype, []

    @staticmethod
    def values(n: int, seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))

    def add(self, lay, vals, cached=()) -> int:
        self.views.append((lay, vals, list(cached)))
        return len(self.views) - 1

    def run(self, backend, device: str = "cpu") -> list[dict[int, torch.Tensor]]:
        from sgrec.model.attention import SeqLayout

        total = sum(len(lay) for lay, _, _ in self.views)
        k_buf = torch.zeros(total + 1, HKV, D, dtype=self.dtype)
        v_buf = torch.zeros_like(k_buf)
        q, k, v, seqs, locs, fresh_of, T, slot = [], [], [], [], [], [], 0, 1
        for lay, (qv, kv, vv), cached in self.views:
            fresh = [r for r in range(len(lay)) if r not in set(cached)]
            cols = cached + fresh
            slots = torch.arange(slot, slot + len(cols))
            slot += len(cols)
            for c, s in zip(cached, slots):
                k_buf[s], v_buf[s] = kv[c].to(self.dtype), vv[c].to(self.dtype)
            q.append(qv[fresh]), k.append(kv[fresh]), v.append(vv[fresh])
            seqs.append(SeqLayout(T, len(fresh), slots, None, lay.bipartite(cols)))
            locs.append(slots[len(cached):])
            fresh_of.append(fresh)
            T += len(fresh)
        q, k, v = (torch.cat(t).to(self.dtype) for t in (q, k, v))
        (out,), _ = run_backends([backend], q, k, v, k_buf, v_buf, seqs, torch.cat(locs), D ** -0.5, device)
        self.seqs, self.qkv = seqs, (q, k, v, k_buf, v_buf)
        return [{r: out[s.q_start + i] for i, r in enumerate(fresh)} for s, fresh in zip(seqs, fresh_of)]


def same_rows(a: dict, b: dict) -> bool:
    common = sorted(set(a) & set(b))
    assert common
    return all(torch.equal(a[r], b[r]) for r in common)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_det_kernel_equals_reference(dtype):
    """Rank layouts (cached columns in and out of layout order), causal sequences and a sequence with
    only a dense mask, in one batch each: float64 attention within 1e-5 (float32), 2e-2 (bfloat16)."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for layouts in (rank_layouts(), big_rank_layouts()):
        q, k, v, k_buf, v_buf, seqs, locs = rank_case(HQ, HKV, D, layouts, dtype, seed=5)
        from sgrec.model.attention import SeqLayout

        seqs[0] = SeqLayout(seqs[0].q_start, seqs[0].q_len, seqs[0].kv_indices, seqs[0].mask)  # dense only
        (out,), _ = run_backends([det()], q, k, v, k_buf, v_buf, seqs, locs, 0.3)
        assert (out.double() - bipartite_reference(q, k, v, k_buf, v_buf, seqs, 0.3)).abs().max() <= tol
    q, k, v, k_buf, v_buf, seqs, refs, locs = causal_case(HQ, HKV, D, [(0, 300), (70, 1), (129, 40), (1, 33)], dtype, 2)
    (out,), _ = run_backends([det()], q, k, v, k_buf, v_buf, seqs, locs, 0.3)
    assert (out.double() - bipartite_reference(q, k, v, k_buf, v_buf, refs, 0.3)).abs().max() <= tol


@needs_kernels
def test_kept_scores_equal_recomputed_ones():
    """Pass 2 reads the scores pass 1 kept, or (over the keep limit) computes them again: the same bits."""
    lib = native.load()
    q, k, v, k_buf, v_buf, seqs, locs = rank_case(HQ, HKV, D, big_rank_layouts(), torch.float32, seed=8)
    (kept,), _ = run_backends([det()], q, k, v, k_buf, v_buf, seqs, locs, 0.3)
    lib.sgrec_set_det_keep_bytes(0)
    try:
        (again,), _ = run_backends([det()], q, k, v, k_buf, v_buf, seqs, locs, 0.3)
    finally:
        lib.sgrec_set_det_keep_bytes(32 << 20)
    assert torch.equal(kept, again)


def test_triton_tiles_list_each_rows_visible_columns_in_order():
    """DetTiles (the Triton kernel's form of a DetMeta): for every row of rank layouts (cached columns
    in and out of layout order, one sequence with a dense mask only) and of causal sequences, the
    first cnt[row] entries of its group's list are the columns the row may see, in summation order;
    rows share lists (fewer lists than rows)."""
    from sgrec.model.attention import DetMeta, ForwardBatch, SeqLayout
    from sgrec.model.kernels.det_attention import DetTiles

    cases = []
    for layouts in (rank_layouts(), big_rank_layouts()):
        _, _, _, _, _, seqs, locs = rank_case(HQ, HKV, D, layouts, torch.float32, seed=5)
        seqs[0] = SeqLayout(seqs[0].q_start, seqs[0].q_len, seqs[0].kv_indices, seqs[0].mask)  # dense only
        cases.append((seqs, locs))
    _, _, _, _, _, seqs, _, locs = causal_case(HQ, HKV, D, [(0, 300), (70, 1), (129, 40), (1, 33)], torch.float32, 2)
    cases.append((seqs, locs))
    for seqs, locs in cases:
        T = locs.numel()
        meta = DetMeta.of(ForwardBatch(torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64), locs,
                                       seqs, None))
        tiles = DetTiles.of(meta, block_m=4)
        lp = torch.full((T,), -1, dtype=torch.int64)
        for r0, r1, off in zip(tiles.row0.tolist(), tiles.row1.tolist(), tiles.lp.tolist()):
            assert (lp[r0:r1] == -1).all()
            lp[r0:r1] = off
        assert (lp >= 0).all() and len(set(tiles.lp.tolist())) < T
        for b, s in enumerate(seqs):
            lo, hi = int(meta.c_ptr[b]), int(meta.c_ptr[b + 1])
            src, order, block = meta.c_idx[lo:hi], meta.c_order[lo:hi], meta.c_block[lo:hi]
            for i in range(s.q_len):
                r = s.q_start + i
                if int(meta.m_ptr[b]) >= 0:
                    m0 = int(meta.m_ptr[b]) + i * (hi - lo)
                    vis = meta.mask[m0 : m0 + hi - lo]
                else:
                    x = meta.q_block[r]
                    vis = (order <= meta.q_order[r]) & ((x < 0) | (block < 0) | (block == x))
                got = tiles.lst[lp[r] : lp[r] + tiles.cnt[r]]
                assert torch.equal(got, src[vis]), (b, i)


def test_causal_batches_meta_equals_the_general_one():
    """DetMeta's loop-free form for plainly causal batches (prompts, decode steps) == its general form."""
    from sgrec.model.attention import DetMeta, ForwardBatch

    for specs in ([(0, 300), (70, 1), (129, 40), (5, 0), (1, 33)], [(9, 1)] * 7):
        _, _, _, _, _, seqs, _, locs = causal_case(HQ, HKV, D, specs, torch.float32, 1)
        T = locs.numel()
        batch = ForwardBatch(torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64), locs, seqs, None)
        fast, general = DetMeta._causal(batch), DetMeta._general(batch)
        for name in ("q_start", "q_end", "q_order", "q_block", "c_idx", "c_ptr", "c_order", "c_block", "m_ptr"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name


@needs_kernels
def test_per_head_norm_takes_one_path_at_any_token_count():
    """Qwen3's q/k norm gets [T, heads, D] slices of the fused projection, which have a 2-D view only at
    T = 1: the fused RMSNorm still takes them at any T (a copy), so a token gets the same bits alone
    as in a batch (it took torch's RMSNorm at T > 1 before)."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 3 * 4 * 16, generator=g)
    heads = qkv[:, : 4 * 16].view(7, 4, 16)  # strided: a token's heads, then the next token's after 192
    w = torch.randn(16, generator=g)
    batch = native.rmsnorm(heads, w, 1e-6)
    assert batch is not None and not heads.is_contiguous()
    for t in range(7):
        assert torch.equal(native.rmsnorm(heads[t : t + 1], w, 1e-6), batch[t : t + 1])


def item_layout():
    items = [[100 + j] * (1 + (5 * j) % 13) for j in range(12)]
    return L.item_as_prefix([5, 6, 7], items, list(range(200, 260)), [9, 8]), items


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_depends_on_its_visible_columns_alone(dtype):
    visible_columns_alone(dtype, det)


def visible_columns_alone(dtype, det, device: str = "cpu"):
    """The same layout computed: cold; with the header and every third item cached (columns out of
    layout order); alone or beside other sequences; and each item's rows computed in a layout of the
    header and that item only (how the item store computes item KV): every shared row, bit for bit.
    det() -> the backend under test (here, in tests/triton_det_interpreted.py and, on a GPU, in
    tests/test_kernels.py), on `device`."""
    lay, items = item_layout()
    vals = Views.values(len(lay), seed=1)
    cached = list(range(3)) + [c for s in lay.items()[::3] for c in range(s.start, s.stop)]
    other = L.user_as_prefix(list(range(30, 90)), items[:5], [9])
    runs = []
    for views in ([(lay, [])], [(lay, cached)], [(other, []), (lay, []), (other, [0, 1, 2])]):
        b = Views(dtype)
        idx = [b.add(lay_, Views.values(len(lay_), seed=1) if lay_ is lay else Views.values(len(lay_), 9), c)
               for lay_, c in views]
        got = b.run(det(), device)
        runs.append(got[[i for i, (lay_, _) in zip(idx, views) if lay_ is lay][0]])
    assert same_rows(runs[0], runs[1]) and same_rows(runs[0], runs[2])
    for seg in lay.items():  # the item store's computation: header + the item, at the same positions
        alone = L.item_as_prefix([5, 6, 7], [items[seg.item]], [], [])
        pick = list(range(3)) + list(range(seg.start, seg.stop))
        b = Views(dtype)
        b.add(alone, tuple(t[pick] for t in vals))
        got = b.run(det(), device)[0]
        for i in range(seg.length):
            assert torch.equal(got[3 + i], runs[0][seg.start + i])


@needs_kernels
def test_the_default_kernel_fails_that_check():
    assert default_kernel_differs(NativeBackend)


def default_kernel_differs(plain) -> bool:
    """Without the deterministic mode an item's rows inside a layout differ from the same rows
    computed with the header alone (the online softmax's tiles cut other columns): what the
    deterministic kernel fixes is real. plain() -> the backend without the mode."""
    lay, items = item_layout()
    vals = Views.values(len(lay), seed=1)
    b = Views(torch.float32)
    b.add(lay, vals)
    full = b.run(plain())[0]
    differs = False
    for seg in lay.items():
        alone = L.item_as_prefix([5, 6, 7], [items[seg.item]], [], [])
        pick = list(range(3)) + list(range(seg.start, seg.stop))
        c = Views(torch.float32)
        c.add(alone, tuple(t[pick] for t in vals))
        got = c.run(plain())[0]
        differs |= any(not torch.equal(got[3 + i], full[seg.start + i]) for i in range(seg.length))
    return differs


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_causal_prefill_gives_the_same_bits(dtype):
    chunked_causal_prefill(dtype, det)


def chunked_causal_prefill(dtype, det, n: int = 300, chunk: int = 37, device: str = "cpu"):
    """An n-token causal sequence at once, or in chunks (each chunk's prefix from the pool), beside
    another sequence: the same rows."""
    lay = L.user_as_prefix(list(range(n)), [], [])  # a plain causal sequence as a layout
    vals = Views.values(n, seed=3)
    b = Views(dtype)
    b.add(lay, vals)
    whole = b.run(det(), device)[0]
    for start in range(0, n, chunk):
        c = Views(dtype)
        c.add(L.user_as_prefix(list(range(20)), [], []), Views.values(20, 4))
        i = c.add(lay, vals, cached=range(start))
        got = c.run(det(), device)[i]
        got = {r: x for r, x in got.items() if r < start + chunk}
        assert same_rows(got, whole)


# ---- the model and the executors ----------------------------------------------------------------
DTYPES = ["float32", "bfloat16"]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def sem_catalog(tmp_path_factory):
    from tests.test_rec_server import write_catalog

    return write_catalog(tmp_path_factory.mktemp("det") / "catalog.jsonl", n=30, semantic=True)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, sem_catalog):
    """engines(dtype, **kw) -> an Engine under the flag (qwen3: per-head q/k norms), cached per kw."""
    from sgrec import Engine

    made: dict = {}

    def get(dtype: str, **kw) -> "Engine":
        key = (dtype, repr(sorted(kw.items())))
        if key not in made:
            made[key] = Engine(tiny_model_dir("qwen3", seed=2), dtype=dtype, max_total_tokens=6000,
                               item_catalog=sem_catalog, max_rank_candidates=20, enable_deterministic_inference=True,
                               **{"device": "cpu", **kw})
        return made[key]

    return get


def prompts(n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(3, 90))] for _ in range(n)]


def outputs(out: dict) -> tuple:
    return out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_generate_alone_batched_cached_and_chunked(engines, dtype):
    """Greedy generation of a prompt: alone; in one batch with 5 other prompts; again (its prefix from
    the radix cache); its prefill in chunks of 16 tokens; beside concurrent callers: the same tokens
    and logprobs, bit for bit."""
    import threading

    e = engines(dtype)
    target, others = [5, *range(40, 117)], prompts(5, 1)

    def gen(engine, ids):
        return engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)

    alone = outputs(gen(e, target))
    e.flush_cache()
    assert outputs(gen(e, [*others[:2], target, *others[2:]])[2]) == alone
    assert outputs(gen(e, target)) == alone  # its prompt is in the radix cache now
    assert outputs(gen(engines(dtype, chunked_prefill_size=16), target)) == alone
    got: dict = {}

    def run(i, ids):
        got[i] = outputs(gen(e, ids))

    threads = [threading.Thread(target=run, args=(i, ids)) for i, ids in enumerate([*others, target])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[len(others)] == alone


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_alone_and_among_other_items(engines, dtype):
    e = engines(dtype)
    labels = [7, 9, 11]
    alone = e.score(query=list(range(20, 70)), items=[[81, 82, 83]], label_token_ids=labels)
    among = e.score(query=list(range(20, 70)), items=[[5, 6], [81, 82, 83], list(range(100, 160))],
                    label_token_ids=labels)
    assert among.scores[1] == alone.scores[0]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("score_by", ["id_token", "semantic_id"])
def test_rank_alone_batched_and_from_every_cache(engines, dtype, score_by):
    """A rank request in every prefix mode: alone with nothing cached (item cache off); with the whole
    catalog's item KV precomputed; with its user's prefix cached; in one forward with other requests:
    the same scores, bit for bit (and so the same ranking)."""
    cands = ["i3", "i7", "i1", "i12", "i25", "i19", "i28"]
    user = [*range(60, 131)]
    cold = engines(dtype, item_cache_tokens=0).scheduler.rank_executor
    warm = engines(dtype).scheduler.rank_executor
    warm.precompute()
    others = [dict(user_key=f"o{k}", user_ids=p, item_ids=["i2", "i5", "i9", "i3"][: 2 + k % 3],
                   instruction_ids=[9, 10], prefix=("item", "user", "none")[k % 3], score_by=score_by)
              for k, p in enumerate(prompts(4, 2))]
    for prefix in ("user", "item", "none"):
        req = dict(user_key=f"u-{prefix}-{score_by}", user_ids=user, item_ids=cands, instruction_ids=[9, 10],
                   prefix=prefix, score_by=score_by)
        want = cold.run(**req)["ranking"]
        first = warm.run(**req)
        assert first["ranking"] == want
        batched = warm.run_batch([*others[:2], req, *others[2:]])[2]
        assert batched["ranking"] == want
        if prefix == "user":
            assert batched["meta_info"]["cached_tokens"] == len(user)
        if prefix == "item":
            assert batched["meta_info"]["cached_tokens"] > 0


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("score_by", ["id_token", "semantic_id"])
def test_rank_partial_item_cache(engines, dtype, score_by):
    """A partial item cache (items cached and computed interleaved in the layout): the same scores as
    with no item cache."""
    cold = engines(dtype, item_cache_tokens=0).scheduler.rank_executor
    part = engines(dtype, item_cache_tokens=12).scheduler.rank_executor
    req = dict(user_key="p", user_ids=list(range(30, 80)), item_ids=[f"i{k}" for k in range(0, 30, 3)],
               instruction_ids=[9, 10], prefix="item", score_by=score_by)
    want = cold.run(**req)["ranking"]
    part.run(user_key="w", user_ids=[5], item_ids=["i3", "i9", "i15"], instruction_ids=[9], prefix="item",
             score_by="id_token")  # fills part of the item store
    got = part.run(**req)
    assert 0 < got["meta_info"]["cached_tokens"] < got["meta_info"]["prompt_tokens"]
    assert got["ranking"] == want


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_retrieve_and_recommend_alone_and_batched(engines, dtype, monkeypatch):
    from sgrec.model.attention import DetMeta

    steps = []  # beam steps through the deterministic kernel
    of_columns = DetMeta.of_columns.__func__
    monkeypatch.setattr(DetMeta, "of_columns", classmethod(lambda cls, m: steps.append(1) or of_columns(cls, m)))
    e = engines(dtype)
    user = list(range(200, 260))
    req = dict(input_ids=user, beam_width=8, top_k=8, num_items=5)
    alone = e.scheduler.retriever.run(**req)
    others = [dict(input_ids=p, beam_width=4 + 4 * (k % 2), top_k=4, num_items=3) for k, p in enumerate(prompts(3, 3))]
    batched = e.scheduler.retriever.run_batch([others[0], req, *others[1:]])[1]
    assert [(it["item"], it["score"]) for it in batched.items] == [(it["item"], it["score"]) for it in alone.items]
    rec = e.recommend({"token_ids": user}, {"beam_width": 8, "num_candidates": 5}, {"prefix": "none"})
    again = e.recommend({"token_ids": user}, {"beam_width": 8, "num_candidates": 5}, {"prefix": "none"})
    assert rec["items"] == again["items"] and rec["items"]
    assert steps


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_prefill_equals_the_normal_forward(engines, dtype):
    """Prefill-only requests' hybrid prefilling (everything but attention chunk by chunk) gives the
    normal forward's bits, beside a sequence with a cached prefix."""
    from sgrec.model.attention import SeqLayout

    for chunk in (1, 5, 64):
        runner = engines(dtype, hybrid_chunk_size=chunk).runner
        alloc = runner.kv_pool.allocator
        pre = alloc.alloc(7)
        runner.forward(runner.make_batch(list(range(30, 37)), list(range(7)), pre, [SeqLayout(0, 7, pre)]), [6])
        a, b = prompts(2, 5)

        def run(fn):
            sa, sb = alloc.alloc(len(a)), alloc.alloc(len(b))
            seqs = [SeqLayout(0, len(a), sa), SeqLayout(len(a), len(b), torch.cat([pre, sb]))]
            batch = runner.make_batch(a + b, [*range(len(a)), *range(7, 7 + len(b))], torch.cat([sa, sb]), seqs)
            out = fn(batch, list(range(len(a) + len(b))))
            alloc.free(sa), alloc.free(sb)
            return out

        assert torch.equal(run(runner.forward), run(runner.forward_prefill_only))
        alloc.free(pre)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_retrieve_with_a_cached_prefix_and_chunked_prefill(engines, dtype):
    """The prompt shared by every beam: from a cold single prefill, or 40 of its tokens from the radix
    cache and the rest in chunks of 16: the same items and scores."""
    history = list(range(300, 370))
    cold = engines(dtype)
    cold.flush_cache()
    want = cold.scheduler.retriever.run(history, 16, 16, 6)
    warm = engines(dtype, chunked_prefill_size=16).scheduler.retriever
    warm.run(history[:40], 8, 8, 4)
    got = warm.run(history, 16, 16, 6)
    assert got.meta["cached_tokens"] == 40
    assert [(it["item"], it["score"]) for it in got.items] == [(it["item"], it["score"]) for it in want.items]


def test_only_the_batch_invariant_kernels_run_the_flag_and_a_failing_layer_goes_row_by_row(monkeypatch):
    import importlib.util

    from sgrec.model.attention import TritonBackend
    from sgrec.model.backends import make_backend
    from sgrec.model.batch_invariant import RowwiseLinear, make_batch_invariant, rows_invariant

    with pytest.raises(ValueError, match="attention-backend auto, native or triton"):
        make_backend("torch", "cpu", deterministic=True)
    with pytest.raises(ValueError, match="C kernels on CPU and Triton's on CUDA"):
        make_backend("auto", "meta", deterministic=True)
    if importlib.util.find_spec("triton") is not None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            make_backend("triton", "cpu", deterministic=True)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        backend = make_backend("triton", "cpu", deterministic=True)
        assert isinstance(backend, TritonBackend) and backend.deterministic
        assert not make_backend("triton", "cpu").deterministic
    lin = torch.nn.Linear(16, 8)

    def bumpy(x):  # other bits for other row counts, as a GEMM's small-row kernels may give
        return lin(x) + (x.shape[0] % 3) * 1e-6

    assert rows_invariant(RowwiseLinear(lin), 16, torch.float32) and not rows_invariant(bumpy, 16, torch.float32)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 8))
    wrapped = make_batch_invariant(model, torch.float32, check=lambda layer, *a: layer.in_features == 8)
    assert wrapped == ["0"] and isinstance(model[0], RowwiseLinear) and isinstance(model[1], torch.nn.Linear)


@pytest.mark.parametrize("dtype", DTYPES)
def test_restricted_logits_under_the_flag_give_a_row_its_bits_alone(engines, dtype):
    """A beam step's logits of one trie level's columns (compute_logits(columns=...): a gathered weight no
    start-up check sees) give every row at 1 .. 70 rows the bits it gets alone (found on an Intel AMX
    Xeon: MKL's float32 sgemm summed in another order at other row counts, so a beam's score changed
    when other requests shared the step)."""
    model = engines(dtype).scheduler.runner.model
    hidden = torch.randn(75, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(getattr(torch, dtype))
    columns = torch.arange(7, model.cfg.vocab_size, 5)
    alone = torch.cat([model.compute_logits(hidden[i : i + 1], columns) for i in range(75)])
    assert alone.shape == (75, columns.numel())
    for n in (1, 2, 3, 5, 8, 13, 33, 64, 70):
        assert torch.equal(model.compute_logits(hidden[5 : 5 + n], columns), alone[5 : 5 + n])


# ---- a real server ------------------------------------------------------------------------------
@needs_kernels
def test_server_request_alone_equals_it_inside_a_burst(start_server, tiny_model_dir, sem_catalog):
    """bfloat16 server under the flag: /generate, /v1/score, /v1/rank, /v1/retrieve and /v1/recommend
    requests answered alone, then each again inside a burst of 12 concurrent different requests: the
    same tokens, logprobs, scores and items."""
    import threading

    import httpx

    srv = start_server(tiny_model_dir("qwen3", seed=2), "--dtype", "bfloat16", "--enable-deterministic-inference",
                       "--max-total-tokens", "6000", "--item-catalog", sem_catalog, "--max-rank-candidates", "20")
    user = {"token_ids": list(range(60, 140))}
    cands = ["i3", "i7", "i1", "i12", "i25", "i19"]
    targets = [
        ("/generate", {"input_ids": list(range(5, 80)), "sampling_params": GREEDY, "return_logprob": True}),
        ("/v1/score", {"query": list(range(20, 70)), "items": [[81, 82, 83]], "label_token_ids": [7, 9, 11]}),
        ("/v1/rank", {"user": user, "items": cands, "prefix": "item"}),
        ("/v1/rank", {"user": {"id": "u-burst", **user}, "items": cands, "prefix": "user"}),
        ("/v1/retrieve", {"user": user, "beam_width": 8, "num_items": 5}),
        ("/v1/recommend", {"user": user, "retrieve": {"beam_width": 8, "num_candidates": 5}, "rank": {"prefix": "none"}}),
    ]
    noise = [(path, {**body, **({"user": {"token_ids": p}} if "user" in body else
                                {"input_ids": p} if "input_ids" in body else {"query": p})})
             for (path, body), p in zip(targets * 2, prompts(12, 7))]

    def answer(path: str, body: dict):
        r = httpx.post(srv.url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        out = r.json()
        if path == "/generate":
            return out["output_ids"], out["meta_info"]["output_token_logprobs"]
        if path == "/v1/score":
            return out["scores"]
        return out.get("ranking") or out.get("items")

    alone = [answer(path, body) for path, body in targets]
    got: dict = {}

    def run(i, path, body):
        got[i] = answer(path, body)

    jobs = [*noise[:6], *targets, *noise[6:]]
    threads = [threading.Thread(target=run, args=(i, path, body)) for i, (path, body) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[6 + i] for i in range(len(targets))] == alone
