"""Linear layers whose rows do not depend on the batch, for --enable-deterministic-inference.

A matmul library may sum a row's products in another order when the row count changes (another
kernel for a few rows, another blocking): measured on an AVX2-only EPYC, MKL's float32 sgemm gives
other bits at 1, 2, 3 and 7 rows than at 300, while oneDNN's prepacked float32 matmul (cpu_linear)
and bfloat16 F.linear gave the same bits at every row count tried. So under the flag every linear
layer is prepacked where packing runs, and each distinct layer shape is checked at start-up
(`rows_invariant`: row counts 1 .. 69 at two offsets against one row at a time); a layer that fails
computes one row per matmul (`RowwiseLinear`: the same call for every row, so the same bits,
whatever else is in the batch; slower, and logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 33, 64)
OFFSETS = (0, 5)


@torch.inference_mode()
def rows_invariant(linear: Callable[[torch.Tensor], torch.Tensor], in_features: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu", seed: int = 0) -> bool:
    """Whether `linear` gives every row the bits it gives that row alone, for ROW_COUNTS rows at OFFSETS."""
    g = torch.Generator().manual_seed(seed)
    n = max(ROW_COUNTS) + max(OFFSETS)
    x = torch.randn(n, in_features, generator=g).to(device, dtype)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(n)])
    return all(torch.equal(linear(x[o : o + m]), alone[o : o + m]) for m in ROW_COUNTS for o in OFFSETS)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn applied to one row of x at a time (the same call for every row, so the same bits whatever
    else is in the batch), the results stacked as fn(x) would be."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.cat([fn(rows[i : i + 1]) for i in range(rows.shape[0])])
    return out.view(*x.shape[:-1], out.shape[-1])


class RowwiseLinear(nn.Module):
    """A linear layer applied one row at a time: batch-invariant by construction."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rowwise(self.inner, x)


def in_features(layer: nn.Module) -> int | None:
    """A linear layer's input width (nn.Linear or cpu_linear.PackedLinear), None for other modules."""
    from sgrec.model.cpu_linear import PackedLinear

    return layer.in_features if isinstance(layer, (nn.Linear, PackedLinear)) else None


def make_batch_invariant(model: nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu",
                         check: Callable[..., bool] = rows_invariant) -> list[str]:
    """Checks each linear layer below `model` (once per kind, input and output width) and wraps the
    ones whose rows change with the batch in RowwiseLinear; returns the wrapped layers' names."""
    verdicts: dict[tuple, bool] = {}
    wrapped: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            k = in_features(child)
            if k is None:
                continue
            key = (type(child).__name__, k, getattr(child, "out_features", None))
            if key not in verdicts:
                verdicts[key] = check(child, k, dtype, device)
            if not verdicts[key]:
                setattr(parent, name, RowwiseLinear(child))
                wrapped.append(f"{parent_name}.{name}" if parent_name else name)
    if wrapped:
        logger.warning("--enable-deterministic-inference: %d linear layer(s) give other bits at other row counts "
                       "here; they compute one row per matmul (slower): %s", len(wrapped), ", ".join(wrapped[:4]))
    return wrapped
