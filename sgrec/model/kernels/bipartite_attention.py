"""Extend attention under a bipartite (rank) mask in one Triton kernel (BAT §4.2): the mask is given
by two integers per KV column, never as a dense [q_len, kv_len] matrix.

A sequence's KV columns are its cached tokens (read from the pool through their slots) and its new
tokens (their K/V as computed, not read back from the pool). Every column carries its `order` (the
token's offset in its layout) and its `block` (-1: in no block, e.g. a user, header or instruction
token; else the candidate it belongs to). A new token (order o, block b) may attend to a column
(order o', block b') iff

    o' <= o  and  not (b >= 0 and b' >= 0 and b != b')

that is, causally in layout order, except that a block never sees another block: the rule of
sgrec.layout.RankLayout.mask, whatever the layout (user or item as prefix) and whichever of its
tokens are cached (the cached columns may come in any order, e.g. item-as-prefix's cached items
before the fresh ones). New tokens must come in ascending order (they are the rows, in layout order).

    q, k, v       [T, H, D]           the batch's new tokens (Hq heads in q, Hkv in k and v)
    k_buf, v_buf  [slots, Hkv, D]     the pool's K/V of one layer
    q_start, q_end [B]                sequence b's new tokens are rows q_start[b] .. q_end[b] - 1
    q_order, q_block [T]              order and block of every new token
    c_idx, c_order, c_block [C]       every sequence's cached columns (slots, order, block), concatenated
    c_ptr          [B + 1]            sequence b's cached columns are c_ptr[b] .. c_ptr[b + 1] - 1
    -> out         [T, Hq * D]

One program per (tile of BLOCK_M new tokens of one sequence, KV head) holds the tile's BLOCK_M x G
query rows (G = Hq / Hkv: GQA), walks the cached columns and then the new ones up to the tile's last
row (causal bound), BLOCK_N at a time, with the online-softmax update. A KV tile whose columns no row
of the program may see (another candidate's tokens) is skipped after reading only its order and
block. Both products run on float32 operands: IEEE float32 for float32 inputs (no TF32 rounding),
TF32 for bfloat16/float16 inputs (which TF32 holds exactly, so q k^T is what a bfloat16 product
with float32 accumulation gives; the probabilities keep TF32's 10 mantissa bits). Running max, sum
and output are float32; the output has q's dtype. Under TRITON_INTERPRET=1 (whose tl.dot would
multiply bfloat16's raw bits) it runs on CPU tensors.
"""

from __future__ import annotations

import torch

from sgrec.mem.kv_pool import FP8  # an fp8 KV pool (--kv-cache-dtype fp8_e4m3): read in float32 like any other
from sgrec.model.kernels import built, pow2

_KERNELS: dict[bool, object] = {}


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(Q, K, V, KB, VB, QS, QE, QORD, QBLK, CIDX, CP, CORD, CBLK, TSEQ, TM0, O, scale,
               s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_bks, s_bkh, s_bvs, s_bvh, s_ot, s_oh,
               G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.load(TSEQ + t)
        qs = tl.load(QS + b)
        qe = tl.load(QE + b)
        row0 = qs + tl.load(TM0 + t)
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        tok = row0 + r // BLOCK_G  # query row r: token tok, head h * G + g
        g = r % BLOCK_G
        row_ok = (tok < qe) & (g < G)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        n = tl.arange(0, BLOCK_N)
        qv = tl.load(Q + tok[:, None] * s_qt + (h * G + g)[:, None] * s_qh + d[None, :],
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        r_ord = tl.load(QORD + tok, mask=row_ok, other=-1)  # order -1: a padding row sees nothing
        r_blk = tl.load(QBLK + tok, mask=row_ok, other=-1)
        r_free = r_blk < 0
        m = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
        for part in tl.static_range(2):  # the cached columns (from the pool by slot), then the new ones
            if part == 0:
                lo, hi = tl.load(CP + b), tl.load(CP + b + 1)
                ORD, BLK, KS, VS, s_ks, s_kh_, s_vs, s_vh_ = CORD, CBLK, KB, VB, s_bks, s_bkh, s_bvs, s_bvh
            else:  # as computed; columns past the tile's last row come later in order: never seen
                lo, hi = qs, tl.minimum(qe, row0 + BLOCK_M)
                ORD, BLK, KS, VS, s_ks, s_kh_, s_vs, s_vh_ = QORD, QBLK, K, V, s_kt, s_kh, s_vt, s_vh
            for n0 in range(lo, hi, BLOCK_N):
                col = n0 + n
                ok = col < hi
                c_ord = tl.load(ORD + col, mask=ok, other=0)
                c_blk = tl.load(BLK + col, mask=ok, other=-1)
                vis = ok[None, :] & (c_ord[None, :] <= r_ord[:, None]) & (
                    r_free[:, None] | (c_blk < 0)[None, :] | (c_blk[None, :] == r_blk[:, None]))
                if tl.sum(vis.to(tl.int32)) > 0:  # else every column is another candidate's: skipped
                    if part == 0:
                        src = tl.load(CIDX + col, mask=ok, other=0)
                    else:
                        src = col
                    kt = tl.load(KS + src[None, :] * s_ks + h * s_kh_ + d[:, None], mask=ok[None, :] & d_ok[:, None],
                                 other=0.0).to(tl.float32)  # [D, N]
                    vt = tl.load(VS + src[:, None] * s_vs + h * s_vh_ + d[None, :], mask=ok[:, None] & d_ok[None, :],
                                 other=0.0).to(tl.float32)  # [N, D]
                    sc = tl.dot(qv, kt, input_precision=PREC)
                    sc = tl.where(vis, sc * scale, float("-inf"))
                    m_new = tl.maximum(m, tl.max(sc, axis=1))
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing stays empty
                    alpha = tl.exp(m - m_use)
                    p = tl.exp(sc - m_use[:, None])
                    pv = tl.dot(p, vt, input_precision=PREC)
                    l = l * alpha + tl.sum(p, axis=1)
                    acc = acc * alpha[:, None] + pv
                    m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(O + tok[:, None] * s_ot + (h * G + g)[:, None] * s_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])

    return kernel


def tiles(q_lens: list[int], block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid's tiles: (sequence, first new token within it) of every BLOCK_M new tokens."""
    seq, m0 = [], []
    for b, n in enumerate(q_lens):
        starts = range(0, n, block_m)
        seq += [b] * len(starts)
        m0 += starts
    return torch.tensor(seq, dtype=torch.int64), torch.tensor(m0, dtype=torch.int64)


def bipartite_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                        q_start: torch.Tensor, q_end: torch.Tensor, q_order: torch.Tensor, q_block: torch.Tensor,
                        c_idx: torch.Tensor, c_ptr: torch.Tensor, c_order: torch.Tensor, c_block: torch.Tensor,
                        scale: float, block_m: int = 16, block_n: int = 32,
                        grid_tiles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """See the module doc. Index tensors are int64 on q's device; `grid_tiles`: tiles(q_lens,
    block_m) on that device, when the caller has them (else made here from q_start and q_end)."""
    T, hq, D = q.shape
    hkv = k.shape[1]
    if hq % hkv or k_buf.shape[1] != hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    if len({t.dtype for t in (q, k, v)}) != 1 or k_buf.dtype != v_buf.dtype or k_buf.dtype not in (q.dtype, FP8):
        raise ValueError("q, k and v need one dtype, and k_buf and v_buf theirs or float8_e4m3fn (an fp8 pool)")
    if min(k.stride(-1), v.stride(-1), k_buf.stride(-1), v_buf.stride(-1)) != 1:
        raise ValueError("k, v, k_buf and v_buf need a contiguous last dimension")
    q = q.contiguous()
    out = torch.empty_like(q)
    if grid_tiles is None:
        lens = (q_end - q_start).tolist()
        grid_tiles = tuple(t.to(q.device) for t in tiles(lens, block_m))
    tseq, tm0 = grid_tiles
    if tseq.numel() == 0:
        return out.reshape(T, hq * D)
    G = hq // hkv
    built(_KERNELS, _build)[(tseq.numel(), hkv)](
        q, k, v, k_buf, v_buf, q_start, q_end, q_order, q_block, c_idx, c_ptr, c_order, c_block, tseq, tm0, out,
        float(scale), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1),
        G=G, D=D, BLOCK_M=block_m, BLOCK_G=pow2(G), BLOCK_D=max(16, pow2(D)), BLOCK_N=block_n,
        PREC="ieee" if q.dtype == torch.float32 else "tf32")
    return out.reshape(T, hq * D)
