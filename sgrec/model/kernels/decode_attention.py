"""Decode attention that reads K/V through slot indices (Triton): one query token per sequence,
its keys and values wherever the KV pool holds them, no gathered copy.

    q        [B, Hq, D]            one new token per sequence
    k_buf    [slots, Hkv, D]       the pool's K of one layer (v_buf likewise)
    kv_idx   [sum of lengths]      every sequence's slots, concatenated
    kv_ptr   [B + 1]               sequence b's slots are kv_idx[kv_ptr[b] : kv_ptr[b + 1]] (>= 1 each)
    -> out   [B, Hq * D]

One program per (sequence, KV head, split) handles the G = Hq / Hkv query heads that share the KV
head (GQA): it walks its split of the sequence's slots BLOCK_N at a time with the online-softmax
update (running max m, sum l, unnormalised output acc), so K and V are read once per KV head, from
the pool in place. Products are broadcast sums rather than tl.dot, which needs 16-row tiles that G
rarely fills. Accumulates in float32 whatever the pool's dtype; the output has q's dtype.

Splits (flash-decoding): with few sequences a GPU would run B x Hkv programs on a handful of its
SMs, each walking a whole long context. `splits` S > 1 cuts each sequence's slots into S equal
runs (whole BLOCK_N tiles), each program writes its run's (m, l, acc), and a merge takes
o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s (a run with no slot has m = -inf,
weight 0). S depends on the batch's shape only (not on the lengths, which the host does not read),
so a CUDA graph of a step keeps it; by default enough programs to fill the device's SMs twice.

Under TRITON_INTERPRET=1 (read when the kernel is first built) the kernel runs on CPU tensors.
"""

from __future__ import annotations

import functools

import torch

from sgrec.model.kernels import built, pow2

_KERNELS: dict[bool, object] = {}  # interpreted or compiled -> the jitted kernel


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(Q, K, V, IDX, PTR, O, M, L, scale, S,
               s_qb, s_qh, s_ks, s_kh, s_vs, s_vh, s_ob, s_oh,
               G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, PARTIAL: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        start = tl.load(PTR + b)
        end = tl.load(PTR + b + 1)
        per = tl.cdiv(tl.cdiv(end - start, S), BLOCK_N) * BLOCK_N  # this split's run: whole tiles
        lo = start + sp * per
        hi = tl.minimum(end, lo + per)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        gd_mask = (g < G)[:, None] & (d < D)[None, :]
        q = tl.load(Q + b * s_qb + (h * G + g)[:, None] * s_qh + d[None, :], mask=gd_mask, other=0.0)
        q = q.to(tl.float32) * scale
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            valid = n0 + n < hi
            slot = tl.load(IDX + n0 + n, mask=valid, other=0)
            nd_mask = valid[:, None] & (d < D)[None, :]
            k = tl.load(K + slot[:, None] * s_ks + h * s_kh + d[None, :], mask=nd_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(V + slot[:, None] * s_vs + h * s_vh + d[None, :], mask=nd_mask, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        if PARTIAL:  # rows (b, head, split) of M, L [B, Hq, S] and O [B, Hq, S, D], all float32
            row = (b * (tl.num_programs(1) * G) + h * G + g) * S + sp
            tl.store(M + row, m, mask=g < G)
            tl.store(L + row, l, mask=g < G)
            tl.store(O + row[:, None] * D + d[None, :], acc, mask=gd_mask)
        else:
            out = acc / l[:, None]
            tl.store(O + b * s_ob + (h * G + g)[:, None] * s_oh + d[None, :], out.to(O.dtype.element_ty),
                     mask=gd_mask)

    return kernel


MAX_SPLITS = 16


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def auto_splits(batch: int, hkv: int, device: torch.device) -> int:
    """Splits per sequence so that batch x hkv x splits programs fill the GPU's SMs about twice
    (at most MAX_SPLITS); 1 off CUDA (the interpreter) and where batch x hkv fill them already."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device)
    return max(1, min(MAX_SPLITS, -(-2 * sms // (batch * hkv))))


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_idx: torch.Tensor,
                     kv_ptr: torch.Tensor, scale: float, block_n: int = 32, splits: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence over its slots (see the module doc) -> [B, Hq * D].
    splits: runs per sequence (default auto_splits)."""
    B, hq, D = q.shape
    hkv = k_buf.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("k_buf and v_buf need a contiguous last dimension")
    S = auto_splits(B, hkv, q.device) if splits is None else int(splits)
    if S < 1:
        raise ValueError("splits must be at least 1")
    q = q.contiguous()
    G = hq // hkv
    idx, ptr = kv_idx.to(torch.int64).contiguous(), kv_ptr.to(torch.int64).contiguous()
    if S == 1:
        out = torch.empty_like(q)
        m = l = out  # unused
    else:
        out = torch.empty((B, hq, S, D), dtype=torch.float32, device=q.device)
        m = torch.empty((B, hq, S), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
    built(_KERNELS, _build)[(B, hkv, S)](
        q, k_buf, v_buf, idx, ptr, out, m, l, float(scale), S,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1),
        G=G, D=D, BLOCK_G=pow2(G), BLOCK_D=pow2(D), BLOCK_N=block_n, PARTIAL=S > 1)
    if S > 1:  # the runs' log-sum-exp merge
        w = torch.exp(m - m.amax(-1, keepdim=True))  # a run with no slot: e^-inf = 0
        out = ((out * w[..., None]).sum(2) / (l * w).sum(-1)[..., None]).to(q.dtype)
    return out.reshape(B, hq * D)
