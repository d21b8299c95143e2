"""The staged beam-step attention kernel alone, its launch variants side by side: where a
retrieve request's beam steps go on a GPU, measured in one short call.

The kernel is a large share of a lone retrieve request's device time on a GPU (docs/performance.md
has the records), and splitting the prompt into runs merged by log-sum-exp made it slower. This
times the default launch against variants that test the other suspects: the prompt's products on bf16 tiles instead of float32 ones (register
pressure; P rounded to bf16), other tile widths (BLOCK_N), warps and pipeline stages, beams per
program (BLOCK_B). Cases: sid-gr's shape alone and four at once, FlashRec's (32 requests of 50 beams
over 300-token prompts). Each variant's output is compared with the default's (max |difference|).

    python benchmarks/bench_staged_kernel.py                           # on a CUDA GPU
    python benchmarks/bench_staged_kernel.py --device cpu --quick      # the code path under Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sgrec.tools.results import row, write_record  # noqa: E402

CASES = {  # name: (requests, beams each, prompt tokens each, own tokens per beam)
    "sid-gr, 1 request": (1, 256, 5000, 2),
    "sid-gr, 4 requests": (4, 256, 5000, 2),
    "FlashRec, 32 requests": (32, 50, 300, 3),
}
VARIANTS = {  # name: staged_attention_batched keyword arguments
    "default": {},
    "16-bit tiles": {"low_precision": True},
    "BLOCK_N 32": {"block_n": 32},
    "BLOCK_N 128": {"block_n": 128},
    "16-bit tiles, BLOCK_N 128": {"low_precision": True, "block_n": 128},
    "8 warps": {"num_warps": 8},
    "2 stages": {"num_stages": 2},
    "4 stages": {"num_stages": 4},
    "BLOCK_B 8": {"block_b": 8},
    "BLOCK_B 32": {"block_b": 32},
}


def make_case(requests: int, beams: int, prompt: int, own: int, hq: int, hkv: int, d: int, dtype, device, seed=0):
    """Random q and pool; each request's prompt and each beam's own tokens on scattered slots."""
    import torch

    g = torch.Generator().manual_seed(seed)
    size = requests * (prompt + beams * own) + 1
    k_buf, v_buf = (torch.randn(size, hkv, d, generator=g).to(device, dtype) for _ in range(2))
    perm = torch.randperm(size, generator=g)
    shared = perm[: requests * prompt].to(device)
    unshared = perm[requests * prompt: requests * (prompt + beams * own)].view(requests * beams, own).to(device)
    sh_ptr = torch.arange(0, requests * prompt + 1, prompt, dtype=torch.int64).to(device)
    q = torch.randn(requests * beams, hq, d, generator=g).to(device, dtype)
    return q, k_buf, v_buf, shared, sh_ptr, unshared


def timed_us(fn, device: str, repeats: int) -> float:
    import torch

    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out = []
        for _ in range(repeats):
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1e3)
        return statistics.median(out)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def record_rows(rows: list[dict], dtype: str) -> list[dict]:
    """The result record's rows: each variant's median launch time beside the default launch's in its case
    (the default's own row without a peer; a variant that failed has none)."""
    default = {r["case"]: r["us"] for r in rows if r["variant"] == "default" and "us" in r}
    return [row("staged attention kernel time (median)", "us", r["us"],
                None if r["variant"] == "default" else default.get(r["case"]), higher_is_better=False,
                params={"case": r["case"], "variant": r["variant"], "dtype": dtype}) for r in rows if "us" in r]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny cases (the code path, not a measurement)")
    ap.add_argument("--out", help="JSON file of the results")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is first built
    import torch

    from sgrec.model.kernels.staged_attention import BLOCK_B, beam_blocks, staged_attention_batched

    hq, hkv, d = (4, 2, 32) if a.quick else (16, 8, 128)
    cases = {"tiny": (2, 8, 40, 2)} if a.quick else CASES
    dtype = torch.float16 if a.device == "cpu" else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    print(f"device {torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu (Triton interpreter)'}, "
          f"{hq}/{hkv} heads, head dim {d}, {dtype}; median of {a.repeats} launches", flush=True)
    rows = []
    for case, (requests, beams, prompt, own) in cases.items():
        q, k_buf, v_buf, shared, sh_ptr, unshared = make_case(requests, beams, prompt, own, hq, hkv, d, dtype,
                                                              a.device)
        flops = 4 * requests * beams * hq * d * (prompt + own)  # q k^T and p v
        base, base_us = None, None
        for name, kw in VARIANTS.items():
            kw = dict(kw)
            block_b = kw.pop("block_b", BLOCK_B)
            blocks = beam_blocks([beams] * requests, block_b).to(a.device)

            def run(kw=kw, block_b=block_b, blocks=blocks):
                return staged_attention_batched(q, k_buf, v_buf, shared, sh_ptr, unshared, blocks, d ** -0.5,
                                                block_b=block_b, **kw)

            try:
                out = run()
                us = timed_us(run, a.device, a.repeats)
            except Exception as err:  # noqa: BLE001 - a variant that does not compile is a row, not the end
                rows.append({"case": case, "variant": name, "error": repr(err)[:200]})
                print(f"{case:24s} {name:26s} error: {repr(err)[:120]}", flush=True)
                continue
            if base is None:
                base, base_us = out.float(), us
            diff = (out.float() - base).abs().max().item()
            rows.append({"case": case, "variant": name, "us": us, "vs_default": base_us / us,
                         "tflops": flops / us / 1e6, "max_abs_diff": diff})
            print(f"{case:24s} {name:26s} {us:9.1f} us  {base_us / us:5.2f}x  {flops / us / 1e6:7.2f} TFLOP/s  "
                  f"max|diff| {diff:.2e}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    records = [] if a.no_record else record_rows(rows, str(dtype).removeprefix("torch."))
    if records:
        cmd = ("python benchmarks/bench_staged_kernel.py " + shlex.join(sys.argv[1:] if argv is None else argv)).strip()
        path = write_record(benchmark="bench_staged_kernel", title="The staged beam-step attention kernel's launches",
                            command=cmd, results=records, peer="the kernel's default launch")
        print(f"result record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
