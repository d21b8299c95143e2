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
