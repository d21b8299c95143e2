"""xBeam retrieval on the hybrid family: sgrec's RetrieveExecutor beside the naive in-engine beam search
and transformers' constrained beam search, on the same Qwen3.5-shaped model and catalog, in one run.

    python benchmarks/bench_hybrid_retrieve.py                      # Qwen3.5-0.8B's shape, random weights, bf16
    python benchmarks/bench_hybrid_retrieve.py --beam-widths 8 --prompt-len 32 --num-items 500 --repeats 1

Setup: random bf16 weights of Qwen3.5-0.8B's shape (as benchmarks/bench_hybrid.py writes them), a random
catalog of --num-items items with ND = --nd semantic-ID tokens (each level drawn from its own --codes
token ids at the top of the vocabulary), prompts of --prompt-len random token ids. A request asks for
beam_width = top_k = BW and num_items = min(BW, 10), one request at a time, the prompt never cached.

Peers, on the same weights, prompts and catalog:
* sgrec: RetrieveExecutor (the prompt's KV read in place by every beam, each beam's state in a slot of
  its own, forked from the prompt's; at each level a fork reads its parent's slot in the next step, no
  state copied);
* naive: sgrec.beam.naive_retrieve (every beam a sequence of a plain decode batch, the prompt's KV and
  state copied into each beam, the parent's copied again at every fork), at the beam widths in
  --naive-beam-widths;
* transformers: generate(num_beams=BW, prefix_allowed_tokens_fn=<the catalog's trie>) in bf16 with its
  default attention (bench_xbeam's peer) at --hf-beam-widths (its cache expands the prompt to BW rows and reorders every layer's KV and state per
  step; it masks after log_softmax, so its beams may differ: only its time is compared).
Reported: the best of --repeats requests after a warm-up (req/s = 1 / best), each peer's ratio, and the
state bytes a request holds (one state a beam row). Results: docs/performance.md.
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
from bench_hybrid import model_dir  # noqa: E402
from bench_roofline import best  # noqa: E402  (one warm-up call, then the best of `repeats`)
from bench_xbeam import build_catalog, hf_peer  # noqa: E402
from sgrec.beam import RetrieveExecutor, naive_retrieve  # noqa: E402
from sgrec.radix.tree import RadixCache  # noqa: E402
from sgrec.runner import ModelRunner  # noqa: E402
from sgrec.server_args import ServerArgs  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--beam-widths", default="32,256")
    ap.add_argument("--naive-beam-widths", default="32")
    ap.add_argument("--hf-beam-widths", default="32")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--num-items", type=int, default=10000)
    ap.add_argument("--nd", type=int, default=3)
    ap.add_argument("--codes", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cmd = " ".join(["python", "benchmarks/bench_hybrid_retrieve.py", *map(shlex.quote, sys.argv[1:])])
    print(header(cmd, "bench_hybrid_retrieve"), flush=True)
    path = model_dir(args)
    bws, naive_bws, hf_bws = ints(args.beam_widths), ints(args.naive_beam_widths), ints(args.hf_beam_widths)
    widest = max(bws + naive_bws)
    runner = ModelRunner(ServerArgs(model_path=path, device="cpu", dtype=args.dtype, disable_radix_cache=True,
                                    max_total_tokens=widest * (args.prompt_len + args.nd) + 4 * args.prompt_len,
                                    max_mamba_cache_size=widest + 8, max_beam_width=widest))
    rng = random.Random(0)
    vocab = runner.config.vocab_size
    catalog = build_catalog(rng, args.num_items, args.nd, args.codes, vocab)
    prompt = [rng.randrange(100, vocab - args.nd * args.codes) for _ in range(args.prompt_len)]
    ex = RetrieveExecutor(runner, RadixCache(runner.memory.allocator, disable=True, states=runner.memory.states),
                          catalog, max_beam_width=widest)
    state_mib = runner.memory.bytes_per_state / 2**20
    res: dict[tuple[str, int], float] = {}
    for bw in bws:
        res["sgrec", bw] = best(lambda: ex.run(prompt, bw, bw, min(bw, 10)), args.repeats)
        print(f"  BW {bw}: sgrec {res['sgrec', bw]:.3f} s ({bw} beam states of {state_mib:.1f} MiB)", flush=True)
    for bw in naive_bws:
        res["naive", bw] = best(lambda: naive_retrieve(runner, catalog, prompt, bw, bw, min(bw, 10)), args.repeats)
        print(f"  BW {bw}: naive {res['naive', bw]:.3f} s", flush=True)
    if hf_bws:
        hf = hf_peer(path, catalog, prompt, args.nd, torch.bfloat16, attn_implementation=None)
        for bw in hf_bws:
            res["transformers", bw] = best(lambda: hf(bw), max(1, args.repeats - 1))
            print(f"  BW {bw}: transformers {res['transformers', bw]:.3f} s", flush=True)
    rows, results = [], []
    params = {"model": os.path.basename(path.rstrip("/")), "dtype": args.dtype, "prompt_len": args.prompt_len,
              "items": args.num_items, "nd": args.nd}
    for (peer, bw), t in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if peer == "sgrec":
            continue
        s = res.get(("sgrec", bw))
        rows.append([f"BW {bw}", peer, f"{s:.3f} s" if s else "—", f"{t:.3f} s", f"**{t / s:.2f}x**" if s else "—"])
        if s:
            results.append(row(f"retrieve throughput, one request at a time, against {peer}", "req/s", 1 / s, 1 / t,
                               params={**params, "beam_width": bw}))
    for bw in bws:
        results.append(row("retrieve latency", "s", res["sgrec", bw], None, higher_is_better=False,
                           params={**params, "beam_width": bw, "state_mib_per_beam": round(state_mib, 1)}))
    print()
    print(md_table(["beam width", "peer", "sgrec", "peer's", "sgrec speed-up"], rows))
    if not args.no_record:
        out = write_record(benchmark="bench_hybrid_retrieve", title="xBeam retrieval on the hybrid family (Qwen3.5)",
                           command=cmd, results=results,
                           peer="sgrec's naive in-engine beam search; transformers' constrained beam search (bf16)")
        print(f"result record: {out}")


if __name__ == "__main__":
    main()
