"""The forward batch description and the attention backend interface.

A ForwardBatch is a flat list of new tokens (T of them) from one or more sequences. Each
sequence names the KV slots it attends to (cached prefix + its new tokens, in order) and
optionally an explicit boolean mask; without one it is causal, with the new tokens at the
end of its KV. Prefill reads only the prefix from the pool and the new tokens' K/V as
computed, so a new token whose KV is discarded (prefill-only suffix) may be given slot 0,
the padding slot, as its out_cache_loc and kv_indices entry. Later request kinds (ranking
layouts, beams) pass explicit masks and positions; the model itself never assumes positions
0..n-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from sgrec.mem.kv_pool import KVPool


@dataclass
class BipartiteMask:
    """A sequence's mask as two integers per KV column (a rank layout's bipartite mask, BAT §4.2):
    column j is the token at offset order[j] of the sequence's layout, in block block[j] (-1: in no
    block). The new tokens are the last q_len columns, in ascending order. A new token may attend to
    column j iff order[j] <= its own order and not (both are in blocks, different ones): the rule of
    sgrec.layout.RankLayout.mask, O(kv_len) instead of O(q_len * kv_len)."""

    order: torch.Tensor  # int64 [kv_len]
    block: torch.Tensor  # int64 [kv_len]

    def dense(self, q_len: int) -> torch.Tensor:
        """The bool [q_len, kv_len] mask it stands for."""
        first = self.order.numel() - q_len
        ro, rb = self.order[first:, None], self.block[first:, None]
        o, b = self.order[None, :], self.block[None, :]
        return (o <= ro) & ((rb < 0) | (b < 0) | (rb == b))


@dataclass
class SeqLayout:
    q_start: int  # offset of this sequence's new tokens in the flat batch
    q_len: int
    kv_indices: torch.Tensor  # int64 slots attended, new tokens' slots included
    mask: torch.Tensor | None = None  # bool [q_len, kv_len], True = may attend
    # the mask compactly (the kernels read it); given alone, a backend that needs the dense mask makes
    # it (dense_mask): a rank layout of an 8K-token user and 200 items is 130M mask entries, 0.3 s on CPU
    bipartite: BipartiteMask | None = None
    # with a dense mask only: each KV column's place in the sequence's own order (e.g. its layout offset),
    # the order --enable-deterministic-inference sums the columns in (default: the KV order)
    col_order: torch.Tensor | None = None

    @property
    def kv_len(self) -> int:
        return self.kv_indices.numel()

    @property
    def masked(self) -> bool:
        """Whether the sequence has a mask (dense or bipartite), rather than plain causal attention."""
        return self.mask is not None or self.bipartite is not None

    def dense_mask(self) -> torch.Tensor | None:
        """The bool [q_len, kv_len] mask: `mask`, else made from `bipartite`; None when causal."""
        if self.mask is None and self.bipartite is not None:
            return self.bipartite.dense(self.q_len)
        return self.mask


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] slots that receive the new tokens' K/V
    seqs: list[SeqLayout]
    kv_pool: KVPool
    attn_meta: Any = field(default=None, repr=False)  # filled by the backend's prepare()
    # per sequence (in seqs' order): its state slot in state_pool (families with recurrent layers;
    # None: every sequence from a zero state, none kept) and its encoder's KV slots (encoder-decoder
    # families); None for the dense decoder
    state_slots: torch.Tensor | None = None
    encoder_slots: list[torch.Tensor] | None = None
    state_pool: Any = field(default=None, repr=False)  # mem.memory.StatePool
    # per sequence: the index of the sequence of this batch whose final state it starts from (its
    # state slot receives a copy, layer by layer, once the parent is done), or -1; None: none do
    # (rank's forks of a user computed in the same forward: sgrec.rank.forked)
    state_parents: list[int] | None = None
    # a beam step's rows (no seqs): the slot each row's state is read from, where it is not its own
    # state_slots row (a fork: the parent's slot; sgrec.beam.attention.BeamStates), or None: every
    # row reads its own. A slot written from another is read by no row of the batch.
    state_sources: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return all(s.q_len == 1 and not s.masked for s in self.seqs)


class AttentionBackend:
    """Computes attention for one layer over a ForwardBatch, writing new K/V into the pool."""

    deterministic = False  # --enable-deterministic-inference: every forward batch-invariant (see make_backend)

    def prepare(self, batch: ForwardBatch) -> None:
        """Build per-batch metadata once, before the first layer runs."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch, scale: float
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
        raise NotImplementedError


@dataclass
class _DecodeMeta:
    rows: torch.Tensor  # [B * Hkv * L] rows of a pool buffer viewed as [slots * Hkv, D], head-major
    shape: tuple[int, int, int]  # (B, Hkv, L)
    mask: torch.Tensor | None  # [B, 1, 1, L] or None when all lengths are equal


@dataclass
class _ExtendMeta:
    masks: list[torch.Tensor | None]  # per sequence; None = plain causal over fresh tokens
    fresh: list[bool]  # True when the sequence attends only to its own new tokens


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = may attend) as the additive mask SDPA makes of it (0 / -inf in the query's
    dtype): made once per forward instead of in every layer's SDPA call (same outputs, bit for bit;
    about 2x faster attention at small head dims on CPU)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class TorchBackend(AttentionBackend):
    """scaled_dot_product_attention on gathered K/V; runs on CPU and CUDA."""

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            lens = [s.kv_len for s in batch.seqs]
            width = max(lens)
            dev = batch.out_cache_loc.device
            kv_idx = torch.nn.utils.rnn.pad_sequence([s.kv_indices for s in batch.seqs], batch_first=True)
            kv_idx = kv_idx.to(dev)  # padded with slot 0, the pool's padding slot
            mask = None
            if min(lens) != width:
                lens_t = torch.tensor(lens, device=dev)
                mask = (torch.arange(width, device=dev)[None, :] < lens_t[:, None])[:, None, None, :]
            # Gathering rows (slot, head) of the pool seen as [slots * Hkv, D] in (b, h, l) order gives
            # K/V already laid out as [B, Hkv, L, D] (contiguous): no transposed copy, and SDPA on
            # contiguous K/V is faster than on the strided view (same values, bit for bit).
            hkv = batch.kv_pool.k_buffer[0].shape[1]
            rows = (kv_idx[:, None, :] * hkv + torch.arange(hkv, device=dev)[None, :, None]).reshape(-1)
            batch.attn_meta = _DecodeMeta(rows, (len(lens), hkv, width), mask)
            return
        masks, fresh, dtype = [], [], batch.kv_pool.attn_dtype
        for s in batch.seqs:
            prefix = s.kv_len - s.q_len
            if s.masked:
                masks.append(_additive(s.dense_mask().to(batch.out_cache_loc.device), dtype))
                fresh.append(False)
            elif prefix == 0:
                masks.append(None)
                fresh.append(True)
            else:
                q_pos = torch.arange(s.q_len, device=batch.out_cache_loc.device)[:, None] + prefix
                causal = torch.arange(s.kv_len, device=batch.out_cache_loc.device)[None, :] <= q_pos
                masks.append(_additive(causal, dtype))
                fresh.append(False)
        batch.attn_meta = _ExtendMeta(masks, fresh)

    def forward(self, q, k, v, layer, batch, scale):
        pool = batch.kv_pool
        pool.set_kv(layer, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer)
        meta = batch.attn_meta
        gqa = q.shape[1] != k.shape[1]
        # CUDA's fused SDPA kernels (flash, memory-efficient, cuDNN) take 4-D inputs only: the extend call
        # below adds the batch dimension (3-D inputs ran torch's float32 math kernel on an H200: an
        # 8K-token prefill 0.86 s, 94% of it there); K/V heads are repeated rather than left to
        # enable_gqa, which those kernels were not checked with
        expand = gqa and q.is_cuda
        if expand:
            gqa = False
        if isinstance(meta, _DecodeMeta):
            d = k_buf.shape[-1]  # index_select: ~4x faster than 2-D advanced indexing here
            kk = k_buf.view(-1, d).index_select(0, meta.rows).view(*meta.shape, d).to(q.dtype)  # [B, Hkv, L, D]
            vv = v_buf.view(-1, d).index_select(0, meta.rows).view(*meta.shape, d).to(q.dtype)  # (an fp8 pool's too)
            if expand:
                kk, vv = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (kk, vv))
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], kk, vv, attn_mask=meta.mask, scale=scale, enable_gqa=gqa
            )  # [B, Hq, 1, D]
            return out.reshape(q.shape[0], -1)
        out = torch.empty_like(q)
        for s, mask, fresh in zip(batch.seqs, meta.masks, meta.fresh):
            sl = slice(s.q_start, s.q_start + s.q_len)
            if fresh:
                kk, vv = k[sl], v[sl]
            else:  # the cached prefix from the pool, the new tokens' K/V as computed (equal to the pool's)
                prefix = s.kv_indices[: s.kv_len - s.q_len]
                kk = torch.cat([k_buf.index_select(0, prefix).to(k.dtype), k[sl]])
                vv = torch.cat([v_buf.index_select(0, prefix).to(v.dtype), v[sl]])
            if expand:  # [L, Hkv, D] -> [L, Hq, D]
                kk, vv = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (kk, vv))
            o = F.scaled_dot_product_attention(
                q[sl].transpose(0, 1)[None],
                kk.transpose(0, 1)[None],
                vv.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )  # [1, Hq, q_len, D]
            out[sl] = o[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)


@dataclass
class _SlotMeta:
    idx: torch.Tensor  # every sequence's KV slots, concatenated
    ptr: torch.Tensor  # [B + 1] offsets into idx

    @classmethod
    def of(cls, batch: ForwardBatch) -> "_SlotMeta":
        dev = batch.out_cache_loc.device
        lens = torch.tensor([0] + [s.kv_len for s in batch.seqs], dtype=torch.int64)
        idx = torch.cat([s.kv_indices for s in batch.seqs]).to(dev, torch.int64)
        return cls(idx, torch.cumsum(lens, 0).to(dev))


@dataclass
class ColumnMeta:
    """bipartite_attention's (and the native extend kernel's) inputs: every sequence's new tokens'
    order and block, and its cached columns' slots, order and block."""

    q_start: torch.Tensor  # [B]
    q_end: torch.Tensor  # [B]
    q_order: torch.Tensor  # [T] order and block of every new token
    q_block: torch.Tensor
    c_idx: torch.Tensor  # every sequence's cached slots, concatenated, and their order and block
    c_ptr: torch.Tensor  # [B + 1]
    c_order: torch.Tensor
    c_block: torch.Tensor
    tiles: tuple[torch.Tensor, torch.Tensor] | None  # the Triton grid's (block_m given)

    @classmethod
    def of(cls, batch: ForwardBatch, block_m: int | None = None, causal: bool = False) -> "ColumnMeta | None":
        """None unless every sequence has a BipartiteMask whose new tokens come in ascending order, or
        (causal=True) no mask at all: a causal sequence is the case of orders 0 .. kv_len - 1, no blocks."""
        from sgrec.model.kernels.bipartite_attention import tiles

        seqs = batch.seqs
        if not seqs or any(s.bipartite is None and not (causal and not s.masked) for s in seqs):
            return None
        T = batch.input_ids.numel()
        q_order = torch.full((T,), -1, dtype=torch.int64)
        q_block = torch.full((T,), -1, dtype=torch.int64)
        c_idx, c_order, c_block, c_len = [], [], [], [0]
        for s in seqs:
            first = s.kv_len - s.q_len
            if s.bipartite is None:
                order, block = torch.arange(s.kv_len), torch.full((s.kv_len,), -1, dtype=torch.int64)
            else:
                order, block = s.bipartite.order.cpu(), s.bipartite.block.cpu()
            new = order[first:]
            if new.numel() > 1 and not bool((new[1:] > new[:-1]).all()):
                return None
            q_order[s.q_start : s.q_start + s.q_len] = new
            q_block[s.q_start : s.q_start + s.q_len] = block[first:]
            c_idx.append(s.kv_indices[:first].cpu())
            c_order.append(order[:first])
            c_block.append(block[:first])
            c_len.append(first)
        dev = batch.out_cache_loc.device
        starts = torch.tensor([s.q_start for s in seqs], dtype=torch.int64)
        ends = starts + torch.tensor([s.q_len for s in seqs], dtype=torch.int64)

        def on(t: torch.Tensor) -> torch.Tensor:
            return t.to(dev, torch.int64)

        grid = None if block_m is None else tuple(on(t) for t in tiles([s.q_len for s in seqs], block_m))
        return cls(on(starts), on(ends), on(q_order), on(q_block), on(torch.cat(c_idx)),
                   on(torch.cumsum(torch.tensor(c_len), 0)), on(torch.cat(c_order)), on(torch.cat(c_block)), grid)


@dataclass
class DetMeta(ColumnMeta):
    """The deterministic extend kernel's inputs (native.extend_attention(deterministic=True)): every
    column of every sequence in c_idx (a pool slot, or -1 - the new token's row), in summation order:
    a rank layout's order (BipartiteMask.order; ties keep the KV order), a causal sequence's own, a
    dense-mask sequence's col_order (else its KV order), with its mask's columns in that order (m_ptr:
    its offset in `mask`)."""

    m_ptr: torch.Tensor  # [B] int64, -1: no dense mask
    mask: torch.Tensor  # bool, the dense masks flattened, [q_len, kv_len] each

    @classmethod
    def of(cls, batch: ForwardBatch) -> "DetMeta":
        if all(s.mask is None and s.bipartite is None for s in batch.seqs):
            return cls._causal(batch)
        return cls._general(batch)

    @classmethod
    def _general(cls, batch: ForwardBatch) -> "DetMeta":
        T = batch.input_ids.numel()
        q_order = torch.zeros(T, dtype=torch.int64)
        q_block = torch.full((T,), -1, dtype=torch.int64)
        c_idx, c_order, c_block, c_len, m_ptr, masks, m_off = [], [], [], [0], [], [], 0
        for s in batch.seqs:
            first = s.kv_len - s.q_len
            new = -1 - torch.arange(s.q_start, s.q_start + s.q_len)  # new tokens: read as computed
            src = torch.cat([s.kv_indices[:first].cpu().to(torch.int64), new])
            block = torch.full((s.kv_len,), -1, dtype=torch.int64)
            if s.mask is not None:  # dense: the mask decides; summed in col_order (else KV order)
                order = torch.arange(s.kv_len) if s.col_order is None else s.col_order.cpu().to(torch.int64)
            elif s.bipartite is not None:
                order, block = s.bipartite.order.cpu(), s.bipartite.block.cpu()
            else:
                order = torch.arange(s.kv_len)
            q_order[s.q_start : s.q_start + s.q_len] = order[first:]
            q_block[s.q_start : s.q_start + s.q_len] = block[first:]
            m_ptr.append(-1 if s.mask is None else m_off)
            if s.mask is None and s.bipartite is None:  # causal: already in order
                perm = None
            else:
                perm = torch.sort(order, stable=True).indices
                src, order, block = src[perm], order[perm], block[perm]
            if s.mask is not None:  # its columns in summation order, as the kernel walks them
                masks.append(s.mask.cpu()[:, perm].reshape(-1))
                m_off += s.mask.numel()
            c_idx.append(src)
            c_order.append(order)
            c_block.append(block)
            c_len.append(s.kv_len)
        dev = batch.out_cache_loc.device
        starts = torch.tensor([s.q_start for s in batch.seqs], dtype=torch.int64)
        ends = starts + torch.tensor([s.q_len for s in batch.seqs], dtype=torch.int64)
        mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
        return cls(starts.to(dev), ends.to(dev), q_order.to(dev), q_block.to(dev), torch.cat(c_idx).to(dev),
                   torch.cumsum(torch.tensor(c_len), 0).to(dev), torch.cat(c_order).to(dev), torch.cat(c_block).to(dev),
                   None, torch.tensor(m_ptr, dtype=torch.int64), mask)


    @classmethod
    def _causal(cls, batch: ForwardBatch) -> "DetMeta":
        """of() where every sequence is plainly causal (prompts, decode steps), without a loop per sequence:
        each sequence's columns in KV order, its new tokens (the last q_len) read as computed."""
        seqs, dev = batch.seqs, batch.out_cache_loc.device
        kv_len = torch.tensor([s.kv_len for s in seqs], dtype=torch.int64)
        q_len = torch.tensor([s.q_len for s in seqs], dtype=torch.int64)
        starts = torch.tensor([s.q_start for s in seqs], dtype=torch.int64)
        c_ptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kv_len, 0)])
        src = torch.cat([s.kv_indices for s in seqs]).cpu().to(torch.int64)
        order = torch.arange(int(c_ptr[-1])) - torch.repeat_interleave(c_ptr[:-1], kv_len)  # offset in its sequence
        first = torch.repeat_interleave(kv_len - q_len, kv_len)
        new = order >= first
        src[new] = -1 - (torch.repeat_interleave(starts, kv_len) + order - first)[new]  # the new token's row
        T = batch.input_ids.numel()
        q_order = torch.zeros(T, dtype=torch.int64)
        rows = torch.repeat_interleave(starts, q_len) + torch.arange(int(q_len.sum())) - torch.repeat_interleave(
            torch.cumsum(q_len, 0) - q_len, q_len)
        q_order[rows] = order[new]
        block = torch.full((T,), -1, dtype=torch.int64)
        none = torch.full((len(seqs),), -1, dtype=torch.int64)
        return cls(starts.to(dev), (starts + q_len).to(dev), q_order.to(dev), block.to(dev), src.to(dev), c_ptr.to(dev),
                   order.to(dev), torch.full_like(order, -1).to(dev), None, none, torch.zeros(0, dtype=torch.bool))

    @classmethod
    def of_columns(cls, meta: ColumnMeta) -> "DetMeta":
        """The same attention as a ColumnMeta (cached columns, then new tokens by their integers) in the
        deterministic kernel's form: each sequence's cached and new columns merged in order."""
        c_idx, c_order, c_block, c_len = [], [], [], [0]
        for b in range(meta.q_start.numel()):
            lo, hi = int(meta.c_ptr[b]), int(meta.c_ptr[b + 1])
            q0, q1 = int(meta.q_start[b]), int(meta.q_end[b])
            src = torch.cat([meta.c_idx[lo:hi].cpu(), -1 - torch.arange(q0, q1)])
            order = torch.cat([meta.c_order[lo:hi].cpu(), meta.q_order[q0:q1].cpu()])
            block = torch.cat([meta.c_block[lo:hi].cpu(), meta.q_block[q0:q1].cpu()])
            perm = torch.sort(order, stable=True).indices
            c_idx.append(src[perm])
            c_order.append(order[perm])
            c_block.append(block[perm])
            c_len.append(len(perm))
        dev = meta.q_start.device
        return cls(meta.q_start, meta.q_end, meta.q_order, meta.q_block, torch.cat(c_idx).to(dev),
                   torch.cumsum(torch.tensor(c_len), 0).to(dev), torch.cat(c_order).to(dev), torch.cat(c_block).to(dev),
                   None, torch.full((meta.q_start.numel(),), -1, dtype=torch.int64), torch.zeros(0, dtype=torch.bool))


class _KernelBackend(TorchBackend):
    """Decode through a kernel that reads the KV pool by slot index (no gathered copy of any
    sequence's K/V), and extend batches whose masks a kernel takes as two integers per KV column
    (`extend_meta`: a ColumnMeta, else None) through `extend`; anything else as TorchBackend.
    Subclasses name the kernels."""

    def decode(self, q, k_buf, v_buf, idx, ptr, scale) -> torch.Tensor:
        raise NotImplementedError

    def extend(self, q, k, v, k_buf, v_buf, meta: "ColumnMeta", scale) -> torch.Tensor:
        raise NotImplementedError

    def takes_decode(self, batch: ForwardBatch) -> bool:
        return batch.is_decode

    def extend_meta(self, batch: ForwardBatch) -> "ColumnMeta | None":
        return None

    def prepare(self, batch: ForwardBatch) -> None:
        if self.takes_decode(batch):
            batch.attn_meta = _SlotMeta.of(batch)
            return
        meta = None if batch.is_decode else self.extend_meta(batch)
        if meta is None:
            return super().prepare(batch)
        batch.attn_meta = meta

    def forward(self, q, k, v, layer, batch, scale):
        meta = batch.attn_meta
        if not isinstance(meta, (_SlotMeta, ColumnMeta)):
            return super().forward(q, k, v, layer, batch, scale)
        batch.kv_pool.set_kv(layer, batch.out_cache_loc, k, v)
        k_buf, v_buf = batch.kv_pool.get_kv(layer)
        if isinstance(meta, _SlotMeta):
            return self.decode(q, k_buf, v_buf, meta.idx, meta.ptr, scale)
        return self.extend(q, k, v, k_buf, v_buf, meta, scale)


class TritonBackend(_KernelBackend):
    """Decode through the Triton kernel (sgrec.model.kernels.decode_attention); an extend batch whose
    sequences all carry a BipartiteMask (rank layouts) through the bipartite-mask kernel (cached K/V
    read by slot, the mask from two integers per column, sgrec.model.kernels.bipartite_attention);
    any other extend batch as TorchBackend. Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (tests)."""

    BLOCK_M = 16  # new tokens per program of the bipartite kernel

    def __init__(self, deterministic: bool = False):
        # --enable-deterministic-inference: every forward, decode steps too, through the batch-invariant
        # kernel (sgrec.model.kernels.det_attention), whatever the mask
        self.deterministic = deterministic

    def prepare(self, batch: ForwardBatch) -> None:
        if self.deterministic:
            from sgrec.model.kernels.det_attention import DetTiles

            batch.attn_meta = DetTiles.of(DetMeta.of(batch))
            return
        super().prepare(batch)

    def forward(self, q, k, v, layer, batch, scale):
        from sgrec.model.kernels.det_attention import DetTiles, det_attention

        if not isinstance(batch.attn_meta, DetTiles):
            return super().forward(q, k, v, layer, batch, scale)
        batch.kv_pool.set_kv(layer, batch.out_cache_loc, k, v)
        k_buf, v_buf = batch.kv_pool.get_kv(layer)
        return det_attention(q, k, v, k_buf, v_buf, batch.attn_meta, scale)

    def extend_meta(self, batch: ForwardBatch) -> "ColumnMeta | None":
        return ColumnMeta.of(batch, self.BLOCK_M)

    def extend(self, q, k, v, k_buf, v_buf, meta, scale):
        from sgrec.model.kernels.bipartite_attention import bipartite_attention

        return bipartite_attention(q, k, v, k_buf, v_buf, meta.q_start, meta.q_end, meta.q_order, meta.q_block,
                                   meta.c_idx, meta.c_ptr, meta.c_order, meta.c_block, scale,
                                   block_m=self.BLOCK_M, grid_tiles=meta.tiles)

    def decode(self, q, k_buf, v_buf, idx, ptr, scale):
        from sgrec.model.kernels.decode_attention import decode_attention

        return decode_attention(q, k_buf, v_buf, idx, ptr, scale)


class NativeBackend(_KernelBackend):
    """sgrec's C kernels on CPU (sgrec.model.native, attention.c): decode reading the KV pool by slot
    (no gathered copy), and extend batches (causal sequences and rank layouts' bipartite masks, from
    two integers per KV column; cached K/V read by slot; column tiles nobody sees skipped), for pools
    of `decode_dtypes` / `extend_dtypes` (default: both the kernels have). Sequences with only a
    dense mask, and other pools, go as TorchBackend.

    auto (sgrec.model.backends) extends float32, and bfloat16 where the kernels were built on the
    CPU's bf16 dot products (avx512_bf16: attention.c's run_task_dp, on AMX tiles where amx_tile and
    amx_bf16 are reported too); elsewhere a bfloat16 extend would widen every element first, slower
    than torch's SDPA. In bfloat16 the kernel's logprobs are not HF's bit for bit (bfloat16 rounds differently in each
    implementation) but as close to HF's float32 as HF's own bfloat16 is (tests/test_hf_equivalence.py).
    It decodes bfloat16 through the kernel (torch's bfloat16 SDPA was 70% of a batch-16 decode step,
    7x the float32 one)."""

    def __init__(self, decode_dtypes: tuple[torch.dtype, ...] | None = None,
                 extend_dtypes: tuple[torch.dtype, ...] | None = None, deterministic: bool = False):
        from sgrec.model import native

        self.decode_dtypes = tuple(native.DTYPES if decode_dtypes is None else decode_dtypes)
        self.extend_dtypes = tuple(native.DTYPES if extend_dtypes is None else extend_dtypes)
        # --enable-deterministic-inference: every forward through the batch-invariant extend kernel
        # (DetMeta), any mask, both dtypes, decode steps included: a token's attention is computed the
        # same way whether it is a prompt token, a decode step or the recomputed last token of a cached prompt
        self.deterministic = deterministic
        if deterministic:
            self.decode_dtypes = self.extend_dtypes = tuple(native.DTYPES)

    @staticmethod
    def _takes(batch: ForwardBatch, dtypes: tuple[torch.dtype, ...]) -> bool:
        return batch.kv_pool.dtype in dtypes and batch.kv_pool.device.type == "cpu"

    def takes_decode(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and self._takes(batch, self.decode_dtypes)

    def extends(self, batch: ForwardBatch) -> bool:
        """Whether extend batches over this batch's pool go through the kernel."""
        return self._takes(batch, self.extend_dtypes)

    def extend_meta(self, batch: ForwardBatch) -> "ColumnMeta | None":
        return ColumnMeta.of(batch, causal=True) if self.extends(batch) else None

    def prepare(self, batch: ForwardBatch) -> None:
        if self.deterministic and self.extends(batch):  # every token, decode steps too, through one kernel
            batch.attn_meta = DetMeta.of(batch)
            return
        super().prepare(batch)

    def extend(self, q, k, v, k_buf, v_buf, meta, scale):
        from sgrec.model import native

        det = {"deterministic": True, "m_ptr": meta.m_ptr, "mask": meta.mask} if isinstance(meta, DetMeta) else {}
        return native.extend_attention(q, k, v, k_buf, v_buf, meta.q_start, meta.q_end - meta.q_start, meta.q_order,
                                       meta.q_block, meta.c_idx, meta.c_order, meta.c_block, meta.c_ptr, scale, **det)

    def decode(self, q, k_buf, v_buf, idx, ptr, scale):
        from sgrec.model import native

        return native.decode_attention(q, k_buf, v_buf, idx, ptr, scale)
