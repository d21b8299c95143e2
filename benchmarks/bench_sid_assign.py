"""Semantic-ID assignment from trained codebooks: `sid-assign`'s items/s against faiss's flat index
searched level by level (the usual way to do it; it returns faiss's nearest, not the exact tie rule),
its efficiency against the machine's float32 GEMM peak (the assignment is one GEMM per level), and
the cost per item of a server assigning on upsert (the front's parse of the embedding from JSON, and
the assignment), beside the rest of an update's validation.

    python benchmarks/bench_sid_assign.py                       # 3 levels x 256 codes, 256 dimensions
    python benchmarks/bench_sid_assign.py --items 50000 --dim 64

Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import numpy as np
import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header  # noqa: E402
from sgrec.catalog import codebooks as cb  # noqa: E402
from sgrec.catalog.update import assign_semantic_ids, parse_items  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402


def best(fn, repeats: int) -> float:
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def gemm_peak(repeats: int) -> float:
    """GFLOP/s of numpy's float32 GEMM at 2048^3, best of `repeats`."""
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    return 2 * 2048**3 / best(lambda: a @ a, repeats) / 1e9


def faiss_assign(books: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The peer: faiss IndexFlatL2, nearest codeword per level, residual by residual."""
    import faiss

    residual, codes = x.copy(), np.empty((len(x), books.shape[0]), np.int64)
    for lv in range(books.shape[0]):
        index = faiss.IndexFlatL2(books.shape[2])
        index.add(books[lv])
        codes[:, lv] = index.search(residual, 1)[1][:, 0]
        residual -= books[lv][codes[:, lv]]
    return codes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=200_000, help="embeddings assigned")
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--codes", type=int, default=256, help="codes per level")
    ap.add_argument("--dim", type=int, default=256, help="embedding dimension")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    cmd = ("python benchmarks/bench_sid_assign.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))).strip()
    print(header(cmd, "bench_sid_assign"), flush=True)
    rng = np.random.default_rng(0)
    shape = {"levels": args.levels, "codes": args.codes, "dim": args.dim}
    x = rng.standard_normal((args.items, args.dim), dtype=np.float32)
    t0 = time.perf_counter()
    books = cb.train(x[: min(len(x), 64 * args.codes)], args.levels, args.codes, niter=10)
    print(f"codebooks {shape} trained on {min(len(x), 64 * args.codes)} embeddings in "
          f"{time.perf_counter() - t0:.1f} s (faiss)")
    peak = gemm_peak(args.repeats)
    ours = best(lambda: cb.assign(books, x), args.repeats)
    peer = best(lambda: faiss_assign(books, x), args.repeats)
    agree = float((cb.assign(books, x) == faiss_assign(books, x)).all(axis=1).mean())
    gflop = 2 * args.items * args.levels * args.codes * args.dim / 1e9
    eff = gflop / ours / peak
    print(f"float32 GEMM peak (numpy, 2048^3): {peak:.1f} GFLOP/s")
    print(f"sid-assign: {args.items / ours:,.0f} items/s ({gflop / ours:.1f} GFLOP/s, {eff:.0%} of the GEMM peak); "
          f"faiss IndexFlatL2 per level: {args.items / peer:,.0f} items/s; ratio {peer / ours:.2f}x; "
          f"the same codes for {agree:.2%} of the items")
    rows = [row("float32 GEMM peak, measured", "GFLOP/s", round(peak, 1), params={"n": 2048}),
            row("sid-assign throughput", "items/s", round(args.items / ours), round(args.items / peer),
                params={**shape, "items": args.items}, efficiency=round(eff, 3))]
    # a server assigning on upsert: per item, the embedding's JSON parse and the assignment, beside
    # the rest of the front's validation of the batch (parse_items)
    server_books = cb.Codebooks(books, np.zeros(books.shape[:2], np.int64))  # what the server loads once
    for batch in (1, 100, 10_000):
        emb = x[:batch].tolist()
        with_emb = orjson.dumps({"items": [{"id": f"n{i}", "token_ids": [5, 6, 7], "embedding": e}
                                           for i, e in enumerate(emb)]})
        without = orjson.dumps({"items": [{"id": f"n{i}", "token_ids": [5, 6, 7]} for i in range(batch)]})
        reps = max(args.repeats, 2000 // batch)
        t_json = best(lambda: orjson.loads(with_emb), reps) - best(lambda: orjson.loads(without), reps)
        objs = orjson.loads(with_emb)["items"]
        t_assign = best(lambda: assign_semantic_ids(objs, server_books), reps)
        t_parse = best(lambda: parse_items(orjson.loads(without)["items"], None, 1000), reps)
        per = (t_json + t_assign) / batch * 1e6
        print(f"upsert of {batch} items: assignment {per:.1f} us/item (JSON {t_json / batch * 1e6:.1f}, assign "
              f"{t_assign / batch * 1e6:.1f}); the rest of the validation {t_parse / batch * 1e6:.1f} us/item")
        rows.append(row("server-side assignment per upserted item", "us", round(per, 2),
                        params={**shape, "batch": batch}, higher_is_better=False))
        rows.append(row("an update's other validation per item", "us", round(t_parse / batch * 1e6, 2),
                        params={"batch": batch}, higher_is_better=False))
    print(f"rerun: {cmd}")
    if not args.no_record:
        path = write_record(
            benchmark="bench_sid_assign", title="Semantic-ID assignment from codebooks", command=cmd, results=rows,
            peer=f"faiss {__import__('faiss').__version__} IndexFlatL2 per level",
            bounds="One float32 GEMM per level and block of 16,384 rows, then argmin and the second minimum; rows "
                   "whose two nearest codewords are closer than float32 rounding can separate are recomputed in "
                   "float64. A server's cost per upserted item is mostly the JSON parse of its embedding.")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
