"""Triton kernels: on CPU under Triton's interpreter, in a subprocess (the cases are
tests/triton_interpreted.py), and compiled on CUDA where a GPU is present."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from sgrec.model.backends import make_backend  # noqa: E402
from sgrec.model.kernels.decode_attention import decode_attention  # noqa: E402
from tests.kernel_refs import case, reference  # noqa: E402
from tests.test_deterministic import engines, sem_catalog  # noqa: E402,F401 (fixtures of the CUDA engine test)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cases", ["tests/triton_interpreted.py", "tests/triton_det_interpreted.py",
                                   "tests/triton_fp8_interpreted.py"])
def test_kernels_under_the_triton_interpreter(cases):
    """Every case of the file passes, none skipped (TRITON_INTERPRET=1 must be set before triton is
    imported, so they run in a fresh interpreter)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cases],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, tail
    assert re.fullmatch(r"=*\s*\d+ passed(, \d+ warnings?)? in .*", summary), tail


def test_triton_backend_is_refused_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        make_backend("triton", "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs a CUDA device (none here)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_decode_attention_compiled_on_cuda(monkeypatch, dtype, tol, splits):
    """Compiled, with the automatic splits (4 sequences x 4 KV heads on a GPU of tens of SMs: several),
    none, and 7."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k_buf, v_buf, idx, ptr = case(16, 4, 64, [1, 100, 513, 37], dtype, device="cuda", seed=9)
    out = decode_attention(q, k_buf, v_buf, idx, ptr, 0.125, splits=splits)
    ref = reference(q.cpu(), k_buf.cpu(), v_buf.cpu(), idx.cpu(), ptr.cpu(), 0.125)
    assert (out.double().cpu() - ref).abs().max() <= tol


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs a CUDA device (none here)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_staged_attention_compiled_on_cuda(monkeypatch, dtype, tol):
    from sgrec.beam.attention import staged_attention as torch_staged
    from sgrec.model.kernels.staged_attention import staged_attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, P, n, s = 16, 4, 64, 1000, 64, 2
    k_buf, v_buf = (torch.randn(P + n * s + 5, hkv, d, generator=g).to("cuda", dtype) for _ in range(2))
    perm = torch.randperm(P + n * s + 5, generator=g).cuda()
    sh, un = perm[:P], perm[P : P + n * s].view(n, s)
    q = torch.randn(n, hq, d, generator=g).to("cuda", dtype)
    out = staged_attention(q, k_buf, v_buf, sh, un, 0.125)
    want = torch_staged(q.float(), k_buf.float(), v_buf.float(), sh, un, 0.125)
    assert (out.float() - want).abs().max() <= tol


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs a CUDA device (none here)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_bipartite_attention_compiled_on_cuda(monkeypatch, dtype, tol):
    from sgrec.model.attention import ColumnMeta, ForwardBatch
    from sgrec.model.kernels.bipartite_attention import bipartite_attention
    from sgrec import layout as L
    from tests.kernel_refs import bipartite_reference, rank_case

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    items = [list(range(5 + j % 7)) for j in range(40)]
    user = L.user_as_prefix(list(range(300)), items, [1, 2, 3])
    item = L.item_as_prefix([7] * 5, items, list(range(200)), [1, 2])
    cached = [c for j, s in enumerate(item.items()) if j % 3 == 0 for c in range(s.start, s.stop)]
    layouts = [(user, list(range(250))), (item, [0, 1, 2, 3, 4] + cached)]
    q, k, v, k_buf, v_buf, seqs, locs = rank_case(16, 4, 80, layouts, dtype, seed=7)
    T = q.shape[0]
    batch = ForwardBatch(torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64), locs.cuda(), seqs, None)
    meta = ColumnMeta.of(batch, 16)
    out = bipartite_attention(q.cuda(), k.cuda(), v.cuda(), k_buf.cuda(), v_buf.cuda(), meta.q_start, meta.q_end,
                              meta.q_order, meta.q_block, meta.c_idx, meta.c_ptr, meta.c_order, meta.c_block,
                              80 ** -0.5, grid_tiles=meta.tiles)
    want = bipartite_reference(q, k, v, k_buf, v_buf, seqs, 80 ** -0.5)
    assert (out.double().cpu() - want).abs().max() <= tol


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs a CUDA device (none here)")
@pytest.mark.parametrize("layered", [False, True], ids=["dense", "layered-updated"])
def test_trie_step_compiled_on_cuda(monkeypatch, layered):
    """Every level of a 3-level trie over 3000 items (256 codes per level), 64 beams of three
    requests (one excluding 500 items) in one launch: the compiled kernel keeps the torch path's beams.
    layered: a LayeredTrie on the GPU after an update (its leaf level runs over a base and a tail)
    against the host's LayeredTrie."""
    import random

    from sgrec.beam import kernel_step
    from sgrec.beam.layered import LayeredTrie
    from sgrec.beam.search import select_level
    from sgrec.beam.filters import FilterCache, build_filter
    from sgrec.beam.trie import SemanticIdTrie
    from sgrec.catalog.update import apply_update, parse_items
    from tests.test_beam import random_catalog

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rng = random.Random(0)
    V = 1024
    cat = random_catalog(rng, 3000, 3, V, codes=256)
    if layered:
        trie, rows = LayeredTrie.from_catalog(cat, V)
        gpu, _ = LayeredTrie.from_catalog(cat, V, "cuda")
        ups = [{"id": f"n{j}", "token_ids": [5], "semantic_id": [V - 256 + rng.randrange(256) for _ in range(3)]}
               for j in range(200)]
        res = apply_update(cat, parse_items(ups, None, V), [it.id for it in cat.items[:100]])
        cat = res.catalog
        trie, _ = trie.updated(None, cat, res.removed_rows, res.added_from)
        gpu, _ = gpu.updated(None, cat, res.removed_rows, res.added_from)
        assert gpu.leaves.n_tail > 0
    else:
        trie, rows = SemanticIdTrie.from_catalog(cat, V)
        gpu, _ = SemanticIdTrie.from_catalog(cat, V, "cuda")
    ids = [cat.ids[r] for r in cat.live_rows()]
    filters = [None, build_filter(trie, rows, cat, FilterCache(), exclude=rng.sample(ids, 500)), None]
    g = torch.Generator().manual_seed(1)
    for depth in range(trie.depth):
        widths = [1, 1, 1] if depth == 0 else [64, 40, 7]
        nodes = [torch.tensor(sorted(rng.sample(range(trie.num_nodes[depth]), w))) for w in widths]
        nodes = [x[f.keep(depth, x)] if f is not None and depth else x for x, f in zip(nodes, filters)]
        scores = [torch.randn(x.numel(), generator=g) - 5 for x in nodes]
        logits = [torch.randn(x.numel(), V, generator=g) * 3 for x in nodes]
        top_k, m = [8, 64, 300], [64, 32, 20]
        got = kernel_step.select_levels(gpu, depth, torch.cat(logits).cuda(), [x.cuda() for x in nodes],
                                        [s.cuda() for s in scores], filters, top_k, m, False, 256)
        for r in range(3):
            want = select_level(logits[r], trie, depth, nodes[r], scores[r], filters[r], top_k[r], m[r], False)
            p, t, s, nd = (x.cpu() for x in got[r])
            assert p.tolist() == want[0].tolist() and t.tolist() == want[1].tolist() and nd.tolist() == want[3].tolist()
            assert (s - want[2]).abs().max() <= 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs a CUDA device (none here)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glue_compiled_on_cuda(monkeypatch, dtype):
    """The Triton glue (RMSNorm, RoPE, SiLU * up) compiled, against the torch ops: float32 within 1e-5,
    bfloat16 within one rounding step (the GPU rounds to nearest as torch does)."""
    import torch.nn.functional as F

    from sgrec.model.kernels import glue
    from sgrec.model.llama import RMSNorm
    from sgrec.model.rope import RotaryEmbedding, apply_rope

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 2048, generator=g) * 3).to("cuda", dtype)
    norm = RMSNorm(2048, 1e-6).to("cuda", dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    torch.testing.assert_close(glue.rmsnorm(x, norm.weight, 1e-6), norm(x), **tol)
    T, hq, hk, d = 37, 16, 8, 128
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to("cuda", dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(T, hq, d), k.view(T, hk, d)
    cos, sin = RotaryEmbedding(d, 1e6, None, 4096, torch.device("cuda")).cos_sin(
        torch.arange(3000, 3000 + T, device="cuda"), dtype)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert glue.rope_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    gu = torch.randn(T, 2 * 6144, generator=g).to("cuda", dtype) * 3
    torch.testing.assert_close(glue.silu_mul(gu, 6144), F.silu(gu[:, :6144]) * gu[:, 6144:], **tol)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs a CUDA device (none here)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_det_attention_compiled_on_cuda(monkeypatch, dtype, tol):
    """--enable-deterministic-inference's kernel compiled (tl.dot on the tensor cores, which the
    interpreter does not run): float64 attention within tol; a row's bits from its visible columns
    alone, also where it sits elsewhere in its tile (an item's rows inside a layout and beside the
    header alone); a causal prefill in chunks gives the same bits."""
    import tests.test_deterministic as td
    from sgrec.model.attention import SeqLayout, TritonBackend
    from tests.kernel_refs import bipartite_reference, rank_case, rank_layouts, run_backends

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def det():
        return TritonBackend(deterministic=True)

    q, k, v, k_buf, v_buf, seqs, locs = rank_case(td.HQ, td.HKV, td.D, rank_layouts(), dtype, seed=5)
    seqs[0] = SeqLayout(seqs[0].q_start, seqs[0].q_len, seqs[0].kv_indices, seqs[0].mask)  # dense only
    (out,), _ = run_backends([det()], q, k, v, k_buf, v_buf, seqs, locs, 0.3, "cuda")
    assert (out.double() - bipartite_reference(q, k, v, k_buf, v_buf, seqs, 0.3)).abs().max() <= tol
    td.visible_columns_alone(dtype, det, "cuda")
    td.chunked_causal_prefill(dtype, det, device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs a CUDA device (none here)")
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_deterministic_engine_on_cuda(monkeypatch, engines, dtype):
    """The engine under the flag on a GPU (auto picks the triton backend's batch-invariant kernel), the
    CPU tests of tests/test_deterministic.py on CUDA: greedy generation alone, batched, cached, chunked
    and among threads; score; rank in every prefix mode and both score_by alone, batched and from
    every cache (whole or partial); retrieve and recommend alone and batched, with a cached prefix and
    chunked; hybrid prefilling: the same bits."""
    import tests.test_deterministic as td
    from sgrec.model.attention import TritonBackend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def on_cuda(dt: str, **kw):
        e = engines(dt, device="cuda", **kw)
        assert isinstance(e.runner.backend, TritonBackend) and e.runner.backend.deterministic
        return e

    td.test_generate_alone_batched_cached_and_chunked(on_cuda, dtype)
    td.test_score_alone_and_among_other_items(on_cuda, dtype)
    for score_by in ("id_token", "semantic_id"):
        td.test_rank_alone_batched_and_from_every_cache(on_cuda, dtype, score_by)
        td.test_rank_partial_item_cache(on_cuda, dtype, score_by)
    td.test_retrieve_and_recommend_alone_and_batched(on_cuda, dtype, monkeypatch)
    td.test_hybrid_prefill_equals_the_normal_forward(on_cuda, dtype)
    td.test_retrieve_with_a_cached_prefix_and_chunked_prefill(on_cuda, dtype)
