"""Retrieve on the CPU's LayeredTrie against the dense SemanticIdTrie: what the leaf
level's runs, slots and overlays cost a request, side by side on one catalog version.

    python benchmarks/bench_layered_retrieve.py                    # 10^6 items, 20 updates of 100
    python benchmarks/bench_layered_retrieve.py --items 10000000 --updates 50

Builds an N-item catalog in memory (a 3-level semantic ID of 1024 codes per level, a genre), a
tiny model (`sgrec.tools.make_tiny_model`, the default dtype: bfloat16 where the CPU has
AVX-512-BF16 or AMX) and one RetrieveExecutor, applies --updates upserts of 100 items as a server
does (`RetrieveExecutor.updated_trie`: the served LayeredTrie gets a tail of runs and changed
slots), then serves the same version from its LayeredTrie and from the dense trie built from
scratch, alternating, per case: beam width 128 and 512, 1,000 exclusions, an attribute filter.
Prints the median latency of each, their ratio, and whether both returned the same items.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402

from sgrec.beam.executor import RetrieveExecutor  # noqa: E402
from sgrec.beam.trie import SemanticIdTrie  # noqa: E402
from sgrec.catalog import Catalog  # noqa: E402
from sgrec.catalog.attrs import AttrColumn, AttrTable  # noqa: E402
from sgrec.catalog.update import apply_update, parse_items  # noqa: E402
from sgrec.radix.tree import RadixCache  # noqa: E402
from sgrec.runner import ModelRunner  # noqa: E402
from sgrec.server_args import ServerArgs  # noqa: E402
from sgrec.tools.make_tiny_model import make_tiny_model  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

V, CODES, ND = 4096, 1024, 3
BASE = V - ND * CODES


def record_rows(medians: list[tuple[str, float, float]], a) -> list[dict]:
    """The result record's rows: per case (name, LayeredTrie s, SemanticIdTrie s), the LayeredTrie's median
    latency beside the dense trie's."""
    return [row("retrieve latency (median)", "ms", lay * 1e3, den * 1e3, higher_is_better=False,
                params={"items": a.items, "updates": a.updates, "case": name}) for name, lay, den in medians]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=10**6)
    ap.add_argument("--updates", type=int, default=20, help="upserts of 100 items before the timed requests")
    ap.add_argument("--repeats", type=int, default=5, help="timed requests per case and trie, per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds alternating the two tries")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(header(" ".join(["python", "benchmarks/bench_layered_retrieve.py", *map(shlex.quote, argv or sys.argv[1:])]),
                 "bench_layered_retrieve"), flush=True)
    n = a.items
    path = make_tiny_model(tempfile.mkdtemp(prefix="bench-layered-"), vocab_size=V, seed=0)
    runner = ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", max_total_tokens=8192))
    rng = np.random.default_rng(0)
    sem = (BASE + np.arange(ND) * CODES + rng.integers(0, CODES, (n, ND))).astype(np.int32)
    attrs = AttrTable(n, {"genre": AttrColumn("str", n, rng.integers(0, 8, n).astype(np.int32),
                                              values=[f"g{k}" for k in range(8)])})
    cat = Catalog.from_columns([f"item{i}" for i in range(n)], np.full(n, 5, np.int32), np.arange(n + 1),
                               np.full(n, -1), sem, np.ones(n, bool), attrs)
    ex = RetrieveExecutor(runner, RadixCache(runner.kv_pool.allocator), cat)
    assert ex.trie.layered, "the executor serves a LayeredTrie"
    for u in range(a.updates):
        items = [{"id": f"item{int(rng.integers(n))}" if j % 2 else f"new{u}_{j}", "token_ids": [5],
                  "semantic_id": (BASE + np.arange(ND) * CODES + rng.integers(0, CODES, ND)).tolist(),
                  "attrs": {"genre": "g1"}} for j in range(100)]
        res = apply_update(cat, parse_items(list({i["id"]: i for i in items}.values()), None, V))
        ex.use_catalog(res.catalog, ex.updated_trie(res))
        cat = res.catalog
    layered = ex.built
    dense = SemanticIdTrie.from_catalog(cat, V)
    t = layered[0]
    print(f"{n} items, dtype {runner.dtype}; after {a.updates} updates the LayeredTrie's tail holds {t.tail_tok.size} "
          f"run entries and {t.ov_slot.size} changed slots over a base of {t.B} leaves", flush=True)
    prompt = rng.integers(3, BASE, 256).tolist()
    exclude = [f"item{i}" for i in rng.integers(0, n, 1000)]
    cases = [("BW 128", dict(beam_width=128, top_k=128, num_items=128)),
             ("BW 512", dict(beam_width=512, top_k=512, num_items=512)),
             ("BW 128, 1,000 exclusions", dict(beam_width=128, top_k=128, num_items=128, exclude_items=exclude)),
             ("BW 128, attribute filter", dict(beam_width=128, top_k=128, num_items=128,
                                                filter={"genre": {"in": ["g1", "g2"]}}))]
    times: dict = {}
    items: dict = {}
    for _ in range(a.rounds):
        for name, kw in cases:
            for kind, built in (("layered", layered), ("dense", dense)):
                ex.use_catalog(cat, built)
                ex.run(prompt, **kw)  # warm: the prompt's KV in the tree, the filter's counts cached
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    out = ex.run(prompt, **kw)
                    times.setdefault((name, kind), []).append(time.perf_counter() - t0)
                items[(name, kind)] = [it["item"] for it in out.items]
    rows, medians = [], []
    for name, _ in cases:
        lay, den = np.median(times[(name, "layered")]), np.median(times[(name, "dense")])
        medians.append((name, float(lay), float(den)))
        rows.append([name, f"{lay * 1e3:.2f}", f"{den * 1e3:.2f}", f"{lay / den:.3f}x",
                     "yes" if items[(name, "layered")] == items[(name, "dense")] else "NO"])
    print()
    print(md_table(["case", "LayeredTrie ms", "SemanticIdTrie ms", "ratio", "same items"], rows))
    print(f"\nrerun: python benchmarks/bench_layered_retrieve.py --items {n} --updates {a.updates}")
    if not a.no_record:
        cmd = ("python benchmarks/bench_layered_retrieve.py " + shlex.join(argv or sys.argv[1:])).strip()
        path = write_record(benchmark="bench_layered_retrieve", command=cmd,

title="Retrieve on the layered trie against the dense trie", results=record_rows(medians, a),
                            peer="the dense SemanticIdTrie built from scratch, same catalog version")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
