"""A beam step's staged attention in one Triton kernel (xGR §5.1-5.2): every beam of a request
against the request's shared prompt K/V, read once per block of beams, and against its own
unshared tokens, merged by the online-softmax (log-sum-exp) rule.

    q          [n, Hq, D]        one token per beam
    k_buf      [slots, Hkv, D]   the pool's K of one layer (v_buf likewise)
    shared     [P]               the prompt's slots (the same for every beam)
    unshared   [n, s]            each beam's own slots (its generated tokens, the current one last)
    -> out     [n, Hq * D]

One program per (block of BLOCK_B beams, KV head): its BLOCK_B x G query rows (G = Hq / Hkv, GQA)
take each BLOCK_N-slot tile of the prompt's K and V once for all of them (the point of staging:
the prompt is not read once per beam), then each beam's s own slots. Running max, sum and output
are float32; the output has q's dtype. The torch reference is sgrec.beam.attention.staged_attention.

Under TRITON_INTERPRET=1 (set before triton is imported) it runs on CPU tensors.
"""

from __future__ import annotations

import torch

from sgrec.model.kernels import built, pow2


_KERNELS: dict[bool, object] = {}


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(Q, K, V, SH, UN, O, scale, n_beams, n_shared, n_own,
               s_qn, s_qh, s_ks, s_kh, s_vs, s_vh, s_un, s_on, s_oh,
               G: tl.constexpr, D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_G: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        beam = pid * BLOCK_B + tl.arange(0, BLOCK_B)  # [B]
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        row_ok = (beam < n_beams)[:, None] & (g < G)[None, :]  # [B, G]
        d_ok = d < D
        q_off = beam[:, None, None] * s_qn + (h * G + g)[None, :, None] * s_qh + d[None, None, :]
        q = tl.load(Q + q_off, mask=row_ok[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32) * scale
        m = tl.full([BLOCK_B, BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_B, BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_B, BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(0, n_shared, BLOCK_N):  # the shared prompt: each tile read once for all rows
            ok = n0 + n < n_shared
            slot = tl.load(SH + n0 + n, mask=ok, other=0)
            kv_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(K + slot[:, None] * s_ks + h * s_kh + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            s = tl.sum(q[:, :, None, :] * k[None, None, :, :], axis=3)  # [B, G, N]
            s = tl.where(ok[None, None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=2))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, :, None])
            v = tl.load(V + slot[:, None] * s_vs + h * s_vh + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            acc = acc * alpha[:, :, None] + tl.sum(p[:, :, :, None] * v[None, None, :, :], axis=2)
            l = l * alpha + tl.sum(p, axis=2)
            m = m_new
        for j in range(0, n_own):  # each beam's own tokens, one column at a time
            slot = tl.load(UN + beam * s_un + j, mask=beam < n_beams, other=0)  # [B]
            kv_ok = (beam < n_beams)[:, None] & d_ok[None, :]
            k = tl.load(K + slot[:, None] * s_ks + h * s_kh + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            s = tl.sum(q * k[:, None, :], axis=2)  # [B, G]
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(V + slot[:, None] * s_vs + h * s_vh + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            acc = acc * alpha[:, :, None] + p[:, :, None] * v[:, None, :]
            l = l * alpha + p
            m = m_new
        out = acc / l[:, :, None]
        o_off = beam[:, None, None] * s_on + (h * G + g)[None, :, None] * s_oh + d[None, None, :]
        tl.store(O + o_off, out.to(O.dtype.element_ty), mask=row_ok[:, :, None] & d_ok[None, None, :])

    return kernel


def staged_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, shared_idx: torch.Tensor,
                     unshared_idx: torch.Tensor, scale: float, block_b: int = 4, block_n: int = 32) -> torch.Tensor:
    """See the module doc; the same contract as sgrec.beam.attention.staged_attention. Needs at
    least one key per beam (a prompt or an own token)."""
    n, hq, D = q.shape
    hkv = k_buf.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    if shared_idx.numel() == 0 and unshared_idx.numel() == 0:
        raise ValueError("staged_attention needs at least one key")
    q = q.contiguous()
    un = unshared_idx.to(torch.int64).contiguous().view(n, -1) if unshared_idx.numel() else \
        torch.zeros(n, 0, dtype=torch.int64, device=q.device)
    out = torch.empty_like(q)
    G = hq // hkv
    grid = (-(-n // block_b), hkv)
    built(_KERNELS, _build)[grid](
        q, k_buf, v_buf, shared_idx.to(torch.int64).contiguous(), un, out, float(scale), n, shared_idx.numel(),
        un.shape[1], q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        max(un.stride(0), 1), out.stride(0), out.stride(1),
        G=G, D=D, BLOCK_B=block_b, BLOCK_G=pow2(G), BLOCK_D=pow2(D), BLOCK_N=block_n)
    return out.reshape(n, hq * D)
