"""GPU kernels in Triton. Each has a torch reference next to its test and runs on CPU under
Triton's interpreter (TRITON_INTERPRET=1), so CI tests them without a GPU (issue 24)."""

from __future__ import annotations

import os


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
