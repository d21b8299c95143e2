"""FP8 linear layers (`--quantization fp8`): W8A8 in float8_e4m3fn on GPUs with FP8 tensor
cores (compute capability 8.9 and newer: Ada, Hopper).

- Weights: one scale per output channel, taken at load time from the bfloat16 checkpoint
  (scale = max |w| of the row / 448, the largest e4m3 value).
- Activations: one scale per token (row), taken on every call by a Triton kernel (`quantize_rows`:
  the row's max |x|, then each element times 448 / max, rounded to the nearest e4m3 value, ties to
  even; a negative value that rounds to zero gives -0, as torch's cast does). The rounding is done
  in float32 before the cast, so that the cast is exact: Triton's
  interpreter rounds a float32 that rounds up across a power of two to half its value (seen with
  Triton 3.8: 125.9 became 64, not 128), and the compiled kernel and the interpreter then agree.
- The product: torch._scaled_mm (cuBLASLt's FP8 GEMM with row-wise scales) into the activations'
  dtype; the bias, if any, added after.

`quantize_rows_ref` and `linear_ref` are the float32 quantize-dequantize reference the tests hold the
kernel and the layer to. The output layer (lm_head) and the embeddings stay in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from sgrec.mem.kv_pool import FP8, FP8_MAX
TINY = 1e-12  # the least row max: an all-zero row gets a finite scale
MAX_BLOCK = 4096  # columns one program holds at once; wider rows loop


def fp8_unsupported(device: torch.device) -> str | None:
    """Why this device cannot run FP8 matmuls, or None where it can."""
    if device.type != "cuda":
        return (f"FP8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
                f"the device is {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return (f"FP8 needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}")
    return None


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 scale [M]) with x ~ q * scale: the reference of quantize_rows."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(TINY)
    inv = torch.full_like(amax, FP8_MAX).div(amax)  # a division (a python float / tensor is a reciprocal times it)
    q = (xf * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, amax / torch.full_like(amax, FP8_MAX)


def linear_ref(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Fp8Linear's product in float32: x's rows quantized and dequantized times the dequantized weight."""
    q, s = quantize_rows_ref(x.reshape(-1, x.shape[-1]))
    out = (q.float() * s[:, None]) @ (qweight.float() * wscale.reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.view(*x.shape[:-1], -1)


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        m = tl.maximum(tl.max(amax, 0), 1e-12)
        inv = tl.math.div_rn(tl.full([], 448.0, tl.float32), m)  # IEEE division, as the reference's
        for k0 in range(0, K, BLOCK):
            mask = k0 + cols < K
            y = tl.load(x_ptr + row * stride_x + k0 + cols, mask=mask, other=0.0).to(tl.float32) * inv
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            # round to e4m3's grid in float32 (3 mantissa bits; below 2^-6 the subnormal step 2^-9):
            # adding and taking away 1.5 * 2^23 steps rounds to a whole step, ties to even
            bits = y.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) - 127
            step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
            big = step * 12582912.0  # 1.5 * 2^23
            y = tl.abs((y + big) - big).to(tl.int32, bitcast=True)
            # the sign put back bit-wise, so that a negative value rounding to zero gives -0 as the cast does
            # (compiled, Triton's -y is 0 - y, which is +0 there: seen on an H200)
            y = (y | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
            tl.store(q_ptr + row * stride_q + k0 + cols, y.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, tl.math.div_rn(m, tl.full([], 448.0, tl.float32)))

    return quantize_rows_kernel


_KERNEL = None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_ref through one Triton program per row (CUDA, or CPU under TRITON_INTERPRET=1)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    import triton

    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(k), MAX_BLOCK)
        _KERNEL[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return q, s


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], float32 scale [N]): one scale per output channel."""
    return quantize_rows_ref(w)


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        q, s = quantize_weight(linear.weight.detach())
        self.register_buffer("qweight", q)  # [N, K], row-major: its transpose is the column-major mat2
        self.register_buffer("wscale", s.view(1, -1))
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.out_dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        q, s = quantize_rows(x2)
        out = torch._scaled_mm(q, self.qweight.t(), scale_a=s.view(-1, 1), scale_b=self.wscale,
                               out_dtype=self.out_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def quantize_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear inside the decoder layers (q/k/v, o, gate/up, down; not lm_head) with
    an Fp8Linear; returns how many. Their in/out features must be multiples of 16 (cuBLASLt's FP8)."""
    count = 0
    for layer in model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    n, k = child.weight.shape
                    if n % 16 or k % 16:
                        raise ValueError(f"--quantization fp8 needs layer sizes that are multiples of 16; {name} is "
                                         f"{n}x{k}")
                    setattr(parent, name, Fp8Linear(child))
                    count += 1
    return count
