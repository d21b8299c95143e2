"""Batch-invariant attention in Triton, for --enable-deterministic-inference on the triton backend:
a row's output bits depend on its visible columns alone, in their summation order, never
on its batch mates, on which of its columns were cached, on how its prefill was chunked, or on the
columns it cannot see that lie between them.

Why the tiled kernels cannot promise that: `tl.dot` and `tl.sum` reduce a tile's columns in a fixed
tree, so a row's sum depends on where each visible column falls in its tile. In the other kernels a
column's place is its place in the sequence's KV, which moves when another candidate joins the
layout, or when the item before it came from the cache.

What this kernel does instead. Each sequence's columns come in summation order (DetMeta: layout
order). A row's *visible list* is the columns it may see, in that order, and a column's *rank* is its
place in the list. Tiles are cut at fixed ranks (0, BLOCK_N, 2 BLOCK_N, ...) of the list: a row's
tiles hold the same columns at the same places wherever the row is computed. Rows that can share a
list are grouped: consecutive new tokens of a sequence each of whose visible lists is a prefix of the
next one's (a causal run, the tokens of one candidate block, a run of free tokens). A group's list is
its last row's, and row r reads the first cnt[r] entries of it; one program takes BLOCK_M rows of a
group (times the G query heads of a KV head), walks the list up to its last row's count with the
online softmax, and masks each row's ranks >= cnt[r]. Past its own count a row's tile is all masked:
its max stays, alpha = e^0 = 1 and the tile adds exact zeros, so a long neighbour changes nothing.
Products as in bipartite_attention: float32 operands, IEEE for float32 inputs, TF32 for bfloat16,
through `tl.dot`, whose tensor-core instructions compute every element of a tile the same way, so a
row's bits do not depend on its place in the tile (tests/test_kernels.py checks that on a GPU).
Triton's interpreter computes `tl.dot` with numpy's BLAS, which does not promise that (OpenBLAS gave
rows other bits when they moved in the tile); interpreted, the kernel therefore takes each product as
a broadcast sum per element instead (USE_DOT=False), and the CPU tests check the algorithm: the lists,
the ranks, the masks and the online softmax.

    q, k, v        [T, H, D]          the batch's new tokens (Hq heads in q, Hkv in k and v)
    k_buf, v_buf   [slots, Hkv, D]    the pool's K/V of one layer
    tiles          DetTiles           the lists, the counts and the grid (DetTiles.of(DetMeta))
    -> out         [T, Hq * D]
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sgrec.model.kernels import built, pow2

_KERNELS: dict[bool, object] = {}
BLOCK_M = 16  # rows per program: one value for every forward, so that a row is computed one way
BLOCK_N = 32


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(Q, K, V, KB, VB, LST, CNT, TR0, TR1, TLP, O, scale,
               s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_bks, s_bkh, s_bvs, s_bvh, s_ot, s_oh,
               G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, USE_DOT: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        r0 = tl.load(TR0 + t)
        r1 = tl.load(TR1 + t)
        lp = tl.load(TLP + t)
        r = tl.arange(0, BLOCK_M * BLOCK_G)
        tok = r0 + r // BLOCK_G  # query row r: token tok, head h * G + g
        g = r % BLOCK_G
        row_ok = (tok < r1) & (g < G)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        n = tl.arange(0, BLOCK_N)
        qv = tl.load(Q + tok[:, None] * s_qt + (h * G + g)[:, None] * s_qh + d[None, :],
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        cnt = tl.load(CNT + tok, mask=row_ok, other=0)
        last = tl.load(CNT + r1 - 1)  # counts grow along a group: the tile's last row reads the most
        m = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(0, last, BLOCK_N):  # tiles at fixed ranks of the list
            j = n0 + n
            ok = j < last
            src = tl.load(LST + lp + j, mask=ok, other=0)  # >= 0: a pool slot; < 0: -1 - a new token's row
            pool = src >= 0
            slot = tl.where(pool, src, 0)
            row = tl.where(pool, 0, -1 - src)
            in_pool = ok & pool
            in_new = ok & (src < 0)
            kt = tl.where(in_pool[None, :],
                          tl.load(KB + slot[None, :] * s_bks + h * s_bkh + d[:, None],
                                  mask=in_pool[None, :] & d_ok[:, None], other=0.0).to(tl.float32),
                          tl.load(K + row[None, :] * s_kt + h * s_kh + d[:, None],
                                  mask=in_new[None, :] & d_ok[:, None], other=0.0).to(tl.float32))  # [D, N]
            vt = tl.where(in_pool[:, None],
                          tl.load(VB + slot[:, None] * s_bvs + h * s_bvh + d[None, :],
                                  mask=in_pool[:, None] & d_ok[None, :], other=0.0).to(tl.float32),
                          tl.load(V + row[:, None] * s_vt + h * s_vh + d[None, :],
                                  mask=in_new[:, None] & d_ok[None, :], other=0.0).to(tl.float32))  # [N, D]
            vis = ok[None, :] & (j[None, :] < cnt[:, None])
            if USE_DOT:
                sc = tl.dot(qv, kt, input_precision=PREC)
            else:  # each score's own sum over D, the same wherever its row sits
                sc = tl.sum(qv[:, :, None] * kt[None, :, :], axis=1)
            sc = tl.where(vis, sc * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing stays empty
            alpha = tl.exp(m - m_use)
            p = tl.exp(sc - m_use[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if USE_DOT:
                pv = tl.dot(p, vt, input_precision=PREC)
            else:
                pv = tl.sum(p[:, :, None] * vt[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(O + tok[:, None] * s_ot + (h * G + g)[:, None] * s_oh + d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])

    return kernel


@dataclass
class DetTiles:
    """The kernel's inputs: every group's visible list (sources: a pool slot, or -1 - a new token's
    row), each row's count of it, and the grid: (first row, end row, list offset) of every tile of
    BLOCK_M rows of one group."""

    lst: torch.Tensor  # int64 [sum of list lengths]
    cnt: torch.Tensor  # int64 [T]
    row0: torch.Tensor  # int64 [tiles]
    row1: torch.Tensor
    lp: torch.Tensor

    @classmethod
    def of(cls, meta, block_m: int = BLOCK_M, device: torch.device | None = None) -> "DetTiles":
        """From a DetMeta (sgrec.model.attention): each sequence's rows split into groups (see the
        module doc), each group's list and each row's count; on `device` (default: the meta's)."""
        dev = meta.q_start.device if device is None else device
        c = {name: getattr(meta, name).cpu() for name in ("q_start", "q_end", "q_order", "q_block", "c_idx",
                                                            "c_ptr", "c_order", "c_block", "m_ptr")}
        lens = c["c_ptr"][1:] - c["c_ptr"][:-1]
        offsets = torch.arange(c["c_order"].numel()) - torch.repeat_interleave(c["c_ptr"][:-1], lens)
        if bool((c["m_ptr"] < 0).all() and (c["c_block"] < 0).all() and torch.equal(c["c_order"], offsets)):
            return cls._causal(c, block_m, dev)
        mask = meta.mask.cpu()
        T = c["q_order"].numel()
        cnt = torch.zeros(T, dtype=torch.int64)
        lists, row0, row1, lp, offset = [], [], [], [], 0
        for b in range(c["q_start"].numel()):
            q0, q1 = int(c["q_start"][b]), int(c["q_end"][b])
            lo, hi = int(c["c_ptr"][b]), int(c["c_ptr"][b + 1])
            if q1 == q0:
                continue
            src, order, block = c["c_idx"][lo:hi], c["c_order"][lo:hi], c["c_block"][lo:hi]
            ro, rb = c["q_order"][q0:q1], c["q_block"][q0:q1]
            m0 = int(c["m_ptr"][b])
            if m0 >= 0:
                vis = mask[m0 : m0 + (q1 - q0) * (hi - lo)].view(q1 - q0, hi - lo)
                groups = _dense_groups(vis)
                picks = [torch.nonzero(vis[e - 1]).flatten() for _, e in groups]
                counts = vis.sum(1)
            else:
                groups = _bipartite_groups(order, block, ro, rb)
                picks, counts = [], torch.zeros(q1 - q0, dtype=torch.int64)
                for s, e in groups:
                    o, x = ro[e - 1], rb[e - 1]
                    pick = torch.nonzero((order <= o) & ((x < 0) | (block < 0) | (block == x))).flatten()
                    picks.append(pick)
                    counts[s:e] = torch.searchsorted(order[pick], ro[s:e], right=True)
            cnt[q0:q1] = counts
            for (s, e), pick in zip(groups, picks):
                lists.append(src[pick])
                for t0 in range(s, e, block_m):
                    row0.append(q0 + t0)
                    row1.append(q0 + min(e, t0 + block_m))
                    lp.append(offset)
                offset += pick.numel()

        def on(x) -> torch.Tensor:
            return torch.as_tensor(x, dtype=torch.int64).to(dev)

        return cls(on(torch.cat(lists) if lists else torch.zeros(0, dtype=torch.int64)), on(cnt), on(row0), on(row1),
                   on(lp))

    @classmethod
    def _causal(cls, c: dict, block_m: int, dev: torch.device) -> "DetTiles":
        """of() where no column is in a block and no sequence has a dense mask (prompts, decode steps):
        a sequence is one group whose list is its columns (orders 0 .. kv_len - 1), row r reads
        q_order[r] + 1 of them."""
        row0, row1, lp = [], [], []
        for q0, q1, off in zip(c["q_start"].tolist(), c["q_end"].tolist(), c["c_ptr"].tolist()):
            for t0 in range(q0, q1, block_m):
                row0.append(t0)
                row1.append(min(q1, t0 + block_m))
                lp.append(off)
        return cls(*(torch.as_tensor(x, dtype=torch.int64).to(dev)
                     for x in (c["c_idx"], c["q_order"] + 1, row0, row1, lp)))


def _runs(same: torch.Tensor, n: int) -> list[tuple[int, int]]:
    """[start, end) of the runs of rows 0..n-1 where same[r] says row r + 1 joins row r's run."""
    cuts = [0, *(torch.nonzero(~same).flatten() + 1).tolist(), n]
    return list(zip(cuts[:-1], cuts[1:]))


def _dense_groups(vis: torch.Tensor) -> list[tuple[int, int]]:
    """Groups of rows under a dense mask (columns in summation order): row r + 1 joins row r when r's
    visible columns are what r + 1 sees up to r's last one."""
    n, k = vis.shape
    if n == 1:
        return [(0, 1)]
    ranks = torch.arange(k)
    last = torch.where(vis, ranks, -1).amax(1)  # -1: sees nothing
    diff = vis[:-1] ^ vis[1:]
    first_diff = torch.where(diff, ranks, k).amin(1)
    return _runs((last[:-1] >= 0) & (first_diff > last[:-1]), n)


def _bipartite_groups(order: torch.Tensor, block: torch.Tensor, ro: torch.Tensor, rb: torch.Tensor) -> list[tuple[int, int]]:
    """Groups of rows under a bipartite mask (columns sorted by order; a row (o, b) sees the columns of
    order <= o in no block or in block b, a free row (b < 0) every one). Row r + 1 joins row r when
    both are in one block or both free; or when one is free and the other in block x and no column of
    order <= r's is in another block than x."""
    n = ro.numel()
    if n == 1:
        return [(0, 1)]
    b1, b2, o1 = rb[:-1], rb[1:], ro[:-1]
    in_block = block >= 0
    upto = torch.searchsorted(order, o1, right=True)  # columns of order <= o1
    blocked = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(in_block.to(torch.int64), 0)])[upto]
    span = int(order.max()) + 2 if order.numel() else 1
    keys = torch.sort(block[in_block] * span + order[in_block]).values
    x = torch.where(b1 >= 0, b1, b2).clamp(min=0)  # the block of the pair's block row
    own = torch.searchsorted(keys, x * span + o1, right=True) - torch.searchsorted(keys, x * span)
    alone = blocked == own  # no column of order <= o1 in a block other than x
    same = (b1 == b2) | (((b1 >= 0) != (b2 >= 0)) & alone)
    return _runs(same, n)


def det_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  tiles: DetTiles, scale: float) -> torch.Tensor:
    """See the module doc."""
    T, hq, D = q.shape
    hkv = k.shape[1]
    if hq % hkv or k_buf.shape[1] != hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    if min(k.stride(-1), v.stride(-1), k_buf.stride(-1), v_buf.stride(-1)) != 1:
        raise ValueError("k, v, k_buf and v_buf need a contiguous last dimension")
    q = q.contiguous()
    out = torch.zeros_like(q)
    if tiles.row0.numel() == 0:
        return out.reshape(T, hq * D)
    G = hq // hkv
    built(_KERNELS, _build)[(tiles.row0.numel(), hkv)](
        q, k, v, k_buf, v_buf, tiles.lst, tiles.cnt, tiles.row0, tiles.row1, tiles.lp, out, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1),
        G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_G=pow2(G), BLOCK_D=max(16, pow2(D)), BLOCK_N=BLOCK_N,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", USE_DOT=os.environ.get("TRITON_INTERPRET") != "1")
    return out.reshape(T, hq * D)
