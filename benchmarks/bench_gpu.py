"""GPU numbers of issue 24 that need no other engine: prefill MFU and retrieve latency on a model of a
real shape with random weights (`make_tiny_model --shape`), written to a JSON file.

    python benchmarks/bench_gpu.py --out results.json                   # on the GPU machine (scripts/gpu_suite.sh)
    python benchmarks/bench_gpu.py --device cpu --quick --out r.json    # the code path on CPU, tiny sizes

1. Prefill: one prompt of each length (1K and 8K tokens; --quick: 64, 128) through ModelRunner.forward
   (logits of the last row only), the median of --repeats after a warm-up. MFU = useful FLOPs /
   time / the device's peak: useful FLOPs = 2 x non-embedding parameters x tokens + the causal
   attention's 2 x 2 x layers x heads x head_dim x tokens^2 / 2. The peak is measured in the same run
   (a bf16 GEMM of 8192^3; --quick: 512^3), so MFU is against what this device reaches.
2. Retrieve: the Engine on a catalog of --items random 3-token semantic IDs, a --context-token
   prompt, BW --beam-width, ND 3, one request at a time: median latency of --repeats (the prompt is
   new each time: no radix hit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sgrec.model.attention import SeqLayout  # noqa: E402
from sgrec.runner import ModelRunner  # noqa: E402
from sgrec.server_args import ServerArgs  # noqa: E402
from sgrec.tools.make_tiny_model import make_tiny_model  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> float:
    fn()
    sync(device)
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def gemm_peak(device: str, dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, device, repeats)


def non_embedding_params(cfg) -> int:
    """The matmul weights of the layers (from the config: packed CPU weights are not parameters)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * (cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size)


def prefill_flops(cfg, n_params: int, tokens: int) -> float:
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens / 2
    return 2 * n_params * tokens + attn


def bench_prefill(model_dir: str, a, dtype: str) -> list[dict]:
    longest = max(a.lengths)
    runner = ModelRunner(ServerArgs.from_kwargs(model_path=model_dir, device=a.device, dtype=dtype,
                                                max_total_tokens=longest + 16, chunked_prefill_size=-1,
                                                context_length=longest + 16))
    cfg = runner.config
    n_params = non_embedding_params(cfg)
    rows = []
    for n in a.lengths:
        ids = np.random.default_rng(n).integers(0, cfg.vocab_size, n).tolist()
        slots = torch.arange(1, n + 1, device=runner.device)
        batch = runner.make_batch(ids, list(range(n)), slots, [SeqLayout(0, n, slots)])
        s = timed(lambda: runner.forward(batch, [n - 1]), a.device, a.repeats)
        rows.append({"tokens": n, "seconds": s, "tflops": prefill_flops(cfg, n_params, n) / s / 1e12})
    return rows


def bench_retrieve(model_dir: str, a, dtype: str, work: str) -> dict:
    from sgrec import Engine

    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    codes = min(256, (vocab - 10) // 3)  # semantic-ID codes: three levels of token ranges from id 10 up
    rng = np.random.default_rng(0)
    cat = os.path.join(work, "catalog.jsonl")
    with open(cat, "w") as f:
        for k in range(a.items):
            sem = (np.arange(3) * codes + rng.integers(0, codes, 3) + 10).tolist()
            f.write(json.dumps({"id": f"i{k}", "token_ids": [int(rng.integers(10, vocab))], "semantic_id": sem}) + "\n")
    e = Engine(model_dir, device=a.device, dtype=dtype, item_catalog=cat, max_beam_width=a.beam_width,
               max_total_tokens=a.context + a.beam_width * 4 + 64, context_length=a.context + 16,
               item_cache_tokens=0)
    lat = []
    for r in range(a.repeats + 1):
        user = {"token_ids": np.random.default_rng(100 + r).integers(10, vocab, a.context).tolist()}
        t = time.perf_counter()
        out = e.retrieve(user, beam_width=a.beam_width, num_items=min(10, a.beam_width))
        sync(a.device)
        if r:  # the first one warms up
            lat.append(time.perf_counter() - t)
        assert out["items"], out
    return {"context": a.context, "beam_width": a.beam_width, "items": a.items, "median_s": statistics.median(lat),
            "requests": len(lat)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-1.7b", help="make_tiny_model --shape (random weights of that size)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--context", type=int, default=5000)
    ap.add_argument("--beam-width", type=int, default=256)
    ap.add_argument("--items", type=int, default=100000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: the code path, not a measurement")
    ap.add_argument("--out", required=True, help="JSON file of the results")
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="sgrec-gpu-")
    if a.quick:
        a.shape, a.lengths, a.context, a.beam_width, a.items, a.repeats = None, [64, 128], 64, 8, 500, 2
    dtype = a.dtype if a.device == "cuda" else "float32"
    tdtype = getattr(torch, dtype)
    model = make_tiny_model(os.path.join(work, "model"), shape=a.shape, dtype=dtype if a.shape else "float32",
                            max_position_embeddings=max(max(a.lengths), a.context) + 64)
    peak = gemm_peak(a.device, tdtype, 512 if a.quick else 8192, a.repeats)
    prefill = bench_prefill(model, a, dtype)
    for r in prefill:
        r["mfu"] = r["tflops"] * 1e12 / peak
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "shape": a.shape, "dtype": dtype,
           "gemm_peak_tflops": peak / 1e12, "prefill": prefill, "retrieve": bench_retrieve(model, a, dtype, work)}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
