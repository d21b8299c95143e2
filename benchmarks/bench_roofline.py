"""Roofline of sgrec's paths on this CPU: the machine's limits and each path's efficiency.

    python benchmarks/bench_roofline.py                  # SmolLM2-135M, float32, the issue's sizes
    python benchmarks/bench_roofline.py --quick          # small sizes (a smoke run)

Measured in the same run, before and after the paths (the better of the two: a VM's slow moment at one
of them would otherwise pass for the machine's limit):
* GEMM peak: the best GFLOP/s of torch.mm at 2048^3 (float32; bfloat16 too where the CPU reports
  avx512_bf16 or amx_bf16) and of the model's own (packed) projection at 16 and 1024 rows; the
  float32 peak of the table is the best of the 2048^3 GEMM and the 1024-row projection.
* memory bandwidth: the best GB/s of a 256 MiB tensor copy (bytes read + written).

Each path runs through `sgrec.Engine` on one catalog of --num-items random items (16 token ids, an
id token and a 3-token semantic ID each). Its useful work is counted from what the engine ran, by
wrapping the model (tokens through the projections), the attention backends (query-key pairs: the
sum of every query's attended keys, masks and causality applied) and compute_logits (rows x
columns), in one counted run; the timed runs (best of --repeats) are not wrapped. FLOPs =
2 x non-embedding parameters x tokens + 4 x heads x head_dim x layers x pairs + 2 x hidden x
logits; bytes = the weights read once per forward + the KV read by decode steps. The roofline limit
is min(GEMM peak, bandwidth x FLOPs / bytes); efficiency = achieved GFLOP/s / limit.

Each path is timed again with --baseline-backend (default torch: the engine's attention backend
swapped for it, nothing else changed; the fused bf16 decode step, sgrec.model.fused_decode, runs only
on sgrec's own kernels), for the "vs" column: baseline time / this time. Times are the
best of --repeats runs after a warm-up, the two backends taking turns run by run.

Paths: prefill of --prefill-len tokens (cache flushed); decode at batch 1 and 16 (--decode-prompt
tokens, --decode-tokens new, decode steps only: the time of K new tokens minus the time of one);
rank of 100 candidates x 16 tokens for a 512-token user, item-as-prefix, cold (cache flushed: items
and user computed) and warm (items' KV cached, a new user); retrieve with a --retrieve-prompt prompt
at BW 128 and 512, ND 3 (cache flushed: the prompt computed). Results: docs/performance.md, "bench_roofline".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
import time

import numpy as np
import orjson
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402
from sgrec.beam.attention import BeamBatchMeta, BeamStepMeta, StagedBeamBackend  # noqa: E402
from sgrec.model.backends import make_backend  # noqa: E402
from sgrec.model.fused_decode import FusedDecode  # noqa: E402
from sgrec.model.llama import CausalLM  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

ND, ITEM_TOKENS = 3, 16
# efficiency targets per --dtype: in float32 (of the GEMM peak), in bfloat16 (of the bf16
# peak; decode batch 1 of its memory limit)
TARGETS_BY_DTYPE = {"float32": {"prefill": 0.70, "rank cold": 0.60, "retrieve": 0.50},
                    "bfloat16": {"prefill": 0.60, "rank cold": 0.50, "retrieve": 0.40, "decode batch 1": 0.80}}


def best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def cpu_has(*flags: str) -> bool:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        have = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
        return any(x in have for x in flags)
    return False


def machine_limits(repeats: int, cfg, dtype: torch.dtype) -> dict:
    out = {}
    n = 2048
    # (the loop's own name: the projection below is measured in the engine's dtype, not the last one here)
    for mm_dtype in [torch.float32] + ([torch.bfloat16] if cpu_has("avx512_bf16", "amx_bf16") else []):
        a, b = torch.randn(n, n).to(mm_dtype), torch.randn(n, n).to(mm_dtype)
        out[f"gemm_{str(mm_dtype)[6:]}"] = 2 * n ** 3 / best(lambda: torch.mm(a, b), max(repeats, 5)) / 1e9
    w = torch.nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False).to(dtype)
    from sgrec.model.cpu_linear import pack_linears

    holder = torch.nn.Sequential(w)
    pack_linears(holder)  # as the engine's projections (oneDNN-packed by default)
    w = holder[0]
    for rows in (16, 1024):
        x = torch.randn(rows, cfg.hidden_size).to(dtype)
        with torch.inference_mode():
            t = best(lambda: w(x), max(repeats, 5) * 4)
        out[f"proj_{rows}_rows"] = 2 * rows * cfg.hidden_size * 2 * cfg.intermediate_size / t / 1e9
    src = torch.empty(64 << 20)  # 256 MiB of float32
    dst = torch.empty_like(src)
    src.fill_(1.0)
    out["membw_gbs"] = 2 * src.numel() * 4 / best(lambda: dst.copy_(src), repeats) / 1e9
    return out


class Counter:
    """Counts what the model runs while active: projection tokens, attention pairs, logit cells."""

    def __init__(self):
        self.tokens = self.pairs = self.logits = self.kv_read = 0
        self.active = False

    @contextlib.contextmanager
    def counting(self):
        orig_fwd, orig_logits = CausalLM.forward, CausalLM.compute_logits
        orig_staged = StagedBeamBackend.prepare
        counter = self

        def forward(model, batch, backend, rows=None):  # the dense family runs every row through its layers
            counter.tokens += int(batch.input_ids.numel())
            if not isinstance(backend, StagedBeamBackend):  # beam steps: counted by staged() below
                for s in batch.seqs:
                    if s.mask is not None:
                        counter.pairs += int(s.mask.sum())
                    else:  # causal, the new tokens last
                        prefix = s.kv_len - s.q_len
                        counter.pairs += s.q_len * prefix + s.q_len * (s.q_len + 1) // 2
                        if batch.is_decode:
                            counter.kv_read += s.kv_len
            return orig_fwd(model, batch, backend, rows)

        def logits(model, hidden, columns=None):
            counter.logits += hidden.shape[0] * (model.cfg.vocab_size if columns is None else int(columns.numel()))
            return orig_logits(model, hidden, columns)

        def staged(backend, batch):
            meta = batch.attn_meta
            for g in (meta.groups if isinstance(meta, BeamBatchMeta) else [meta]) if isinstance(
                    meta, (BeamStepMeta, BeamBatchMeta)) else []:
                n = g.unshared_idx.shape[0]
                counter.pairs += n * (g.shared_idx.numel() + g.unshared_idx.shape[1])
                counter.kv_read += g.shared_idx.numel() + n * g.unshared_idx.shape[1]
            return orig_staged(backend, batch)

        CausalLM.forward, CausalLM.compute_logits = forward, logits
        StagedBeamBackend.prepare = staged
        orig_takes = FusedDecode.takes
        FusedDecode.takes = lambda *a: False  # counted on the layer-by-layer path: the same work, seen op by op
        try:
            yield self
        finally:
            CausalLM.forward, CausalLM.compute_logits = orig_fwd, orig_logits
            StagedBeamBackend.prepare = orig_staged
            FusedDecode.takes = orig_takes


def work(fn, cfg, nonembed: int, esize: int, forwards_fn=None) -> tuple[float, float]:
    """(GFLOP, GB) of one call of fn, counted."""
    c = Counter()
    with c.counting():
        fn()
    attn = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * c.pairs
    flops = 2 * nonembed * c.tokens + attn + 2 * cfg.hidden_size * c.logits
    kv = c.kv_read * 2 * cfg.num_kv_heads * cfg.head_dim * esize * cfg.num_layers
    forwards = forwards_fn() if forwards_fn else 1
    return flops / 1e9, (forwards * nonembed * esize + kv) / 1e9


def write_catalog(path: str, n: int, base: int, codes: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, base, (n, ITEM_TOKENS)).tolist()
    idt = rng.integers(3, base, n).tolist()
    sem = (base + np.arange(ND) * codes + rng.integers(0, codes, (n, ND))).tolist()
    with open(path, "wb") as f:
        f.write(b"".join(orjson.dumps({"id": f"i{k}", "token_ids": toks[k], "id_token": idt[k],
                                       "semantic_id": sem[k]}) + b"\n" for k in range(n)))


def record_rows(results: dict, args, model: str) -> list[dict]:
    """The result record's rows: the machine's limits as measured; each path's time beside the baseline
    backend's, with its efficiency against the roofline limit (None where the run beat the limit by more
    than check() takes: a tiny model's weights in cache are not bound by the memory bandwidth measured);
    decode's tok/s the same way."""
    params = {"model": model, "dtype": args.dtype, "attention_backend": args.attention_backend}
    limits = results["limits"]
    peak = max(limits[f"gemm_{args.dtype}"], limits["proj_1024_rows"])  # as main() takes it
    out = [row(f"{args.dtype} GEMM peak, measured", "GFLOP/s", peak, params={"dtype": args.dtype}),
           row("memory bandwidth, measured (256 MiB copy)", "GB/s", limits["membw_gbs"])]
    for name, p in results["paths"].items():
        eff = p["efficiency"] if 0 <= p["efficiency"] <= 1.5 else None
        base = p["baseline_s"]
        out.append(row(name, "ms", p["s"] * 1e3, None if base is None else base * 1e3, params=params, efficiency=eff,
                       higher_is_better=False))
        if "tok_s" in p:
            out.append(row(f"{name} throughput", "tok/s", p["tok_s"],
                           None if base is None else p["tok_s"] * p["s"] / base, params=params, efficiency=eff))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="~/.cache/sgrec/SmolLM2-135M-Instruct")
    ap.add_argument("--num-items", type=int, default=100_000)
    ap.add_argument("--codes", type=int, default=1024, help="semantic-ID codes per level (top of the vocabulary)")
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--decode-prompt", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--retrieve-prompt", type=int, default=1024)
    ap.add_argument("--beam-widths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--user-len", type=int, default=512)
    ap.add_argument("--candidates", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--baseline-backend", default="torch",
                    help="also time every path with this attention backend (same engine, backend swapped), "
                         "for the 'vs baseline' column; 'none' skips it")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the engine's dtype; the table's peak is this dtype's (bfloat16: where native)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_items, args.prefill_len, args.decode_prompt, args.decode_tokens = 2000, 128, 32, 8
        args.retrieve_prompt, args.beam_widths, args.user_len, args.candidates, args.repeats = 64, [16], 32, 10, 1
    torch.set_num_threads(args.threads)
    cmd = ("python benchmarks/bench_roofline.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))).strip()
    print(header(cmd, "bench_roofline"), flush=True)

    from sgrec import Engine
    from sgrec.model.config import ModelConfig

    model = os.path.expanduser(args.model_path)
    cfg = ModelConfig.from_dir(model)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    nonembed = cfg.num_layers * (cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size)
    dtype = getattr(torch, args.dtype)
    targets = TARGETS_BY_DTYPE[args.dtype]
    limits = machine_limits(args.repeats, cfg, dtype)
    if f"gemm_{args.dtype}" not in limits:
        sys.exit(f"--dtype {args.dtype}: this CPU reports no native bf16 matmul (avx512_bf16 / amx_bf16)")
    esize = torch.empty((), dtype=dtype).element_size()
    print("machine (before the paths): " + ", ".join(f"{k} {v:.1f}" for k, v in limits.items()), flush=True)

    tmp = tempfile.mkdtemp()
    base = cfg.vocab_size - ND * args.codes
    catalog = os.path.join(tmp, "items.jsonl")
    write_catalog(catalog, args.num_items, base, args.codes)
    eng = Engine(model, device="cpu", dtype=args.dtype, item_catalog=catalog, attention_backend=args.attention_backend,
                 max_beam_width=max(args.beam_widths), log_level="warning")
    main_backend = eng.runner.backend
    base_backend = None if args.baseline_backend == "none" else make_backend(args.baseline_backend, "cpu")
    print(f"engine: attention backend {type(main_backend).__name__}, weights "
          f"{'packed' if eng.runner.packed else 'plain'}; {args.num_items} items; baseline backend "
          f"{type(base_backend).__name__ if base_backend else 'none'}", flush=True)

    def timed(once, combine=lambda t: t[0]) -> tuple[float, float | None]:
        """once() -> seconds of one or more runs, as a tuple; each element's best over --repeats (after a
        warm-up) with the engine's backend and with the baseline's (None without one), the two taking
        turns within each repeat so that a VM's slow moments fall on both alike; combine(bests) -> s."""
        backends = [main_backend] + ([base_backend] if base_backend is not None else [])
        bests: list[list[float]] = [[], []]
        try:
            for r in range(args.repeats + 1):
                for i, backend in enumerate(backends):
                    eng.runner.backend = backend
                    t = once()
                    if r:
                        bests[i] = [min(a, b) for a, b in zip(bests[i], t)] if bests[i] else list(t)
        finally:
            eng.runner.backend = main_backend
        return combine(bests[0]), (combine(bests[1]) if base_backend is not None else None)

    def run_s(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    rng = np.random.default_rng(1)

    def ids(n):
        return rng.integers(3, base, n).tolist()

    measured = []  # (name, s, baseline s, GFLOP, GB, target, tok/s or None): efficiencies once the limits are final

    def record(name, fn, times, forwards=1, target=None):
        t, t_base = times
        gflop, gb = work(fn, cfg, nonembed, esize, lambda: forwards)
        measured.append((name, t, t_base, gflop, gb, target, None))
        print(f"  {name}: {t * 1e3:.1f} ms, {gflop / t:.1f} GFLOP/s", flush=True)

    # prefill
    prompt = ids(args.prefill_len)

    def prefill():
        eng.flush_cache()
        eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0})

    record(f"prefill {args.prefill_len}", prefill, timed(lambda: (run_s(prefill),)), target=targets["prefill"])

    # decode: K new tokens minus one, per batch size
    for b in (1, 16):
        prompts = [ids(args.decode_prompt) for _ in range(b)]

        def gen(k, prompts=prompts):
            eng.flush_cache()
            eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": k, "temperature": 0,
                                                             "ignore_eos": True})

        k = args.decode_tokens
        t, t_base = timed(lambda: (run_s(lambda: gen(k)), run_s(lambda: gen(1))), lambda t: t[0] - t[1])
        c = Counter()
        with c.counting():
            gen(k)
        full = (c.tokens, c.pairs, c.logits, c.kv_read)
        c1 = Counter()
        with c1.counting():
            gen(1)
        tokens, pairs, logit_cells, kv_read = (x - y for x, y in zip(full, (c1.tokens, c1.pairs, c1.logits, c1.kv_read)))
        gflop = (2 * nonembed * tokens + 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * pairs
                 + 2 * cfg.hidden_size * logit_cells) / 1e9
        gb = ((k - 1) * (nonembed + cfg.vocab_size * cfg.hidden_size) * esize
              + kv_read * 2 * cfg.num_kv_heads * cfg.head_dim * esize * cfg.num_layers) / 1e9
        name = f"decode batch {b}"
        measured.append((name, t, t_base, gflop, gb, targets.get(name), b * (k - 1) / t))
        print(f"  {name}: {b * (k - 1) / t:.1f} tok/s", flush=True)

    # rank, item-as-prefix, cold and warm
    cands = [f"i{k}" for k in rng.choice(args.num_items, args.candidates, replace=False).tolist()]

    def rank_cold():
        eng.flush_cache()
        return eng.rank({"token_ids": ids(args.user_len)}, cands, prefix="item", score_by="id_token")

    def rank_warm():
        return eng.rank({"token_ids": ids(args.user_len)}, cands, prefix="item", score_by="id_token")

    record(f"rank {args.candidates}x{ITEM_TOKENS}, item-prefix, cold", rank_cold, timed(lambda: (run_s(rank_cold),)),
           target=targets["rank cold"])
    rank_warm()
    record(f"rank {args.candidates}x{ITEM_TOKENS}, item-prefix, warm", rank_warm, timed(lambda: (run_s(rank_warm),)))

    # retrieve, prompt computed each time
    user = ids(args.retrieve_prompt)
    for bw_ in args.beam_widths:
        def retrieve(bw_=bw_):
            eng.flush_cache()
            return eng.retrieve({"token_ids": user}, beam_width=bw_, num_items=10)

        record(f"retrieve {args.retrieve_prompt} tok, BW {bw_}", retrieve, timed(lambda: (run_s(retrieve),)),
               forwards=1 + ND, target=targets["retrieve"])
    eng.shutdown()

    # the limits: the best of two measurements, before and after the paths (a VM's slow moment at one of
    # them would otherwise pass for the machine's limit and inflate every efficiency)
    after = machine_limits(args.repeats, cfg, dtype)
    print("machine (after the paths): " + ", ".join(f"{k} {v:.1f}" for k, v in after.items()), flush=True)
    limits = {k: max(v, after[k]) for k, v in limits.items()}
    # the peak: the best GEMM rate of the dtype seen (torch.mm or the packed projection at 1024 rows)
    peak, bw = max(limits[f"gemm_{args.dtype}"], limits["proj_1024_rows"]), limits["membw_gbs"]
    rows, results = [], {"limits": limits, "paths": {}}
    for name, t, t_base, gflop, gb, target, tok_s in measured:
        limit = min(peak, bw * gflop / gb)
        achieved = gflop / t
        eff = achieved / limit
        bound = "compute" if limit == peak else "memory"
        results["paths"][name] = {"s": t, "gflop": gflop, "gb": gb, "gflops": achieved, "limit": limit,
                                  "bound": bound, "efficiency": eff, "target": target, "baseline_s": t_base,
                                  **({"tok_s": tok_s} if tok_s is not None else {})}
        if tok_s is not None:  # decode: of its limit (memory)
            note = f"{tok_s:.1f} tok/s (HF ratio: bench_engine)" + ("" if target is None else (
                f"; >= {target:.0%} of its limit: " + ("met" if eff >= target else "MISSED")))
        else:
            note = "" if target is None else f">= {target:.0%} of peak: " + (
                "met" if achieved / peak >= target else f"MISSED ({achieved / peak:.0%} of peak)")
        rows.append([name, f"{t * 1e3:.1f}", "-" if t_base is None else f"{t_base * 1e3:.1f}",
                     "-" if t_base is None else f"{t_base / t:.2f}", f"{gflop:.2f}", f"{achieved:.1f}",
                     f"{limit:.1f} ({bound})", f"{eff:.0%}", note])

    print()
    print(md_table(["path", "time ms", f"{args.baseline_backend} ms", f"vs {args.baseline_backend}", "GFLOP", "GFLOP/s",
                    "limit GFLOP/s", "efficiency", "note / target"], rows))
    print(f"\n{args.dtype} GEMM peak {peak:.1f} GFLOP/s (the best of 2048^3 torch.mm and the packed projection at 1024 rows, "
          f"before and after the paths), memory {bw:.1f} GB/s (256 MiB copy); "
          f"model projections {limits['proj_16_rows']:.1f} GFLOP/s at 16 rows, {limits['proj_1024_rows']:.1f} at 1024"
          + "".join(f"; {k} {v:.1f} GFLOP/s" for k, v in limits.items() if k.startswith("gemm_")))
    print(f"rerun: {cmd}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if not args.no_record:
        path = write_record(benchmark="bench_roofline",
                            title="Roofline: each path's share of the machine's measured limits", command=cmd,
                            results=record_rows(results, args, os.path.basename(model.rstrip("/"))),
                            peer=None if base_backend is None else f"the {args.baseline_backend} attention backend")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
