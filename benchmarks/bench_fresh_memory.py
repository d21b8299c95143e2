"""What touching memory costs on this machine, right after the process freed as much and after an
idle pause (why the first catalog updates after a pause are the slow ones on some VMs).

    python benchmarks/bench_fresh_memory.py                  # 0.48 GB, 4 back to back, 3 after 10 s idle
    python benchmarks/bench_fresh_memory.py --gb 1 --idle 30

A catalog update at 10^7 items makes its trie's arrays anew (about 0.5 GB). Freed memory normally
stays with the machine, and a new allocation costs its page faults and zeroing; a VM with free page
reporting (a virtio balloon; the kernel's `page_reporting.page_reporting_order`) hands freed memory
back to its host within seconds, and touching it again faults it in from the host. This prints the
time to allocate and write --gb of memory (numpy, huge pages as numpy asks for them) several times
back to back (each after the one before was freed) and then each after --idle seconds, with the
kernel's page-fault counters (/proc/vmstat) and its command line's page-reporting setting.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

COUNTERS = ("pgfault", "thp_fault_alloc", "thp_fault_fallback", "compact_stall")


def vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        d = dict(line.split() for line in f)
    return {k: int(d.get(k, 0)) for k in COUNTERS}


def touch(n: int) -> tuple[float, dict[str, int]]:
    before = vmstat()
    t = time.perf_counter()
    a = np.ones(n, dtype=np.int64)
    dt = time.perf_counter() - t
    after = vmstat()
    del a
    return dt, {k: after[k] - before[k] for k in COUNTERS}


def record_rows(rates: list[tuple[str, int, float]], gb: float) -> list[dict]:
    """The result record's rows: each touch's GB/s ((when, #, GB/s) as in the table), those after an idle
    pause beside the median of the back-to-back ones."""
    back = [r for when, _, r in rates if when == "back to back"]
    median = statistics.median(back) if back else None
    return [row("allocate and write memory", "GB/s", r, None if when == "back to back" else median,
                params={"gb": gb, "when": when, "touch": k}) for when, k, r in rates]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=0.48, help="memory touched each time, GB")
    ap.add_argument("--back-to-back", type=int, default=4)
    ap.add_argument("--after-idle", type=int, default=3)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds idle before each of the --after-idle touches")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args(argv)
    print(header(" ".join(["python", "benchmarks/bench_fresh_memory.py", *map(shlex.quote, argv or sys.argv[1:])]),
                 "bench_fresh_memory"), flush=True)
    with open("/proc/cmdline") as f:
        reporting = [w for w in f.read().split() if w.startswith("page_reporting")]
    print(f"kernel page reporting: {' '.join(reporting) or 'not set on the command line'}")
    n = int(a.gb * 1e9) // 8
    rows, rates = [], []
    for k in range(a.back_to_back):
        dt, c = touch(n)
        rows.append(["back to back", k + 1, f"{dt:.3f}", f"{a.gb / dt:.1f}", *(c[x] for x in COUNTERS)])
        rates.append(("back to back", k + 1, a.gb / dt))
    for k in range(a.after_idle):
        time.sleep(a.idle)
        dt, c = touch(n)
        rows.append([f"after {a.idle:g} s idle", k + 1, f"{dt:.3f}", f"{a.gb / dt:.1f}", *(c[x] for x in COUNTERS)])
        rates.append((f"after {a.idle:g} s idle", k + 1, a.gb / dt))
    print(md_table(["when", "#", "s", "GB/s", *COUNTERS], rows))
    print(f"\nrerun: python benchmarks/bench_fresh_memory.py {' '.join(argv or sys.argv[1:])}")
    if not a.no_record and rates:
        cmd = ("python benchmarks/bench_fresh_memory.py " + shlex.join(argv or sys.argv[1:])).strip()
        path = write_record(benchmark="bench_fresh_memory",
                            title="Writing freshly freed memory on the VM: the host's page faults",
                            command=cmd, results=record_rows(rates, a.gb),
                            peer="the same touch back to back (no idle pause)")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
