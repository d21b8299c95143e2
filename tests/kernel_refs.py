"""Torch references of the attention kernels (Triton: sgrec.model.kernels; C: sgrec.model.native) and
their test inputs."""

import torch

from sgrec.model.attention import SeqLayout


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
