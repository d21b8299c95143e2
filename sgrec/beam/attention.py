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
from sgrec.mem.memory import StatePool
from sgrec.model.attention import AttentionBackend, ColumnMeta, DetMeta, ForwardBatch, NativeBackend
from sgrec.model.kernels.det_attention import DetTiles, det_attention


def _partial(scores: torch.Tensor, v: torch.Tensor, eq: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised stage output sum_j e^(s_j - m) v_j, the max m and the sum l (last dim of scores).
    Overwrites scores."""
    m = scores.amax(-1, keepdim=True)
    e = scores.sub_(m).exp_()
    return torch.einsum(eq, e, v), m, e.sum(-1, keepdim=True)


Stage = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (o, m, l), each [n, Hkv, G, x]


def _queries(q: torch.Tensor, hkv: int, scale: float) -> torch.Tensor:
    n, hq, d = q.shape
    return (q.float() * scale).view(n, hkv, hq // hkv, d)


def shared_stage(qf: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, shared_idx: torch.Tensor) -> Stage:
    """Every beam's queries qf [n, Hkv, G, D] against the prompt's K/V: one matmul per KV head, so
    the prompt's K/V are read once for all beams."""
    n, hkv, g, d = qf.shape
    ks = k_buf.index_select(0, shared_idx).float().permute(1, 2, 0)
    vs = v_buf.index_select(0, shared_idx).float().transpose(0, 1)
    qs = qf.permute(1, 0, 2, 3).reshape(hkv, n * g, d)
    o, m, l = _partial(torch.bmm(qs, ks), vs, "hqp,hpd->hqd")  # scores [Hkv, n*G, P] -> [Hkv, n*G, D]

    def back(t: torch.Tensor) -> torch.Tensor:  # [Hkv, n*G, x] -> [n, Hkv, G, x]
        return t.view(hkv, n, g, -1).permute(1, 0, 2, 3)

    return back(o), back(m), back(l)


def unshared_stage(qf: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, unshared_idx: torch.Tensor) -> Stage:
    """Each beam against its own tokens unshared_idx [n, s]."""
    n, hkv, g, d = qf.shape
    s = unshared_idx.shape[1]
    flat = unshared_idx.reshape(-1)
    ku = k_buf.index_select(0, flat).float().view(n, s, hkv, d)
    vu = v_buf.index_select(0, flat).float().view(n, s, hkv, d)
    return _partial(torch.einsum("nhgd,nshd->nhgs", qf, ku), vu, "nhgs,nshd->nhgd")


def merge_stages(stages: list[Stage], dtype: torch.dtype) -> torch.Tensor:
    """Online-softmax merge of the stages' partial results -> [n, Hq * D] in dtype."""
    if not stages:
        raise ValueError("staged_attention needs at least one key")
    acc_o, acc_m, acc_l = stages[0]
    for o2, m2, l2 in stages[1:]:
        m = torch.maximum(acc_m, m2)
        a1, a2 = torch.exp(acc_m - m), torch.exp(m2 - m)
        acc_o = acc_o * a1 + o2 * a2
        acc_l = acc_l * a1 + l2 * a2
    n = acc_o.shape[0]
    return (acc_o / acc_l).to(dtype).reshape(n, -1)


def staged_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, shared_idx: torch.Tensor,
                     unshared_idx: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D]; k_buf/v_buf [slots, Hkv, D]; shared_idx [P] (the prompt, same for every beam);
    unshared_idx [n, s] (each beam's own tokens, the current one included). -> [n, Hq * D].
    Query head h uses KV head h // (Hq / Hkv) (GQA)."""
    qf = _queries(q, k_buf.shape[1], scale)
    stages = []
    if shared_idx.numel():
        stages.append(shared_stage(qf, k_buf, v_buf, shared_idx))
    if unshared_idx.numel():
        stages.append(unshared_stage(qf, k_buf, v_buf, unshared_idx))
    return merge_stages(stages, q.dtype)


def _shared_once(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: "BeamBatchMeta",
                 scale: float) -> torch.Tensor:
    """staged_attention per group, except that consecutive groups with the same shared_idx tensor
    (several unshared lengths over one prompt: a rank request's semantic-ID levels) run their
    shared stage once, over all their rows."""
    groups, rows, out, i = meta.groups, meta.rows(), [], 0
    qf = _queries(q, k_buf.shape[1], scale)
    while i < len(groups):
        j = i
        while j + 1 < len(groups) and groups[j + 1].shared_idx is groups[i].shared_idx:
            j += 1
        a0, b0 = rows[i][0], rows[j][1]
        shared = shared_stage(qf[a0:b0], k_buf, v_buf, groups[i].shared_idx) if groups[i].shared_idx.numel() else None
        for g, (a, b) in zip(groups[i : j + 1], rows[i : j + 1]):
            stages = [] if shared is None else [tuple(t[a - a0 : b - a0] for t in shared)]
            if g.unshared_idx.numel():
                stages.append(unshared_stage(qf[a:b], k_buf, v_buf, g.unshared_idx))
            out.append(merge_stages(stages, q.dtype))
        i = j + 1
    return torch.cat(out)


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


@dataclass
class StagedMeta:
    """A batched beam step as the Triton staged kernel reads it, every tensor on the device
    (sgrec.model.kernels.staged_attention): the requests' prompt slots concatenated (shared, offsets
    sh_ptr), each beam's own slots (unshared [n, s]) and the kernel's block table (blocks)."""

    shared: torch.Tensor
    sh_ptr: torch.Tensor
    unshared: torch.Tensor
    blocks: torch.Tensor

    @classmethod
    def of(cls, meta: "BeamStepMeta | BeamBatchMeta", device) -> "StagedMeta":
        from sgrec.model.kernels.staged_attention import BLOCK_B, beam_blocks

        groups = meta.groups if isinstance(meta, BeamBatchMeta) else [meta]
        s = groups[0].unshared_idx.shape[1]
        if any(g.unshared_idx.shape[1] != s for g in groups):
            raise ValueError("a batched beam step needs every request at one step (one unshared width)")
        ptr = [0]
        for g in groups:
            ptr.append(ptr[-1] + g.shared_idx.numel())
        return cls(torch.cat([g.shared_idx for g in groups]).to(device, torch.int64),
                   torch.tensor(ptr, dtype=torch.int64, device=device),
                   torch.cat([g.unshared_idx for g in groups]).to(device, torch.int64),
                   beam_blocks([g.unshared_idx.shape[0] for g in groups], BLOCK_B).to(device))


def beams_as_blocks(meta: "BeamStepMeta | BeamBatchMeta") -> ColumnMeta:
    """A beam step as the bipartite layout the extend kernels take (BipartiteMask's rule): per
    request one sequence whose new tokens are its beams' current tokens; its cached columns are the
    prompt (orders 0 .. P - 1, in no block) and beam i's earlier tokens (block i, orders
    P + i * s + t, t < s - 1), beam i's current token having order P + i * s + s - 1. So beam i sees
    the prompt and its own tokens only, and the new tokens come in ascending order."""
    groups = meta.groups if isinstance(meta, BeamBatchMeta) else [meta]
    rows = meta.rows() if isinstance(meta, BeamBatchMeta) else [(0, meta.unshared_idx.shape[0])]
    q_order, q_block, c_idx, c_order, c_block, c_len = [], [], [], [], [], [0]
    for g in groups:
        n, s = g.unshared_idx.shape
        P = g.shared_idx.numel()
        beam = torch.arange(n, dtype=torch.int64)
        q_order.append(P + beam * s + s - 1)
        q_block.append(beam)
        own = g.unshared_idx[:, : s - 1].cpu()
        c_idx += [g.shared_idx.cpu(), own.reshape(-1)]
        c_order += [torch.arange(P, dtype=torch.int64), (P + beam[:, None] * s + torch.arange(s - 1)).reshape(-1)]
        c_block += [torch.full((P,), -1, dtype=torch.int64), beam.repeat_interleave(s - 1)]
        c_len.append(P + own.numel())
    starts = torch.tensor([a for a, _ in rows], dtype=torch.int64)
    ends = torch.tensor([b for _, b in rows], dtype=torch.int64)
    cat = torch.cat
    return ColumnMeta(starts, ends, cat(q_order), cat(q_block), cat(c_idx).to(torch.int64),
                      torch.cumsum(torch.tensor(c_len), 0), cat(c_order), cat(c_block), None)


class StagedBeamBackend(AttentionBackend):
    """AttentionBackend for a beam step; the caller sets batch.attn_meta to a BeamStepMeta (one
    request) or a BeamBatchMeta (several requests: the projections and MLP run on all their beams
    at once, attention per request).

    With `units` (a `sgrec.policy.streams.UnitRunner`), a batched step's attention runs as work
    units of the multi-stream executor (xGR §7): per request a shared and an unshared stage
    (independent) and a merge that depends on both; the stages' partial results go to the tensor
    pool of the stream that made them until the merge that reads them is done.

    With a `runner` whose kernels are sgrec's C kernels (`runner.kernels == "native"`, CPU; read
    at each step, so swapping the runner's backend swaps this too) and no units, a step over a pool
    whose dtype it extends runs through sgrec's C extend kernel instead, every beam of a request one
    block of a bipartite layout (`beams_as_blocks`): one pass over the prompt's K/V per tile of
    beams, the softmax fused (the staged path materialises every beam's scores against the prompt);
    equal to the staged path within float32 rounding (tests/test_beam.py)."""

    def __init__(self, units=None, triton: bool = False, runner=None):
        self.units = units
        self.triton = triton  # every request's staged attention in one Triton launch (--attention-backend triton)
        self.runner = runner

    @property
    def native(self) -> NativeBackend | None:
        """The runner's backend where it runs sgrec's C kernels."""
        runner = self.runner
        return runner.backend if runner is not None and runner.kernels == "native" else None

    def prepare(self, batch: ForwardBatch) -> None:
        meta = batch.attn_meta
        if isinstance(meta, StagedMeta):
            return
        if not isinstance(meta, (BeamStepMeta, BeamBatchMeta)):
            raise TypeError("StagedBeamBackend needs batch.attn_meta = BeamStepMeta(...), BeamBatchMeta(...) or "
                            "StagedMeta(...)")
        runner = self.runner
        if runner is not None and runner.kernels == "triton" and runner.deterministic:  # its batch-invariant kernel
            # a beam step's meta is built on the host: its tiles go where the kernel reads them
            batch.attn_meta = DetTiles.of(DetMeta.of_columns(beams_as_blocks(meta)), device=batch.out_cache_loc.device)
            return
        if self.triton:  # every request's staged attention in one kernel launch
            batch.attn_meta = StagedMeta.of(meta, batch.out_cache_loc.device)
            return
        native = self.native
        if native is not None and (self.units is None or native.deterministic) and native.extends(batch):
            batch.attn_meta = beams_as_blocks(meta)  # the kernel's form of the step
            if native.deterministic:  # the batch-invariant mode, like every other forward under the flag
                batch.attn_meta = DetMeta.of_columns(batch.attn_meta)

    def forward(self, q, k, v, layer, batch, scale):
        pool = batch.kv_pool
        pool.set_kv(layer, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer)
        meta = batch.attn_meta
        if isinstance(meta, ColumnMeta):
            return self.native.extend(q, k, v, k_buf, v_buf, meta, scale)
        if isinstance(meta, DetTiles):
            return det_attention(q, k, v, k_buf, v_buf, meta, scale)
        if isinstance(meta, StagedMeta):
            from sgrec.model.kernels.staged_attention import staged_attention_batched

            return staged_attention_batched(q, k_buf, v_buf, meta.shared, meta.sh_ptr, meta.unshared, meta.blocks,
                                            scale)
        if isinstance(meta, BeamStepMeta):
            return staged_attention(q, k_buf, v_buf, meta.shared_idx, meta.unshared_idx, scale)
        if self.units is not None:
            return self._as_units(q, k_buf, v_buf, meta, scale)
        return _shared_once(q, k_buf, v_buf, meta, scale)

    def _as_units(self, q, k_buf, v_buf, meta: "BeamBatchMeta", scale: float) -> torch.Tensor:
        from sgrec.policy.streams import UnitCost, WorkUnit

        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        qf = _queries(q, k_buf.shape[1], scale)
        parts: dict[str, Stage] = {}
        units = []
        total = max(1, sum(g.unshared_idx.shape[0] * (g.shared_idx.numel() + g.unshared_idx.shape[1])
                           for g in meta.groups))
        for r, (g, (a, b)) in enumerate(zip(meta.groups, meta.rows())):
            deps = []
            for name, idx, stage in (("shared", g.shared_idx, shared_stage), ("unshared", g.unshared_idx, unshared_stage)):
                if not idx.numel():
                    continue
                key = f"r{r}.{name}"
                work = (b - a) * idx.numel()  # score entries: the cost estimate and device share

                def run(key=key, idx=idx, stage=stage, a=a, b=b):
                    parts[key] = stage(qf[a:b], k_buf, v_buf, idx)
                    return parts[key]

                units.append(WorkUnit(key, UnitCost(work * 1e-9, min(1.0, work / total)), group=f"r{r}", fn=run))
                deps.append(key)

            def merge(r=r, a=a, b=b, deps=tuple(deps)):
                out[a:b] = merge_stages([parts.pop(d) for d in deps], q.dtype)

            units.append(WorkUnit(f"r{r}.merge", UnitCost(0.0, 0.05), deps=tuple(deps), group=f"r{r}", fn=merge))
        self.units.run(units)
        return out


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
        for buf in self.pool.buffers():
            apply_schedule_(buf, d, s, self.chunk)


class BeamStates:
    """Each beam's recurrent state (a family with recurrent layers): `slots` [rows], row i's state-pool
    slot, a permutation of the request's slots. Row 0 holds the prompt's state until level 0 forks it
    to every beam (parents all 0). A level's reorder copies no state: a parent's first child takes
    over the parent's slot, and each further child gets a slot no kept beam needs (a beam without
    children left it) and reads its parent's slot once: `sources`, row i's read slot for the next
    beam step, where the step's kernels read the state from there and write the updated one into
    the row's own slot (qwen3_5.GatedDeltaNet: the copy a fork needs is the step's own read and
    write of the state, about 19 MiB a beam at the 0.8B shape). A reorder before the step consumed
    the sources copies the pending forks first."""

    def __init__(self, pool: StatePool, slots: torch.Tensor):
        self.pool = pool
        self.slots = slots.clone()
        self.sources: torch.Tensor | None = None

    def reorder_(self, parents: torch.Tensor) -> None:
        """Rows 0..len(parents)-1 take the states of rows `parents` (non-decreasing)."""
        self.settle_()
        old, kept = self.slots.tolist(), parents.tolist()
        needed = set(kept)
        free = [old[j] for j in range(len(old)) if j not in needed][::-1]  # pop() takes the lowest row's first
        taken, slots, sources = set(), [], []
        for p in kept:
            if p in taken:
                slots.append(free.pop())
            else:
                taken.add(p)
                slots.append(old[p])
            sources.append(old[p])
        slots += free[::-1]
        self.slots = torch.tensor(slots, dtype=self.slots.dtype, device=self.slots.device)
        forks = slots[: len(kept)] != sources
        self.sources = torch.tensor(sources, dtype=self.slots.dtype, device=self.slots.device) if forks else None

    def step_sources(self, n: int) -> torch.Tensor:
        """Rows 0..n-1's read slots for the next beam step (their own where they are not forks); the
        step consumes them (consumed())."""
        return self.slots[:n] if self.sources is None else self.sources[:n]

    def consumed(self) -> None:
        """A beam step has read the sources and written every row's own slot."""
        self.sources = None

    def settle_(self) -> None:
        """Copies the pending forks' states into their rows' own slots (a reorder with no step since)."""
        if self.sources is not None:
            n = self.sources.numel()
            pairs = [(d, s) for d, s in zip(self.slots[:n].tolist(), self.sources.tolist()) if d != s]
            self.pool.copy_pairs_(pairs)
            self.sources = None
