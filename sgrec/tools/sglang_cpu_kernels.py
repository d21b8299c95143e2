"""Build SGLang's CPU kernels (the `sgl_kernel` ops SGLang's `--device cpu` path calls) from an SGLang
source tree against the installed torch, for a stock SGLang server on a machine without CUDA.

    sudo apt-get install libnuma-dev          # numa.h
    pip install ninja
    python -m sgrec.tools.sglang_cpu_kernels --sglang-src ~/src/sglang --out ~/sglang-cpu-kernels
    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=~/sglang-cpu-kernels python -m sglang.launch_server --device cpu ...

The package index has no CPU build of `sgl_kernel` (the test extra's `sglang-kernel` is the CUDA build,
which fails at import without libcuda), and SGLang's own CPU recipe (`pyproject_cpu.toml`, CMake's
find_package(Torch)) stops when the installed torch is a CUDA build and no CUDA toolkit is present. This
compiles the same sources (`csrc/cpu`: `sgl-kernel/csrc/cpu` in older trees,
`python/sglang/kernels/aot/csrc/cpu` in newer ones) with the same compiler flags through
torch.utils.cpp_extension, which needs no CUDA toolkit, and writes an overlay: a copy of the installed
`sgl_kernel` package whose ops library (`sm100/common_ops.*`, the one its loader picks without a GPU)
is the CPU build. Put the overlay first on PYTHONPATH for SGLang's processes.

The flags target AVX-512 with AVX-512-BF16/VNNI and AMX (`-march=x86-64-v4 -mamx-*`, as SGLang's CMake
file); kernels that use AMX run only where the CPU has it (SGLang checks `amx_tile` at run time).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import time

LAYOUTS = ("sgl-kernel", "python/sglang/kernels/aot")  # where csrc/cpu sits, older and newer trees
CFLAGS = ["-O3", "-Wno-unknown-pragmas", "-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mamx-tile",
          "-mamx-bf16", "-mamx-int8", "-fopenmp", "-DSGLANG_CPU_FP8_CVT_FTZ"]


def kernel_root(sglang_src: str) -> str:
    for sub in LAYOUTS:
        root = os.path.join(sglang_src, sub)
        if os.path.isdir(os.path.join(root, "csrc", "cpu")):
            return root
    raise SystemExit(f"no csrc/cpu under {sglang_src} (looked in {', '.join(LAYOUTS)})")


def sources(cpu_dir: str) -> list[str]:
    """Every .cpp of csrc/cpu and its sub-folders, less other architectures' (as SGLang's CMake file)."""
    out = []
    for path in sorted(glob.glob(os.path.join(cpu_dir, "**", "*.cpp"), recursive=True)):
        rel = os.path.relpath(path, cpu_dir).split(os.sep)
        if rel[0] in ("aarch64", "ppc64"):
            continue
        out.append(path)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-src", required=True, help="an SGLang source tree (a git checkout)")
    ap.add_argument("--out", required=True, help="the overlay folder to write (put it first on PYTHONPATH)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler jobs")
    args = ap.parse_args(argv)
    if shutil.which("ninja") is None and not _has_ninja_module():
        raise SystemExit("torch.utils.cpp_extension needs ninja: pip install ninja")
    if not os.path.exists("/usr/include/numa.h"):
        print("warning: /usr/include/numa.h not found (apt-get install libnuma-dev); the build needs it",
              file=sys.stderr)
    root = kernel_root(args.sglang_src)
    cpu_dir = os.path.join(root, "csrc", "cpu")
    files = sources(cpu_dir)
    work = os.path.join(args.out, "_build")
    os.makedirs(work, exist_ok=True)
    os.environ["MAX_JOBS"] = str(args.jobs)
    from torch.utils.cpp_extension import load

    t0 = time.monotonic()
    print(f"compiling {len(files)} sources of {cpu_dir} ({args.jobs} jobs)", flush=True)
    load(name="common_ops", sources=files, build_directory=work,
         extra_include_paths=[cpu_dir, os.path.join(root, "csrc"), os.path.join(root, "include")],
         extra_cflags=CFLAGS, extra_ldflags=["-lnuma", "-fopenmp"], is_python_module=False, verbose=False)
    print(f"built in {time.monotonic() - t0:.0f} s", flush=True)
    import importlib.util

    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        raise SystemExit("sgl_kernel is not installed (pip install sglang installs it): nothing to overlay")
    pkg = os.path.join(args.out, "sgl_kernel")
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(os.path.dirname(spec.origin), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for old in glob.glob(os.path.join(pkg, "sm100", "common_ops.*")):
        os.remove(old)
    os.makedirs(os.path.join(pkg, "sm100"), exist_ok=True)
    shutil.copy2(os.path.join(work, "common_ops.so"), os.path.join(pkg, "sm100", "common_ops.so"))
    print(f"overlay: {args.out}\nrun SGLang with: SGLANG_USE_CPU_ENGINE=1 PYTHONPATH={args.out} "
          "python -m sglang.launch_server --device cpu ...")


def _has_ninja_module() -> bool:
    import importlib.util

    return importlib.util.find_spec("ninja") is not None


if __name__ == "__main__":
    main()
