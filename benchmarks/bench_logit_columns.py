"""Beam steps computing only their level's logits vs the whole vocabulary's.

    python benchmarks/bench_logit_columns.py          # SmolLM2-135M, 10^5 items, BW 128 and 512

One RetrieveExecutor, one catalog of --num-items random 3-token semantic IDs (each level --codes
codes at the top of the vocabulary), one --prompt-len prompt cached by the warm-up. The two peers
differ only in the output layer of a beam step: "all columns" computes every vocabulary logit
(SemanticIdTrie.logit_columns patched to None, the path before this change), "level columns" the
rows of the level's tokens only. They run alternately in one process (one call of each in turn),
--repeats times after a warm-up; the table shows medians, their ratio, and whether both returned
the same items with the same scores (rounded to 1e-4).

Then score (`Engine.score` with apply_softmax): --score-items items of --score-item-len tokens after
a --score-query-len-token query (cached by the warm-up), four labels; "all columns" (the label-only
path switched off: the whole output layer, then the labels' logprobs) against "label columns" (the
labels' rows only), alternately, medians of --repeats, and the largest difference of a score.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench_catalog import header, md_table  # noqa: E402
from sgrec.beam import RetrieveExecutor  # noqa: E402
from sgrec.beam.trie import SemanticIdTrie  # noqa: E402
from sgrec.catalog import Catalog, Item  # noqa: E402
from sgrec.radix.tree import RadixCache  # noqa: E402
from sgrec.runner import ModelRunner  # noqa: E402
from sgrec.server_args import ServerArgs  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

ND = 3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="~/.cache/sgrec/SmolLM2-135M-Instruct")
    ap.add_argument("--beam-widths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--num-items", type=int, default=100_000)
    ap.add_argument("--codes", type=int, default=1024, help="semantic-ID codes per level")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--score-items", type=int, default=100)
    ap.add_argument("--score-item-len", type=int, default=4)
    ap.add_argument("--score-query-len", type=int, default=64)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cmd = ("python benchmarks/bench_logit_columns.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))).strip()
    print(header(cmd, "bench_logit_columns"), flush=True)
    model = os.path.expanduser(args.model_path)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    base = vocab - ND * args.codes
    rng = np.random.default_rng(0)
    sem = base + np.arange(ND) * args.codes + rng.integers(0, args.codes, (args.num_items, ND))
    catalog = Catalog([Item(f"i{k}", (5,), None, tuple(s)) for k, s in enumerate(sem.tolist())])
    runner = ModelRunner(ServerArgs.from_kwargs(
        model_path=model, device="cpu", dtype="float32", chunked_prefill_size=-1,
        max_total_tokens=args.prompt_len + max(args.beam_widths) * (ND - 1) + 256))
    ex = RetrieveExecutor(runner, RadixCache(runner.kv_pool.allocator), catalog, max_beam_width=max(args.beam_widths))
    prompt = rng.integers(10, base, args.prompt_len).tolist()
    level = SemanticIdTrie.logit_columns
    peers = {"all columns": lambda self, depth: None, "level columns": level}
    print(f"model {model} (vocabulary {vocab}); {args.num_items} items; level tokens per depth: "
          f"{[int(t.numel()) for t in ex.trie.level_tokens]}", flush=True)
    rows, medians = [], []
    try:
        for bw in args.beam_widths:
            times: dict[str, list[float]] = {k: [] for k in peers}
            items: dict[str, list] = {}
            for rep in range(args.repeats + 1):  # the first round is the warm-up
                for name, columns in peers.items():
                    SemanticIdTrie.logit_columns = columns
                    t = time.perf_counter()
                    res = ex.run(prompt, bw, bw, 10)
                    if rep:
                        times[name].append(time.perf_counter() - t)
                    items[name] = [(x["item"], round(x["score"], 4)) for x in res.items]
            full, part = (statistics.median(times[k]) * 1e3 for k in peers)
            rows.append([bw, f"{full:.1f}", f"{part:.1f}", f"{full / part:.2f}",
                         items["all columns"] == items["level columns"]])
            medians.append((bw, full, part))
            print(f"  BW {bw}: {full:.1f} / {part:.1f} ms", flush=True)
    finally:
        SemanticIdTrie.logit_columns = level
    print(md_table(["BW", "all columns ms", "level columns ms", "speed-up", "same items and scores"], rows))
    score, score_ms = score_row(model, vocab, args)
    print(md_table(["score", "all columns ms", "label columns ms", "speed-up", "max score difference"], [score]))
    print(f"rerun: {cmd}")
    if not args.no_record:
        path = write_record(benchmark="bench_logit_columns",
                            title="Beam steps and scoring that compute only the logit columns they need",
                            command=cmd,
                            results=record_rows(medians, score_ms, args, os.path.basename(model.rstrip("/"))),
                            peer="the same step over the whole vocabulary's logits (all columns)")
        print(f"result record: {path}")


def record_rows(medians: list[tuple[int, float, float]], score_ms: tuple[float, float], args, model: str) -> list[dict]:
    """The result record's rows: a retrieve request's median with the level's columns beside all columns,
    per beam width (medians: (BW, all columns ms, level columns ms)); score's label columns beside all."""
    out = [row("retrieve latency (median)", "ms", part, full, higher_is_better=False,
               params={"model": model, "items": args.num_items, "beam_width": bw}) for bw, full, part in medians]
    full, part = score_ms
    out.append(row("score latency, label columns (median)", "ms", part, full, higher_is_better=False,
                   params={"model": model, "items": args.score_items, "item_tokens": args.score_item_len}))
    return out


def score_row(model: str, vocab: int, args) -> tuple[list, tuple[float, float]]:
    from sgrec import Engine
    from sgrec.scheduler.scheduler import Scheduler

    e = Engine(model, device="cpu", dtype="float32", log_level="warning")
    rng = np.random.default_rng(1)
    query = rng.integers(10, vocab, args.score_query_len).tolist()
    items = [rng.integers(10, vocab, args.score_item_len).tolist() for _ in range(args.score_items)]
    labels = rng.choice(vocab, 4, replace=False).tolist()
    labels_only = Scheduler.__dict__["_labels_only"]  # the staticmethod itself
    peers = {"all columns": staticmethod(lambda req: False), "label columns": labels_only}
    times: dict[str, list[float]] = {k: [] for k in peers}
    scores: dict[str, list] = {}
    try:
        for rep in range(args.repeats + 1):  # the first round is the warm-up (and caches the query)
            for name, fn in peers.items():
                Scheduler._labels_only = fn
                t = time.perf_counter()
                scores[name] = e.score(query=query, items=items, label_token_ids=labels, apply_softmax=True).scores
                if rep:
                    times[name].append(time.perf_counter() - t)
    finally:
        Scheduler._labels_only = labels_only
    full, part = (statistics.median(times[k]) * 1e3 for k in peers)
    diff = max(abs(a - b) for x, y in zip(*scores.values()) for a, b in zip(x, y))
    print(f"  score: {full:.1f} / {part:.1f} ms", flush=True)
    return [f"{args.score_items} items x {args.score_item_len} tokens", f"{full:.1f}", f"{part:.1f}",
            f"{full / part:.2f}", f"{diff:.1e}"], (full, part)


if __name__ == "__main__":
    main()
