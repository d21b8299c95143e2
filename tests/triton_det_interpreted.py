"""--enable-deterministic-inference on the triton backend, under Triton's interpreter on CPU:
the batch-invariant kernel (sgrec.model.kernels.det_attention) against float64 attention, a row's
bits from its visible columns alone, and the engine's requests alone, batched, chunked and cached.
Run by tests/test_kernels.py with TRITON_INTERPRET=1 (see tests/triton_interpreted.py); the same
checks compiled on a GPU are in tests/test_kernels.py (marked cuda)."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_kernels.py with TRITON_INTERPRET=1", allow_module_level=True)

import tests.test_deterministic as td  # noqa: E402
from sgrec.model.attention import SeqLayout, TritonBackend  # noqa: E402
from tests.kernel_refs import bipartite_reference, rank_case, rank_layouts, run_backends  # noqa: E402
from tests.test_deterministic import HKV, HQ, D, engines, sem_catalog  # noqa: E402,F401 (fixtures)
from tests.test_native_kernels import causal_case  # noqa: E402


def det() -> TritonBackend:
    return TritonBackend(deterministic=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_det_kernel_equals_reference(dtype, tol):
    """Rank layouts (cached columns in and out of layout order, one sequence with a dense mask only)
    and causal sequences with cached prefixes: float64 attention within tol."""
    q, k, v, k_buf, v_buf, seqs, locs = rank_case(HQ, HKV, D, rank_layouts(), dtype, seed=5)
    seqs[0] = SeqLayout(seqs[0].q_start, seqs[0].q_len, seqs[0].kv_indices, seqs[0].mask)  # dense only
    (out,), _ = run_backends([det()], q, k, v, k_buf, v_buf, seqs, locs, 0.3)
    assert (out.double() - bipartite_reference(q, k, v, k_buf, v_buf, seqs, 0.3)).abs().max() <= tol
    q, k, v, k_buf, v_buf, seqs, refs, locs = causal_case(HQ, HKV, D, [(0, 90), (70, 1), (29, 40), (1, 33)], dtype, 2)
    (out,), _ = run_backends([det()], q, k, v, k_buf, v_buf, seqs, locs, 0.3)
    assert (out.double() - bipartite_reference(q, k, v, k_buf, v_buf, refs, 0.3)).abs().max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_depends_on_its_visible_columns_alone(dtype):
    td.visible_columns_alone(dtype, det)


def test_the_plain_triton_kernel_fails_that_check():
    assert td.default_kernel_differs(TritonBackend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_causal_prefill_gives_the_same_bits(dtype):
    td.chunked_causal_prefill(dtype, det, n=100, chunk=37)


# ---- the engine on the triton backend -------------------------------------------------------------
@pytest.fixture(scope="module")
def triton_engines(engines):  # noqa: F811
    def get(dtype: str, **kw):
        e = engines(dtype, attention_backend="triton", **kw)
        assert isinstance(e.runner.backend, TritonBackend) and e.runner.backend.deterministic
        return e

    return get


# each check in one dtype or two (the interpreter is slow); every one in both on the native backend
# (tests/test_deterministic.py) and, compiled, in bfloat16 on a GPU (tests/test_kernels.py)
def test_generate_alone_batched_cached_and_chunked(triton_engines):
    td.test_generate_alone_batched_cached_and_chunked(triton_engines, "bfloat16")


@pytest.mark.parametrize("dtype", td.DTYPES)
def test_score_alone_and_among_other_items(triton_engines, dtype):
    td.test_score_alone_and_among_other_items(triton_engines, dtype)


@pytest.mark.parametrize("dtype,score_by", [("bfloat16", "id_token"), ("float32", "semantic_id")])
def test_rank_alone_batched_and_from_every_cache(triton_engines, dtype, score_by):
    td.test_rank_alone_batched_and_from_every_cache(triton_engines, dtype, score_by)


def test_retrieve_and_recommend_alone_and_batched(triton_engines, monkeypatch):
    td.test_retrieve_and_recommend_alone_and_batched(triton_engines, "float32", monkeypatch)
