"""sgrec's C kernels for CPU (attention.c: extend and decode attention; glue.c: RMSNorm, RoPE and
SiLU-times-up fused, float32 and bfloat16; decode.c: a whole decode step, sgrec.model.fused_decode;
delta.c: the gated delta rule's decode step, its chunked form and its inputs' pass for prefill,
flushing denormals on torch's threads, the float32 FMA limit), compiled on first use with the
machine's C compiler and
loaded with ctypes. No torch headers: each kernel is a plain C function over data pointers, so a
build takes a few seconds. OpenMP pragmas bind to the OpenMP runtime torch has already loaded
(libgomp.so.1 by soname), so a kernel's threads are torch's own intra-op threads.

The library is built for the vector ISA the CPU reports (`march_flags`: x86-64-v4 with AVX-512,
x86-64-v3 with AVX2 and FMA, else the compiler's default target) and cached under native/ in sgrec's
cache directory (sgrec.server_args.cache_dir: $SGREC_CACHE_DIR, else $XDG_CACHE_HOME/sgrec, default
~/.cache/sgrec), keyed by the source, the compiler's version and the flags. Where no
compiler works, `load()` answers None with one warning; `--attention-backend native` is then a
start-up error naming why, and auto uses torch (a compiler that cannot build for the CPU's -march
counts as none: a baseline build would be slower than torch there). Run `python -m sgrec.model.native`
to build now and see where the library is.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from sgrec.model.kernels import rows2d

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention.c")
SOURCES = (SOURCE, SOURCE.with_name("glue.c"), SOURCE.with_name("decode.c"), SOURCE.with_name("delta.c"))
HEADERS = (SOURCE.with_name("vec.h"),)
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-Wno-psabi"]
DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read and write (they compute in float32)
DEVICE = "cpu"  # the device type of the tensors the kernels take (a model's glue hook checks it)
_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib" -> ctypes.CDLL | None once load() has run; "path" -> its file


def cache_dir() -> Path:
    from sgrec.server_args import cache_dir as root

    return Path(root()) / "native"


def compiler() -> str | None:
    """The C compiler: $CC, else cc, gcc or clang on PATH."""
    for name in ([os.environ["CC"]] if os.environ.get("CC") else []) + ["cc", "gcc", "clang"]:
        if shutil.which(name):
            return name
    return None


X86_64_V4 = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
X86_64_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave")


def march_flags(flags) -> list[str]:
    """The -march of the kernels for a CPU with these /proc/cpuinfo flags: x86-64-v4 where AVX-512
    (F, BW, CD, DQ, VL) is reported, with -mavx512bf16 where avx512_bf16 is too (the bfloat16 extend
    then runs on the CPU's bf16 dot products) and -mamx-tile -mamx-bf16 where amx_tile and amx_bf16 are
    as well (on AMX tiles), x86-64-v3 with AVX2 and FMA, else none (the compiler's default target, e.g.
    SSE2 or another architecture's baseline)."""
    if all(f in flags for f in X86_64_V4 + X86_64_V3):
        if "avx512_bf16" not in flags:
            return ["-march=x86-64-v4"]
        amx = all(f in flags for f in ("amx_tile", "amx_bf16"))
        return ["-march=x86-64-v4", "-mavx512bf16"] + (["-mamx-tile", "-mamx-bf16"] if amx else [])
    if all(f in flags for f in X86_64_V3):
        return ["-march=x86-64-v3"]
    return []


def _build(cc: str, march: list[str]) -> Path:
    """The cached library built with these -march flags."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    flags = FLAGS + list(march)
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(text + version.encode() + " ".join(flags).encode()).hexdigest()[:16]
    path = cache_dir() / f"{SOURCE.stem}-{key}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    proc = subprocess.run([cc, *flags, f"-I{SOURCE.parent}", *map(str, SOURCES), "-o", tmp, "-lm"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{cc} could not build {SOURCE.name}: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, path)  # atomic: concurrent builders (ranks starting together) agree
    return path


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.sgrec_decode_attention.restype = ctypes.c_int
    lib.sgrec_decode_attention.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int] * 4
                                           + [ctypes.c_float, ctypes.c_int])
    lib.sgrec_extend_attention.restype = ctypes.c_int
    lib.sgrec_extend_attention.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 9
                                           + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int])
    lib.sgrec_extend_attention_det.restype = ctypes.c_int
    lib.sgrec_extend_attention_det.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 11
                                               + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int])
    for name in ("sgrec_bf16_dot", "sgrec_bf16_amx", "sgrec_fused_decode"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name, args in (("sgrec_set_det_keep_bytes", [i64]),
                       ("sgrec_rmsnorm", [p, i64, p, i64, p, p, i64, i64, i32, ctypes.c_float, i32]),
                       ("sgrec_rmsnorm_f32w", [p, i64, p, i64, p, p, i64, i64, i32, ctypes.c_float, i32]),
                       ("sgrec_gated_rmsnorm", [p, i64, p, i64, p, p, i64, i64, i32, i32, ctypes.c_float, i32]),
                       ("sgrec_rope", [p, i64, i32, p, i64, i32, p, p, i64, i32, i32]),
                       ("sgrec_silu_mul", [p, i64, p, i64, i64, i32, i32]),
                       ("sgrec_gdr_step", [p] * 9 + [i32] * 4)):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = args
    lib.sgrec_flush_denormals.restype = ctypes.c_int
    lib.sgrec_flush_denormals.argtypes = [i32]
    lib.sgrec_gdr_chunked.restype = ctypes.c_int
    lib.sgrec_gdr_chunked.argtypes = [p] * 7 + [i64, i64] + [i32] * 6
    lib.sgrec_fma_peak.restype = ctypes.c_double
    lib.sgrec_fma_peak.argtypes = [i64]
    lib.sgrec_gdr_prefill.restype = ctypes.c_int
    lib.sgrec_gdr_prefill.argtypes = [p, i64, i32, p, p] + [i32] * 6 + [ctypes.c_float] + [p] * 4 + [i64, i64] \
        + [i32] * 3
    if lib.sgrec_fused_decode():  # decode.c: float32 on AVX2 + FMA or AVX-512, bf16 with avx512_bf16
        lib.sgrec_gemv.restype = ctypes.c_int
        lib.sgrec_gemv.argtypes = [p, p, p, i64, p, i64, i32, i32, i32, i32]
        lib.sgrec_decode_step.restype = ctypes.c_int
        lib.sgrec_decode_step.argtypes = [p] * 10 + [p, i32, ctypes.c_float, ctypes.c_float, i32]
    return lib


def load() -> ctypes.CDLL | None:
    """The kernels' library, built for this CPU's vector ISA if needed; None (warned once) where it
    cannot be built."""
    from sgrec.model.cpu_caps import cpu_flags

    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib = None
        cc = compiler()
        try:
            if cc is None:
                raise RuntimeError("no C compiler found (set CC, or install cc/gcc/clang)")
            path = _build(cc, march_flags(cpu_flags()))
            lib = _open(path)
            _state["path"] = path
            logger.info("CPU kernels loaded from %s", path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            logger.warning("CPU kernels unavailable, using the pure-torch paths: %s", exc)
            lib = None
        _state["lib"] = lib
        return lib


def library(march: list[str]) -> ctypes.CDLL:
    """The kernels built for another -march than this CPU's best (tests run every ISA build this CPU
    can execute); raises where they cannot be built."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found")
    return _open(_build(cc, list(march)))


def bf16_dot(lib: ctypes.CDLL | None = None) -> bool:
    """Whether this build (else load()'s) extends bfloat16 with the CPU's bf16 dot products (vdpbf16ps:
    built with -mavx512bf16, see march_flags) rather than widening to float32 first."""
    lib = lib or load()
    return lib is not None and bool(lib.sgrec_bf16_dot())


def bf16_amx(lib: ctypes.CDLL | None = None) -> bool:
    """Whether this build (else load()'s) extends bfloat16 on AMX tiles: built with -mamx-tile -mamx-bf16
    (amx_tile and amx_bf16 in the CPU's flags, see march_flags) and the kernel granted this process the
    tile data (Linux: arch_prctl ARCH_REQ_XCOMP_PERM); else the dot products (bf16_dot) run."""
    lib = lib or load()
    return lib is not None and bool(lib.sgrec_bf16_amx())


def _loaded(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    lib = lib or load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built (see the warning above)")
    return lib


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_idx: torch.Tensor,
                     kv_ptr: torch.Tensor, scale: float, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q [B, Hq, D]; k_buf/v_buf [slots, Hkv, D] (one pool layer); sequence b attends to the slots
    kv_idx[kv_ptr[b] : kv_ptr[b + 1]] (int64, at least one each) -> [B, Hq * D] in q's dtype. The same
    contract as the Triton kernel (sgrec.model.kernels.decode_attention), on CPU tensors. `lib`: a
    build of `library` (else load()'s)."""
    lib = _loaded(lib)
    B, Hq, D = q.shape
    Hkv = k_buf.shape[1]
    if q.dtype not in DTYPES or not (q.dtype == k_buf.dtype == v_buf.dtype):
        raise TypeError(f"decode_attention: float32 or bfloat16 q/k/v of one dtype, got {q.dtype}, "
                        f"{k_buf.dtype}, {v_buf.dtype}")
    if Hq % Hkv or k_buf.shape[2] != D or v_buf.shape != k_buf.shape or kv_ptr.numel() != B + 1:
        raise ValueError(f"decode_attention: shapes q {tuple(q.shape)}, k {tuple(k_buf.shape)}, "
                         f"v {tuple(v_buf.shape)}, kv_ptr {tuple(kv_ptr.shape)}")
    q, k_buf, v_buf = q.contiguous(), k_buf.contiguous(), v_buf.contiguous()
    kv_idx = kv_idx.to(torch.int64).contiguous()
    kv_ptr = kv_ptr.to(torch.int64).contiguous()
    out = torch.empty((B, Hq, D), dtype=q.dtype)
    if lib.sgrec_decode_attention(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), kv_idx.data_ptr(),
                                  kv_ptr.data_ptr(), out.data_ptr(), B, Hq, Hkv, D, scale,
                                  int(q.dtype == torch.bfloat16)):
        raise MemoryError("decode_attention: scratch allocation failed")
    return out.view(B, Hq * D)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     q_start: torch.Tensor, q_len: torch.Tensor, q_order: torch.Tensor, q_block: torch.Tensor,
                     c_idx: torch.Tensor, c_order: torch.Tensor, c_block: torch.Tensor, c_ptr: torch.Tensor,
                     scale: float, lib: ctypes.CDLL | None = None, deterministic: bool = False,
                     m_ptr: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Extend attention under a causal or bipartite mask (attention.c's doc; the contract of
    sgrec.model.kernels.bipartite_attention): q [T, Hq, D], k/v [T, Hkv, D] the new tokens (any
    token stride, the last two dimensions contiguous), k_buf/v_buf one pool layer; sequence b's new
    tokens are rows q_start[b] .. q_start[b] + q_len[b] - 1, its cached columns c_idx[c_ptr[b] ..
    c_ptr[b + 1]) (slots) with their c_order/c_block; q_order/q_block per new token. Integer tensors
    int64 on CPU. -> [T, Hq * D] in q's dtype. `lib`: a build of `library` (else load()'s).

    deterministic: the batch-invariant kernel (attention.c, sgrec_extend_attention_det): c_idx lists
    every column of a sequence, new ones as -1 - their row, in summation order; m_ptr [B] (int64,
    -1: none) and mask (bool, flat) give sequences a dense mask over their listed columns instead."""
    lib = _loaded(lib)
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if q.dtype not in DTYPES or len({t.dtype for t in (q, k, v, k_buf, v_buf)}) != 1:
        raise TypeError(f"extend_attention: float32 or bfloat16 q/k/v/k_buf/v_buf of one dtype, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}, {k_buf.dtype}, {v_buf.dtype}")
    if Hq % Hkv or tuple(k_buf.shape[1:]) != (Hkv, D) or v_buf.shape != k_buf.shape or k.shape != v.shape \
            or k.shape[::2] != (T, D) or c_ptr.numel() != q_start.numel() + 1:
        raise ValueError(f"extend_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_buf {tuple(k_buf.shape)}, c_ptr {tuple(c_ptr.shape)}")

    def rows(t: torch.Tensor) -> torch.Tensor:  # [T, H, D] with heads and dims packed, any token stride
        return t if t.stride(2) == 1 and t.stride(1) == D else t.contiguous()

    q, k, v = rows(q), rows(k), rows(v)
    k_buf, v_buf = k_buf.contiguous(), v_buf.contiguous()
    ints = [t.to(torch.int64).contiguous() for t in (q_start, q_len, q_order, q_block, c_idx, c_order, c_block, c_ptr)]
    out = torch.empty((T, Hq, D), dtype=q.dtype)
    bufs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), q.stride(0), k.stride(0),
            v.stride(0), *(t.data_ptr() for t in ints)]
    tail = [out.data_ptr(), q_start.numel(), Hq, Hkv, D, scale, int(q.dtype == torch.bfloat16)]
    if deterministic:
        m_ptr = torch.full((q_start.numel(),), -1, dtype=torch.int64) if m_ptr is None else m_ptr.to(torch.int64)
        mask = torch.zeros(1, dtype=torch.uint8) if mask is None or not mask.numel() else mask.to(torch.uint8)
        m_ptr, mask = m_ptr.contiguous(), mask.contiguous()
        failed = lib.sgrec_extend_attention_det(*bufs, m_ptr.data_ptr(), mask.data_ptr(), *tail)
    else:
        failed = lib.sgrec_extend_attention(*bufs, *tail)
    if failed:
        raise MemoryError("extend_attention: scratch allocation failed")
    return out.view(T, Hq * D)


# ---- fused glue (float32 and bfloat16, CPU; see glue.c) --------------------------------------------
def glue_takes(*tensors: torch.Tensor) -> bool:
    """Whether the fused glue runs on these tensors (all float32, or all bfloat16, on CPU): the callers'
    fallback test."""
    dtype = tensors[0].dtype
    return dtype in DTYPES and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


def _bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, as a new tensor; with `residual`,
    x += residual in place first. A weight of x's dtype: in bfloat16 the normalised row is rounded
    before the weight multiplies it (HF's Llama norm); a float32 weight on bfloat16 rows multiplies in
    float32 before the one rounding (HF's Qwen3.5 norm, its weight 1 + the parameter in float32).
    None where x (and residual) are not float32 or bfloat16 rows of one dtype (the caller uses torch)."""
    rows = rows2d(x, copy=residual is None)  # x += residual needs x's own rows
    res = None if residual is None else rows2d(residual)
    f32w = weight.dtype == torch.float32 and x.dtype == torch.bfloat16 and weight.device.type == "cpu"
    if rows is None or (residual is not None and (res is None or res.shape != rows.shape)) \
            or not glue_takes(x, *(() if f32w else (weight,)), *(() if residual is None else (residual,))):
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    fn = _loaded(lib).sgrec_rmsnorm_f32w if f32w else _loaded(lib).sgrec_rmsnorm
    fn(rows.data_ptr(), rows.stride(0), None if res is None else res.data_ptr(), 0 if res is None else res.stride(0),
       weight.contiguous().data_ptr(), out.data_ptr(), rows.shape[1], rows.shape[0], rows.shape[1], eps, _bf16(x))
    return out


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                  lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """The Gated DeltaNet's output norm: each group of n = weight.numel() channels of x [T, H * n] (any
    shape with T rows) normalised, times weight, times SiLU of the same channels of gate [T, H * n]
    (any token stride), as a new [T, H * n] tensor: weight * (x / sqrt(mean(x^2) + eps)) * silu(gate),
    in bfloat16 rounded where torch's ops round (the normalised row, its product with the weight, the
    gated product; the gate's SiLU in float32). None where the tensors are not float32 or bfloat16 rows
    of one dtype (the caller uses torch)."""
    n = weight.numel()
    rows, gates = rows2d(x.reshape(x.shape[0], -1), copy=True), rows2d(gate)
    if rows is None or gates is None or rows.shape != gates.shape or rows.shape[1] % n or not glue_takes(x, gate, weight):
        return None
    out = torch.empty(rows.shape, dtype=x.dtype)
    _loaded(lib).sgrec_gated_rmsnorm(rows.data_ptr(), rows.stride(0), gates.data_ptr(), gates.stride(0),
                                     weight.contiguous().data_ptr(), out.data_ptr(), rows.shape[1], rows.shape[0],
                                     rows.shape[1] // n, n, eps, _bf16(x))
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          lib: ctypes.CDLL | None = None) -> bool:
    """HF's rotate-half RoPE on q [T, Hq, D] and k [T, Hk, D] in place (heads and dims contiguous, any
    token stride), cos/sin [T, D], all float32 or all bfloat16 (each product rounded before the sum,
    as torch's path does); False (nothing done) where the layout or dtype does not fit."""
    T, Hq, D = q.shape
    ok = (glue_takes(q, k, cos, sin) and D % 2 == 0 and q.stride()[1:] == (D, 1) and k.stride()[1:] == (D, 1)
          and cos.shape == sin.shape == (T, D) and k.shape[0] == T and k.shape[2] == D)
    if not ok:
        return False
    cos, sin = cos.contiguous(), sin.contiguous()
    _loaded(lib).sgrec_rope(q.data_ptr(), q.stride(0), Hq, k.data_ptr(), k.stride(0), k.shape[1], cos.data_ptr(),
                            sin.data_ptr(), T, D, _bf16(q))
    return True


def silu_mul(gate_up: torch.Tensor, inter: int, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """silu(gate_up[:, :inter]) * gate_up[:, inter:] as a new [T, inter] tensor (in bfloat16 silu is
    rounded before the product, as torch's path does); None where gate_up is not float32 or bfloat16
    rows of 2 * inter."""
    rows = rows2d(gate_up)
    if rows is None or rows.shape[1] != 2 * inter or not glue_takes(gate_up):
        return None
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype)
    _loaded(lib).sgrec_silu_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(), inter, rows.shape[0], inter,
                                _bf16(gate_up))
    return out.view(*gate_up.shape[:-1], inter)


# ---- the gated delta rule and the threads' floating-point mode (delta.c) --------------------------
def flush_denormals(on: bool = True, lib: ctypes.CDLL | None = None) -> bool | None:
    """Flush-to-zero and denormals-are-zero (on=False: off) on the calling thread and its OpenMP team,
    the threads torch's CPU ops started from it run on; returns whether the calling thread flushed
    before (None: this architecture has no such mode, nothing was set)."""
    before = int(_loaded(lib).sgrec_flush_denormals(int(on)))
    return None if before < 0 else bool(before)


def gdr_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor, sources: torch.Tensor | None = None,
             lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """One token of each of B sequences through the gated delta rule, their states updated in place:
    q, k [B, H, dk], v [B, H, dv], g, beta [B, H] (float32, q and k normalised as the rule wants),
    states the pool's float32 [slots, H, dk, dv], slots [B] distinct rows of it. sources [B]: the row
    each sequence's state is read from (a beam fork reads its parent's; its own where equal), None:
    slots; a slot written from another source is no sequence's source. -> o [B, H, dv]
    (delta_rule.step's values to float32 rounding)."""
    lib = _loaded(lib)
    B, H, dk = q.shape
    dv = v.shape[-1]
    if states.dtype != torch.float32 or tuple(states.shape[1:]) != (H, dk, dv) or not states.is_contiguous():
        raise ValueError(f"gdr_step: states must be a contiguous float32 [slots, {H}, {dk}, {dv}], got "
                         f"{states.dtype} {tuple(states.shape)}")
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    slots = slots.to(torch.int64).contiguous()
    sources = slots if sources is None else sources.to(torch.int64).contiguous()
    if sources.shape != slots.shape:
        raise ValueError(f"gdr_step: sources {tuple(sources.shape)} must match slots {tuple(slots.shape)}")
    out = torch.empty(B, H, dv, dtype=torch.float32)
    lib.sgrec_gdr_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), states.data_ptr(),
                       slots.data_ptr(), sources.data_ptr(), out.data_ptr(), B, H, dk, dv)
    return out


def _rule_output(name: str, chunk: int, out: torch.Tensor | None, L: int, H: int,
                 dv: int) -> tuple[torch.Tensor, int, int]:
    """The chunked rule's o and its token and head strides (elements): `out` where given (checked:
    token-major [L, H, dv], float32 or bfloat16, its last dimension contiguous), else a new float32
    [H, L, dv]; a ValueError naming the kernel for a chunk outside 1..64."""
    if not 1 <= chunk <= 64:
        raise ValueError(f"{name}: chunk must be 1..64 tokens, got {chunk}")
    if out is None:
        return torch.empty(H, L, dv, dtype=torch.float32), dv, L * dv
    if tuple(out.shape) != (L, H, dv) or out.dtype not in DTYPES or out.stride(2) != 1:
        raise ValueError(f"{name}: out must be a float32 or bfloat16 [{L}, {H}, {dv}] with a contiguous last "
                         f"dimension, got {out.dtype} {tuple(out.shape)} (strides {out.stride()})")
    return out, out.stride(0), out.stride(1)


def gdr_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, chunk: int = 64, lib: ctypes.CDLL | None = None,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the gated delta rule in chunks of `chunk` tokens (1..64): the contract of
    sgrec.model.delta_rule.chunked (q, k [H, L, dk], v [H, L, dv], g, beta [H, L], state [H, dk, dv],
    float32; returns (o [H, L, dv], the state after the last token); `state` is not modified), its
    values to float32 rounding. out: o's home instead, token-major [L, H, dv] (float32 or bfloat16,
    rounded once; its last dimension contiguous), returned as o."""
    lib = _loaded(lib)
    H, L, dk = q.shape
    dv = v.shape[-1]
    if tuple(k.shape) != (H, L, dk) or tuple(v.shape[:2]) != (H, L) or tuple(g.shape) != (H, L) \
            or tuple(beta.shape) != (H, L) or tuple(state.shape) != (H, dk, dv):
        raise ValueError(f"gdr_sequence: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)} do not agree")
    o, o_tok, o_head = _rule_output("gdr_sequence", chunk, out, L, H, dv)
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    state = state.to(torch.float32, copy=True).contiguous()
    if L and lib.sgrec_gdr_chunked(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                   state.data_ptr(), o.data_ptr(), o_tok, o_head, int(o.dtype == torch.bfloat16),
                                   H, L, dk, dv, chunk):
        raise MemoryError("gdr_sequence: no memory for the kernel's scratch")
    return o, state


def gdr_prefill(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, k_heads: int, v_heads: int, dk: int,
                dv: int, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor, chunk: int = 64,
                lib: ctypes.CDLL | None = None, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's prefill of a Gated DeltaNet layer from its input projection: qwen3_5.GatedDeltaNet's
    _convolve and _heads_first (the causal convolution, SiLU, q and k L2-normalised, q times dk^-1/2),
    then gdr_sequence's rule, in one kernel whose q, k, v never leave a thread's scratch. x [L, C] the
    projection's q, k, v channels (float32 or bfloat16, rows may be strided), window [C, K - 1] the
    inputs before x (the state's), weight [C, K] the depthwise taps; g, beta [v_heads, L], state
    [v_heads, dk, dv] (not modified), chunk and out as gdr_sequence's. Returns (o, the state after the
    last token)."""
    lib = _loaded(lib)
    L, C = x.shape
    K = weight.shape[1]
    if x.dtype not in DTYPES or x.stride(1) != 1 or C != 2 * k_heads * dk + v_heads * dv \
            or tuple(window.shape) != (C, K - 1) or v_heads % k_heads or not 1 <= K <= 8:
        raise ValueError(f"gdr_prefill: x {x.dtype} {tuple(x.shape)} (stride {x.stride()}), window "
                         f"{tuple(window.shape)}, weight {tuple(weight.shape)} do not fit {k_heads} key heads of "
                         f"{dk} and {v_heads} value heads of {dv} (and 1 to 8 taps)")
    if tuple(g.shape) != (v_heads, L) or tuple(beta.shape) != (v_heads, L) or tuple(state.shape) != (v_heads, dk, dv):
        raise ValueError(f"gdr_prefill: g {tuple(g.shape)}, beta {tuple(beta.shape)}, state {tuple(state.shape)} do "
                         f"not fit {v_heads} heads of {L} tokens")
    o, o_tok, o_head = _rule_output("gdr_prefill", chunk, out, L, v_heads, dv)
    past = window.to(x.dtype).float().t().contiguous()  # as _convolve reads it: in x's dtype
    taps = weight.float().t().contiguous()
    g, beta = g.float().contiguous(), beta.float().contiguous()
    state = state.to(torch.float32, copy=True).contiguous()
    if L and lib.sgrec_gdr_prefill(x.data_ptr(), x.stride(0), int(x.dtype == torch.bfloat16), past.data_ptr(),
                                   taps.data_ptr(), K, C, k_heads, v_heads, dk, dv, dk**-0.5, g.data_ptr(),
                                   beta.data_ptr(), state.data_ptr(), o.data_ptr(), o_tok, o_head,
                                   int(o.dtype == torch.bfloat16), L, chunk):
        raise MemoryError("gdr_prefill: no memory for the kernel's scratch")
    return o, state


def fma_peak_gflops(seconds: float = 0.3, lib: ctypes.CDLL | None = None) -> float:
    """The float32 vector FMA rate of torch's OpenMP team on this machine in GFLOP/s (best of three runs
    of about `seconds` each): independent FMAs on registers, no memory; the compute limit benchmarks
    set the float32 kernels against."""
    import time

    lib = _loaded(lib)
    iters = 1 << 16
    while True:  # grow until a run takes a tenth of `seconds`
        t = time.perf_counter()
        lib.sgrec_fma_peak(iters)
        took = time.perf_counter() - t
        if took >= seconds / 10:
            break
        iters *= 4
    iters = max(iters, int(iters * seconds / took))
    best_rate = 0.0
    for _ in range(3):
        t = time.perf_counter()
        flops = lib.sgrec_fma_peak(iters)
        best_rate = max(best_rate, flops / (time.perf_counter() - t) / 1e9)
    return best_rate
