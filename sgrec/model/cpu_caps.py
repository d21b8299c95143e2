"""Does this CPU multiply bfloat16 (or float16) natively? Decides `--dtype auto` on CPU.

torch sends CPU bf16 matmuls to oneDNN, which runs them on AVX-512-BF16 or AMX-BF16 at 2-7x the
float32 rate. Without those instructions bf16 is emulated or falls back to a scalar GEMM: measured
1.3 GFLOP/s on an AVX2-only CPU, about 100x slower than float32. Likewise float16 needs
AVX-512-FP16 or AMX-FP16 (on an AVX-512-BF16 CPU without them, float16 matmul measured 3-6x
slower than float32). The decisions are pure functions of a flag set, so tests inject flags;
`cpu_flags()` reads the real ones.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_FLAGS = ("avx512_fp16", "amx_fp16")
SLOW_RISK = {  # the warning for an explicit half dtype without native matmuls
    torch.bfloat16: "about 100x slower matmul than float32 (bf16 at 1.3 GFLOP/s measured on an AVX2-only CPU)",
    torch.float16: "3-6x slower matmul than float32 (measured on an AVX-512-BF16 CPU without AVX-512-FP16; "
    "unmeasured on AVX2-only CPUs)",
}


@dataclass(frozen=True)
class NativeSupport:
    """Whether matmuls of one half dtype run natively, and why (for the start-up log)."""

    native: bool
    reason: str


def _support(name: str, wanted: tuple[str, ...], flags: Collection[str], onednn: bool) -> NativeSupport:
    seen = [f for f in wanted if f in flags]
    if not seen:
        return NativeSupport(False, f"CPU flags have neither {' nor '.join(wanted)}")
    if not onednn:
        return NativeSupport(False, f"CPU flags have {'+'.join(seen)} but torch's oneDNN runs no {name} matmul here")
    return NativeSupport(True, f"CPU flags have {'+'.join(seen)}")


def bf16_support(flags: Collection[str], onednn_bf16: bool = True) -> NativeSupport:
    """Native bf16 matmul: avx512_bf16 or amx_bf16 among `flags`, and torch able to use it (oneDNN)."""
    return _support("bf16", BF16_FLAGS, flags, onednn_bf16)


def fp16_support(flags: Collection[str], onednn_fp16: bool = True) -> NativeSupport:
    return _support("fp16", FP16_FLAGS, flags, onednn_fp16)


def parse_cpuinfo(text: str) -> frozenset[str]:
    """The first processor's flags ('flags' on x86, 'Features' on ARM) of /proc/cpuinfo's text."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """This CPU's flags: /proc/cpuinfo (what the kernel enabled; AMX needs its support), else, where
    there is none (not Linux), the features torch's cpuinfo detected."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = parse_cpuinfo(f.read())
    except OSError:
        flags = frozenset()
    if flags:
        return flags
    caps = getattr(torch.cpu, "get_capabilities", None)
    return frozenset(k for k, v in caps().items() if v is True) if caps else frozenset()


def _onednn(check: str) -> bool:
    fn = getattr(torch.ops.mkldnn, check, None)
    return torch.backends.mkldnn.is_available() and fn is not None and bool(fn())


def cpu_bf16_support() -> NativeSupport:
    return bf16_support(cpu_flags(), _onednn("_is_mkldnn_bf16_supported"))


def cpu_fp16_support() -> NativeSupport:
    return fp16_support(cpu_flags(), _onednn("_is_mkldnn_fp16_supported"))
