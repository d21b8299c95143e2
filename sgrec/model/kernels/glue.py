"""The element-wise glue around a layer's matmuls in Triton (CUDA): RMSNorm, RoPE in place and
SiLU-times-up, one pass over the data each where torch takes several (RMSNorm: a float32 copy, its
square, the mean, the scaling, the cast, the weight; RoPE: the rotated copy, two products, a sum).
The same interface as sgrec.model.native's C glue (the model's `glue` hook): a function returns
None (or False for rope_) where it does not take the tensors (here: rmsnorm with a residual to add
first), and the model falls back to torch. The hybrid family's gated delta rule (gdr_step, gdr_sequence)
comes from sgrec.model.kernels.delta_rule.

Each rounds where the torch path rounds: in bfloat16 the normalised row is cast to bfloat16 before
the weight multiplies it; RoPE's two products are rounded before their sum; SiLU is rounded before
the product with up. Arithmetic is float32. Under TRITON_INTERPRET=1 the kernels run on CPU tensors
(the tests; the interpreter truncates float32 to bfloat16 where a GPU rounds to nearest, so its
bfloat16 results may be a step or two off torch's); otherwise they take CUDA tensors only.
"""

from __future__ import annotations

import os

import torch

from sgrec.model.kernels import built, pow2, rows2d
from sgrec.model.kernels.delta_rule import gdr_sequence, gdr_step  # noqa: F401  (the hybrid family's rule)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICE = "cuda"  # the device type of the tensors the kernels take (a model's glue hook checks it)
_KERNELS: dict[bool, object] = {}


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def rmsnorm_kernel(X, W, O, s_x, s_o, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        mask = c < N
        x = tl.load(X + row * s_x + c, mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        y = (x * r).to(O.dtype.element_ty)  # the normalised row in the activations' dtype, then the weight
        w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(O + row * s_o + c, (w * y.to(tl.float32)).to(O.dtype.element_ty), mask=mask)

    @triton.jit
    def rope_kernel(X, COS, SIN, s_x, s_h, s_c, H, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h < H)[:, None] & (d < HALF)[None, :]
        base = X + t * s_x + h[:, None] * s_h + d[None, :]
        lo = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
        dm = d < HALF
        c_lo = tl.load(COS + t * s_c + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        c_hi = tl.load(COS + t * s_c + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        s_lo = tl.load(SIN + t * s_c + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        s_hi = tl.load(SIN + t * s_c + HALF + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        ty = X.dtype.element_ty
        # out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-hi, lo); each product rounded first
        new_lo = (lo * c_lo).to(ty).to(tl.float32) + (-hi * s_lo).to(ty).to(tl.float32)
        new_hi = (hi * c_hi).to(ty).to(tl.float32) + (lo * s_hi).to(ty).to(tl.float32)
        tl.store(base, new_lo.to(ty), mask=mask)
        tl.store(base + HALF, new_hi.to(ty), mask=mask)

    @triton.jit
    def silu_mul_kernel(X, O, s_x, s_o, N, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < N
        g = tl.load(X + row * s_x + c, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + row * s_x + N + c, mask=mask, other=0.0).to(tl.float32)
        ty = O.dtype.element_ty
        act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
        tl.store(O + row * s_o + c, (act * u).to(ty), mask=mask)

    return rmsnorm_kernel, rope_kernel, silu_mul_kernel


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels run on these tensors: one dtype of DTYPES, on CUDA (or anywhere under
    TRITON_INTERPRET=1)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in DTYPES
            and all(t.is_cuda or interpreted for t in tensors))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dimension, as a new tensor; None where x is
    not rows of the kernels' dtypes, or a residual is to be added first (the caller uses torch)."""
    rows = rows2d(x, copy=True)
    if residual is not None or rows is None or not takes(x, weight) or rows.shape[1] > 65536:
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = rows.shape[1]
    if rows.shape[0]:
        built(_KERNELS, _build)[0][(rows.shape[0],)](rows, weight.contiguous(), out, rows.stride(0), n, n, float(eps),
                                                     BLOCK=pow2(n))
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """HF's rotate-half RoPE on q [T, Hq, D] and k [T, Hk, D] in place (dims contiguous, any token
    and head stride), cos/sin [T, D] in their dtype; False (nothing done) where they do not fit."""
    T, _, D = q.shape
    ok = (takes(q, k, cos, sin) and D % 2 == 0 and q.stride(2) == 1 and k.stride(2) == 1 and k.shape[0] == T
          and k.shape[2] == D and cos.shape == sin.shape == (T, D))
    if not ok:
        return False
    cos, sin = cos.contiguous(), sin.contiguous()
    kernel = built(_KERNELS, _build)[1]
    for x in (q, k):
        H = x.shape[1]
        block_h = min(pow2(H), 16)
        if T:
            kernel[(T, -(-H // block_h))](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), H, HALF=D // 2,
                                          BLOCK_H=block_h, BLOCK_D=pow2(D // 2))
    return True


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor | None:
    """silu(gate_up[..., :inter]) * gate_up[..., inter:] as a new tensor; None where gate_up is not
    rows of 2 * inter in the kernels' dtypes."""
    rows = rows2d(gate_up)
    if rows is None or rows.shape[1] != 2 * inter or not takes(gate_up):
        return None
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(pow2(inter), 1024)
    if rows.shape[0]:
        built(_KERNELS, _build)[2][(rows.shape[0], -(-inter // block))](rows, out, rows.stride(0), out.stride(0), inter,
                                                                         BLOCK=block)
    return out.view(*gate_up.shape[:-1], inter)
