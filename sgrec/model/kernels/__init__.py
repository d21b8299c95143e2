"""GPU kernels in Triton. Each has a torch reference next to its test and runs on CPU under
Triton's interpreter (TRITON_INTERPRET=1), so CI tests them without a GPU."""

from __future__ import annotations

import os

import torch


def built(cache: dict, build):
    """The kernel `build()` makes, once per mode: interpreted (TRITON_INTERPRET=1 when first asked
    for) or compiled. The mode is fixed when triton.jit runs, so a kernel is built lazily."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted not in cache:
        cache[interpreted] = build()
    return cache[interpreted]


def pow2(x: int) -> int:
    """The least power of two >= x (Triton's block sizes)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def rows2d(t: torch.Tensor, copy: bool = False) -> torch.Tensor | None:
    """t as 2-D rows whose last dimension is contiguous (a view), or None where no such view exists:
    what the fused element-wise kernels (this package's glue and sgrec.model.native's) walk. copy: a
    contiguous copy's rows where no view exists, for a kernel that only reads t. Qwen3's per-head q/k
    norm gets a [T, heads, D] slice of the fused projection, which has such a view only at T = 1: a
    token must not take another path (other rounding) in a batch than alone."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    if t.is_contiguous():
        return t.view(-1, t.shape[-1])
    return t.contiguous().view(-1, t.shape[-1]) if copy else None
