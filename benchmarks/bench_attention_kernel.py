"""The CPU extend attention kernel alone (sgrec/model/native/attention.c), in every ISA build this CPU
runs, against torch's SDPA on the same inputs.

    python benchmarks/bench_attention_kernel.py                 # SmolLM2's shapes, 1024 and 4096 tokens
    python benchmarks/bench_attention_kernel.py --lens 256 --repeats 3   # a smoke run

One layer of a causal prefill with SmolLM2-135M's heads (9 query / 3 KV heads, head dim 64), float32 and
bfloat16, through `native.extend_attention` with each build (`native.library(march)`: AMX tiles,
AVX-512-BF16 dot products, widening AVX-512, AVX2 ... as the CPU allows) and through
`torch.nn.functional.scaled_dot_product_attention` (is_causal, K/V repeated per query head). Time: the
best over --repeats of the mean of --calls calls, the kernels taking turns within each repeat (a VM's
slow moments fall on all of them alike). FLOPs: 4 x query heads x head dim x the query-key pairs a
causal mask keeps (T (T + 1) / 2). Each row's output is checked against float64 attention over the same
inputs (max abs error printed) so a fast wrong build cannot pass unseen. Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402
from sgrec.model import native  # noqa: E402
from sgrec.model.cpu_caps import cpu_flags  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

BUILDS = [["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"], ["-march=x86-64-v4", "-mavx512bf16"],
          ["-march=x86-64-v4"], ["-march=x86-64-v3"]]


def builds() -> list[list[str]]:
    """The builds this CPU runs, its best (what auto loads) first."""
    best = native.march_flags(cpu_flags())
    return BUILDS[BUILDS.index(best):] if best in BUILDS else [best]


def isa(march: list[str]) -> str:
    return {"-march=x86-64-v4": "AVX-512", "-march=x86-64-v3": "AVX2"}.get(march[0] if march else "", "default")


def build_name(march: list[str], dtype: torch.dtype) -> str:
    """What a build runs for this dtype (float32: the same vector kernel in every AVX-512 build)."""
    if dtype == torch.bfloat16 and "-mamx-bf16" in march:
        return "bf16 on AMX tiles (amx_bf16)"
    if dtype == torch.bfloat16 and "-mavx512bf16" in march:
        return "bf16 on dot products (avx512_bf16)"
    return f"{isa(march)}, {'widened to float32' if dtype == torch.bfloat16 else 'float32'}"


def case(T: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    empty = i64([])
    meta = (i64([0]), i64([T]), torch.arange(T), torch.full((T,), -1, dtype=torch.int64), empty, empty, empty,
            i64([0, 0]))
    pool = torch.zeros(1, hkv, d, dtype=dtype)
    return q, k, v, pool, meta


def best_ms(fns: list, calls: int, repeats: int) -> list[float]:
    """Each fn's best over `repeats` of its mean over `calls` calls, in ms; the fns take turns within a
    repeat, so a VM's slow moments fall on all of them alike."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - t0) / calls)
    return [b * 1e3 for b in best]


def record_rows(results: list[dict]) -> list[dict]:
    """The result record's rows: each sgrec kernel's time beside torch SDPA's on the same inputs."""
    return [row("extend attention time", "ms", r["ms"], r["sdpa_ms"], higher_is_better=False,
                params={"tokens": r["tokens"], "dtype": r["dtype"], "kernel": r["kernel"]}) for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args()
    print(header("python benchmarks/bench_attention_kernel.py " + shlex.join(sys.argv[1:]), "bench_attention_kernel"))
    hq, hkv, d = 9, 3, 64
    scale = d ** -0.5
    libs = [(m, native.library(m)) for m in builds()]
    rows, results = [], []
    for T in args.lens:
        flops = 4 * hq * d * T * (T + 1) / 2
        for name in args.dtypes:
            dtype = getattr(torch, name)
            q, k, v, pool, meta = case(T, hq, hkv, d, dtype)
            qt, kt, vt = q.transpose(0, 1), k.repeat_interleave(hq // hkv, 1).transpose(0, 1), \
                v.repeat_interleave(hq // hkv, 1).transpose(0, 1)
            ref = torch.nn.functional.scaled_dot_product_attention(qt.double(), kt.double(), vt.double(),
                                                                   is_causal=True, scale=scale)
            ref = ref.transpose(0, 1).reshape(T, hq * d)
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,  # noqa: E731
                                                                            scale=scale)
            runs, names = [sdpa], ["torch SDPA"]
            for march, lib in libs:
                if build_name(march, dtype) not in names:  # float32: one row per vector ISA
                    runs.append(lambda lib=lib: native.extend_attention(q, k, v, pool, pool, *meta, scale, lib))
                    names.append(build_name(march, dtype))
            times = best_ms(runs, args.calls, args.repeats)
            for i, (fn, kernel, ms) in enumerate(zip(runs, names, times)):
                out = fn()
                out = out.transpose(0, 1).reshape(T, hq * d) if i == 0 else out
                rows.append([T, name, kernel, f"{ms:.2f}", f"{flops / ms / 1e6:.0f}", f"{times[0] / ms:.2f}",
                             f"{(out.double() - ref).abs().max().item():.1e}"])
                if i:
                    results.append({"tokens": T, "dtype": name, "kernel": kernel, "ms": ms, "sdpa_ms": times[0]})
    print()
    print(md_table(["tokens", "dtype", "kernel", "ms", "GFLOP/s", "vs torch SDPA", "max abs err vs float64"], rows))
    print(f"\nauto loads the {' '.join(builds()[0]) or 'default'} build; torch {torch.get_num_threads()} threads")
    print("rerun: python benchmarks/bench_attention_kernel.py " + shlex.join(sys.argv[1:]))
    if not args.no_record:
        path = write_record(benchmark="bench_attention_kernel", title="CPU extend attention kernel against torch SDPA",
                            command=("python benchmarks/bench_attention_kernel.py " + shlex.join(sys.argv[1:])).strip(),
                            results=record_rows(results), peer=f"torch {torch.__version__} SDPA")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
