"""Catalog load time and peak memory: one catalog as JSON Lines, Parquet and the npz bundle, each loaded
by `load_catalog` in a fresh subprocess (bench_catalog.py's part 1 alone, with its catalogs and its
measurement: the call's wall time, the child's peak RSS).

    python benchmarks/bench_catalog_load.py                     # 10^6 and 10^7 items (run it alone)
    python benchmarks/bench_catalog_load.py --sizes 100000

Targets (issue: Parquet catalogs): Parquet loads faster than JSON Lines, with a peak RSS within 1.2x
of the npz bundle's. Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import EXTRA_VOCAB, ND, bench_load, header, record_rows, report_load  # noqa: E402
from sgrec.tools.results import write_record  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--codes", type=int, default=1024, help="semantic-ID codes per level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    cmd = ("python benchmarks/bench_catalog_load.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))).strip()
    print(header(cmd, "bench_catalog_load"), flush=True)
    vocab = ND * args.codes + EXTRA_VOCAB
    work = tempfile.mkdtemp(prefix="bench_catalog_load_", dir="/tmp")
    rows = []
    try:
        for n in sorted(args.sizes):
            rows.append(bench_load(n, work, vocab, vocab - ND * args.codes, args)[0])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report_load(rows)
    print(f"rerun: {cmd}")
    if not args.no_record:
        path = write_record(benchmark="bench_catalog_load", title="Catalog load: JSON Lines, Parquet and the npz bundle",
                            command=cmd, results=record_rows(rows, [], [], 0))
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
