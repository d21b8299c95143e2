"""Generation on the encoder-decoder family (T5): sgrec's scheduler beside transformers' generate on the
same model and inputs, in one run.

    python benchmarks/bench_t5_generate.py                                  # TIGER and T5-small shapes
    python benchmarks/bench_t5_generate.py --shapes t5-small --batches 8 --repeats 1

Setup: random weights of the named shapes (`make_tiny_model --shape tiger | t5-small`) in the default
dtype here (bfloat16 where the CPU multiplies it natively, else float32), B different inputs of
--input-tokens random tokens at once, each decoded greedily for --output-tokens tokens (no early stop),
the radix cache off (no input is seen twice).

Peers, on the same weights and inputs:
* sgrec: `sgrec.Engine.generate` over the B inputs: the scheduler's prefill batch (each input through
  the encoder once, its cross-attention K/V in the pool) and decode batches of every running request;
* transformers: `T5ForConditionalGeneration.generate(do_sample=False)` over the B inputs as one
  batch (all inputs of one length: no padding).
Reported: output tokens/s and the median time of a batch (of --repeats runs after a warm-up), sgrec's
speed-up, and whether the greedy tokens agree (the share of inputs whose tokens equal transformers';
bfloat16 rounds differently on the two sides, so a near tie may go either way there).
Results: docs/performance.md.
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
from bench_t5_retrieve import ints, median_time, model_dir  # noqa: E402
from sgrec.engine import Engine  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiger,t5-small")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--batches", default="1,8,32", help="inputs generated at once")
    ap.add_argument("--input-tokens", type=int, default=80)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cmd = " ".join(["python", "benchmarks/bench_t5_generate.py", *map(shlex.quote, sys.argv[1:])])
    print(header(cmd, "bench_t5_generate"), flush=True)
    batches, n_out = ints(args.batches), args.output_tokens
    rows, results = [], []
    for shape in args.shapes.split(","):
        from transformers import T5ForConditionalGeneration

        path = model_dir(shape)
        most = max(batches)
        eng = Engine(model_path=path, device="cpu", dtype=args.dtype, disable_radix_cache=True,
                     max_total_tokens=most * (args.input_tokens + n_out + 8), max_running_requests=most,
                     cpu_threads=args.threads)
        start = eng.runner.config.decoder_start_token_id or 0
        hf = T5ForConditionalGeneration.from_pretrained(path, dtype=eng.runner.dtype).eval()
        rng = random.Random(0)
        vocab = eng.runner.config.vocab_size
        inputs = [[rng.randrange(1, vocab) for _ in range(args.input_tokens)] for _ in range(most * (args.repeats + 1))]
        dtype = str(eng.runner.dtype).removeprefix("torch.")
        print(f"{shape}: {dtype}, inputs of {args.input_tokens} tokens, {n_out} output tokens each", flush=True)
        sp = {"max_new_tokens": n_out, "temperature": 0, "ignore_eos": True}
        for b in batches:
            turn = iter(range(10**9))

            def batch(k: int) -> list[list[int]]:
                a = (k * b) % (len(inputs) - b + 1)
                return inputs[a:a + b]

            def ours():
                xs = batch(next(turn))
                return xs, [o["output_ids"] for o in eng.generate(input_ids=xs, sampling_params=sp)]

            def greedy(xs: list[list[int]]) -> list[list[int]]:
                with torch.no_grad():
                    out = hf.generate(torch.tensor(xs), attention_mask=torch.ones(len(xs), len(xs[0]), dtype=torch.long),
                                      max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, num_beams=1,
                                      decoder_start_token_id=start, pad_token_id=start, eos_token_id=None)
                return [r[1:].tolist() for r in out]

            def theirs():
                xs = batch(next(turn))
                return xs, greedy(xs)

            ts, (xs, got) = median_time(ours, args.repeats)
            th, _ = median_time(theirs, args.repeats)
            same = sum(g == r for g, r in zip(got, greedy(xs))) / len(xs)  # transformers' tokens for sgrec's inputs
            tok_s, tok_h = b * n_out / ts, b * n_out / th
            print(f"  B {b}: sgrec {tok_s:.0f} tok/s ({ts * 1e3:.0f} ms), transformers {tok_h:.0f} tok/s "
                  f"({th * 1e3:.0f} ms): {th / ts:.2f}x; same tokens {same:.0%}", flush=True)
            rows.append([shape, str(b), f"{tok_s:.0f}", f"{ts * 1e3:.0f} ms", f"{tok_h:.0f}", f"{th * 1e3:.0f} ms",
                         f"**{th / ts:.2f}x**", f"{same:.0%}"])
            params = {"model": f"random-{shape}", "dtype": dtype, "input_tokens": args.input_tokens,
                      "output_tokens": n_out, "batch": b, "same_tokens": same}
            results.append(row("greedy generation throughput against transformers' generate", "tok/s", tok_s, tok_h,
                               params=params))
        del eng, hf
    print()
    print(md_table(["shape", "batch", "sgrec tok/s", "sgrec batch time", "transformers tok/s",
                    "transformers batch time", "sgrec speed-up", "same greedy tokens"], rows))
    if not args.no_record:
        out = write_record(benchmark="bench_t5_generate", title="Generation on the encoder-decoder family (T5)",
                           command=cmd, results=results, peer="transformers' generate(do_sample=False), same dtype")
        print(f"result record: {out}")


if __name__ == "__main__":
    main()
