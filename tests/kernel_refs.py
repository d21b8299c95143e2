"""Torch references of the attention kernels (Triton: sgrec.model.kernels; C: sgrec.model.native) and
their test inputs."""

import torch

from sgrec.mem.kv_pool import KVPool
from sgrec.model.attention import ColumnMeta, ForwardBatch, SeqLayout
from sgrec import layout as L


def reference(q, k_buf, v_buf, idx, ptr, scale):
    """float64 attention of each sequence over its slots, read one by one."""
    hq, hkv = q.shape[1], k_buf.shape[1]
    out = []
    for b in range(q.shape[0]):
        slots = idx[int(ptr[b]) : int(ptr[b + 1])]
        k = k_buf[slots].double().repeat_interleave(hq // hkv, dim=1)
        v = v_buf[slots].double().repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[b].double(), k) * scale, dim=-1)
        out.append(torch.einsum("hl,lhd->hd", p, v).reshape(-1))
    return torch.stack(out)


def case(hq, hkv, d, lens, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    size = sum(lens) + 17
    k_buf = torch.randn(size, hkv, d, generator=g).to(device, dtype)
    v_buf = torch.randn(size, hkv, d, generator=g).to(device, dtype)
    idx = (torch.randperm(size, generator=g)[: sum(lens)]).to(device)  # scattered over the pool
    ptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    q = torch.randn(len(lens), hq, d, generator=g).to(device, dtype)
    return q, k_buf, v_buf, idx, ptr


def decode_logits(runner, prompts=([5, 9, 33, 2, 8, 41, 7], [17, 3]), steps=4) -> torch.Tensor:
    """Prefill the prompts on a ModelRunner, then `steps` greedy decode steps of all of them in one
    batch (different lengths): the decode steps' logits [steps, len(prompts), vocab]."""
    alloc, got = runner.kv_pool.allocator, []
    slots = [alloc.alloc(len(p) + steps) for p in prompts]
    ids, pos, seqs, last = [], [], [], []
    for p, s in zip(prompts, slots):
        seqs.append(SeqLayout(len(ids), len(p), s[: len(p)]))
        ids += p
        pos += range(len(p))
        last.append(len(ids) - 1)
    out = runner.forward(runner.make_batch(ids, pos, torch.cat([s[: len(p)] for p, s in zip(prompts, slots)]), seqs),
                         last)
    toks = out.argmax(-1).tolist()
    for step in range(steps):
        lens = [len(p) + step + 1 for p in prompts]
        seqs = [SeqLayout(i, 1, s[:n]) for i, (s, n) in enumerate(zip(slots, lens))]
        out = runner.forward(runner.make_batch(toks, [n - 1 for n in lens], torch.stack([s[n - 1] for s, n in zip(slots, lens)]),
                                               seqs), list(range(len(prompts))))
        got.append(out)
        toks = out.argmax(-1).tolist()
    return torch.stack(got)


def bipartite_reference(q, k, v, k_buf, v_buf, seqs, scale):
    """float64 attention of each sequence's new tokens (rows q_start .. q_start + q_len of the flat
    q, k, v) over its cached slots (kv_indices but the last q_len) then its new tokens, under the
    sequence's dense bool mask (SeqLayout.mask)."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], hq * q.shape[2], dtype=torch.float64)
    for s in (s for s in seqs if s.q_len):  # a sequence with no new token has no rows
        rows = slice(s.q_start, s.q_start + s.q_len)
        cached = s.kv_indices[: s.kv_len - s.q_len]
        kk = torch.cat([k_buf[cached], k[rows]]).double().repeat_interleave(hq // hkv, dim=1)
        vv = torch.cat([v_buf[cached], v[rows]]).double().repeat_interleave(hq // hkv, dim=1)
        sc = torch.einsum("qhd,khd->hqk", q[rows].double(), kk) * scale
        p = torch.softmax(sc.masked_fill(~s.mask, float("-inf")), dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", p, vv).reshape(s.q_len, -1)
    return out


def rank_case(hq, hkv, d, layouts, dtype, seed, pool_extra=7):
    """Sequences of rank layouts, each a (RankLayout, cached layout offsets): the cached ones read
    from the pool (scattered slots), the rest new, in layout order. -> q, k, v, k_buf, v_buf, seqs
    (SeqLayouts with the dense mask and its BipartiteMask), out_cache_loc."""
    g = torch.Generator().manual_seed(seed)
    total = sum(len(lay) for lay, _ in layouts)
    k_buf, v_buf = (torch.randn(total + pool_extra, hkv, d, generator=g).to(dtype) for _ in range(2))
    perm = torch.randperm(total + pool_extra - 1, generator=g) + 1  # slot 0: the padding slot
    seqs, locs, used, T = [], [], 0, 0
    for lay, cached in layouts:
        fresh = [r for r in range(len(lay)) if r not in set(cached)]
        cols = list(cached) + fresh
        slots = perm[used : used + len(cols)]
        used += len(cols)
        seqs.append(SeqLayout(T, len(fresh), slots, lay.mask(fresh, cols), lay.bipartite(cols)))
        locs.append(slots[len(cached):])
        T += len(fresh)
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    k, v = (torch.randn(T, hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, k_buf, v_buf, seqs, torch.cat(locs)


def rank_layouts():
    """Rank layouts as the rank executor computes them: (layout, cached layout offsets)."""
    user = L.user_as_prefix(list(range(1, 12)), [[20, 21, 22], [23], [24, 25, 26, 27, 28], [29, 30]], [40, 41])
    item = L.item_as_prefix([5, 6, 7], [[20, 21], [22, 23, 24, 25], [26], [27, 28, 29]], list(range(50, 59)), [40])
    segs = item.items()
    item_cached = list(range(3)) + list(range(segs[0].start, segs[0].stop)) + list(range(segs[2].start, segs[2].stop))
    return [
        (user, list(range(7))),  # part of the user cached (a radix hit)
        (item, item_cached),  # header and items 0 and 2 from the item store: columns not in layout order
        (L.item_as_prefix([], [[3, 4, 5], [6]], [7, 8], [9]), []),  # nothing cached, no header
        (L.user_as_prefix([1, 2], [list(range(10, 31))], [9]), [0, 1]),  # one long item: several tiles
    ]


def pack(seqs, locs, T, block_m=None, causal=False):
    """The kernels' integer inputs (ColumnMeta) of a batch of these sequences."""
    batch = ForwardBatch(torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64), locs, seqs, None)
    meta = ColumnMeta.of(batch, block_m, causal)
    assert meta is not None
    return meta


def run_backends(backends, q, k, v, k_buf, v_buf, seqs, locs, scale, device="cpu"):
    """Each backend's attention output (on the CPU) for one extend batch of these sequences over a pool
    layer on `device` that holds k_buf/v_buf, and whether its prepare() chose the kernel path (a ColumnMeta)."""
    pool = KVPool(k_buf.shape[0] - 1, 1, k.shape[1], k.shape[2], k_buf.dtype, device)  # slot 0 + the rest
    q, k, v, locs = (t.to(device) for t in (q, k, v, locs))
    outs, kernel = [], []
    for backend in backends:
        pool.k_buffer[0].copy_(k_buf)
        pool.v_buffer[0].copy_(v_buf)
        T = q.shape[0]
        batch = ForwardBatch(torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64), locs, seqs, pool)
        backend.prepare(batch)
        outs.append(backend.forward(q, k, v, 0, batch, scale).cpu())
        kernel.append(isinstance(batch.attn_meta, ColumnMeta))
    return outs, kernel


class HostReads(torch.overrides.TorchFunctionMode):
    """Records every tensor call that reads a value back to the host (on a GPU: waits for the
    device) made by code that `counts`: .tolist(), .item(), bool()/int()/float(), nonzero and the
    like, a boolean mask index, and a copy to another device (not a .to() of the tensor's own)."""

    NAMES = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "numpy",
             "cpu", "cuda", "unique", "unique_consecutive", "masked_select", "is_nonzero", "equal", "allclose"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def counts(self, caller: str) -> bool:
        """Whether a read made by code in file `caller` is recorded (subclasses narrow it)."""
        return True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import sys

        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        caller = sys._getframe(1).f_code.co_filename
        if self.counts(caller):
            masks = [a for a in list(args[1:]) + list(kwargs.values()) if isinstance(a, (tuple, list))]
            bool_index = name in ("__getitem__", "__setitem__", "index_put_", "index_put") and any(
                isinstance(x, torch.Tensor) and x.dtype == torch.bool
                for x in ([args[1]] if len(args) > 1 else []) + [y for m in masks for y in m])
            targets = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (torch.device, str))]
            to_device = name == "to" and any(
                not isinstance(args[0], torch.Tensor) or torch.device(t).type != args[0].device.type for t in targets)
            if name in self.NAMES or bool_index or to_device:
                self.reads.append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
        return func(*args, **kwargs)


def gdr_fork_case(step, H: int = 2, dk: int = 24, dv: int = 40, seed: int = 0) -> None:
    """A gated-delta-rule step kernel `step(q, k, v, g, beta, states, slots, sources)` (native's C or
    the Triton one) on a beam step with forks: rows 0 and 2 update their states in place, rows 1 and 3
    read row 0's parent slot and write slots no row reads. Asserts o and every written slot equal
    sgrec.model.delta_rule.step on the states as they were before the call (the forks read the parent
    before its own row updates it in place), and that no other slot changes."""
    from sgrec.model import delta_rule

    gen = torch.Generator().manual_seed(seed)
    B = 4
    q = delta_rule.l2norm(torch.randn(B, H, dk, generator=gen)) * dk**-0.5
    k = delta_rule.l2norm(torch.randn(B, H, dk, generator=gen))
    v = torch.randn(B, H, dv, generator=gen)
    g, beta = -torch.rand(B, H, generator=gen) * 2, torch.rand(B, H, generator=gen)
    pool = torch.randn(8, H, dk, dv, generator=gen) * 0.3
    slots, sources = torch.tensor([5, 0, 3, 6]), torch.tensor([5, 5, 3, 5])
    before = pool.clone()
    want_o, want = delta_rule.step(q, k, v, g, beta, before[sources])
    got = step(q, k, v, g, beta, pool, slots, sources)
    assert (got - want_o).abs().max() <= 2e-6 and (pool[slots] - want).abs().max() <= 2e-6
    others = [i for i in range(8) if i not in slots.tolist()]
    assert torch.equal(pool[others], before[others])
