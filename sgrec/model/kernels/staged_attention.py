"""A beam step's staged attention in one Triton kernel (xGR §5.1-5.2): every beam of a request
against the request's shared prompt K/V, read once per block of beams, and against its own
unshared tokens, merged by the online-softmax (log-sum-exp) rule. Several requests' beams go in
one launch (a batched beam step of a retrieve round).

    q          [n, Hq, D]        one token per beam, the requests' beams one after the other
    k_buf      [slots, Hkv, D]   the pool's K of one layer (v_buf likewise)
    shared     [sum P_g]         the requests' prompt slots, concatenated; sh_ptr [groups + 1] their offsets
    unshared   [n, s]            each beam's own slots (its generated tokens, the current one last)
    blocks     [programs, 3]     each program's (request, first row, end row): a block of at most
                                 BLOCK_B beams of one request (`beam_blocks`); request -1 = no work
    -> out     [n, Hq * D]

One program per (block, KV head): its BLOCK_B x G query rows (G = Hq / Hkv, GQA; padded to a tile of
BLOCK_M >= 16 rows, the least tl.dot takes) take each BLOCK_N-slot tile of their prompt's K and V once
for all of them (the point of staging: the prompt is not read once per beam) through two matrix
products, q k^T and p v, then each beam's s own slots one column at a time. Every bound the kernel
loops over is read on the device (sh_ptr, blocks), so a launch's metadata can sit in static buffers
(a CUDA graph's). The products run on float32 operands: IEEE float32 for float32 inputs, TF32 for
bfloat16/float16 ones (which TF32 holds exactly), like the bipartite kernel's. Running max, sum and
output are float32; the output has q's dtype. The torch reference is
sgrec.beam.attention.staged_attention, per request. Its measured time per layer and step, and the
launch variants compared with it (benchmarks/bench_staged_kernel.py), are in docs/performance.md.

Under TRITON_INTERPRET=1 (set before triton is imported) it runs on CPU tensors.
"""

from __future__ import annotations

import torch

from sgrec.model.kernels import built, pow2


_KERNELS: dict[bool, object] = {}
BLOCK_B = 16  # beams per program (x G query rows: a 32-row tile for Qwen3-1.7B's 16 over 8 heads)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(Q, K, V, SH, SH_PTR, UN, BLOCKS, O, scale, n_own,
               s_qn, s_qh, s_ks, s_kh, s_vs, s_vh, s_un, s_on, s_oh,
               G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr):
        pid = tl.program_id(0)
        h = tl.program_id(1)
        grp = tl.load(BLOCKS + pid * 3)
        first = tl.load(BLOCKS + pid * 3 + 1)
        end = tl.load(BLOCKS + pid * 3 + 2)  # first == end for a program with no work
        sh0 = tl.load(SH_PTR + tl.maximum(grp, 0))
        n_shared = tl.where(grp >= 0, tl.load(SH_PTR + tl.maximum(grp, 0) + 1) - sh0, 0)
        r = tl.arange(0, BLOCK_M)  # the program's query rows: beam r // BLOCK_G, head h * G + r % BLOCK_G
        beam = first + r // BLOCK_G
        g = r % BLOCK_G
        row_ok = (beam < end) & (g < G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        d_ok = d < D
        q_off = beam[:, None] * s_qn + (h * G + g)[:, None] * s_qh + d[None, :]
        q_in = tl.load(Q + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
        q = q_in.to(tl.float32)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(0, n_shared, BLOCK_N):  # the shared prompt: each tile read once for all rows
            ok = n0 + n < n_shared
            slot = tl.load(SH + sh0 + n0 + n, mask=ok, other=0)
            kv_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(K + slot[:, None] * s_ks + h * s_kh + d[None, :], mask=kv_ok, other=0.0)
            if LOW:  # the tiles in the inputs' 16-bit dtype, float32 sums
                s = tl.dot(q_in, tl.trans(k)) * scale  # [M, N]
            else:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PREC) * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(V + slot[:, None] * s_vs + h * s_vh + d[None, :], mask=kv_ok, other=0.0)
            if LOW:  # p rounded to the 16-bit dtype, as flash attention does
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PREC)
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        for j in range(0, n_own):  # each beam's own tokens, one column at a time
            slot = tl.load(UN + beam * s_un + j, mask=row_ok, other=0)  # [M]
            kv_ok = row_ok[:, None] & d_ok[None, :]
            k = tl.load(K + slot[:, None] * s_ks + h * s_kh + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            s = tl.sum(q * k, axis=1) * scale  # [M]
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            v = tl.load(V + slot[:, None] * s_vs + h * s_vh + d[None, :], mask=kv_ok, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + p[:, None] * v
            l = l * alpha + p
            m = m_new
        out = acc / l[:, None]
        tl.store(O + beam[:, None] * s_on + (h * G + g)[:, None] * s_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])

    return kernel


def beam_blocks(rows: list[int], block_b: int, programs: int | None = None) -> torch.Tensor:
    """The block table of requests with rows[g] beams each, one after the other: (request, first
    row, end row) per block of at most block_b beams; padded to `programs` entries by no-work
    blocks (request -1) when given (a static buffer's size). Host int64 [programs, 3]."""
    table, a = [], 0
    for g, n in enumerate(rows):
        table += [(g, b, min(b + block_b, a + n)) for b in range(a, a + n, block_b)]
        a += n
    if programs is not None:
        if len(table) > programs:
            raise ValueError(f"{len(table)} blocks do not fit {programs} programs")
        table += [(-1, 0, 0)] * (programs - len(table))
    return torch.tensor(table, dtype=torch.int64).view(-1, 3)


def staged_attention_batched(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, shared: torch.Tensor,
                             sh_ptr: torch.Tensor, unshared: torch.Tensor, blocks: torch.Tensor, scale: float,
                             block_b: int = BLOCK_B, block_n: int = 64, low_precision: bool = False,
                             num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """See the module doc. `blocks` made by beam_blocks(..., block_b) and on q's device, like
    shared, sh_ptr (int64) and unshared ([n, s] int64, s >= 0). Every beam needs a key: a non-empty
    prompt or s >= 1. low_precision, num_warps, num_stages: the variants benchmarks/bench_staged_kernel.py
    compares (not the engine's path): the prompt's products on 16-bit tiles where q and the pool share a
    bfloat16/float16 dtype (P rounded to it), else as by default; Triton's launch options."""
    n, hq, D = q.shape
    hkv = k_buf.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    q = q.contiguous()
    out = torch.empty_like(q)
    G = hq // hkv
    block_m = max(16, pow2(block_b * pow2(G)))
    low = low_precision and q.dtype in (torch.bfloat16, torch.float16) and k_buf.dtype == q.dtype
    launch = {} if num_stages is None else {"num_stages": num_stages}
    built(_KERNELS, _build)[(blocks.shape[0], hkv)](
        q, k_buf, v_buf, shared, sh_ptr, unshared, blocks, out, float(scale), unshared.shape[1],
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        max(unshared.stride(0), 1), out.stride(0), out.stride(1),
        G=G, D=D, BLOCK_M=block_m, BLOCK_G=pow2(G), BLOCK_D=max(16, pow2(D)), BLOCK_N=block_n,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", LOW=low,
        num_warps=num_warps or (4 if block_m <= 64 else 8), **launch)
    return out.reshape(n, hq * D)


def staged_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, shared_idx: torch.Tensor,
                     unshared_idx: torch.Tensor, scale: float, block_b: int = BLOCK_B, block_n: int = 64
                     ) -> torch.Tensor:
    """One request's beams; the same contract as sgrec.beam.attention.staged_attention."""
    n = q.shape[0]
    if shared_idx.numel() == 0 and unshared_idx.numel() == 0:
        raise ValueError("staged_attention needs at least one key")
    dev = q.device
    un = unshared_idx.to(torch.int64).contiguous().view(n, -1) if unshared_idx.numel() else \
        torch.zeros(n, 0, dtype=torch.int64, device=dev)
    sh_ptr = torch.tensor([0, shared_idx.numel()], dtype=torch.int64, device=dev)
    return staged_attention_batched(q, k_buf, v_buf, shared_idx.to(torch.int64).contiguous(), sh_ptr, un,
                                    beam_blocks([n], block_b).to(dev), scale, block_b, block_n)
