"""xBeam retrieval on the encoder-decoder family (TIGER's T5): sgrec beside transformers' constrained
beam search on the same model and catalog, in one run.

    python benchmarks/bench_t5_retrieve.py                                  # TIGER and T5-small shapes
    python benchmarks/bench_t5_retrieve.py --shapes tiger --beam-widths 50 --concurrency 8 --repeats 1

Setup: random weights of the named shapes (`make_tiny_model --shape tiger | t5-small`) in the default
dtype here (bfloat16 where the CPU multiplies it natively, else float32), a random catalog of
--num-items items with ND = --nd semantic-ID tokens (each level drawn from its own --codes ids at the
top of the vocabulary: Amazon Beauty's 12,101 items and TIGER's 4 codes by default), and inputs of
--history items' semantic IDs (TIGER's user history), never cached. A request asks for
beam_width = top_k = BW and num_items = min(BW, 10). Concurrency C: C different requests at once:
sgrec runs them as one round (RetrieveExecutor.run_batch: the scheduler's batch of C arrivals), and
transformers as one generate call over the C inputs (its batch of C x BW beams).

Peers, on the same weights, inputs and catalog:
* sgrec: EncoderDecoderRetrieve (the encoder once per request, its cross-attention K/V read in place by
  every beam, each beam's decoder tokens its own);
* transformers: generate(num_beams=BW, prefix_allowed_tokens_fn=<the catalog's trie>), whose encoder
  output and cross-attention cache are expanded to BW rows per input and reordered at every step, and
  whose trie is read in Python per beam. It masks after log_softmax over the whole vocabulary (sgrec
  normalises over the valid children): the scores differ, so only times and the validity of what
  each returns are compared.
Reported: requests/s and median request latency of each peer (the median of --repeats runs after a
warm-up), sgrec's speed-up, and the share of returned items not in the catalog (zero expected for both).
Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402
from bench_xbeam import build_catalog  # noqa: E402
from sgrec.beam.encdec import EncoderDecoderRetrieve  # noqa: E402
from sgrec.catalog import Catalog  # noqa: E402
from sgrec.radix.tree import RadixCache  # noqa: E402
from sgrec.runner import ModelRunner  # noqa: E402
from sgrec.server_args import ServerArgs  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def model_dir(shape: str) -> str:
    """Random weights of a named shape, written once under ~/.cache/sgrec."""
    from sgrec.tools.make_tiny_model import make_tiny_model

    path = os.path.expanduser(f"~/.cache/sgrec/random-{shape}")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        make_tiny_model(path, shape=shape)
    return path


def hf_peer(path: str, catalog: Catalog, nd: int, dtype: torch.dtype, start: int):
    """transformers' constrained beam search over a batch of inputs: run(inputs, bw) -> each input's
    returned paths."""
    from transformers import T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    sets: dict[tuple[int, ...], set[int]] = {}
    for it in catalog.items:
        for d in range(nd):
            sets.setdefault(tuple(it.semantic_id[:d]), set()).add(it.semantic_id[d])
    children = {k: sorted(v) for k, v in sets.items()}

    def allowed(batch_id, ids):  # ids: the decoder's tokens so far, the start token first
        return children.get(tuple(ids[1:].tolist()), [start])

    def run(inputs: list[list[int]], bw: int) -> list[list[tuple[int, ...]]]:
        n = min(bw, 10)
        with torch.no_grad():
            out = model.generate(torch.tensor(inputs), attention_mask=torch.ones(len(inputs), len(inputs[0]),
                                                                                 dtype=torch.long),
                                 num_beams=bw, num_return_sequences=n, max_new_tokens=nd, min_new_tokens=nd,
                                 do_sample=False, prefix_allowed_tokens_fn=allowed, early_stopping=True,
                                 decoder_start_token_id=start, pad_token_id=start, eos_token_id=None)
        paths = [tuple(r[1:].tolist()) for r in out]
        return [paths[i * n:(i + 1) * n] for i in range(len(inputs))]

    return run


def median_time(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def invalid_share(results: list[list[tuple[int, ...]]], valid: set[tuple[int, ...]]) -> float:
    paths = [p for r in results for p in r]
    return sum(p not in valid for p in paths) / max(1, len(paths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiger,t5-small")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--beam-widths", default="20,50,128,256")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--num-items", type=int, default=12101)
    ap.add_argument("--nd", type=int, default=4)
    ap.add_argument("--codes", type=int, default=256)
    ap.add_argument("--history", type=int, default=20, help="items in a user's history (nd tokens each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cmd = " ".join(["python", "benchmarks/bench_t5_retrieve.py", *map(shlex.quote, sys.argv[1:])])
    print(header(cmd, "bench_t5_retrieve"), flush=True)
    bws, concs = ints(args.beam_widths), ints(args.concurrency)
    rows, results = [], []
    for shape in args.shapes.split(","):
        path = model_dir(shape)
        widest, most = max(bws), max(concs)
        runner = ModelRunner(ServerArgs(model_path=path, device="cpu", dtype=args.dtype, disable_radix_cache=True,
                                        max_total_tokens=most * (widest * args.nd + args.history * args.nd + 8),
                                        max_beam_width=widest))
        rng = random.Random(0)
        vocab = runner.config.vocab_size
        catalog = build_catalog(rng, args.num_items, args.nd, args.codes, vocab)
        valid = {tuple(it.semantic_id) for it in catalog.items}
        sids = [it.semantic_id for it in catalog.items]
        inputs = [[t for _ in range(args.history) for t in rng.choice(sids)] for _ in range(most * (args.repeats + 1))]
        ex = EncoderDecoderRetrieve(runner, RadixCache(runner.memory.allocator, disable=True), catalog,
                                    max_beam_width=widest)
        hf = hf_peer(path, catalog, args.nd, runner.dtype, runner.config.decoder_start_token_id or 0)
        dtype = str(runner.dtype).removeprefix("torch.")
        print(f"{shape}: {dtype}, {len(catalog)} items, ND {args.nd}, inputs of {len(inputs[0])} tokens", flush=True)
        for c in concs:
            for bw in bws:
                turn = iter(range(10**9))

                def batch(k: int) -> list[list[int]]:
                    a = (k * c) % (len(inputs) - c + 1)
                    return inputs[a:a + c]

                def ours():
                    reqs = [dict(input_ids=x, beam_width=bw, top_k=bw, num_items=min(bw, 10))
                            for x in batch(next(turn))]
                    return [[tuple(it["semantic_id"]) for it in r.items] for r in ex.run_batch(reqs)]

                def theirs():
                    return hf(batch(next(turn)), bw)

                ts, got = median_time(ours, args.repeats)
                th, ref = median_time(theirs, args.repeats)
                bad_s, bad_h = invalid_share(got, valid), invalid_share(ref, valid)
                print(f"  C {c} BW {bw}: sgrec {c / ts:.1f} req/s ({ts * 1e3:.0f} ms), transformers "
                      f"{c / th:.2f} req/s ({th * 1e3:.0f} ms): {th / ts:.1f}x; invalid {bad_s:.0%} / {bad_h:.0%}",
                      flush=True)
                rows.append([shape, str(c), str(bw), f"{c / ts:.1f}", f"{ts * 1e3:.0f} ms", f"{c / th:.2f}",
                             f"{th * 1e3:.0f} ms", f"**{th / ts:.1f}x**", f"{bad_s:.0%} / {bad_h:.0%}"])
                params = {"model": f"random-{shape}", "dtype": dtype, "items": len(catalog), "nd": args.nd,
                          "input_tokens": len(inputs[0]), "beam_width": bw, "concurrency": c,
                          "invalid_sgrec": bad_s, "invalid_transformers": bad_h}
                results.append(row("retrieve throughput against transformers' constrained beam search", "req/s",
                                   c / ts, c / th, params=params))
                results.append(row("retrieve median latency", "s", ts, th, higher_is_better=False, params=params))
        del ex, runner, hf
    print()
    print(md_table(["shape", "concurrency", "beam width", "sgrec req/s", "sgrec latency", "transformers req/s",
                    "transformers latency", "sgrec speed-up", "invalid (sgrec / transformers)"], rows))
    if not args.no_record:
        out = write_record(benchmark="bench_t5_retrieve", title="xBeam retrieval on the encoder-decoder family (T5)",
                           command=cmd, results=results,
                           peer="transformers' generate(num_beams, prefix_allowed_tokens_fn), same dtype")
        print(f"result record: {out}")


if __name__ == "__main__":
    main()
