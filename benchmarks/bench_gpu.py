"""GPU numbers that need no other engine: prefill MFU and retrieve latency on a model of a
real shape with random weights (`make_tiny_model --shape`), written to a JSON file.

    python benchmarks/bench_gpu.py --out results.json                   # on the GPU machine (scripts/gpu_suite.sh)
    python benchmarks/bench_gpu.py --device cpu --quick --out r.json    # the code path on CPU, tiny sizes

1. Prefill: one prompt of each length (1K and 8K tokens; --quick: 64, 128) through ModelRunner.forward
   (logits of the last row only), the median of --repeats after a warm-up; with the auto attention
   backend (triton on CUDA, with the fused glue; the profile of its longest prefill), and again with
   torch's. MFU = useful FLOPs /
   time / the device's peak: useful FLOPs = 2 x non-embedding parameters x tokens + the causal
   attention's 2 x 2 x layers x heads x head_dim x tokens^2 / 2. The peak is measured in the same run
   (a bf16 GEMM of 8192^3; --quick: 512^3), so MFU is against what this device reaches. Then
   --prefill-batch prompts of --context tokens in one forward (sid-gr's batch: 4 x 5000), the
   logits of each one's last row: its time and MFU.
2. Retrieve: the Engine on a catalog of --items random 3-token semantic IDs, a --context-token
   prompt, BW --beam-width, ND 3, one request at a time: median latency of --repeats (the prompt is
   new each time: no radix hit). Then --concurrency threads at once (the engine batches their
   rounds), each sending --repeats requests: median latency and requests per second (sid-gr's
   published point: context 5000, BW 256, concurrency 4; warm-up rounds until no new beam-step
   graph is captured). Each row carries where the time went (the requests' meta_info: the batch's
   prefill, its beam steps, the wait before it, and the batch sizes that formed); --retrieve-variant
   k=v,... runs this part again on an engine with other arguments. Then one request at each of
   --wide-beams (512, 1000): its latency, or the error (out of memory) it ended with.
3. Rank: a --rank-user-token user and --rank-candidates candidates of 16 tokens each (id-token
   scores), item-as-prefix and user-as-prefix, cold (cache flushed): median latency.
4. HF transformers on the same device, same weights and dtype (skipped where transformers does not
   import): prefill of each --lengths prompt (logits of the last row) and greedy generation of
   --gen-tokens tokens for batches of 1 and 16 prompts of --gen-prompt tokens, against sgrec's
   runner and Engine on the same work; rank against the naive way (every candidate its own prompt,
   user + item, in batches of 8). Ratios are HF time / sgrec time.
5. FP8 (`--quantization fp8`, on GPUs with FP8 tensor cores; --no-fp8 leaves it out): the FP8 GEMM
   peak (torch._scaled_mm of 8192^3), prefill at each length, next-token logprobs against bf16,
   retrieve's whole last beam against bf16's for the same prompts (at least 95% overlap),
   and retrieve latency and concurrency as in 2; then the same overlap on the packaged demo model,
   trained on MovieLens-100K (random weights' flat distributions reorder under any rounding), with
   FP8 weights, an FP8 KV pool, and both.
6. FlashRec's matrix (--no-flashrec leaves it out): a catalog of 4-level semantic IDs (ND 4),
   prompts of --flashrec-prompts tokens (300, 2500), beam widths --flashrec-beams (50, 128, 512,
   1000) and --flashrec-concurrency threads at once (1, 8, 16, 32), in bf16 and, on FP8 GPUs, with
   --quantization fp8; one engine per dtype with its default KV pool (--flashrec-pool: another),
   so a cell that does not fit at once waits for later rounds. Per cell: req/s, median and P99
   latency, failed requests, the share of returned items that are not the catalog's item on the
   returned semantic ID, and peak memory. FlashRec's published req/s (OneRec-1.7B, a Qwen3-1.7B
   shape, FP8, on an RTX 5090: another GPU) are the peers of the 300-token, 32-at-once cells.

7. The other model families (--parts families): retrieve as in 2 (one at a time and --concurrency
   at once, no wide beams) on each family's own shape with random weights: the hybrid linear
   attention family on Qwen3.5-0.8B's shape at --context tokens, the encoder-decoder family on
   TIGER's (4 + 4 layers, d_model 128) at --encdec-context tokens; a family whose run fails records
   its error and the others still run.

--parts picks parts (the bf16 GEMM peak always runs). Prefill rows carry the host's time of the call
(equal to its wall time when the forward is host-bound) and, for the shortest, a host profile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sgrec.model.attention import SeqLayout  # noqa: E402
from sgrec.runner import ModelRunner  # noqa: E402
from sgrec.server_args import ServerArgs  # noqa: E402
from sgrec.tools.make_tiny_model import make_tiny_model  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402


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


def prefill_runner(model_dir: str, a, dtype: str, backend: str = "auto", quantization: str | None = None):
    longest = max(a.lengths)
    return ModelRunner(ServerArgs.from_kwargs(model_path=model_dir, device=a.device, dtype=dtype,
                                              max_total_tokens=longest + 16, chunked_prefill_size=-1,
                                              context_length=longest + 16, attention_backend=backend,
                                              disable_cuda_graph=True, quantization=quantization))


def last_logprobs(runner, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    slots = torch.arange(1, n + 1, device=runner.device)
    batch = runner.make_batch(ids, list(range(n)), slots, [SeqLayout(0, n, slots)])
    return torch.log_softmax(runner.forward(batch, [n - 1])[0], -1)


def prefill_batch(runner, n: int):
    """One seeded random n-token prompt as a prefill batch on slots 1..n."""
    ids = np.random.default_rng(n).integers(0, runner.config.vocab_size, n).tolist()
    slots = torch.arange(1, n + 1, device=runner.device)
    return runner.make_batch(ids, list(range(n)), slots, [SeqLayout(0, n, slots)])


def bench_prefill(model_dir: str, a, dtype: str, backend: str = "auto", quantization: str | None = None) -> list[dict]:
    runner = prefill_runner(model_dir, a, dtype, backend, quantization)
    cfg = runner.config
    n_params = non_embedding_params(cfg)
    rows = []
    for n in a.lengths:
        batch = prefill_batch(runner, n)
        s = timed(lambda: runner.forward(batch, [n - 1]), a.device, a.repeats)
        sync(a.device)
        t = time.perf_counter()
        runner.forward(batch, [n - 1])  # the host's part: until the call returns, before the device is done
        host = time.perf_counter() - t
        rows.append({"tokens": n, "seconds": s, "host_s": host, "tflops": prefill_flops(cfg, n_params, n) / s / 1e12,
                     "backend": type(runner.backend).__name__})
    if backend == "auto":
        rows[-1]["profile"] = profile(lambda: runner.forward(batch, [n - 1]), a.device)
        n = a.lengths[0]
        batch = prefill_batch(runner, n)
        rows[0]["host_profile"] = host_profile(lambda: runner.forward(batch, [n - 1]), a.device)
    return rows


def bench_prefill_batch(model_dir: str, a, dtype: str) -> dict:
    """--prefill-batch new prompts of --context tokens in one forward (module doc, 1): what a batch of
    concurrent retrieve requests' prefill costs; MFU is filled in by the caller."""
    k, n = a.prefill_batch, a.context
    runner = ModelRunner(ServerArgs.from_kwargs(model_path=model_dir, device=a.device, dtype=dtype,
                                                max_total_tokens=k * n + 16, chunked_prefill_size=-1,
                                                context_length=n + 16, disable_cuda_graph=True))
    rng = np.random.default_rng(k * n)
    ids = rng.integers(0, runner.config.vocab_size, k * n).tolist()
    slots = torch.arange(1, k * n + 1, device=runner.device)
    seqs = [SeqLayout(i * n, n, slots[i * n:(i + 1) * n]) for i in range(k)]
    batch = runner.make_batch(ids, [p for _ in range(k) for p in range(n)], slots, seqs)
    last = [(i + 1) * n - 1 for i in range(k)]
    s = timed(lambda: runner.forward(batch, last), a.device, a.repeats)
    cfg = runner.config
    return {"prompts": k, "tokens": n, "seconds": s,
            "tflops": k * prefill_flops(cfg, non_embedding_params(cfg), n) / s / 1e12}


def host_profile(fn, device: str, top: int = 12) -> list[dict]:
    """The Python functions that took most host time (cProfile, own time) in one call of fn: where a
    host-bound forward's time goes."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    sync(device)
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # (cc, nc, tottime, cumtime, callers)
    return [{"func": f"{os.path.basename(f[0])}:{f[1]}({f[2]})", "calls": v[1], "own_ms": v[2] * 1e3,
             "cum_ms": v[3] * 1e3} for f, v in rows]


def profile(fn, device: str, top: int = 15) -> list[dict]:
    """The operators that took most device time (CPU time off CUDA) in one call of fn: where the
    longest prefill's time goes, for the next round of work on its MFU."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        fn()
        sync(device)
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:top]
    return [{"op": e.key, "ms": getattr(e, key, 0) / 1e3, "calls": e.count} for e in events]


ITEM_TOKENS = 16


def vocab_of(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["vocab_size"]


def write_catalog(model_dir: str, a, work: str, levels: int = 3) -> tuple[str, list[list[int]]]:
    """--items items: 16 random tokens, an id token and a random semantic ID of `levels` levels each.
    Returns the file and every item's tokens."""
    vocab = vocab_of(model_dir)
    codes = min(256, (vocab - 10) // levels)  # semantic-ID codes: a range of tokens per level from id 10 up
    rng = np.random.default_rng(0)
    cat, tokens = os.path.join(work, f"catalog{levels}.jsonl"), []
    with open(cat, "w") as f:
        for k in range(a.items):
            sem = (np.arange(levels) * codes + rng.integers(0, codes, levels) + 10).tolist()
            tokens.append(rng.integers(10, vocab, ITEM_TOKENS).tolist())
            f.write(json.dumps({"id": f"i{k}", "token_ids": tokens[-1], "id_token": int(rng.integers(10, vocab)),
                                "semantic_id": sem}) + "\n")
    return cat, tokens


def engine(model_dir: str, a, dtype: str, cat: str, quantization: str | None = None, **extra):
    from sgrec import Engine

    widest = max([a.beam_width, *a.wide_beams])
    rank_len = a.rank_user + max(a.rank_candidates) * ITEM_TOKENS + 64
    pool = max(a.concurrency * (a.context + a.beam_width * 4), a.context + widest * 4, rank_len) + 64
    return Engine(model_dir, device=a.device, dtype=dtype, item_catalog=cat, max_beam_width=widest,
                  max_total_tokens=pool, context_length=max(a.context, rank_len) + 16, item_cache_tokens=0,
                  max_rank_candidates=max(a.rank_candidates), quantization=quantization, **extra)


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab, n).tolist()


def breakdown(runs: list[tuple[float, dict]]) -> dict:
    """Where retrieve requests' time went, from their meta_info: the median of the batch's prefill
    (prompts of every request in it), its beam search, and the wait before the batch started
    (latency - both); how many requests ran in each one's batch."""
    sizes: dict[int, int] = {}
    for _, m in runs:
        sizes[m.get("batch_size", 1)] = sizes.get(m.get("batch_size", 1), 0) + 1
    return {"prefill_s": statistics.median(m["prefill_s"] for _, m in runs),
            "beam_search_s": statistics.median(m["beam_search_s"] for _, m in runs),
            "wait_s": statistics.median(t - m["prefill_s"] - m["beam_search_s"] for t, m in runs),
            "batch_sizes": {str(k): v for k, v in sorted(sizes.items())}}


def captured(e) -> int:
    """Beam-step CUDA graphs the engine has captured so far (0 without graphs)."""
    graphs = getattr(e.scheduler.retriever, "graphs", None)
    return 0 if graphs is None else len(graphs.graphs)


def warm_concurrent(e, pool, send, concurrency: int, seed0: int, max_rounds: int = 6) -> int:
    """Rounds of `concurrency` requests at once (send(seed)) until one captures no new beam-step graph:
    which batch sizes form (so which graph buckets a timed run needs) depends on arrival timing, and a
    capture inside the timed part would be counted as serving time. Returns the rounds run."""
    for r in range(max_rounds):
        before = captured(e)
        list(pool.map(send, range(seed0 + r * concurrency, seed0 + (r + 1) * concurrency)))
        if r and captured(e) == before:
            return r + 1
    return max_rounds


def bench_retrieve(e, a) -> dict:
    vocab = e.vocab_size

    def run(seed: int, bw: int) -> tuple[float, dict]:
        t = time.perf_counter()
        out = e.retrieve({"token_ids": prompt(vocab, a.context, seed)}, beam_width=bw, num_items=min(10, bw))
        sync(a.device)
        assert out["items"], out
        return time.perf_counter() - t, out["meta_info"]

    def one(seed: int, bw: int) -> float:
        return run(seed, bw)[0]

    one(99, a.beam_width)  # warm-up
    alone = [run(100 + r, a.beam_width) for r in range(a.repeats)]
    res = {"context": a.context, "beam_width": a.beam_width, "items": a.items,
           "median_s": statistics.median(t for t, _ in alone), "requests": len(alone), "breakdown": breakdown(alone)}
    # concurrency: threads sending at once (the scheduler batches their rounds)
    with ThreadPoolExecutor(a.concurrency) as pool:  # warm-up: the batched rounds' beam-step graphs are captured
        warm = warm_concurrent(e, pool, lambda i: one(i, a.beam_width), a.concurrency, 900)
        t0 = time.perf_counter()
        conc = list(pool.map(lambda i: run(1000 + i, a.beam_width), range(a.concurrency * a.repeats)))
        wall = time.perf_counter() - t0
    res["concurrent"] = {"concurrency": a.concurrency, "requests": len(conc), "warmup_rounds": warm,
                         "median_s": statistics.median(t for t, _ in conc), "req_per_s": len(conc) / wall,
                         "breakdown": breakdown(conc)}
    wide = []
    for bw in a.wide_beams:
        try:
            first = one(2000 + bw, bw)  # with the first use's graph captures
            wide.append({"beam_width": bw, "first_s": first, "seconds": one(3000 + bw, bw)})
        except (RuntimeError, ValueError) as err:  # out of memory (torch), or the engine's 4xx / 5xx
            wide.append({"beam_width": bw, "error": str(err)[:300]})
    res["wide_beams"] = wide
    return res


def fp8_gemm_peak(device: str, n: int, repeats: int) -> float:
    """torch._scaled_mm (cuBLASLt FP8, row-wise scales, bf16 out) of n^3 on random data: FLOP/s."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(n, 1, device=device) + 0.5, torch.rand(1, n, device=device) + 0.5
    return 2 * n**3 / timed(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
                            device, repeats)


def bench_fp8(model_dir: str, a, dtype: str, cat: str, e, peak: float) -> dict:
    """--quantization fp8 against the bf16 path (module doc, 5): prefill; next-token logprobs of
    --fp8-prompts 1K prompts (top-1 agreement, mean and max |difference| over bf16's 20 likeliest
    tokens); retrieve's items (num_items = beam width: the whole last beam) overlapping bf16's for the
    same prompts; retrieve latency and concurrency as in part 2."""
    res: dict = {"gemm_peak_tflops": fp8_gemm_peak(a.device, 512 if a.quick else 8192, a.repeats) / 1e12}
    res["prefill"] = bench_prefill(model_dir, a, dtype, quantization="fp8")
    for r in res["prefill"]:
        r["mfu_bf16_peak"] = r["tflops"] * 1e12 / peak
    ref_runner, fp8_runner = prefill_runner(model_dir, a, dtype), prefill_runner(model_dir, a, dtype, quantization="fp8")
    top1, mean_d, max_d = [], [], []
    for seed in range(a.fp8_prompts):
        ids = prompt(ref_runner.config.vocab_size, min(1024, max(a.lengths)), 7700 + seed)
        want, got = last_logprobs(ref_runner, ids), last_logprobs(fp8_runner, ids)
        top = torch.topk(want, 20).indices
        d = (got[top] - want[top]).abs()
        top1.append(bool(got.argmax() == want.argmax()))
        mean_d.append(d.mean().item())
        max_d.append(d.max().item())
    res["logprobs"] = {"prompts": a.fp8_prompts, "top1_agree": sum(top1) / len(top1),
                       "mean_abs_diff_top20": statistics.mean(mean_d), "max_abs_diff_top20": max(max_d)}
    del ref_runner, fp8_runner
    e8 = engine(model_dir, a, dtype, cat, quantization="fp8")
    overlaps = []
    for seed in range(a.fp8_prompts):
        user = {"token_ids": prompt(e.vocab_size, a.context, 8800 + seed)}
        want = {it["item"] for it in e.retrieve(user, beam_width=a.beam_width, num_items=a.beam_width)["items"]}
        got = {it["item"] for it in e8.retrieve(user, beam_width=a.beam_width, num_items=a.beam_width)["items"]}
        overlaps.append(len(want & got) / max(1, len(want)))
    res["retrieve_overlap"] = {"beam_width": a.beam_width, "prompts": a.fp8_prompts,
                               "mean": statistics.mean(overlaps), "min": min(overlaps)}
    wide, a.wide_beams = a.wide_beams, []
    res["retrieve"] = bench_retrieve(e8, a)
    a.wide_beams = wide
    return res


def demo_overlap(a, dtype: str, variants: dict[str, dict], users: int = 32, beam_width: int = 256) -> dict:
    """Retrieve on the packaged demo model (trained on MovieLens-100K: Llama, 2 layers, hidden 128;
    its catalog of 1,682 movies with 4-level semantic IDs) for `users` synthetic users (30 movies
    each, drawn by popularity), the whole last beam (num_items = beam width) and the top 10, on an
    engine per variant (Engine arguments) against the plain `dtype` one: mean and min overlap.
    Random weights give near-flat next-token distributions that any rounding reorders; a trained
    model's are what FP8 serving meets."""
    from sgrec import Engine
    from sgrec.demo import HISTORY_LEN, catalog_path, model_path
    from sgrec.demo.data import Vocab

    def make(**kw):
        return Engine(model_path(), device=a.device, dtype=dtype, item_catalog=catalog_path(),
                      max_beam_width=beam_width, item_cache_tokens=0, **kw)

    base = make()
    vocab = Vocab.from_tokenizer(base.tokenizer.hf, base.scheduler.catalog)
    movies = sorted(vocab.item)
    pop = np.array([float(base.scheduler.catalog.get(f"m{m}").meta.get("popularity", 1)) for m in movies])
    rng = np.random.default_rng(41)
    prompts = [vocab.retrieve_ids(rng.choice(movies, HISTORY_LEN, replace=False, p=pop / pop.sum()).tolist())
               for _ in range(users)]

    def items(e, ids) -> list[str]:
        out = e.retrieve({"token_ids": ids}, beam_width=beam_width, top_k=beam_width, num_items=beam_width)
        return [it["item"] for it in out["items"]]

    want = [items(base, p) for p in prompts]
    res: dict = {"model": "sgrec demo (MovieLens-100K)", "users": users, "beam_width": beam_width}
    for name, kw in variants.items():
        e = make(**kw)
        got = [items(e, p) for p in prompts]
        whole = [len(set(w) & set(g)) / max(1, len(w)) for w, g in zip(want, got)]
        top10 = [len(set(w[:10]) & set(g[:10])) / max(1, len(w[:10])) for w, g in zip(want, got)]
        res[name] = {"engine_args": kw, "overlap_mean": statistics.mean(whole), "overlap_min": min(whole),
                     "top10_overlap_mean": statistics.mean(top10), "top10_overlap_min": min(top10)}
        del e
    return res


def matrix_cell(e, a, plen: int, bw: int, conc: int, seeds) -> dict:
    """One cell of FlashRec's matrix: `conc` threads at once, each sending --flashrec-requests retrieve
    requests of a new `plen`-token prompt at beam width `bw`, after warm-up rounds: req/s, median and
    P99 latency, failed requests (none expected: what does not fit waits for a later round), the
    share of returned items that are not the catalog's item on the returned semantic ID, and peak
    memory (CUDA: the allocator's peak in this cell; CPU: the process's peak RSS so far)."""
    catalog = e.scheduler.catalog

    def one(seed: int) -> tuple[float, dict | None, str | None]:
        t = time.perf_counter()
        try:
            out = e.retrieve({"token_ids": prompt(e.vocab_size, plen, seed)}, beam_width=bw, num_items=min(10, bw))
            sync(a.device)
        except Exception as err:  # noqa: BLE001 - counted: a cell's failures are what it measures
            return time.perf_counter() - t, None, repr(err)[:300]
        return time.perf_counter() - t, out, None

    def invalid(it: dict) -> bool:
        item = catalog.get(it["item"])
        return item is None or list(item.semantic_id) != list(it["semantic_id"])

    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with ThreadPoolExecutor(conc) as pool:
        warm = warm_concurrent(e, pool, lambda s: one(s)[0], conc, next(seeds) * 1000)
        todo = [next(seeds) for _ in range(conc * a.flashrec_requests)]
        t0 = time.perf_counter()
        runs = list(pool.map(one, todo))
        wall = time.perf_counter() - t0
    ok = [(t, out) for t, out, err in runs if err is None]
    items = [it for _, out in ok for it in out["items"]]
    lat = [t for t, _ in ok]
    if a.device == "cuda":
        memory = torch.cuda.max_memory_allocated() / 2**30
    else:
        import resource

        memory = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return {"prompt_tokens": plen, "beam_width": bw, "concurrency": conc, "requests": len(runs),
            "failed": len(runs) - len(ok), "errors": [err for _, _, err in runs if err][:3], "warmup_rounds": warm,
            "req_per_s": len(ok) / wall, "median_s": statistics.median(lat) if lat else None,
            "p99_s": float(np.percentile(lat, 99)) if lat else None, "items_returned": len(items),
            "invalid_share": sum(map(invalid, items)) / max(1, len(items)), "memory_gib": memory}


def bench_flashrec(model_dir: str, a, dtype: str, work: str, res: dict, save, quantization: str | None = None) -> None:
    """FlashRec's matrix (module doc, 6) on one engine, into `res`: every (--flashrec-prompts,
    --flashrec-beams, --flashrec-concurrency) cell over a catalog of 4-level semantic IDs (ND 4);
    save() after each cell."""
    from sgrec import Engine

    cat, _ = write_catalog(model_dir, a, work, levels=4)
    kw = {"max_total_tokens": a.flashrec_pool} if a.flashrec_pool else {}
    e = Engine(model_dir, device=a.device, dtype=dtype, item_catalog=cat, max_beam_width=max(a.flashrec_beams),
               item_cache_tokens=0, context_length=max(a.flashrec_prompts) + 16, quantization=quantization, **kw)
    res.update({"levels": 4, "items": a.items, "quantization": quantization, "requests_per_thread": a.flashrec_requests,
                "pool_tokens": e.scheduler.runner.kv_pool.size, "cells": []})
    seeds = itertools.count(10)
    for plen, bw, conc in itertools.product(a.flashrec_prompts, a.flashrec_beams, a.flashrec_concurrency):
        res["cells"].append(matrix_cell(e, a, plen, bw, conc, seeds))
        save(f"flashrec {quantization or dtype} {plen}/{bw}/{conc}")
    del e


FAMILIES = {"hybrid linear attention": ("qwen3_5", "qwen3.5-0.8b"), "encoder-decoder": ("t5", "tiger")}


def bench_families(a, dtype: str, work: str) -> list[dict]:
    """Part 7 (module doc): per family, bench_retrieve on an engine over its own shape's model."""
    from sgrec import Engine

    out = []
    saved = a.context, a.wide_beams
    for name, (arch, shape) in FAMILIES.items():
        a.context, a.wide_beams = (a.encdec_context if arch == "t5" else saved[0]), []
        res = {"family": name, "shape": shape if not a.quick else f"make_tiny_model's {arch} default"}
        try:
            model = make_tiny_model(os.path.join(work, f"family-{arch}"), arch=arch, shape=None if a.quick else shape,
                                    dtype=dtype if not a.quick else "float32",
                                    **({} if arch == "t5" else {"max_position_embeddings": a.context + 128}))
            cat, _ = write_catalog(model, a, work)
            e = Engine(model, device=a.device, dtype=dtype, item_catalog=cat, max_beam_width=a.beam_width,
                       item_cache_tokens=0, context_length=a.context + 16,
                       max_total_tokens=a.concurrency * (a.context + a.beam_width * 4) + 64)
            res.update(bench_retrieve(e, a))
            del e
        except Exception as err:  # noqa: BLE001 - recorded: the other families still run
            res["error"] = repr(err)[:500]
        out.append(res)
    a.context, a.wide_beams = saved
    return out


def bench_rank(e, a) -> list[dict]:
    vocab, rows = e.vocab_size, []
    for n in a.rank_candidates:
        cands = [f"i{k}" for k in np.random.default_rng(n).choice(a.items, n, replace=False).tolist()]
        for prefix in ("item", "user"):
            seeds = itertools.count(5000)

            def go(prefix=prefix, cands=cands, seeds=seeds):  # a new user each call, nothing cached
                e.flush_cache()
                e.rank({"token_ids": prompt(vocab, a.rank_user, next(seeds))}, cands, prefix=prefix,
                       score_by="id_token")
            rows.append({"user_tokens": a.rank_user, "candidates": n, "prefix": prefix,
                         "median_s": timed(go, a.device, a.repeats)})
    return rows


def bench_hf(model_dir: str, a, dtype: str, e, prefill: list[dict], items: list[list[int]]) -> dict | None:
    """HF transformers against sgrec on the same work (module doc, 4); None without transformers.
    sgrec's prefill times are bench_prefill's (the same forward: logits of the last row)."""
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    tdtype = getattr(torch, dtype)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": tdtype}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", **kw).to(a.device).eval()
    vocab, res = e.vocab_size, {"transformers": transformers.__version__, "prefill": [], "generate": [], "rank": []}
    with torch.inference_mode():
        for row in prefill:
            n = row["tokens"]
            ids = torch.tensor([prompt(vocab, n, n)], device=a.device)
            hf_s = timed(lambda: hf(ids, logits_to_keep=1), a.device, a.repeats)
            sg_s = row["seconds"]
            res["prefill"].append({"tokens": n, "hf_s": hf_s, "sgrec_s": sg_s, "ratio": hf_s / sg_s})
        k = a.gen_tokens
        for b in (1, 16):
            prompts = [prompt(vocab, a.gen_prompt, 300 + i) for i in range(b)]
            ids = torch.tensor(prompts, device=a.device)
            hf_s = timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k,
                                             min_new_tokens=k, do_sample=False), a.device, max(1, a.repeats // 2))

            def sg(prompts=prompts):
                e.flush_cache()
                e.generate(input_ids=prompts, sampling_params={"max_new_tokens": k, "temperature": 0,
                                                               "ignore_eos": True})

            sg_s = timed(sg, a.device, max(1, a.repeats // 2))
            res["generate"].append({"batch": b, "prompt_tokens": a.gen_prompt, "new_tokens": k, "hf_s": hf_s,
                                    "sgrec_s": sg_s, "ratio": hf_s / sg_s, "sgrec_tok_s": b * k / sg_s})
        # rank the naive way: every candidate its own prompt (user + item), the logits after it
        n = min(a.rank_candidates)
        picks = np.random.default_rng(n).choice(a.items, n, replace=False).tolist()
        user = prompt(vocab, a.rank_user, 7000)

        def naive():
            for i in range(0, n, 8):
                hf(torch.tensor([user + items[k] for k in picks[i:i + 8]], device=a.device), logits_to_keep=1)

        def ours():
            e.flush_cache()
            e.rank({"token_ids": user}, [f"i{k}" for k in picks], prefix="item", score_by="id_token")

        hf_s, sg_s = timed(naive, a.device, 1), timed(ours, a.device, 1)
        res["rank"].append({"user_tokens": a.rank_user, "candidates": n, "hf_s": hf_s, "sgrec_s": sg_s,
                            "ratio": hf_s / sg_s})
    return res


PARTS = ("prefill", "retrieve", "rank", "hf", "fp8", "flashrec", "families")


def variant_args(spec: str) -> dict:
    """'k=v,k=v' -> Engine keyword arguments (true / false, ints, floats, else strings)."""
    out = {}
    for kv in spec.split(","):
        k, v = kv.split("=", 1)
        if v.lower() in ("true", "false"):
            out[k] = v.lower() == "true"
            continue
        for cast in (int, float):
            try:
                out[k] = cast(v)
                break
            except ValueError:
                continue
        else:
            out[k] = v
    return out


# FlashRec's published req/s by beam width: OneRec-1.7B, 300-token prompts, 32 at once, FP8, an RTX 5090
FLASHREC_REQ_S = {50: 28.08, 128: 19.91, 512: 8.18, 1000: 4.62}


def flashrec_peer(matrix: dict, cell: dict) -> float | None:
    """FlashRec's published req/s where a cell of part 6 ran at its shape, else None."""
    return FLASHREC_REQ_S.get(cell["beam_width"]) if (matrix["levels"], cell["prompt_tokens"],
                                                      cell["concurrency"]) == (4, 300, 32) else None


def record_peer(res: dict) -> str | None:
    """What the record's rows were run beside."""
    parts = [f"HF transformers {res['hf']['transformers']}"] if res.get("hf") else []
    parts += ["sgrec in bf16 (the FP8 rows)"] if "prefill" in (res.get("fp8") or {}) else []
    if any(flashrec_peer(m, c) for m in res.get("flashrec") or [] for c in m.get("cells", [])):
        parts.append("FlashRec's published req/s (OneRec-1.7B, FP8, on an RTX 5090)")
    return "; ".join(parts) or None


def record_rows(res: dict) -> list[dict]:
    """The result record's rows, from the results file's dict: the GEMM peak measured; prefill (MFU against
    it) beside HF's; retrieve, rank; generation and the naive rank beside HF's; FP8 beside bf16 (MFU
    against the FP8 GEMM peak); FlashRec's shape beside its published number."""
    def share(x):  # of a limit: outside 0..1.5 the limit did not bound the run (check() refuses it)
        return x if 0 <= x <= 1.5 else None

    def retrieve_rows(ret: dict, extra: dict, peer: dict | None = None) -> list[dict]:
        p = {**base, **extra, "context": ret["context"], "beam_width": ret["beam_width"], "items": ret["items"]}
        c, pc = ret["concurrent"], (peer or {}).get("concurrent", {})
        cp = {**p, "concurrency": c["concurrency"]}
        rows = [row("retrieve latency, one request at a time (median)", "s", ret["median_s"],
                    (peer or {}).get("median_s"), params=p, higher_is_better=False),
                row("retrieve latency, concurrent requests (median)", "s", c["median_s"], pc.get("median_s"),
                    params=cp, higher_is_better=False),
                row("retrieve throughput, concurrent requests", "req/s", c["req_per_s"], pc.get("req_per_s"),
                    params=cp)]
        rows += [row("retrieve latency, wide beam", "s", w["seconds"], params={**p, "beam_width": w["beam_width"]},
                     higher_is_better=False) for w in ret.get("wide_beams", []) if "seconds" in w]
        return rows

    base = {"shape": res["shape"] or "make_tiny_model's default (--quick)", "dtype": res["dtype"]}
    hf = res.get("hf") or {}
    hf_prefill = {x["tokens"]: x["hf_s"] for x in hf.get("prefill", [])}
    out = [row(f"{res['dtype']} GEMM peak, measured (the MFU's limit)", "TFLOP/s", res["gemm_peak_tflops"],
               params={"dtype": res["dtype"]})]
    for key, backend in (("prefill", "auto"), ("prefill_torch_backend", "torch")):
        out += [row(f"prefill time ({backend} attention backend)", "s", r["seconds"], hf_prefill.get(r["tokens"]),
                    params={**base, "tokens": r["tokens"]}, efficiency=share(r["mfu"]), higher_is_better=False)
                for r in res[key]]
    pb = res.get("prefill_batch")
    if pb:
        out.append(row("prefill time, several prompts in one forward", "s", pb["seconds"], higher_is_better=False,
                       params={**base, "prompts": pb["prompts"], "tokens": pb["tokens"]}, efficiency=share(pb["mfu"])))
    if res.get("retrieve"):
        out += retrieve_rows(res["retrieve"], {})
    for v in res.get("retrieve_variants", []):
        out += retrieve_rows(v, {"engine_args": v["engine_args"]})
    for f in res.get("families") or []:
        if "error" not in f:
            out += retrieve_rows(f, {"family": f["family"], "shape": f["shape"]})
    out += [row(f"rank latency, {r['prefix']} as prefix (median)", "s", r["median_s"], higher_is_better=False,
                params={**base, "user_tokens": r["user_tokens"], "candidates": r["candidates"]})
            for r in res.get("rank") or []]
    out += [row("greedy generation time", "s", r["sgrec_s"], r["hf_s"], higher_is_better=False,
                params={**base, "batch": r["batch"], "prompt_tokens": r["prompt_tokens"],
                        "new_tokens": r["new_tokens"]}) for r in hf.get("generate", [])]
    out += [row("rank, item as prefix, against HF one prompt per candidate", "s", r["sgrec_s"], r["hf_s"],
                params={**base, "user_tokens": r["user_tokens"], "candidates": r["candidates"]}, higher_is_better=False)
            for r in hf.get("rank", [])]
    fp8 = res.get("fp8") or {}
    if "prefill" in fp8:
        bf16 = {r["tokens"]: r["seconds"] for r in res["prefill"]}
        out.append(row("FP8 GEMM peak, measured (_scaled_mm)", "TFLOP/s", fp8["gemm_peak_tflops"],
                       params={"dtype": "float8_e4m3fn"}))
        out += [row("prefill time, FP8 weights", "s", r["seconds"], bf16.get(r["tokens"]), higher_is_better=False,
                    params={**base, "tokens": r["tokens"]}, efficiency=share(r["tflops"] / fp8["gemm_peak_tflops"]))
                for r in fp8["prefill"]]
        out.append(row("FP8 next-token top-1 agreement with bf16", "share", fp8["logprobs"]["top1_agree"],
                       params={**base, "prompts": fp8["logprobs"]["prompts"]}))
        ov = fp8["retrieve_overlap"]
        out.append(row("FP8 retrieve overlap with bf16 (mean)", "share", ov["mean"],
                       params={**base, "beam_width": ov["beam_width"], "prompts": ov["prompts"]}))
        out += retrieve_rows(fp8["retrieve"], {"quantization": "fp8"}, res.get("retrieve"))
        demo = fp8.get("demo_overlap") or {}
        out += [row("retrieve overlap with bf16 on the demo model (mean)", "share", v["overlap_mean"],
                    params={"model": demo["model"], "variant": name, "beam_width": demo["beam_width"]})
                for name, v in demo.items() if isinstance(v, dict) and "overlap_mean" in v]
    for m in res.get("flashrec") or []:
        for c in m.get("cells", []):
            p = {**base, "quantization": m["quantization"] or "none", "levels": m["levels"],
                 **{k: c[k] for k in ("prompt_tokens", "beam_width", "concurrency", "failed", "invalid_share",
                                      "memory_gib")}}
            out.append(row("FlashRec's matrix: retrieve throughput", "req/s", c["req_per_s"], flashrec_peer(m, c),
                           params=p))
            out += [row(f"FlashRec's matrix: retrieve latency ({name})", "s", c[key], params=p,
                        higher_is_better=False) for name, key in (("median", "median_s"), ("P99", "p99_s"))
                    if c[key] is not None]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="qwen3-1.7b", help="make_tiny_model --shape (random weights of that size)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--context", type=int, default=5000)
    ap.add_argument("--encdec-context", type=int, default=256, help="part 7: the encoder-decoder family's input tokens")
    ap.add_argument("--prefill-batch", type=int, default=4, help="part 1: prompts of --context tokens in one forward")
    ap.add_argument("--beam-width", type=int, default=256)
    ap.add_argument("--items", type=int, default=100000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--wide-beams", type=int, nargs="*", default=[512, 1000])
    ap.add_argument("--rank-user", type=int, default=8192)
    ap.add_argument("--rank-candidates", type=int, nargs="+", default=[100, 200])
    ap.add_argument("--gen-prompt", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--no-hf", action="store_true", help="leave out the HF transformers comparison")
    ap.add_argument("--no-fp8", action="store_true", help="leave out --quantization fp8 (part 5)")
    ap.add_argument("--no-flashrec", action="store_true", help="leave out FlashRec's matrix (part 6)")
    ap.add_argument("--flashrec-prompts", type=int, nargs="+", default=[300, 2500], help="part 6's prompt lengths")
    ap.add_argument("--flashrec-beams", type=int, nargs="+", default=[50, 128, 512, 1000], help="part 6's beam widths")
    ap.add_argument("--flashrec-concurrency", type=int, nargs="+", default=[1, 8, 16, 32],
                    help="part 6's requests at once")
    ap.add_argument("--flashrec-requests", type=int, default=2, help="part 6: requests each thread sends per cell")
    ap.add_argument("--flashrec-pool", type=int, default=0,
                    help="part 6's KV pool in tokens (0: the engine's default, from --mem-fraction-static)")
    ap.add_argument("--fp8-prompts", type=int, default=4, help="prompts of part 5's logprob and overlap checks")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated parts to run, of {','.join(PARTS)} (the bf16 GEMM peak always runs)")
    ap.add_argument("--retrieve-variant", action="append", default=[], metavar="K=V[,K=V]",
                    help="part 2 again (no wide beams) on an engine with these extra Engine arguments, e.g. "
                         "batch_wait_ms=20; repeatable")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: the code path, not a measurement")
    ap.add_argument("--out", required=True, help="JSON file of the results")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="sgrec-gpu-")
    if a.quick:
        a.shape, a.lengths, a.context, a.beam_width, a.items, a.repeats = None, [64, 128], 64, 8, 500, 2
        a.concurrency, a.wide_beams, a.rank_user, a.rank_candidates = 2, [16], 64, [4, 8]
        a.gen_prompt, a.gen_tokens, a.encdec_context = 16, 4, 32
        # a pool for two requests of the largest cell at once: its others wait for later rounds
        a.flashrec_prompts, a.flashrec_beams, a.flashrec_concurrency, a.flashrec_pool = [24, 48], [4, 8], [1, 4], 200
    dtype = a.dtype if a.device == "cuda" else "float32"
    tdtype = getattr(torch, dtype)
    longest = max(max(a.lengths), a.context, a.rank_user + max(a.rank_candidates) * ITEM_TOKENS)
    model = make_tiny_model(os.path.join(work, "model"), shape=a.shape, dtype=dtype if a.shape else "float32",
                            max_position_embeddings=longest + 128)
    parts = set(a.parts.split(","))
    if parts - set(PARTS):
        ap.error(f"--parts: unknown {sorted(parts - set(PARTS))}; known: {','.join(PARTS)}")
    peak = gemm_peak(a.device, tdtype, 512 if a.quick else 8192, a.repeats)
    res = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "shape": a.shape, "dtype": dtype,
           "gemm_peak_tflops": peak / 1e12, "prefill": [], "prefill_torch_backend": []}

    def save(part: str) -> None:  # after each part: a run cut short by its time limit keeps what it measured
        res["done"] = part
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"bench_gpu: {part} done", flush=True)

    if "prefill" in parts or "hf" in parts:  # HF's prefill ratios need sgrec's
        res["prefill"] = bench_prefill(model, a, dtype)
    if "prefill" in parts:
        # the same with torch's attention and ops (no fused glue): what the auto backend's kernels add
        res["prefill_torch_backend"] = bench_prefill(model, a, dtype, "torch")
        res["prefill_batch"] = bench_prefill_batch(model, a, dtype)
    for r in res["prefill"] + res["prefill_torch_backend"] + ([res["prefill_batch"]] if "prefill_batch" in res else []):
        r["mfu"] = r["tflops"] * 1e12 / peak
    save("prefill")
    cat, items = write_catalog(model, a, work)
    e = engine(model, a, dtype, cat)
    res["retrieve"] = bench_retrieve(e, a) if "retrieve" in parts else None
    save("retrieve")
    if "retrieve" in parts and a.retrieve_variant:
        wide, a.wide_beams = a.wide_beams, []
        res["retrieve_variants"] = []
        for spec in a.retrieve_variant:
            ev = engine(model, a, dtype, cat, **variant_args(spec))
            res["retrieve_variants"].append({"engine_args": spec, **bench_retrieve(ev, a)})
            del ev
            save(f"retrieve {spec}")
        a.wide_beams = wide
    res["rank"] = bench_rank(e, a) if "rank" in parts else None
    save("rank")
    res["hf"] = None if a.no_hf or "hf" not in parts else bench_hf(model, a, dtype, e, res["prefill"], items)
    save("hf")
    from sgrec.model.fp8 import fp8_unsupported

    why = "--no-fp8" if a.no_fp8 else ("--parts" if "fp8" not in parts else fp8_unsupported(torch.device(a.device)))
    res["fp8"] = {"skipped": why} if why else bench_fp8(model, a, dtype, cat, e, peak)
    save("fp8")
    if not why:
        try:
            res["fp8"]["demo_overlap"] = demo_overlap(a, dtype, {
                "fp8": {"quantization": "fp8"}, "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"},
                "fp8_and_fp8_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}})
        except Exception as err:  # noqa: BLE001 - recorded: the other parts still run
            res["fp8"]["demo_overlap"] = {"error": repr(err)[:500]}
        save("fp8 demo")
    del e
    res["flashrec"] = []
    if not a.no_flashrec and "flashrec" in parts:
        for quantization in [None] + ([] if why else ["fp8"]):
            res["flashrec"].append({})
            bench_flashrec(model, a, dtype, os.path.dirname(cat), res["flashrec"][-1], save, quantization)
    save("flashrec")
    res["families"] = bench_families(a, dtype, work) if "families" in parts else None
    save("families")
    print(json.dumps(res, indent=1))
    rows = [] if a.no_record else record_rows(res)
    if rows:  # (--parts may leave nothing to record)
        cmd = ("python benchmarks/bench_gpu.py " + shlex.join(sys.argv[1:] if argv is None else argv)).strip()
        path = write_record(benchmark="bench_gpu", title="GPU prefill MFU and retrieve latency",
                            command=cmd, results=rows, peer=record_peer(res))
        print(f"result record: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
