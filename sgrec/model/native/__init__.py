"""sgrec's C kernels for CPU, compiled on first use with the machine's C compiler and loaded with
ctypes (issue 23, part 2). No torch headers: each kernel is a plain C function over data pointers,
so a build takes about a second. OpenMP pragmas bind to the OpenMP runtime torch has already loaded
(libgomp.so.1 by soname), so a kernel's threads are torch's own intra-op threads.

A build is cached under $SGREC_CACHE_DIR (default ~/.cache/sgrec)/native, keyed by the source, the
compiler's version and the flags. Where no compiler works, `load()` answers None with one warning;
`--attention-backend native` is then a start-up error naming why (the default, torch, needs none). Run `python -m sgrec.model.native` to build now and
see where the library is.
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

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib" -> ctypes.CDLL | None once load() has run


def cache_dir() -> Path:
    root = os.environ.get("SGREC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sgrec")
    return Path(root) / "native"


def compiler() -> str | None:
    """The C compiler: $CC, else cc, gcc or clang on PATH."""
    for name in ([os.environ["CC"]] if os.environ.get("CC") else []) + ["cc", "gcc", "clang"]:
        if shutil.which(name):
            return name
    return None


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    src = SOURCE.read_bytes()
    last_error = ""
    # Multi-versioned (AVX-512 / AVX2 / baseline clones picked at load time from the CPU's own
    # report); a compiler without target_clones gets one baseline build.
    for extra in ([], ["-DSGREC_NO_CLONES"]):
        key = hashlib.sha256(src + version.encode() + " ".join(FLAGS + extra).encode()).hexdigest()[:16]
        path = cache_dir() / f"decode_attention-{key}.so"
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        proc = subprocess.run([cc, *FLAGS, *extra, str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode == 0:
            os.replace(tmp, path)  # atomic: concurrent builders (ranks starting together) agree
            return path
        os.unlink(tmp)
        last_error = proc.stderr.strip()[-2000:]
    raise RuntimeError(f"{cc} could not build {SOURCE.name}: {last_error}")


def load() -> ctypes.CDLL | None:
    """The kernels' library, built if needed; None (warned once) where it cannot be built."""
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        lib = None
        cc = compiler()
        try:
            if cc is None:
                raise RuntimeError("no C compiler found (set CC, or install cc/gcc/clang)")
            path = _build(cc)
            lib = ctypes.CDLL(str(path))
            for name in ("sgrec_decode_attention_f32", "sgrec_decode_attention_bf16"):
                fn = getattr(lib, name)
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 4 + [ctypes.c_float]
            _state["path"] = path
            logger.info("CPU kernels loaded from %s", path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            logger.warning("CPU kernels unavailable, using the pure-torch paths: %s", exc)
            lib = None
        _state["lib"] = lib
        return lib


DTYPES = {torch.float32: "sgrec_decode_attention_f32", torch.bfloat16: "sgrec_decode_attention_bf16"}


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_idx: torch.Tensor,
                     kv_ptr: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D]; k_buf/v_buf [slots, Hkv, D] (one pool layer); sequence b attends to the slots
    kv_idx[kv_ptr[b] : kv_ptr[b + 1]] (int64, at least one each) -> [B, Hq * D] in q's dtype. The same
    contract as the Triton kernel (sgrec.model.kernels.decode_attention), on CPU tensors."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built (see the warning above)")
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
    fn = getattr(lib, DTYPES[q.dtype])
    if fn(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), kv_idx.data_ptr(), kv_ptr.data_ptr(),
          out.data_ptr(), B, Hq, Hkv, D, scale):
        raise MemoryError("decode_attention: scratch allocation failed")
    return out.view(B, Hq * D)
