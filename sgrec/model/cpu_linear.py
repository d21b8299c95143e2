"""float32 (and native-bf16) Linear layers with weights prepacked for oneDNN on CPU.

Packing reorders each weight once into oneDNN's blocked layout, so every matmul skips that
reorder; on a 2-core CPU it roughly halves decode-step matmul time (docs/performance.md). These are
the same private aten ops torch.compile uses for frozen CPU weights. The summation order differs
from plain F.linear, so logits differ by float32 rounding, amplified by large activations (up to
~1e-3 in logprob, inside ARCHITECTURE.md's 2e-3 agreement with HF): the default on CPU
(--disable-weight-packing turns it off), measured against the plain path in tests.
bfloat16 weights are packed too where the CPU multiplies bf16 natively (cpu_caps; --dtype auto picks
bf16 there): plain bf16 F.linear is no faster than packed float32 at 1-16 rows, packed bf16 is
1.2-1.7x packed float32 (AVX-512-BF16 EPYC, 576x1536); oneDNN refuses packed bf16 on AVX2-only CPUs.
"""

from __future__ import annotations

import torch
from torch import nn

from sgrec.model.cpu_caps import cpu_bf16_support

BATCH_HINT = 16  # rows the packing is tuned for; any row count is correct
MIN_PACKED_NUMEL = 1 << 18  # smaller matrices run faster unpacked (oneDNN's per-call overhead wins)


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_bf16_support().native))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_plain: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.plain = weight.detach() if keep_plain else None  # for sgrec.model.fused_decode
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, min_numel: int = MIN_PACKED_NUMEL, keep_plain: bool = False) -> int:
    """Replaces every nn.Linear of at least min_numel weights below model with a PackedLinear (keeping
    the plain weight too where keep_plain); returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.numel() >= min_numel:
                setattr(parent, name, PackedLinear(child.weight, child.bias, keep_plain))
                count += 1
    return count
