"""The fused decode step (sgrec.model.fused_decode) against the layer-by-layer path, per batch size.

    python benchmarks/bench_fused_decode.py                        # SmolLM2-135M, bf16, batches 1-16
    python benchmarks/bench_fused_decode.py --dtype float32        # the float32 step
    python benchmarks/bench_fused_decode.py --batch-sizes 1 2 --steps 8 --repeats 1   # a smoke run

Two engines over the same model in one process, in --dtype on the C kernels: one as the defaults build it, one
with --disable-fused-decode. The fused one runs its step at every batch size here (the engine's own
limit, fused_decode.MAX_BATCH, is what this table chose). Time of a decode step: (the time of --steps + 1
new tokens minus the time of one) / --steps, cache flushed before each, best of --repeats, the two engines
taking turns. Greedy tokens of the two are compared (bf16 rounds differently in the two paths, so a
near-tie may flip; the count of identical sequences is printed). Needs a CPU with avx512_bf16 for bfloat16,
AVX2 + FMA or AVX-512 for float32 (the fused step is built only there). Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402
from sgrec import Engine  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402


def record_rows(results: list[dict], args) -> list[dict]:
    """The result record's rows: the fused step's time beside the layer-by-layer path's, per batch size."""
    model = os.path.basename(os.path.expanduser(args.model_path).rstrip("/"))
    return [row("decode step time", "ms", r["fused_s"] * 1e3, r["layer_s"] * 1e3, higher_is_better=False,
                params={"batch": r["batch"], "dtype": args.dtype, "model": model}) for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="~/.cache/sgrec/SmolLM2-135M-Instruct")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(header(" ".join(["python", "benchmarks/bench_fused_decode.py", *map(shlex.quote, sys.argv[1:])]),
                 "bench_fused_decode"), flush=True)
    path = os.path.expanduser(args.model_path)
    engines = {"fused": Engine(path, device="cpu", dtype=args.dtype),
               "layer by layer": Engine(path, device="cpu", dtype=args.dtype, disable_fused_decode=True)}
    fused = engines["fused"].runner.fused
    if fused is None:
        sys.exit(f"the fused decode step is not built on this machine for {args.dtype} (bf16 needs avx512_bf16, "
                 "float32 AVX2 + FMA or AVX-512, both the C kernels)")
    limit = fused.max_batch
    fused.max_batch = max(args.batch_sizes)
    rng = random.Random(0)
    rows, results = [], []
    for b in args.batch_sizes:
        vocab = engines["fused"].vocab_size
        prompts = [[rng.randrange(min(100, vocab // 2), min(40000, vocab)) for _ in range(args.prompt_len)]
                   for _ in range(b)]
        best = {name: float("inf") for name in engines}
        outs = {}
        for _ in range(args.repeats):
            for name, eng in engines.items():
                def gen(k, eng=eng):
                    eng.flush_cache()
                    t = time.perf_counter()
                    out = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": k, "temperature": 0,
                                                                           "ignore_eos": True})
                    return time.perf_counter() - t, out
                gen(2)
                (t_long, outs[name]), (t_one, _) = gen(args.steps + 1), gen(1)
                best[name] = min(best[name], (t_long - t_one) / args.steps)
        same = sum(a["output_ids"] == c["output_ids"] for a, c in zip(outs["fused"], outs["layer by layer"]))
        f, p = best["fused"], best["layer by layer"]
        rows.append([b, f"{f * 1e3:.2f}", f"{b / f:.0f}", f"{p * 1e3:.2f}", f"{b / p:.0f}", f"**{p / f:.2f}**",
                     f"{same}/{b}"])
        results.append({"batch": b, "fused_s": f, "layer_s": p})
        print(f"  batch {b}: fused {f * 1e3:.2f} ms/step, layer by layer {p * 1e3:.2f}", flush=True)
    print()
    print(md_table(["batch", "fused ms/step", "fused tok/s", "layer-by-layer ms/step", "tok/s", "ratio",
                    "identical greedy outputs"], rows))
    print(f"\nthe engine runs the {args.dtype} fused step up to {limit} sequences (fused_decode.MAX_BATCH)")
    for eng in engines.values():
        eng.shutdown()
    if not args.no_record:
        cmd = ("python benchmarks/bench_fused_decode.py " + shlex.join(sys.argv[1:])).strip()
        path = write_record(benchmark="bench_fused_decode",
                            title="The fused CPU decode step against the layer-by-layer path",
                            command=cmd, results=record_rows(results, args),
                            peer="the layer-by-layer decode step (--disable-fused-decode)")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
