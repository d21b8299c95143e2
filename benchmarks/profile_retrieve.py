"""Where one retrieve request's time goes: the sid-gr shape of bench_gpu.py (Qwen3-1.7B
shape, random weights, context 5000, BW 256, ND 3, 100000 items), one warm request profiled three ways:
Python (cProfile, the calling thread steps the engine), torch's profiler (device and host time per
operator), and the host-device synchronizations (torch's sync debug mode, counted per call site).

    python benchmarks/profile_retrieve.py                          # on the GPU machine
    python benchmarks/profile_retrieve.py --concurrency 4          # 4 requests at once (one batched round)
    python benchmarks/profile_retrieve.py --device cpu --quick     # the code path on CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_gpu import engine, prompt, sync, write_catalog  # noqa: E402

from sgrec.tools.make_tiny_model import make_tiny_model  # noqa: E402


def torch_profile(a, fn) -> None:
    """fn() under torch's profiler: the operators by device time (CUDA) and by host time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=acts) as p:
        fn()
    for key in (["self_cuda_time_total"] if a.device == "cuda" else []) + ["self_cpu_time_total"]:
        print(f"--- torch profiler by {key}\n" + p.key_averages().table(sort_by=key, row_limit=a.top,
                                                                          max_name_column_width=70), flush=True)


def concurrent(a, one) -> int:
    """--concurrency N: N threads send one request each, at once; their latencies and the batch's
    wall time, then one such batch under torch's profiler."""
    from concurrent.futures import ThreadPoolExecutor

    def batch(seed0: int) -> tuple[list[float], float]:
        t = time.perf_counter()
        with ThreadPoolExecutor(a.concurrency) as pool:
            lat = list(pool.map(one, range(seed0, seed0 + a.concurrency)))
        return lat, time.perf_counter() - t

    for r in range(4):
        lat, wall = batch(100 + 10 * r)
        print(f"{'warm-up' if r < 2 else 'timed'} batch of {a.concurrency}: wall {wall * 1e3:.1f} ms, "
              f"{a.concurrency / wall:.2f} req/s, latencies {[round(x * 1e3, 1) for x in lat]} ms", flush=True)
    torch_profile(a, lambda: batch(200))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--context", type=int, default=5000)
    ap.add_argument("--beam-width", type=int, default=256)
    ap.add_argument("--items", type=int, default=100000)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests sent at once by as many threads (the engine batches them); > 1 profiles one such "
                         "batch with torch's profiler only (cProfile sees one thread)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    if a.quick:
        a.shape, a.context, a.beam_width, a.items = None, 64, 8, 500
    a.wide_beams, a.rank_user, a.rank_candidates = [], 16, [1]
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    work = tempfile.mkdtemp(prefix="sgrec-prof-")
    model = make_tiny_model(os.path.join(work, "model"), shape=a.shape, dtype=dtype if a.shape else "float32",
                            max_position_embeddings=a.context + 256)
    cat, _ = write_catalog(model, a, work)
    e = engine(model, a, dtype, cat)
    vocab = e.vocab_size

    def one(seed):
        t = time.perf_counter()
        e.retrieve({"token_ids": prompt(vocab, a.context, seed)}, beam_width=a.beam_width, num_items=min(10, a.beam_width))
        sync(a.device)
        return time.perf_counter() - t

    for s in range(3):
        print(f"warm-up {s}: {one(s) * 1e3:.1f} ms", flush=True)
    print(f"timed: {[round(one(10 + s) * 1e3, 1) for s in range(3)]} ms", flush=True)
    if a.concurrency > 1:
        return concurrent(a, one)
    prof = cProfile.Profile()
    prof.enable()
    one(20)
    prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(a.top)
        print(f"--- cProfile by {key}\n" + "\n".join(buf.getvalue().splitlines()[6:]), flush=True)
    torch_profile(a, lambda: one(21))
    if a.device == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            one(22)
        torch.cuda.set_sync_debug_mode(0)
        sites = collections.Counter()
        for x in w:
            sites[f"{os.path.relpath(x.filename, ROOT)}:{x.lineno}"] += 1
        print(f"--- {sum(sites.values())} synchronizing calls, by call site")
        for site, n in sites.most_common(a.top):
            print(f"{n:6d} {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
