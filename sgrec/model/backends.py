"""Which attention backend a runner gets (--attention-backend): auto's choice per device and the
start-up checks behind it. Kept apart from sgrec.model.attention (the backends themselves) so that a
backend defined on top of those (sgrec.model.flashinfer_backend) is chosen here without a cycle."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from sgrec.model.attention import AttentionBackend, NativeBackend, TorchBackend, TritonBackend

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "native", "triton", "flashinfer")


def native_by_default() -> bool:
    """auto's choice on CPU: sgrec's C kernels where the CPU reports AVX-512 (the ISA they were
    measured faster than torch on, docs/performance.md) and they build; else torch."""
    from sgrec.model import native
    from sgrec.model.cpu_caps import cpu_flags

    return all(f in cpu_flags() for f in native.X86_64_V4) and native.load() is not None


def native_extend_dtypes() -> tuple[torch.dtype, ...]:
    """The pools auto extends through the C kernel: float32, and bfloat16 where the kernels were built
    on the CPU's bf16 dot products (avx512_bf16 detected: native.bf16_dot; AMX tiles with amx_bf16 too:
    native.bf16_amx); elsewhere a bfloat16 extend widens every element first, slower than torch's SDPA,
    so bfloat16 prefill stays on torch."""
    from sgrec.model import native

    return (torch.float32, torch.bfloat16) if native.bf16_dot() else (torch.float32,)


def triton_decodes(device: torch.device) -> bool:
    """Whether the Triton decode kernel compiles and runs on this device and equals a torch reference
    on a small case (in one run and in splits): auto's check before it picks triton on CUDA, so a
    Triton that cannot compile for this GPU leaves the server on torch with a warning."""
    from sgrec.model.kernels.decode_attention import decode_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((2, 4, 16), (40, 2, 16), (40, 2, 16)))
    idx, ptr = torch.arange(1, 38), torch.tensor([0, 5, 37])
    try:
        on = [t.to(device) for t in (q, k, v, idx, ptr)]
        outs = [decode_attention(*on, 0.25, splits=s).cpu() for s in (1, 3)]
    except Exception as e:  # noqa: BLE001 - whatever Triton raises (compilation, launch), torch still runs
        logger.warning("the Triton kernels do not run on %s (%s: %s); attention falls back to torch", device,
                       type(e).__name__, e)
        return False
    ref = []
    for b in range(2):
        s = idx[ptr[b]:ptr[b + 1]]
        kk, vv = k[s].repeat_interleave(2, 1), v[s].repeat_interleave(2, 1)  # [L, Hq, D]
        w = torch.softmax(torch.einsum("hd,lhd->hl", q[b], kk) * 0.25, -1)
        ref.append(torch.einsum("hl,lhd->hd", w, vv).reshape(-1))
    ok = all((o - torch.stack(ref)).abs().max() <= 1e-4 for o in outs)
    if not ok:
        logger.warning("the Triton decode kernel disagrees with torch on %s; attention falls back to torch", device)
    return ok


def check_triton(device: torch.device) -> None:
    """A start-up error unless the triton backend can run here: the triton package, and CUDA (or CPU
    under Triton's interpreter)."""
    if importlib.util.find_spec("triton") is None:
        raise ValueError("--attention-backend triton needs the triton package")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--attention-backend triton runs on CUDA, or on CPU only under TRITON_INTERPRET=1 "
                         "(Triton's interpreter: slow, for tests)")


def deterministic_backend(name: str, device: torch.device) -> AttentionBackend:
    """--enable-deterministic-inference: on CPU, sgrec's C kernels with the batch-invariant extend
    (NativeBackend(deterministic=True)) under auto or native, whatever the ISA; on CUDA (or on CPU under
    TRITON_INTERPRET=1, for tests) the triton backend with the batch-invariant Triton kernel
    (TritonBackend(deterministic=True)) under auto or triton. Anything else is a start-up error saying
    why (torch's SDPA pads a decode batch to its longest sequence and tiles by length; FlashInfer's
    kernels split their work by the batch)."""
    from sgrec.model import native

    if name == "triton" or (name == "auto" and device.type == "cuda"):
        check_triton(device)
        return TritonBackend(deterministic=True)
    if device.type != "cpu":
        raise ValueError(f"--enable-deterministic-inference on {device.type} needs --attention-backend auto or "
                         f"triton (the batch-invariant kernels are sgrec's C kernels on CPU and Triton's on CUDA)")
    if name not in ("auto", "native"):
        raise ValueError(f"--enable-deterministic-inference needs --attention-backend auto, native or triton, "
                         f"not {name}: torch's SDPA pads a decode batch to its longest sequence and picks tiles by "
                         f"length, so a request's bits would depend on its batch")
    if native.load() is None:
        raise ValueError("--enable-deterministic-inference needs sgrec's C kernels, and no C compiler builds them "
                         "here (see the warning above)")
    return NativeBackend(deterministic=True)


def make_backend(name: str, device: torch.device | str = "cpu", deterministic: bool = False) -> AttentionBackend:
    """auto: on CPU with AVX-512, NativeBackend where the kernels build (decode in float32 and bfloat16,
    extend in float32, and in bfloat16 where native_extend_dtypes says); on CUDA, TritonBackend where
    triton imports and its decode kernel passes triton_decodes, FlashInferBackend (a TritonBackend) over
    it where flashinfer imports and passes flashinfer_runs; otherwise torch. deterministic: see deterministic_backend."""
    device = torch.device(device)
    if deterministic:
        return deterministic_backend(name, device)
    if name == "auto":
        if device.type == "cpu" and native_by_default():
            return NativeBackend(extend_dtypes=native_extend_dtypes())
        if device.type == "cuda" and importlib.util.find_spec("triton") is not None and triton_decodes(device):
            if importlib.util.find_spec("flashinfer") is not None:
                from sgrec.model.flashinfer_backend import FlashInferBackend, flashinfer_runs

                if flashinfer_runs(device):
                    return FlashInferBackend()
            return TritonBackend()
        name = "torch"
    if name == "torch":
        return TorchBackend()
    if name == "native":
        from sgrec.model import native

        if device.type != "cpu":
            raise ValueError("--attention-backend native runs on CPU (sgrec's C kernels)")
        if native.load() is None:
            raise ValueError("--attention-backend native needs a C compiler to build sgrec's CPU kernels "
                             "(see the warning above); --attention-backend torch needs none")
        return NativeBackend()
    if name == "triton":
        check_triton(device)
        return TritonBackend()
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("--attention-backend flashinfer runs on CUDA")
        if importlib.util.find_spec("flashinfer") is None or importlib.util.find_spec("triton") is None:
            raise ValueError("--attention-backend flashinfer needs the flashinfer package (pip install 'sgrec[gpu]') "
                             "and triton")
        from sgrec.model.flashinfer_backend import FlashInferBackend

        return FlashInferBackend()
    raise ValueError(f"Unknown attention backend {name!r} (available: {', '.join(BACKENDS)})")
