"""Maximum input length (PrefillOnly §4, Table 2): peak memory of one prefill for growing inputs.

Three ways to prefill one prompt of n tokens, each in a fresh subprocess:
- standard: one forward over the whole prompt, every token's KV stored in the pool;
- chunked:  chunked prefill (--chunk tokens per forward, each attending to the stored KV before it);
- hybrid:   sgrec's prefill-only path: hybrid prefilling (attention over the whole prompt, MLP and
            projections chunk by chunk) with the suffix KV discarded (nothing stored).
Peak memory = the highest resident set size sampled every 0.2 ms during the prefill (KV pool
allocation included) minus the RSS just before it, with glibc's mmap threshold fixed so that freed
tensors leave the RSS. A line peak(n) = a + b*n is fitted per mode and
the maximum input length under --budget-mib is (budget - a) / b. Target: hybrid >= 5x standard.

    python benchmarks/bench_mil.py                          # SmolLM2-135M if prepared, else a same-shape random model
    python benchmarks/bench_mil.py --lengths 512,1024,2048 --budget-mib 256
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time

from sgrec.tools.results import row, write_record

MODES = ["standard", "chunked", "hybrid"]
# a fixed mmap threshold: every large tensor is mmapped and returned to the OS when freed, so the RSS
# follows the live tensors (glibc's dynamic threshold would keep freed blocks resident)
MALLOC_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model: str, mode: str, n: int, chunk: int, device: str = "cpu") -> int:
    """Runs in the subprocess: peak memory growth (bytes) of one prefill of n tokens: the RSS on CPU,
    torch.cuda.max_memory_allocated on CUDA."""
    import torch

    from sgrec.model.attention import SeqLayout
    from sgrec.runner import ModelRunner
    from sgrec.server_args import ServerArgs

    torch.set_num_threads(2)
    runner = ModelRunner(ServerArgs(model_path=model, device=device, dtype="float32", max_total_tokens=64,
                                    hybrid_chunk_size=chunk))
    dev = runner.device
    cfg = runner.config
    ids = [(7 * i) % (cfg.vocab_size - 3) + 3 for i in range(n)]
    warm = runner.make_batch(ids[:16], list(range(16)), torch.arange(1, 17),
                             [SeqLayout(0, 16, torch.arange(1, 17, device=dev))])
    runner.forward(warm, [15])
    runner.forward_prefill_only(warm, [15])
    runner.kv_pool = None
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        run_prefill(runner, mode, ids, n, chunk)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base
    base, peak, stop = _rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0002)

    t = threading.Thread(target=sample)
    t.start()
    run_prefill(runner, mode, ids, n, chunk)
    stop.set()
    t.join()
    return max(peak[0], _rss()) - base


def run_prefill(runner, mode: str, ids: list[int], n: int, chunk: int) -> None:
    """One prefill of ids in the given mode; the KV pool is allocated here (counted in the peak)."""
    import torch

    from sgrec.mem.kv_pool import KVPool
    from sgrec.model.attention import SeqLayout

    cfg, dev = runner.config, runner.device
    if mode == "hybrid":
        runner.kv_pool = KVPool(1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, runner.dtype, dev)
        zeros = torch.zeros(n, dtype=torch.int64, device=dev)
        runner.forward_prefill_only(runner.make_batch(ids, list(range(n)), zeros, [SeqLayout(0, n, zeros)]), [n - 1])
    else:
        runner.kv_pool = KVPool(n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, runner.dtype, dev)
        slots = torch.arange(1, n + 1, device=dev)
        step = n if mode == "standard" else chunk
        for s in range(0, n, step):
            e = min(s + step, n)
            batch = runner.make_batch(ids[s:e], list(range(s, e)), slots[s:e], [SeqLayout(0, e - s, slots[:e])])
            runner.forward(batch, [e - s - 1])


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    import numpy as np

    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    b, a = np.polyfit(xs, ys, 1)
    return float(a), float(b)


def default_model() -> str:
    smol = os.path.join(os.environ.get("SGREC_CACHE_DIR") or os.path.expanduser("~/.cache/sgrec"),
                        "SmolLM2-135M-Instruct")
    if os.path.isdir(smol):
        return smol
    from sgrec.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(tempfile.mkdtemp(prefix="sgrec_mil_"), arch="llama", hidden_size=576,
                           intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                           max_position_embeddings=65536)


def record_rows(peaks: dict[str, list[tuple[int, int]]], mil: dict[str, float], args, model: str) -> list[dict]:
    """The result record's rows: chunked's and hybrid's peak memory beside the standard prefill's per
    length, and their maximum input lengths under --budget-mib beside the standard one's."""
    def finite(x):
        return x if math.isfinite(x) else None

    base = {"model": model, "chunk": args.chunk, "device": args.device}
    std = dict(peaks["standard"])
    out = [row(f"peak memory of one prefill, {mode}", "MiB", peak / 2**20, std[n] / 2**20, higher_is_better=False,
               params={**base, "tokens": n}) for mode in ("chunked", "hybrid") for n, peak in peaks[mode]]
    out += [row(f"maximum input length under {args.budget_mib:g} MiB, {mode}", "tokens", finite(mil[mode]),
                finite(mil["standard"]), params=base) for mode in ("chunked", "hybrid")]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--chunk", type=int, default=512, help="chunked-prefill chunk and hybrid chunk (tokens)")
    ap.add_argument("--budget-mib", type=float, default=1024.0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--measure", nargs=3, metavar=("MODEL", "MODE", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.measure:
        model, mode, n = args.measure
        print(json.dumps({"peak": measure(model, mode, int(n), args.chunk, args.device)}))
        return
    model = args.model or default_model()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"model: {model}\nchunk: {args.chunk} tokens; budget: {args.budget_mib:g} MiB\n")
    peaks: dict[str, list[tuple[int, int]]] = {m: [] for m in MODES}
    print("| n tokens | " + " | ".join(f"{m} MiB" for m in MODES) + " | standard / hybrid |")
    print("|---|" + "---|" * (len(MODES) + 1))
    for n in lengths:
        row = []
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--chunk", str(args.chunk), "--device", args.device,
                                  "--measure", model, mode, str(n)], capture_output=True, text=True, check=True,
                                  env=MALLOC_ENV)
            peak = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
            peaks[mode].append((n, peak))
            row.append(peak)
        print(f"| {n} | " + " | ".join(f"{p / 2**20:.1f}" for p in row) + f" | {row[0] / max(row[2], 1):.1f}x |",
              flush=True)
    budget = args.budget_mib * 2**20
    print(f"\nmaximum input length under {args.budget_mib:g} MiB (line fitted to the measured peaks):")
    mil = {}
    for mode in MODES:
        a, b = fit_line(peaks[mode])
        mil[mode] = (budget - a) / b if b > 0 else float("inf")
        print(f"  {mode:9s} {mil[mode]:>10,.0f} tokens   (peak ~ {a / 2**20:.1f} MiB + {b / 1024:.1f} KiB/token)")
    print(f"hybrid / standard: {mil['hybrid'] / mil['standard']:.1f}x (target >= 5x); "
          f"chunked / standard: {mil['chunked'] / mil['standard']:.1f}x")
    print("rerun: python benchmarks/bench_mil.py " + " ".join(sys.argv[1:]))
    if not args.no_record:
        name = os.path.basename(model.rstrip("/"))
        name = name if args.model or name == "SmolLM2-135M-Instruct" else "random, SmolLM2-135M's shape"
        cmd = ("python benchmarks/bench_mil.py " + shlex.join(sys.argv[1:] if argv is None else argv)).strip()
        path = write_record(benchmark="bench_mil", title="Maximum input length of one prefill",
                            command=cmd, results=record_rows(peaks, mil, args, name),
                            peer="standard prefill (one forward, every token's KV stored)")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
