"""The hybrid family (Qwen3.5: Gated DeltaNet and gated attention) against transformers on the same
checkpoint: prefill of one prompt and decode steps of a batch, side by side in one run.

    python benchmarks/bench_hybrid.py                              # Qwen3.5-0.8B's shape, random weights, bf16
    python benchmarks/bench_hybrid.py --model-path DIR --dtype float32
    python benchmarks/bench_hybrid.py --prompt-len 128 --batch 2 --steps 2 --repeats 1   # a smoke run

Without --model-path, random weights of Qwen3.5-0.8B's exact shape are written once (bfloat16,
`make_tiny_model --shape qwen3.5-0.8b`) under ~/.cache/sgrec/. Both sides run in --dtype on
--threads threads, best of --repeats, the runs of the sides taken in turn:
- prefill: one --prompt-len prompt; sgrec's engine with one new token (cache flushed), transformers'
  forward with the last position's logits only;
- decode: a batch of --batch prompts of --decode-prompt-len tokens; the time of a step is (the time
  of --steps + 1 new tokens minus that of one) / --steps, on each side (transformers' generate with
  its cache, greedy).
Greedy tokens of the two are compared (bf16 rounds differently in the two; the count of identical
sequences is printed). transformers runs its own torch forms of the gated delta rule (without
`flash-linear-attention`, which needs a GPU).

sgrec flushes denormal floats to zero on the threads its forwards run on, for the forward (the rule's
decays underflow into denormals, which x86 multiplies tens of times slower). transformers is timed twice: as it runs
by default, and with the same flushing set on its threads (what torch.set_flush_denormal alone does
not give: it sets the calling thread only), so the ratios show what is the floating-point mode and
what is sgrec's kernels. The chunked rule of one layer at the model's shape is timed alone, sgrec's C
kernel (native.gdr_sequence: the rule of what prefill runs on CPU, native.gdr_prefill, without the
convolution that kernel makes its inputs with) beside the torch form (delta_rule.chunked,
the transformers-like form), and set against the machine's float32 FMA limit (16 independent vector
FMAs a round on every thread, sgrec.model.native.fma_peak_gflops) as its share of the machine; torch.mm's
float32 rate at 2048^3 is printed beside it. Results:
docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402
from bench_roofline import best  # noqa: E402  (one warm-up call, then the best of `repeats`)
from sgrec import Engine  # noqa: E402
from sgrec.model import delta_rule, native  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

SHAPE = "qwen3.5-0.8b"


def model_dir(args) -> str:
    if args.model_path:
        return os.path.expanduser(args.model_path)
    from sgrec.server_args import cache_dir
    from sgrec.tools.make_tiny_model import make_tiny_model

    path = os.path.join(cache_dir(), f"random-{SHAPE}")
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"writing random weights of {SHAPE}'s shape to {path} ...", flush=True)
        make_tiny_model(path, shape=SHAPE, dtype="bfloat16")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cmd = " ".join(["python", "benchmarks/bench_hybrid.py", *map(shlex.quote, sys.argv[1:])])
    print(header(cmd, "bench_hybrid"), flush=True)
    path = model_dir(args)
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    engine = Engine(path, device="cpu", dtype=args.dtype, disable_radix_cache=True,
                    chunked_prefill_size=max(args.prompt_len, 2048), max_total_tokens=max(8192, 2 * args.prompt_len))
    rng = random.Random(0)
    vocab = engine.vocab_size
    prompt = [rng.randrange(100, min(vocab, 40000)) for _ in range(args.prompt_len)]
    greedy = {"temperature": 0, "ignore_eos": True}

    def sgrec_prefill():
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, **greedy})

    def hf_prefill():
        with torch.inference_mode():
            hf(torch.tensor([prompt]), logits_to_keep=1)

    def flushed(fn, on: bool):  # fn with this thread's team flushing denormals (on) or not
        def run(*a):
            native.flush_denormals(on)
            try:
                return fn(*a)
            finally:
                native.flush_denormals(False)  # the default, which sgrec's runner restores after each forward
        return run

    pre = best_interleaved({"sgrec": sgrec_prefill, "transformers": flushed(hf_prefill, False),
                            "transformers, flushed": flushed(hf_prefill, True)}, args.repeats)
    print("  prefill " + str(args.prompt_len) + ": " + ", ".join(f"{k} {v:.3f} s" for k, v in pre.items()), flush=True)
    proj = projections_seconds(engine.runner.model, sgrec_prefill)
    print(f"  of sgrec's prefill, the projections' matrix products (what transformers runs too): {proj:.3f} s; "
          f"transformers' time over them: {pre['transformers'] / proj:.2f}x (the most any engine could reach "
          f"without faster matrix products)", flush=True)

    prompts = [[rng.randrange(100, min(vocab, 40000)) for _ in range(args.decode_prompt_len)]
               for _ in range(args.batch)]
    outs = {}

    def sgrec_gen(k):
        out = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": k, **greedy})
        outs["sgrec"] = [o["output_ids"] for o in out]

    def hf_gen(k):
        with torch.inference_mode():
            out = hf.generate(torch.tensor(prompts), attention_mask=torch.ones(len(prompts), len(prompts[0]),
                              dtype=torch.int64), max_new_tokens=k, min_new_tokens=k, do_sample=False)
        outs["transformers"] = out[:, len(prompts[0]):].tolist()

    gens = {"sgrec": sgrec_gen, "transformers": flushed(hf_gen, False), "transformers, flushed": flushed(hf_gen, True)}
    t_long = best_interleaved({name: (lambda gen=gen: gen(args.steps + 1)) for name, gen in gens.items()}, args.repeats)
    same = sum(a == b for a, b in zip(outs["sgrec"], outs["transformers"]))  # the long runs' sequences
    t_one = best_interleaved({name: (lambda gen=gen: gen(1)) for name, gen in gens.items()}, args.repeats)
    step = {name: (t_long[name] - t_one[name]) / args.steps for name in gens}
    for name in gens:
        print(f"  decode batch {args.batch}: {name} {step[name] * 1e3:.1f} ms/step", flush=True)
    engine.shutdown()
    rule = rule_share(path, args)
    fast = rule["kernel"] if rule["kernel"] is not None else rule["torch"]
    print(f"  chunked delta rule, one layer, {args.prompt_len} tokens: C kernel "
          + ("not built" if rule["kernel"] is None else f"{rule['kernel'] * 1e3:.1f} ms")
          + f", torch form {rule['torch'] * 1e3:.1f} ms; {rule['gflop'] / fast:.0f} GFLOP/s, "
          f"{rule['gflop'] / fast / rule['peak']:.0%} of the float32 FMA limit ({rule['peak']:.0f} GFLOP/s; "
          f"torch.mm at 2048^3: {rule['gemm']:.0f} GFLOP/s)", flush=True)

    model = os.path.basename(path.rstrip("/"))
    rows = []
    for peer in ("transformers", "transformers, flushed"):
        rows += [["prefill", f"{args.prompt_len} tokens", peer, f"{pre['sgrec']:.3f} s", f"{pre[peer]:.3f} s",
                  f"**{pre[peer] / pre['sgrec']:.2f}x**"],
                 ["decode", f"batch {args.batch}", peer, f"{args.batch / step['sgrec']:.1f} tok/s",
                  f"{args.batch / step[peer]:.1f} tok/s", f"**{step[peer] / step['sgrec']:.2f}x**"]]
    print()
    print(md_table(["phase", "shape", "peer", "sgrec", "peer's", "sgrec speed-up"], rows))
    print(f"\nidentical greedy decode sequences: {same}/{args.batch}")
    if not args.no_record:
        params = {"model": model, "dtype": args.dtype}
        results = []
        for peer, fp in (("transformers", "default"), ("transformers, flushed", "denormals flushed")):
            results += [
                row("prefill time", "s", pre["sgrec"], pre[peer], higher_is_better=False,
                    params={**params, "prompt_tokens": args.prompt_len, "peer_fp_mode": fp}),
                row("decode throughput", "tok/s", args.batch / step["sgrec"], args.batch / step[peer],
                    params={**params, "batch": args.batch, "prompt_tokens": args.decode_prompt_len, "peer_fp_mode": fp}),
            ]
        results.append(row("prefill projections (matrix products)", "s", proj, None, higher_is_better=False,
                           params={**params, "prompt_tokens": args.prompt_len}))
        results.append(row("chunked delta rule, one layer", "ms", fast * 1e3, rule["torch"] * 1e3,
                           higher_is_better=False, efficiency=rule["gflop"] / fast / rule["peak"],
                           params={"heads": rule_heads(path), "tokens": args.prompt_len,
                                   "sgrec": "C kernel" if rule["kernel"] is not None else "torch form",
                                   "peer": "torch chunked form"}))
        out = write_record(benchmark="bench_hybrid", title="The hybrid family (Qwen3.5) against transformers",
                           command=cmd, results=results, peer="transformers (torch forms of the gated delta rule); the rule alone: its torch chunked form; the float32 FMA limit (efficiency)")
        print(f"result record: {out}")


def best_interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Each fn's best time of `repeats` runs, after one warm-up run each, the runs of the fns taken in
    turn (a noisy spell on a shared machine falls on every side alike)."""
    import time

    for fn in fns.values():
        fn()
    times = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t)
    return times


def projections_seconds(model: torch.nn.Module, run) -> float:
    """Seconds one run() spends in the model's projections (its linear layers, packed or not): their
    forwards timed by hooks, best of two runs."""
    import time

    from sgrec.model.cpu_linear import PackedLinear

    spent = [0.0]
    hooks = []
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, PackedLinear)):
            hooks.append(m.register_forward_pre_hook(lambda mod, a: setattr(mod, "_t0", time.perf_counter())))
            hooks.append(m.register_forward_hook(lambda mod, a, o: spent.__setitem__(0, spent[0] + time.perf_counter()
                                                                                         - mod._t0)))
    try:
        best_s = float("inf")
        for _ in range(2):
            spent[0] = 0.0
            run()
            best_s = min(best_s, spent[0])
    finally:
        for h in hooks:
            h.remove()
    return best_s


def rule_heads(path: str) -> int:
    from sgrec.model.config import ModelConfig
    from sgrec.model.qwen3_5 import HybridShape

    return HybridShape.of(ModelConfig.from_dir(path)).v_heads


def rule_share(path: str, args) -> dict:
    """The chunked rule of one layer at the model's shape (random inputs, denormals flushed): seconds of
    sgrec's C kernel (native.gdr_sequence; None where it is not built) and of the torch form
    (delta_rule.chunked), the C kernel's GFLOP (its matrix products: K S and Q S, the state's update
    K^T U, the chunk's q.k and k.k products and its triangular solve and output over the causal half),
    torch.mm's float32 rate at 2048^3 and the machine's float32 FMA limit (native.fma_peak_gflops;
    the GEMM rate where the C kernels are not built) in GFLOP/s."""
    from sgrec.model.config import ModelConfig
    from sgrec.model.qwen3_5 import HybridShape

    shape = HybridShape.of(ModelConfig.from_dir(path))
    H, L, dk, dv, C = shape.v_heads, args.prompt_len, shape.k_dim, shape.v_dim, delta_rule.CHUNK
    g = torch.Generator().manual_seed(0)
    q = delta_rule.l2norm(torch.randn(H, L, dk, generator=g)) * dk**-0.5
    k = delta_rule.l2norm(torch.randn(H, L, dk, generator=g))
    v = torch.randn(H, L, dv, generator=g)
    decay, beta = -torch.rand(H, L, generator=g) * 2, torch.rand(H, L, generator=g)
    state = torch.zeros(H, dk, dv)
    lib = native.load()
    before = native.flush_denormals(True, lib) if lib is not None else None
    try:
        kernel = (None if lib is None else
                  best(lambda: native.gdr_sequence(q, k, v, decay, beta, state, C, lib), max(args.repeats, 3)))
        torch_form = best(lambda: delta_rule.chunked(q, k, v, decay, beta, state), max(args.repeats, 3))
    finally:
        if before is not None:
            native.flush_denormals(before, lib)
    n = -(-L // C)
    per_chunk = 2 * (3 * C * dk * dv + C * C * dk + C * C * dv)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    gemm = 2 * 2048**3 / best(lambda: torch.mm(a, b), 5) / 1e9
    peak = native.fma_peak_gflops(lib=lib) if lib is not None else gemm
    return {"kernel": kernel, "torch": torch_form, "gflop": H * n * per_chunk / 1e9, "gemm": gemm, "peak": peak}


if __name__ == "__main__":
    main()
