"""Torch references of the Triton kernels (sgrec.model.kernels) and their test inputs."""

import torch


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
