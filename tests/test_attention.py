"""The torch attention backend's batched decode (one gather of head-major rows, SDPA on padded K/V)
against the obviously-right reference: each sequence's K/V read slot by slot and attention in float64."""

import pytest
import torch

from sgrec.mem.kv_pool import KVPool
from sgrec.model.attention import ForwardBatch, SeqLayout, TorchBackend


def reference(q, k_buf, v_buf, seqs, scale):
    out = []
    hq, hkv = q.shape[1], k_buf.shape[1]
    for i, s in enumerate(seqs):
        k = k_buf[s.kv_indices].double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        v = v_buf[s.kv_indices].double().repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), k) * scale, dim=-1)
        out.append(torch.einsum("hl,lhd->hd", p, v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("lens", [[5], [7, 7, 7], [1, 13, 4, 30]])
def test_decode_equals_per_sequence_reference(hq, hkv, lens):
    torch.manual_seed(len(lens) * 10 + hkv)
    d, size = 16, 200
    pool = KVPool(size, 1, hkv, d, torch.float32)
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]))
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0]))
    slots = (torch.randperm(size)[: sum(lens)] + 1).split(lens)  # scattered over the pool, never slot 0
    seqs = [SeqLayout(i, 1, sl) for i, sl in enumerate(slots)]
    new = torch.stack([sl[-1] for sl in slots])  # each sequence's new token is its last slot
    b = len(lens)
    q, k, v = torch.randn(b, hq, d), torch.randn(b, hkv, d), torch.randn(b, hkv, d)
    batch = ForwardBatch(torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64), new, seqs, pool)
    assert batch.is_decode
    backend = TorchBackend()
    backend.prepare(batch)
    out = backend.forward(q, k, v, 0, batch, d ** -0.5)
    assert torch.equal(pool.k_buffer[0][new], k) and torch.equal(pool.v_buffer[0][new], v)  # written first
    want = reference(q, pool.k_buffer[0], pool.v_buffer[0], seqs, d ** -0.5)
    assert out.shape == (b, hq * d)
    assert (out.double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_extend_is_sdpa_on_the_bool_mask(dtype):
    """Sequences with an explicit bool mask (rank layouts, path rows) and a cached prefix: the
    backend's additive mask (made once per forward) gives SDPA's output on the bool mask bit for bit,
    in every layer's call; the result is the float64 masked attention's within float32 rounding."""
    torch.manual_seed(3)
    hq, hkv, d, size = 6, 2, 16, 300
    pool = KVPool(size, 1, hkv, d, dtype)
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0], dtype=torch.float32))
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0], dtype=torch.float32))
    perm = torch.randperm(size)[:70] + 1
    specs = [(30, 12), (25, 25), (3, 1)]  # (kv_len, q_len): the new tokens are the last q_len slots
    seqs, q_start, used = [], 0, 0
    for kv_len, q_len in specs:
        mask = torch.rand(q_len, kv_len) < 0.6
        mask[:, 0] = True  # every row sees something
        seqs.append(SeqLayout(q_start, q_len, perm[used : used + kv_len], mask))
        q_start, used = q_start + q_len, used + kv_len
    new = torch.cat([s.kv_indices[s.kv_len - s.q_len :] for s in seqs])
    n = new.numel()
    q, k, v = (torch.randn(n, h, d).to(dtype) for h in (hq, hkv, hkv))
    batch = ForwardBatch(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), new, seqs, pool)
    backend = TorchBackend()
    backend.prepare(batch)
    out = backend.forward(q, k, v, 0, batch, d ** -0.5).view(n, hq, d)
    for s in seqs:
        sl = slice(s.q_start, s.q_start + s.q_len)
        kk, vv = pool.k_buffer[0][s.kv_indices], pool.v_buffer[0][s.kv_indices]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[sl].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=s.mask, scale=d ** -0.5,
            enable_gqa=True).transpose(0, 1)
        assert torch.equal(out[sl], want)
        kd, vd = (t.double().repeat_interleave(hq // hkv, dim=1) for t in (kk, vv))
        sc = torch.einsum("qhd,lhd->hql", q[sl].double(), kd) * d ** -0.5
        p = torch.softmax(sc.masked_fill(~s.mask, float("-inf")), dim=-1)
        ref = torch.einsum("hql,lhd->qhd", p, vd)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert (out[sl].double() - ref).abs().max() < tol


def test_flashinfer_page_tables_and_backend_choice(monkeypatch):
    """FlashInfer's page tables at page size 1 (sgrec.model.flashinfer_backend.paged_layout): the
    query and KV offsets and the slots of a decode, a prefill and an extend sequence; the backend is
    refused off CUDA, or without flashinfer, with the flag's name; auto on CPU never picks it."""
    import importlib.util

    from sgrec.model.backends import make_backend
    from sgrec.model.flashinfer_backend import FlashInferBackend, paged_layout

    seqs = [SeqLayout(0, 1, torch.tensor([7, 3, 9])), SeqLayout(1, 4, torch.tensor([1, 2, 4, 8])),
            SeqLayout(5, 2, torch.tensor([20, 21, 22, 5, 6]))]
    qo, kv, idx, last = paged_layout(seqs, "cpu")
    assert qo.tolist() == [0, 1, 5, 7] and kv.tolist() == [0, 3, 7, 12]
    assert idx.tolist() == [7, 3, 9, 1, 2, 4, 8, 20, 21, 22, 5, 6] and last.tolist() == [1, 1, 1]
    assert {t.dtype for t in (qo, kv, idx, last)} == {torch.int32}
    from sgrec.model.flashinfer_backend import check_cases

    cases = check_cases("cpu")  # the start-up check's batches: valid layouts torch attends over
    assert [[(s.q_len, s.kv_len) for s in c[0]] for c in cases] == [[(1, 9), (1, 20)], [(5, 5), (7, 30)]]
    assert len({int(x) for c in cases for s in c[0] for x in s.kv_indices}) == 64  # no slot shared
    for seqs, q, k, v, loc, pool in cases:
        batch = ForwardBatch(torch.zeros(q.shape[0], dtype=torch.int64), torch.zeros(q.shape[0], dtype=torch.int64),
                             loc, seqs, pool)
        assert not FlashInferBackend().takes(batch)  # a CPU pool
        TorchBackend().prepare(batch)
        assert TorchBackend().forward(q, k, v, 0, batch, 0.125).shape == (q.shape[0], 8 * 64)
    with pytest.raises(ValueError, match="attention-backend flashinfer runs on CUDA"):
        make_backend("flashinfer", "cpu")
    assert not isinstance(make_backend("auto", "cpu"), FlashInferBackend)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    with pytest.raises(ValueError, match="needs the flashinfer package"):
        make_backend("flashinfer", "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_flashinfer_backend_on_cuda(tiny_model_dir):
    """Where FlashInfer is installed (the `gpu` extra; the lent GPU machines lack it): the start-up
    check passes, and a bfloat16 runner on it prefills and decodes like the torch backend (logits
    within 5e-2, bfloat16)."""
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed (pip install 'sgrec[gpu]')")
    from sgrec.model.flashinfer_backend import FlashInferBackend, flashinfer_runs
    from sgrec.runner import ModelRunner
    from sgrec.server_args import ServerArgs
    from tests.kernel_refs import decode_logits

    assert flashinfer_runs(torch.device("cuda"))
    runners = [ModelRunner(ServerArgs.from_kwargs(model_path=tiny_model_dir("qwen3"), device="cuda", dtype="bfloat16",
                                                  max_total_tokens=512, attention_backend=name,
                                                  disable_cuda_graph=True)) for name in ("torch", "flashinfer")]
    assert isinstance(runners[1].backend, FlashInferBackend)
    a, b = (decode_logits(r) for r in runners)
    assert (a.float() - b.float()).abs().max() <= 5e-2
