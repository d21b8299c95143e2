"""Staged attention for beam steps and the unshared per-beam KV buffer (xGR §5.1-5.2).

A beam step forwards one token per beam. Its keys are the prompt's (shared by every beam, stored
once) followed by the beam's own generated tokens (the unshared part). Attention runs in two
stages whose partial results are merged with the log-sum-exp (online softmax) rule:

  shared:   all n beam queries against the prompt K/V in one batched matmul, so the prompt KV
            is read once per layer per step, not once per beam;
  unshared: each beam against its own <= ND - 1 tokens;
  merge:    o = (o1 * e^(m1 - m) + o2 * e^(m2 - m)) / (l1 * e^(m1 - m) + l2 * e^(m2 - m)), where
            stage i has max score m_i, l_i = sum e^(s - m_i), o_i = sum e^(s - m_i) v, m = max(m1, m2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgrec.beam.search import apply_schedule_, inplace_schedule
from sgrec.mem.kv_pool import KVPool
from sgrec.model.attention import AttentionBackend, ForwardBatch


def _partial(scores: torch.Tensor, v: torch.Tensor, eq: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised stage output sum_j e^(s_j - m) v_j, the max m and the sum l (last dim of scores).
    Overwrites scores."""
    m = scores.amax(-1, keepdim=True)
    e = scores.sub_(m).exp_()
    return torch.einsum(eq, e, v), m, e.sum(-1, keepdim=True)


def staged_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, shared_idx: torch.Tensor,
                     unshared_idx: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D]; k_buf/v_buf [slots, Hkv, D]; shared_idx [P] (the prompt, same for every beam);
    unshared_idx [n, s] (each beam's own tokens, the current one included). -> [n, Hq * D].
    Query head h uses KV head h // (Hq / Hkv) (GQA)."""
    n, hq, d = q.shape
    hkv = k_buf.shape[1]
    g = hq // hkv
    qf = (q.float() * scale).view(n, hkv, g, d)
    acc_o = acc_m = acc_l = None
    if shared_idx.numel():
        # [Hkv, n*G, D] x [Hkv, D, P]: every beam's queries in one matmul per KV head, so the
        # prompt's K/V are read once for all beams
        ks = k_buf.index_select(0, shared_idx).float().permute(1, 2, 0)
        vs = v_buf.index_select(0, shared_idx).float().transpose(0, 1)
        qs = qf.permute(1, 0, 2, 3).reshape(hkv, n * g, d)
        o1, m1, l1 = _partial(torch.bmm(qs, ks), vs, "hqp,hpd->hqd")  # scores [Hkv, n*G, P] -> [Hkv, n*G, D]

        def back(t: torch.Tensor) -> torch.Tensor:  # [Hkv, n*G, x] -> [n, Hkv, G, x]
            return t.view(hkv, n, g, -1).permute(1, 0, 2, 3)

        acc_o, acc_m, acc_l = back(o1), back(m1), back(l1)
    if unshared_idx.numel():
        s = unshared_idx.shape[1]
        flat = unshared_idx.reshape(-1)
        ku = k_buf.index_select(0, flat).float().view(n, s, hkv, d)
        vu = v_buf.index_select(0, flat).float().view(n, s, hkv, d)
        s2 = torch.einsum("nhgd,nshd->nhgs", qf, ku)
        o2, m2, l2 = _partial(s2, vu, "nhgs,nshd->nhgd")
        if acc_o is None:
            acc_o, acc_m, acc_l = o2, m2, l2
        else:  # online-softmax merge of the two stages
            m = torch.maximum(acc_m, m2)
            a1, a2 = torch.exp(acc_m - m), torch.exp(m2 - m)
            acc_o = acc_o * a1 + o2 * a2
            acc_l = acc_l * a1 + l2 * a2
    if acc_o is None:
        raise ValueError("staged_attention needs at least one key")
    return (acc_o / acc_l).to(q.dtype).reshape(n, hq * d)


@dataclass
class BeamStepMeta:
    shared_idx: torch.Tensor  # [P] prompt slots
    unshared_idx: torch.Tensor  # [n, s] each beam's generated-token slots, the new token last


@dataclass
class BeamBatchMeta:
    """Several requests' beams in one forward (a batched beam step): request g owns rows
    starts[g] .. starts[g] + n_g of the flat batch and attends to its own prompt and beams."""

    groups: list[BeamStepMeta]

    def rows(self) -> list[tuple[int, int]]:
        out, a = [], 0
        for g in self.groups:
            out.append((a, a + g.unshared_idx.shape[0]))
            a = out[-1][1]
        return out


class StagedBeamBackend(AttentionBackend):
    """AttentionBackend for a beam step; the caller sets batch.attn_meta to a BeamStepMeta (one
    request) or a BeamBatchMeta (several requests: the projections and MLP run on all their beams
    at once, attention per request)."""

    def prepare(self, batch: ForwardBatch) -> None:
        if not isinstance(batch.attn_meta, (BeamStepMeta, BeamBatchMeta)):
            raise TypeError("StagedBeamBackend needs batch.attn_meta = BeamStepMeta(...) or BeamBatchMeta(...)")

    def forward(self, q, k, v, layer, batch, scale):
        pool = batch.kv_pool
        pool.set_kv(layer, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer)
        meta = batch.attn_meta
        if isinstance(meta, BeamStepMeta):
            return staged_attention(q, k_buf, v_buf, meta.shared_idx, meta.unshared_idx, scale)
        return torch.cat([staged_attention(q[a:b], k_buf, v_buf, g.shared_idx, g.unshared_idx, scale)
                          for g, (a, b) in zip(meta.groups, meta.rows())])


class UnsharedKV:
    """The unshared cache: `slots` [rows, cols] KV-pool slots, row i holding beam i's generated
    tokens (column c = the token of step c). Allocated once per request, never resized; a beam
    reorder rewrites the rows in place (inplace_schedule's order), in every layer."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, chunk: int = 64):
        self.pool = pool
        self.slots = slots
        self.chunk = chunk

    def reorder_(self, parents: torch.Tensor, cols: int,
                 schedule: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Rows 0..len(parents)-1 take the first `cols` tokens' K/V of rows `parents` (non-decreasing).
        `schedule`: inplace_schedule(parents)'s (dst, src), when the caller already has it."""
        if cols == 0:
            return
        dst, src = schedule if schedule is not None else inplace_schedule(parents)[:2]
        if dst.numel() == 0:
            return
        d, s = self.slots[dst, :cols], self.slots[src, :cols]
        for layer in range(self.pool.num_layers):
            k_buf, v_buf = self.pool.get_kv(layer)
            apply_schedule_(k_buf, d, s, self.chunk)
            apply_schedule_(v_buf, d, s, self.chunk)
