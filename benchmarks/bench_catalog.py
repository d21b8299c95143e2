"""Production catalogs: catalog load time and peak memory (JSON Lines, Parquet and the npz bundle),
retrieve latency against catalog size and exclusion-list size, and rank by semantic ID vs id token.

    python benchmarks/bench_catalog.py                          # 10^5, 10^6, 10^7 items (run it alone)
    python benchmarks/bench_catalog.py --quick                  # 10^4, 10^5 items, 2 repeats
    python benchmarks/bench_catalog_load.py                     # part 1 alone
    python benchmarks/bench_catalog.py --sizes 100000 --repeats 3 --keep --workdir /tmp/cat

Catalogs: N random items "item<k>" with 1-6 item tokens, an id_token, a 3-token semantic_id (each
level --codes codes in a token range of its own at the top of the vocabulary, so 1024^3 paths and
10^7 items mostly get distinct ones) and attrs {"genre": one of 20, "year": int}. Model: a tiny
random llama (sgrec.tools.make_tiny_model), float32 on CPU, vocabulary 3 * codes + 320; or a real one
with --model-path (its top 3 * codes tokens become the codes).

1. Load: the JSONL is written (not timed), `load_catalog` runs in a fresh subprocess (the call's
   wall time; peak RSS: the child's VmHWM, imports included, ~0.03 GB), the catalog is converted
   with `sgrec.catalog.binary.save` and `sgrec.catalog.parquet.write` (row groups of 2^20 items),
   and the npz and the Parquet file loaded in a fresh subprocess each too.
2. Retrieve: RetrieveExecutor on the catalog (its construction, mostly the trie build, is timed),
   one prompt of --prompt-len tokens put into the radix tree by the warm-up, so every timed
   request hits it (computes the last prompt token + the beam steps); top_k = BW, num_items 10;
   exclusions are random catalog ids, fixed per cell (a cell with exclusions >= N is skipped).
3. Rank: 100 random candidates of the smallest catalog, a --user-len token profile, scored by
   semantic ID (ND 3) and by id token, prefix none (all computed) and item (candidate KV from the
   item store, filled by the warm-up).
Every latency is the median of --repeats after one warm-up. The cells of a table are timed
round-robin (one call of each in turn; every catalog stays loaded), so the machine's drift during
the run lands on every cell alike. On a shared machine, run it alone.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import orjson
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench_engine import cpu_model  # noqa: E402
from bench_xbeam import loadavg  # noqa: E402
from sgrec.beam import RetrieveExecutor  # noqa: E402
from sgrec.catalog import Catalog, binary, load_catalog, parquet  # noqa: E402
from sgrec.radix.tree import RadixCache  # noqa: E402
from sgrec.rank.executor import RankExecutor  # noqa: E402
from sgrec.runner import ModelRunner  # noqa: E402
from sgrec.server_args import ServerArgs  # noqa: E402
from sgrec.tools.make_tiny_model import make_tiny_model  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

ND = 3
EXTRA_VOCAB = 320  # token ids below the semantic-ID codes: item tokens, id tokens, prompts
GENRES = [f"genre{k:02d}" for k in range(20)]
CHUNK = 100_000  # items generated per batch when writing the JSONL
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
TARGETS = {"load_items": 10**7, "load_s": 60.0, "load_gb": 3.0, "exclusions": 1000, "exclusion_ratio": 1.10,
           "size_ratio": 1.5, "size_base": 10**5, "rank_ratio": 2.0, "parquet_gb_to_npz": 1.2}
FORMATS = (("jsonl", "JSON Lines"), ("parquet", "Parquet"), ("npz", "npz bundle"))
# The child's peak RSS: VmHWM, the high-water mark of its own address space. Its ru_maxrss is not
# usable: Linux carries the parent's high-water mark (torch, the model: ~0.8 GB) across fork + exec.
CHILD = """import json, sys, time
from sgrec.catalog import load_catalog
t = time.perf_counter()
c = load_catalog(sys.argv[1], vocab_size=int(sys.argv[2]))
dt = time.perf_counter() - t
kb = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
print(json.dumps({"items": len(c), "s": dt, "rss_kb": kb}))
"""


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            have = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        have = []
    return " ".join(f"{x}={'yes' if x in have else 'no'}" for x in FLAGS)


def header(cmd: str, name: str = "bench_catalog") -> str:
    return (f"# {name}  {datetime.datetime.now().isoformat(timespec='seconds')}\n"
            f"CPU: {cpu_model()} ({os.cpu_count()} cores); flags: {cpu_flags()}\n"
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; load avg {loadavg():.2f}\n"
            f"command: {cmd}")


def write_jsonl(path: str, n: int, codes: int, base: int, seed: int) -> None:
    """N random items as JSON Lines (token ids in [3, base), semantic codes from base up)."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for a in range(0, n, CHUNK):
            m = min(CHUNK, n - a)
            lens = rng.integers(1, 7, m)
            ptr = np.concatenate([[0], np.cumsum(lens)]).tolist()
            toks = rng.integers(3, base, ptr[-1]).tolist()
            idt = rng.integers(3, base, m).tolist()
            sem = (base + np.arange(ND) * codes + rng.integers(0, codes, (m, ND))).tolist()
            genre, year = rng.integers(0, len(GENRES), m).tolist(), rng.integers(1950, 2026, m).tolist()
            f.write(b"".join(orjson.dumps({"id": f"item{a + i}", "token_ids": toks[ptr[i]:ptr[i + 1]],
                                           "id_token": idt[i], "semantic_id": sem[i],
                                           "attrs": {"genre": GENRES[genre[i]], "year": year[i]}}) + b"\n"
                             for i in range(m)))


def child_load(path: str, vocab: int) -> dict:
    """load_catalog of `path` in a fresh interpreter: {items, s (the call's wall time), rss_kb}."""
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(vocab)], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def convert(jsonl: str, npz: str, pq: str, vocab: int) -> tuple[Catalog, float]:
    """The catalog loaded here (for the retrieve and rank runs), saved as the npz bundle and as Parquet."""
    t = time.perf_counter()
    cat = load_catalog(jsonl, vocab_size=vocab)
    binary.save(cat, npz)
    parquet.write(cat, pq)
    return cat, time.perf_counter() - t


def make_runner(model_dir: str, tokens: int, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs.from_kwargs(model_path=model_dir, device="cpu", dtype="float32",
                                              max_total_tokens=tokens, chunked_prefill_size=-1, **kw))


def interleaved(cells: list, run, repeats: int) -> list[list[float]]:
    """Seconds of `repeats` calls run(cell, True) per cell, round-robin over the cells (one warm-up
    call run(cell, False) each first), so that the machine's drift over the run lands on every cell alike."""
    for c in cells:
        run(c, False)
    times: list[list[float]] = [[] for _ in cells]
    for _ in range(repeats):
        for k, c in enumerate(cells):
            t = time.perf_counter()
            run(c, True)
            times[k].append(time.perf_counter() - t)
    return times


def make_retrievers(runner, catalog: Catalog) -> tuple[RetrieveExecutor, RadixCache, float]:
    """(the catalog's RetrieveExecutor, its radix tree, seconds to build it: mostly the trie)."""
    tree = RadixCache(runner.kv_pool.allocator)
    t = time.perf_counter()
    ex = RetrieveExecutor(runner, tree, catalog, max_beam_width=runner.args.max_beam_width)
    return ex, tree, time.perf_counter() - t


def bench_retrieve(runner, executors: list[RetrieveExecutor], base: int, args, rng) -> list[dict]:
    """One row per (catalog size, BW, exclusions) cell, every cell timed round-robin."""
    prompt = rng.integers(3, base, args.prompt_len).tolist()
    cells = []
    for ex in executors:
        cat = ex.catalog
        excl = {e: [cat.ids[r] for r in rng.choice(len(cat), e, replace=False)] or None
                for e in args.exclusions if e < len(cat)}  # fixed per cell (a cell with e >= N is skipped)
        cells += [(ex, bw, e, excl[e]) for bw in args.beam_widths for e in excl]

    def run(cell, timed):
        ex, bw, _, excl = cell
        res = ex.run(prompt, bw, bw, 10, exclude_items=excl)
        assert not timed or res.meta["cached_tokens"] >= args.prompt_len - 1, res.meta  # a cache hit
    times = interleaved(cells, run, args.repeats)
    rows = []
    for (ex, bw, e, _), ts in zip(cells, times):
        rows.append({"items": len(ex.catalog), "bw": bw, "excl": e, "ms": statistics.median(ts) * 1e3,
                     "best": min(ts) * 1e3})
        print(f"  retrieve N={rows[-1]['items']} BW={bw} exclusions={e}: {rows[-1]['ms']:.1f} ms", flush=True)
    return rows


def bench_rank(model_dir: str, catalog: Catalog, base: int, args, rng) -> list[dict]:
    user = rng.integers(3, base, args.user_len).tolist()
    cands = [catalog.ids[r] for r in rng.choice(len(catalog), 100, replace=False)]
    tokens = sum(catalog.token_len(catalog.index[c]) for c in cands)
    runner = make_runner(model_dir, 2 * (args.user_len + tokens) + 100 * ND + 512, item_cache_tokens=tokens + 16)
    ex = RankExecutor(runner, RadixCache(runner.kv_pool.allocator), catalog, runner.args, header_ids=[4, 5, 6])
    cells = [(prefix, score_by) for prefix in ("none", "item") for score_by in ("id_token", "semantic_id")]
    out = {}

    def run(cell, timed):
        out[cell] = ex.run("u0", user, cands, [7, 8, 9], prefix=cell[0], score_by=cell[1])
    times = interleaved(cells, run, args.repeats)
    rows = []
    for (prefix, score_by), ts in zip(cells, times):
        mi = out[(prefix, score_by)]["meta_info"]
        rows.append({"prefix": prefix, "score_by": score_by, "ms": statistics.median(ts) * 1e3,
                     "cached": f"{mi['cached_tokens']} of {mi['prompt_tokens']}"})
        print(f"  rank prefix={prefix} score_by={score_by}: {rows[-1]['ms']:.1f} ms", flush=True)
    return rows


def md_table(head: list[str], body: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
                     + ["| " + " | ".join(str(c) for c in row) + " |" for row in body])


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def report_load(rows: list[dict]) -> None:
    print("\n## 1. Catalog load (fresh subprocess per load)\n")
    print(md_table(["items", *(f"{name} {what}" for _, name in FORMATS for what in ("MB", "load s", "peak RSS GB"))],
                   [[r["items"], *(v for kind, _ in FORMATS for v in (f"{r[kind + '_mb']:.0f}", f"{r[kind]['s']:.2f}",
                                                                       f"{r[kind]['gb']:.2f}"))] for r in rows]))
    big = rows[-1]
    s_pq, s_js = big["parquet"]["s"], big["jsonl"]["s"]
    q = big["parquet"]["gb"] / big["npz"]["gb"]
    print(f"target: Parquet loads faster than JSON Lines: {s_pq:.2f} s against {s_js:.2f} s ({verdict(s_pq < s_js)}); "
          f"its peak RSS within {TARGETS['parquet_gb_to_npz']}x of the npz bundle's: {q:.2f}x "
          f"({verdict(q <= TARGETS['parquet_gb_to_npz'])})")
    for kind in ("jsonl", "npz", "parquet"):
        s, gb = big[kind]["s"], big[kind]["gb"]
        v = (f"{verdict(s <= TARGETS['load_s'])} / {verdict(gb <= TARGETS['load_gb'])}"
             if big["items"] >= TARGETS["load_items"] else "no verdict below 10^7 items")
        print(f"target: {kind} load of 10^7 items <= {TARGETS['load_s']:.0f} s and <= {TARGETS['load_gb']:.0f} GB; "
              f"at {big['items']} items: {s:.2f} s, {gb:.2f} GB ({v})")


def report_retrieve(rows: list[dict], build: dict[int, tuple[float, int]], args) -> None:
    print(f"\n## 2. Retrieve latency (prompt {args.prompt_len} tokens cached in the radix tree after the warm-up; "
          f"top_k = BW, num_items 10; median and best of {args.repeats}; ratios of medians)\n")
    print("trie build (RetrieveExecutor construction): "
          + ", ".join(f"{n} items ({p} distinct paths) {s:.2f} s" for n, (s, p) in build.items()))
    cell = {(r["items"], r["bw"], r["excl"]): r["ms"] for r in rows}
    smallest = {}  # (BW, exclusions) -> the smallest catalog measured at it
    for r in rows:
        smallest.setdefault((r["bw"], r["excl"]), r["items"])
    print(md_table(["items", "BW", "exclusions", "median ms", "best ms", "ratio to 0 excl.",
                    "ratio to smallest catalog"],
                   [[r["items"], r["bw"], r["excl"], f"{r['ms']:.1f}", f"{r['best']:.1f}",
                     f"{r['ms'] / cell[(r['items'], r['bw'], 0)]:.2f}",
                     f"{r['ms'] / cell[(smallest[(r['bw'], r['excl'])], r['bw'], r['excl'])]:.2f}"] for r in rows]))
    E = TARGETS["exclusions"]
    for r in (r for r in rows if r["excl"] == E):
        q = r["ms"] / cell[(r["items"], r["bw"], 0)]
        print(f"target: {E} exclusions add <= 10% (ratio <= {TARGETS['exclusion_ratio']}): N={r['items']} "
              f"BW={r['bw']}: {q:.2f} ({verdict(q <= TARGETS['exclusion_ratio'])})")
    sizes = sorted({r["items"] for r in rows})
    ref = TARGETS["size_base"] if TARGETS["size_base"] in sizes[:-1] else sizes[0]
    for bw in args.beam_widths if len(sizes) > 1 else []:
        q = cell[(sizes[-1], bw, 0)] / cell[(ref, bw, 0)]
        v = verdict(q <= TARGETS["size_ratio"]) if sizes[-1] >= 10**7 and ref == 10**5 else "no verdict"
        print(f"target: retrieve at 10^7 within {TARGETS['size_ratio']}x of 10^5: BW={bw}, "
              f"{sizes[-1]} vs {ref} items, 0 exclusions: {q:.2f}x ({v})")


def report_rank(rows: list[dict], n: int, args) -> None:
    print(f"\n## 3. Rank 100 candidates by semantic ID (ND {ND}) vs by id token ({n}-item catalog, user "
          f"{args.user_len} tokens; median of {args.repeats})\n")
    ms = {(r["prefix"], r["score_by"]): r["ms"] for r in rows}
    print(md_table(["prefix", "score_by", "cached prompt tokens", "median ms", "ratio semantic/id_token"],
                   [[r["prefix"], r["score_by"], r["cached"], f"{r['ms']:.1f}",
                     f"{r['ms'] / ms[(r['prefix'], 'id_token')]:.2f}"] for r in rows]))
    for p in ("none", "item"):
        q = ms[(p, "semantic_id")] / ms[(p, "id_token")]
        print(f"target: semantic/id_token <= {TARGETS['rank_ratio']:.0f}: prefix {p}: {q:.2f} "
              f"({verdict(q <= TARGETS['rank_ratio'])})")


def record_rows(load_rows: list[dict], ret_rows: list[dict], rank_rows: list[dict], n_rank: int) -> list[dict]:
    """The result record's rows: load time and peak RSS per format, retrieve latency beside the same cell
    without exclusions, rank by semantic ID beside rank by id token."""
    out = []
    for r in load_rows:
        for kind, fmt in FORMATS:
            params = {"items": r["items"], "format": fmt}
            out.append(row("catalog load time", "s", r[kind]["s"], params=params, higher_is_better=False))
            out.append(row("catalog load peak RSS", "GB", r[kind]["gb"], params=params, higher_is_better=False))
    no_excl = {(r["items"], r["bw"]): r["ms"] for r in ret_rows if r["excl"] == 0}
    for r in ret_rows:
        peer = no_excl.get((r["items"], r["bw"])) if r["excl"] else None
        out.append(row("retrieve latency (median)", "ms", r["ms"], peer, higher_is_better=False,
                       params={"items": r["items"], "beam_width": r["bw"], "exclusions": r["excl"]}))
    by_id = {r["prefix"]: r["ms"] for r in rank_rows if r["score_by"] == "id_token"}
    for r in rank_rows:
        if r["score_by"] == "semantic_id":
            out.append(row("rank 100 candidates by semantic ID (median)", "ms", r["ms"], by_id.get(r["prefix"]),
                           params={"items": n_rank, "prefix": r["prefix"]}, higher_is_better=False))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="catalog sizes (default 10^5 10^6 10^7)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per cell, after one warm-up (default 5)")
    ap.add_argument("--quick", action="store_true", help="sizes 10^4 10^5 and 2 repeats unless given")
    ap.add_argument("--beam-widths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--exclusions", type=int, nargs="+", default=[0, 1000, 100_000])
    ap.add_argument("--codes", type=int, default=1024, help="semantic-ID codes per level")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--user-len", type=int, default=256, help="rank: user profile tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where the catalogs and the model go (default: a new /tmp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--model-path", default=None,
                    help="a real model (e.g. ~/.cache/sgrec/SmolLM2-135M-Instruct) instead of the tiny random one; "
                         "the semantic-ID codes take the top 3 x --codes tokens of its vocabulary")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args(argv)
    a.sizes = sorted(a.sizes or ([10_000, 100_000] if a.quick else [100_000, 1_000_000, 10_000_000]))
    a.repeats = a.repeats or (2 if a.quick else 5)
    a.exclusions = sorted({0, *a.exclusions})  # the ratios are to 0 exclusions
    return a


def bench_load(n: int, work: str, vocab: int, base: int, args) -> tuple[dict, Catalog]:
    """Writes the N-item JSONL, loads it and its npz bundle in fresh subprocesses: (table row, the
    catalog loaded here). Deletes both files unless --keep."""
    jsonl, npz, pq = (os.path.join(work, f"catalog_{n}.{ext}") for ext in ("jsonl", "npz", "parquet"))
    t = time.perf_counter()
    write_jsonl(jsonl, n, args.codes, base, args.seed + n)
    print(f"[{n} items] JSONL written in {time.perf_counter() - t:.1f} s (not timed)", flush=True)
    try:
        row = {"items": n, "jsonl": child_load(jsonl, vocab)}
        cat, conv_s = convert(jsonl, npz, pq, vocab)
        row["npz"], row["parquet"] = child_load(npz, vocab), child_load(pq, vocab)
        for kind, path in (("jsonl", jsonl), ("npz", npz), ("parquet", pq)):
            row[f"{kind}_mb"] = os.path.getsize(path) / 1e6
            row[kind]["gb"] = row[kind]["rss_kb"] * 1024 / 1e9
    finally:
        for path in (jsonl, npz, pq) if not args.keep else ():
            if os.path.exists(path):
                os.remove(path)
    print(f"[{n} items] loads: JSONL {row['jsonl']['s']:.2f} s, Parquet {row['parquet']['s']:.2f} s, npz "
          f"{row['npz']['s']:.2f} s; converted (JSONL load here + binary.save + parquet.write) in {conv_s:.1f} s",
          flush=True)
    return row, cat


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cmd = ("python benchmarks/bench_catalog.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))).strip()
    print(header(cmd), flush=True)
    own_dir = args.workdir is None
    work = tempfile.mkdtemp(prefix="bench_catalog_", dir="/tmp") if own_dir else args.workdir
    os.makedirs(work, exist_ok=True)
    if args.model_path:
        model_dir = os.path.expanduser(args.model_path)
        with open(os.path.join(model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        print(f"model: {model_dir} (vocabulary {vocab})")
    else:
        vocab = ND * args.codes + EXTRA_VOCAB
    base = vocab - ND * args.codes
    load_rows, ret_rows, build, rank_rows = [], [], {}, []
    try:
        if not args.model_path:
            model_dir = make_tiny_model(os.path.join(work, "model"), arch="llama", seed=args.seed, vocab_size=vocab,
                                        max_position_embeddings=4096)
        # room for every catalog's cached prompt and one request's beams
        runner = make_runner(model_dir, len(args.sizes) * args.prompt_len + max(args.beam_widths) * (ND - 1) + 256,
                             max_beam_width=max(args.beam_widths))
        rng = np.random.default_rng(args.seed)
        executors = []
        for n in args.sizes:  # every catalog stays loaded: the retrieve cells are timed round-robin
            row, cat = bench_load(n, work, vocab, base, args)
            load_rows.append(row)
            ex, _, build_s = make_retrievers(runner, cat)
            build[n] = (build_s, ex.trie.num_nodes[-1])
            executors.append(ex)
            if n == args.sizes[0]:
                rank_rows = bench_rank(model_dir, cat, base, args, rng)
        ret_rows = bench_retrieve(runner, executors, base, args, rng)
        del executors, cat
        gc.collect()
    finally:
        if not args.keep:
            shutil.rmtree(work if own_dir else os.path.join(work, "model"), ignore_errors=True)  # never --model-path
    report_load(load_rows)
    report_retrieve(ret_rows, build, args)
    report_rank(rank_rows, args.sizes[0], args)
    print(f"\nload avg at the end {loadavg():.2f}; files {'kept in ' + work if args.keep else 'deleted'}")
    print(f"rerun: {cmd}")
    if not args.no_record:
        path = write_record(benchmark="bench_catalog",
                            title="Production catalogs: load, retrieve against catalog size and exclusions, rank by semantic ID",
                            command=cmd, results=record_rows(load_rows, ret_rows, rank_rows, args.sizes[0]),
                            peer="the same retrieve without exclusions; rank by id token")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
