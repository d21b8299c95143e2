"""A server on a 10^7-item catalog under updates (the server-level targets): how long a
100-item update takes to be acknowledged, what kept versions cost in memory, and what a second DP
rank costs for the catalog.

    python benchmarks/bench_catalog_server.py                   # 10^7 items, dp-size 1 and 2
    python benchmarks/bench_catalog_server.py --items 1000000 --updates 4 --dp-sizes 1

The catalog is written as a binary bundle (`sgrec.catalog.binary`; columns made directly, as in
bench_catalog_versions: 1-6 item tokens, an id token, a 3-level semantic ID of 1024 codes per level, a
genre and a year) and served by a tiny random model (vocabulary 4096), defaults otherwise
(`--catalog-history 8`, a journal). Per --dp-sizes value, two servers one after the other: one
without the catalog and one with it; the catalog's memory is the difference of the two servers'
process trees (proportional set size, PSS: pages that ranks share are counted once in the sum; the
files of the ranks' shared catalog image count whole, mapped or not, see tree_pss_gib).
On each server with the catalog, --updates upserts of --batch items (half replace random items with new
semantic IDs, half are new), one POST /v1/catalog/items at a time: the time until each is
acknowledged (journaled, every rank switched), then a retrieve restricted to the last new item
must return it, and the memory after the updates (every version kept). Targets: an
update acknowledged in under 0.5 s, memory after 8 kept versions within 10% of one version's,
the catalog's memory at dp-size 2 within 1.2x of dp-size 1's.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table, verdict  # noqa: E402
from sgrec.catalog import image  # noqa: E402
from sgrec.tools.local_server import LocalServer  # noqa: E402
from sgrec.tools.make_tiny_model import make_tiny_model  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

V, CODES, ND = 4096, 1024, 3
BASE = V - ND * CODES

# Runs in a child process, so that the catalog built here is not held by the benchmark's process.
WRITE = r"""
import sys
import numpy as np
from sgrec.catalog import Catalog, binary
from sgrec.catalog.attrs import AttrColumn, AttrTable

n, path, V, CODES, ND = int(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:6])
BASE = V - ND * CODES
rng = np.random.default_rng(0)
ptr = np.concatenate([[0], np.cumsum(rng.integers(1, 7, n))]).astype(np.int64)
attrs = AttrTable(n, {"genre": AttrColumn("str", n, rng.integers(0, 8, n).astype(np.int32), values=[f"g{k}" for k in range(8)]),
                      "year": AttrColumn("num", n, rng.integers(1950, 2026, n).astype(np.float64), present=np.ones(n, bool))})
sem = (BASE + np.arange(ND) * CODES + rng.integers(0, CODES, (n, ND))).astype(np.int32)
binary.save(Catalog.from_columns([f"item{i}" for i in range(n)], rng.integers(3, BASE, int(ptr[-1])).astype(np.int32),
                                 ptr, rng.integers(3, BASE, n), sem, np.ones(n, bool), attrs), path)
"""




def tree_pss_gib(pid: int) -> float:
    """Proportional set size of a process and its children, GiB (shared pages split between them),
    with each file of a shared catalog image that a process maps counted once at its whole allocated
    size, in place of the pages mapped so far: the rank that wrote it left it in memory (the page
    cache, or shared memory when the image is in /dev/shm) whether or not a rank has touched it yet
    (PSS alone would miss the untouched pages), plus each rank's copy-on-write pages of them. Files
    are told apart by inode, read through /proc/PID/map_files, so that one removed while still
    mapped (a trie version being let go of) counts too."""
    root = psutil.Process(pid)
    total, files = 0, {}
    for p in [root, *root.children(recursive=True)]:
        try:
            for m in p.memory_maps(grouped=False):
                if image.PREFIX not in m.path:
                    total += m.pss
                    continue
                total += m.anonymous  # a rank's own copy-on-write pages of the file (its appends)
                try:
                    st = os.stat(f"/proc/{p.pid}/map_files/{m.addr}")
                except OSError:
                    continue
                files[(st.st_dev, st.st_ino)] = st.st_blocks * 512
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return (total + sum(files.values())) / 2**30


def steady_pss(pid: int, settle_s: float = 2.0, readings: int = 30) -> float:
    """The tree's PSS once two readings settle_s apart agree within 1% (start-up's frees done); the last
    reading, with a warning, if they never do within `readings`."""
    last = tree_pss_gib(pid)
    for _ in range(readings):
        time.sleep(settle_s)
        now = tree_pss_gib(pid)
        if abs(now - last) <= 0.01 * max(now, 1e-9):
            return now
        last = now
    print(f"  (memory still moving after {readings * settle_s:.0f} s: {last:.2f} GiB taken)", flush=True)
    return last


def upsert_body(rng: np.random.Generator, u: int, n: int, batch: int) -> dict:
    items = {}
    for j in range(batch):
        item_id = f"item{int(rng.integers(n))}" if j % 2 else f"new{u}_{j}"
        items[item_id] = {"id": item_id, "token_ids": rng.integers(3, BASE, 4).tolist(), "id_token": 7,
                          "semantic_id": (BASE + np.arange(ND) * CODES + rng.integers(0, CODES, ND)).tolist(),
                          "attrs": {"genre": "g1", "year": 2001}}
    return {"items": list(items.values())}


def serve(flags: list[str], work: str, name: str) -> LocalServer:
    return LocalServer(flags, log_path=os.path.join(work, f"{name}.log"), ready_timeout=3600)


def record_rows(memory: dict, a) -> list[dict]:
    """The result record's rows, per dp-size: the upserts' acknowledgement times, the server's start, the
    catalog's memory (PSS over the server without it) with one version and after the updates beside it."""
    out = []
    for dp, m in memory.items():
        params = {"items": a.items, "dp_size": dp}
        one, after = m["one"] - m["plain"], m["after"] - m["plain"]
        out.append(row("update acknowledged (median)", "s", statistics.median(m["acks"]), higher_is_better=False,
                       params={**params, "batch": a.batch}))
        out.append(row("update acknowledged (max)", "s", max(m["acks"]), higher_is_better=False,
                       params={**params, "batch": a.batch}))
        out.append(row("server start with the catalog", "s", m["start_s"], params=params, higher_is_better=False))
        out.append(row("catalog memory (PSS), one version", "GiB", one, params=params, higher_is_better=False))
        out.append(row(f"catalog memory (PSS) after {a.updates} updates, beside one version's", "GiB", after, one,
                       params=params, higher_is_better=False))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=10**7)
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--batch", type=int, default=100, help="items per upsert")
    ap.add_argument("--dp-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args(argv)
    print(header(" ".join(["python", "benchmarks/bench_catalog_server.py", *map(shlex.quote, argv or sys.argv[1:])]),
                 "bench_catalog_server"), flush=True)
    work = a.workdir or tempfile.mkdtemp(prefix="bench-catalog-server-")
    model = make_tiny_model(os.path.join(work, "model"), vocab_size=V, seed=0)
    npz = os.path.join(work, f"catalog_{a.items}.npz")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", WRITE, str(a.items), npz, str(V), str(CODES), str(ND)], cwd=ROOT, check=True)
    print(f"catalog of {a.items:,} items written in {time.perf_counter() - t:.1f} s ({os.path.getsize(npz) / 2**30:.2f} GiB)",
          flush=True)
    base = ["--model-path", model, "--device", "cpu", "--max-total-tokens", "65536"]
    with_cat = ["--item-catalog", npz, "--item-cache-tokens", "4096"]
    memory = {}
    for dp in a.dp_sizes:
        flags = [*base, "--dp-size", str(dp)]
        with serve(flags, work, f"plain-dp{dp}") as srv:
            plain = steady_pss(srv.pid)
        t = time.perf_counter()
        journal = os.path.join(work, f"dp{dp}.journal")
        if os.path.exists(journal):  # a rerun in the same --workdir starts from the catalog file too
            os.remove(journal)
        with serve([*flags, *with_cat, "--catalog-journal", journal], work, f"catalog-dp{dp}") as srv, \
                httpx.Client(base_url=srv.url, timeout=600) as c:
            start_s = time.perf_counter() - t
            one = steady_pss(srv.pid)
            memory[dp] = {"plain": plain, "one": one, "start_s": start_s}
            print(f"dp-size {dp}: started in {start_s:.1f} s; PSS {one:.2f} GiB with the catalog, {plain:.2f} without",
                  flush=True)
            rng = np.random.default_rng(1)
            acks = memory[dp]["acks"] = []
            for u in range(1, a.updates + 1):
                body = upsert_body(rng, u, a.items, a.batch)
                t0 = time.perf_counter()
                r = c.post("/v1/catalog/items", json=body)
                acks.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
                print(f"  dp-size {dp}, update {u}: acknowledged in {acks[-1]:.3f} s", flush=True)
            new_id = next(it["id"] for it in reversed(body["items"]) if it["id"].startswith("new"))
            got = c.post("/v1/retrieve", json={"user": {"token_ids": [11, 12, 13]}, "beam_width": 1, "num_items": 1,
                                               "include_items": [new_id]}).json()
            assert [x["item"] for x in got["items"]] == [new_id], got
            memory[dp]["kept"] = c.get("/v1/catalog").json()["kept_versions"]
            memory[dp]["after"] = steady_pss(srv.pid)
    print()
    rows = []
    for dp, m in memory.items():
        cat = m["one"] - m["plain"]
        rows.append([dp, f"{m['start_s']:.1f}", f"{m['plain']:.2f}", f"{m['one']:.2f}", f"{cat:.2f}",
                     f"{m['after']:.2f}", f"{m['after'] - m['plain']:.2f}", f"{m['after'] / m['one']:.2f}x"])
    print(md_table(["dp-size", "start s", "PSS without catalog GiB", "PSS with catalog GiB", "catalog GiB",
                    f"PSS after {a.updates} updates GiB", "catalog after GiB", "after / one version"], rows))
    for dp, m in memory.items():
        acks = m["acks"]
        print(f"\ndp-size {dp}: {len(acks)} upserts of {a.batch} items acknowledged in median "
              f"{statistics.median(acks):.3f} s, max {max(acks):.3f} s; versions kept: {m['kept']}")
        print(f"an update acknowledged in under 0.5 s: {verdict(max(acks) < 0.5)} (median: "
              f"{verdict(statistics.median(acks) < 0.5)})")
        after = (m["after"] - m["plain"]) / (m["one"] - m["plain"])
        print(f"the catalog's memory after {a.updates} kept versions within 10% of one version's: "
              f"{verdict(after <= 1.10)} ({after:.2f}x; the whole server {m['after'] / m['one']:.2f}x)")
    if 1 in memory and 2 in memory:
        for when, key in (("at start", "one"), (f"after {a.updates} updates", "after")):
            ratio = (memory[2][key] - memory[2]["plain"]) / (memory[1][key] - memory[1]["plain"])
            print(f"the catalog's memory at dp-size 2 within 1.2x of dp-size 1's, {when}: {verdict(ratio <= 1.2)} "
                  f"({ratio:.2f}x)")
    print(f"\nrerun: python benchmarks/bench_catalog_server.py {' '.join(argv or sys.argv[1:])}")
    if not a.no_record and memory:
        cmd = ("python benchmarks/bench_catalog_server.py " + shlex.join(argv or sys.argv[1:])).strip()
        path = write_record(benchmark="bench_catalog_server",
                            title="A server's catalog under updates: ack time and memory",
                            command=cmd, results=record_rows(memory, a),
                            peer="the same catalog with one version (memory)")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
