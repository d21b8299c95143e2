"""Catalog versions at scale: what an update costs a rank, in time and memory, on this
tree (its LayeredTrie, what a server serves, and the dense SemanticIdTrie) and on an earlier
commit, by default the one before versions shared storage (each in its own process, one after the other).

    python benchmarks/bench_catalog_versions.py                       # 10^6 and 10^7 items
    python benchmarks/bench_catalog_versions.py --sizes 1000000 --updates 4
    python benchmarks/bench_catalog_versions.py --baseline-rev none   # this tree only
    python benchmarks/bench_catalog_versions.py --baseline-rev none --tries layered
    python benchmarks/bench_catalog_versions.py --baseline-rev none --tries layered-device dense-device  # a GPU's

The "-device" tries keep the beam step's arrays on a device, as a GPU server (or the Triton trie
step) does: CUDA where there is one, else the CPU standing in for it; an update's time then
includes its copies to the device (synchronized).

Each side builds an N-item catalog in memory (columns made directly: 1-6 item tokens, an id token,
a 3-level semantic ID of 1024 codes per level, a genre and a year) and its semantic-ID trie, then
applies --updates upserts of --batch items each (half replace random items with new semantic IDs,
half are new items), one after the other, keeping every version (CatalogVersions, keep 8, as the
server's --catalog-history default). Timed per update: what a rank's prepare does off the step
(the next version and its trie: `Scheduler.prepare_catalog`'s work, each tree's own way), and the
commit (with sgrec/scheduler/release.py, as a server does it: the old trie handed to a thread
that frees it part by part; its whole time and its largest part are printed). Memory: the process's RSS once the catalog and trie are built (one version), and after the
updates (kept versions and the served trie). Targets (at 10^7): a 100-item update
acknowledged in under 0.5 s; memory after 8 kept versions within 10% of one version's. The ack
time of a server adds the journal's fsync and the messages (not measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table, verdict  # noqa: E402
from bench_serving_ab import worktree  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

BASELINE_REV = "302ae15"  # the last commit before catalog versions shared storage

# Runs in the tree under test; uses only what both trees have: Catalog.from_columns, AttrColumn,
# AttrTable, CatalogVersions.prepare / commit, SemanticIdTrie.from_catalog, and (this tree only)
# SemanticIdTrie.updated, as each tree's Scheduler.prepare_catalog uses them.
CHILD = r"""
import gc, json, sys, time
import numpy as np

from sgrec.beam.trie import SemanticIdTrie
from sgrec.catalog import Catalog
from sgrec.catalog.attrs import AttrColumn, AttrTable
from sgrec.catalog.versions import CatalogVersions

n, updates, batch, seed = map(int, sys.argv[1:5])
kind = sys.argv[5]  # "layered": LayeredTrie (what a server serves); "dense": SemanticIdTrie; "-device": on a device
device = None
if kind.endswith("-device"):
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = kind[: -len("-device")]
if kind == "layered":
    from sgrec.beam.layered import LayeredTrie


def sync():
    if device == "cuda":
        torch.cuda.synchronize()
V, CODES, ND = 4096, 1024, 3
BASE = V - ND * CODES


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


rng = np.random.default_rng(seed)
lens = rng.integers(1, 7, n)
ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
attrs = AttrTable(n, {"genre": AttrColumn("str", n, rng.integers(0, 8, n).astype(np.int32), values=[f"g{k}" for k in range(8)]),
                      "year": AttrColumn("num", n, rng.integers(1950, 2026, n).astype(np.float64), present=np.ones(n, bool))})
sem = (BASE + np.arange(ND) * CODES + rng.integers(0, CODES, (n, ND))).astype(np.int32)
cat = Catalog.from_columns([f"item{i}" for i in range(n)], rng.integers(3, BASE, int(ptr[-1])).astype(np.int32), ptr,
                           rng.integers(3, BASE, n), sem, np.ones(n, bool), attrs)
del sem, ptr, lens, attrs
versions = CatalogVersions(cat, 0, keep=8)
del cat  # what a server keeps: the versions' catalog (this tree moves the columns into storage with room)
t = time.perf_counter()
trie, rows = (LayeredTrie if kind == "layered" else SemanticIdTrie).from_catalog(versions.current, V,
                                                                                   *([device] if device else []))
sync()
build_s = time.perf_counter() - t
rss_one = rss()
gc.collect()
gc.freeze()  # as a server's scheduler does after start-up: no full collection scans the catalog mid-update
incremental = hasattr(SemanticIdTrie, "updated")
try:
    from sgrec.scheduler.release import take_apart
    releasable = True
except ImportError:
    releasable = False
prepare_s, commit_s, release_s, part_max_s = [], [], [], []
for u in range(1, updates + 1):
    items = []
    for j in range(batch):
        item_id = f"item{int(rng.integers(n))}" if j % 2 else f"new{u}_{j}"
        items.append({"id": item_id, "token_ids": rng.integers(3, BASE, 4).tolist(), "id_token": 7,
                      "semantic_id": (BASE + np.arange(ND) * CODES + rng.integers(0, CODES, ND)).tolist(),
                      "attrs": {"genre": "g1", "year": 2001}})
    items = list({it["id"]: it for it in items}.values())
    t = time.perf_counter()
    prepared = versions.prepare({"version": u, "op": "upsert", "items": items}, V)
    applied = prepared.applied
    if incremental:
        new_trie = trie.updated(rows, applied.catalog, applied.removed_rows, applied.added_from)
    else:
        new_trie = SemanticIdTrie.from_catalog(applied.catalog, V)
    sync()
    t2 = time.perf_counter()
    versions.commit(prepared)
    if releasable:  # as a server does: the old trie handed to its releasing thread, taken apart there
        box = [(trie, rows)]
        trie, rows = new_trie
        commit_s.append(time.perf_counter() - t2)
        last, gaps = [time.perf_counter()], []

        def pause():
            now = time.perf_counter()
            gaps.append(now - last[0])
            last[0] = now
        t3 = time.perf_counter()
        take_apart(box, pause)
        release_s.append(time.perf_counter() - t3)
        part_max_s.append(max(gaps))
    else:
        trie, rows = new_trie  # the old trie freed here, on the step
        commit_s.append(time.perf_counter() - t2)
    prepare_s.append(t2 - t)
print(json.dumps({"n": n, "device": device, "build_s": build_s, "prepare_s": prepare_s, "commit_s": commit_s, "rss_one": rss_one,
                  "rss_after": rss(), "kept": len(versions.kept()), "incremental": incremental,
                  "release_s": release_s, "part_max_s": part_max_s}))
"""


def run_side(tree: str, n: int, updates: int, batch: int, seed: int, kind: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(updates), str(batch), str(seed), kind], cwd=tree,
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def record_rows(results: list[tuple[int, str, dict, dict | None]], updates: int) -> list[dict]:
    """The result record's rows: per catalog size and this tree's trie, (n, trie kind, its side's result,
    the baseline commit's or None), each number beside the baseline's."""
    def p50(r):
        return sorted(r["prepare_s"])[len(r["prepare_s"]) // 2]

    measures = [("trie build", "s", lambda r: r["build_s"]), ("update prepare P50", "s", p50),
                ("update prepare max", "s", lambda r: max(r["prepare_s"])),
                ("commit max", "ms", lambda r: max(r["commit_s"]) * 1e3),
                ("RSS, one version", "GiB", lambda r: r["rss_one"] / 2**30),
                (f"RSS after {updates} kept versions", "GiB", lambda r: r["rss_after"] / 2**30)]
    return [row(metric, unit, get(r), None if b is None else get(b),
                params={"items": n, "trie": kind, **({"device": r["device"]} if r.get("device") else {})},
                higher_is_better=False) for n, kind, r, b in results for metric, unit, get in measures]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**7])
    ap.add_argument("--updates", type=int, default=8, help="upserts applied, every version kept (keep 8)")
    ap.add_argument("--batch", type=int, default=100, help="items per upsert")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-rev", default=BASELINE_REV, help="the commit to compare with; none: this tree only")
    ap.add_argument("--tries", nargs="+", default=["layered", "dense"],
                    choices=["layered", "dense", "layered-device", "dense-device"],
                    help="this tree's tries to run: layered (LayeredTrie, what a server serves), dense "
                         "(SemanticIdTrie.updated); -device: the beam step's arrays on a device (CUDA where "
                         "there is one, else the CPU), the update's copies to it included")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    cmd = ("python benchmarks/bench_catalog_versions.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))).strip()
    print(header(cmd, "bench_catalog_versions"), flush=True)
    tmp = tempfile.mkdtemp()
    sides = [(f"this tree, {kind} trie", ROOT, kind) for kind in args.tries]
    base = None
    if args.baseline_rev != "none":
        base = worktree(args.baseline_rev, tmp)
        sides.insert(0, (f"sgrec at {args.baseline_rev}" + (" (before shared-storage versions)" if args.baseline_rev == BASELINE_REV else ""),
                         base, "dense"))
    rows, results = [], []
    try:
        for n in args.sizes:
            got = {}
            for name, tree, kind in sides:
                r = got[name] = run_side(tree, n, args.updates, args.batch, args.seed, kind)
                p = sorted(r["prepare_s"])
                rows.append([f"{n:.0e}", name, f"{r['build_s']:.2f}", f"{p[len(p) // 2]:.3f}", f"{p[-1]:.3f}",
                             f"{max(r['commit_s']) * 1e3:.2f}", f"{r['rss_one'] / 2**30:.2f}",
                             f"{r['rss_after'] / 2**30:.2f}", f"{r['rss_after'] / r['rss_one']:.2f}x"])
                print(" | ".join(rows[-1]), "| each update, s:", " ".join(f"{x:.3f}" for x in r["prepare_s"]), flush=True)
                if r.get("release_s"):
                    print(f"  {name}: the old trie freed off the step: {max(r['release_s']) * 1e3:.1f} ms at most in "
                          f"all, its largest part {max(r['part_max_s']) * 1e3:.1f} ms (the longest the step can wait "
                          f"for it)", flush=True)
            for (first, a), (name, b) in zip(list(got.items())[:1] * (len(got) - 1), list(got.items())[1:]):
                rows.append([f"{n:.0e}", f"ratio ({first} / {name})", f"{a['build_s'] / b['build_s']:.2f}x",
                             f"{sorted(a['prepare_s'])[len(a['prepare_s']) // 2] / sorted(b['prepare_s'])[len(b['prepare_s']) // 2]:.3g}x",
                             f"{max(a['prepare_s']) / max(b['prepare_s']):.3g}x", "", "",
                             f"{a['rss_after'] / b['rss_after']:.2f}x", ""])
            results += [(n, kind, got[name], got[sides[0][0]] if base is not None else None)
                        for name, tree, kind in sides if tree == ROOT]
    finally:
        if base is not None:
            subprocess.run(["git", "worktree", "remove", "--force", base], cwd=ROOT, capture_output=True)
    print()
    print(md_table(["items", "tree", "trie build s", "update P50 s", "update max s", "commit max ms", "RSS 1 version GiB",
                    f"RSS after {args.updates} GiB", "growth"], rows))
    last = {r[1]: r for r in rows if r[0] == f"{max(args.sizes):.0e}"}.get(f"this tree, {args.tries[0]} trie")
    if last is not None:
        print(f"\ntargets at {max(args.sizes):.0e} items: update max {last[4]} s < 0.5 s: "
              f"{verdict(float(last[4]) < 0.5)}; memory after {args.updates} versions {last[8]} within 1.10x: "
              f"{verdict(float(last[8][:-1]) <= 1.10)}")
    if not args.no_record and results:
        path = write_record(benchmark="bench_catalog_versions",
                            title="A rank's catalog update at scale: update time and memory of kept versions",
                            command=cmd, results=record_rows(results, args.updates),
                            peer=None if base is None else sides[0][0])
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
