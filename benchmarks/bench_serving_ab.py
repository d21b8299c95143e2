"""Saturated serving throughput of several server configurations, one after another in one run
("bench_serving saturated output tok/s (256 in / 64 out) >= 2x today's, same machine").

    python benchmarks/bench_serving_ab.py                 # SmolLM2-135M, the three configurations below
    python benchmarks/bench_serving_ab.py --num-prompts 16 --model-path DIR

Each configuration is a real server (`python -m sgrec.launch_server` on loopback, SmolLM2 by
default) driven by `python -m sgrec.bench_serving` at request rate inf: --num-prompts random
prompts of exactly 256 tokens, exactly 64 output tokens (ignore_eos), greedy, after 8 warm-up
requests. Configurations (flags added to the server's):

* torch, float32: `--attention-backend torch --dtype float32`: attention over gathered K/V (torch's
  SDPA), float32, packed weights (the float32 defaults before sgrec's C attention kernels);
* native, float32: `--attention-backend native --dtype float32`: sgrec's C decode and extend
  kernels (what `--attention-backend auto` picks for float32 on an AVX-512 CPU);
* defaults: no flag: `--attention-backend auto --dtype auto` (bfloat16 where the CPU multiplies it
  natively, with torch attention, since auto keeps bfloat16 on torch's SDPA; float32 elsewhere);
* defaults, --cpu-threads 1: the forward on one thread (not in the default set: `--configs` names it).

With --baseline-rev REV (default bebe1e4, the last commit before the C kernels: float32, plain
weights, torch attention over gathered K/V, the "today's" of the issue), a first row runs that
commit's server with its defaults from a `git worktree` of REV, so the ratios are against it.
--baseline-rev none leaves it out.

The table gives each one's output tok/s, req/s, mean TTFT and mean ITL, and its ratio to the first.
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

from bench_catalog import header, md_table  # noqa: E402
from sgrec.tools.local_server import LocalServer  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

CONFIGS = {
    "torch, float32": ["--attention-backend", "torch", "--dtype", "float32"],
    "native, float32": ["--attention-backend", "native", "--dtype", "float32"],
    "defaults (auto, auto)": [],
    "defaults, --cpu-threads 1": ["--cpu-threads", "1"],  # a core left to the HTTP process
}
DEFAULT_CONFIGS = ["torch, float32", "native, float32", "defaults (auto, auto)"]
BASELINE_REV = "bebe1e4"  # the parent of 639fa46, the C kernels' first commit


def worktree(rev: str, where: str) -> str:
    """A detached checkout of rev under where (removed from git's list at exit by the caller)."""
    path = os.path.join(where, f"sgrec-{rev}")
    subprocess.run(["git", "worktree", "add", "--detach", path, rev], cwd=ROOT, check=True, capture_output=True)
    return path


def record_rows(results: list[tuple[str, dict]], args) -> list[dict]:
    """The result record's rows: each configuration's bench_serving numbers ((name, its result row) in run
    order) beside the first configuration's (the baseline commit's where there is one)."""
    model = os.path.basename(os.path.expanduser(args.model_path).rstrip("/"))
    first = results[0][1] if results else None
    out = []
    for k, (name, r) in enumerate(results):
        peer = first if k else {}
        p = {"model": model, "server": name, "num_prompts": args.num_prompts, "input_len": args.input_len,
             "output_len": args.output_len}
        out += [row("saturated output throughput", "tok/s", r["output_throughput"], peer.get("output_throughput"),
                    params=p),
                row("saturated request throughput", "req/s", r["request_throughput"], peer.get("request_throughput"),
                    params=p)]
        out += [row(f"mean {what}", "ms", r[key], peer.get(key), params=p, higher_is_better=False)
                for what, key in (("TTFT", "mean_ttft_ms"), ("ITL", "mean_itl_ms")) if r.get(key) is not None]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="~/.cache/sgrec/SmolLM2-135M-Instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="names of the configurations to run")
    ap.add_argument("--baseline-rev", default=BASELINE_REV,
                    help="a commit whose server (its defaults) runs first, the ratios' base; none: no such row")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    cmd = ("python benchmarks/bench_serving_ab.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))).strip()
    print(header(cmd, "bench_serving_ab"), flush=True)
    tmp = tempfile.mkdtemp()
    runs = [(name, CONFIGS[name], None) for name in args.configs]
    tree, raw = None, []
    if args.baseline_rev != "none":
        tree = worktree(args.baseline_rev, tmp)
        what = " (before the C kernels)" if args.baseline_rev == BASELINE_REV else ""
        runs.insert(0, (f"sgrec at {args.baseline_rev}{what}, its defaults", [], tree))
    try:
        rows = run_all(args, runs, tmp, raw)
    finally:
        if tree:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)
    print()
    print(md_table(["server", "done", "failed", "out tok/s", "ratio", "req/s", "TTFT mean ms", "ITL mean ms"], rows))
    print(f"rerun: {cmd}")
    if not args.no_record and raw:
        path = write_record(benchmark="bench_serving_ab",
                            title="Saturated serving throughput of server configurations, side by side",
                            command=cmd, results=record_rows([(run[0], r) for run, r in zip(runs, raw)], args),
                            peer=runs[0][0])
        print(f"result record: {path}")


def run_all(args, runs, tmp: str, raw: list | None = None) -> list[list]:
    """The table's rows, one per (name, flags, tree) of runs; each run's bench_serving result row appended to
    `raw` where given."""
    rows, first = [], None
    for name, config, root in runs:
        flags = ["--model-path", os.path.expanduser(args.model_path), "--device", "cpu", "--max-total-tokens", "65536",
                 *config]
        out = os.path.join(tmp, f"{len(rows)}.json")
        with LocalServer(flags, os.path.join(tmp, f"{len(rows)}.log"), root=root) as srv:
            subprocess.run([sys.executable, "-m", "sgrec.bench_serving", "--base-url", srv.url, "--backend", "sgrec",
                            "--dataset", "random", "--num-prompts", str(args.num_prompts), "--random-input-len",
                            str(args.input_len), "--random-output-len", str(args.output_len), "--random-range-ratio",
                            "1.0", "--request-rate", "inf", "--warmup-requests", "8", "--seed", "1", "--timeout",
                            "1800", "--output-file", out, "--disable-tqdm"], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
            startup = [ln for ln in srv.read_log().splitlines() if "--dtype auto" in ln or "KV pool:" in ln]
        with open(out) as f:
            r = json.load(f)["results"][0]
        first = first or r
        if raw is not None:
            raw.append(r)
        rows.append([name, r["completed"], r["failed"], f"{r['output_throughput']:.1f}",
                     f"{r['output_throughput'] / first['output_throughput']:.2f}", f"{r['request_throughput']:.2f}",
                     f"{r['mean_ttft_ms']:.0f}", f"{r['mean_itl_ms']:.0f}"])
        print(f"  {name}: {r['output_throughput']:.1f} out tok/s; " + " | ".join(s.split("] ")[-1] for s in startup),
              flush=True)
    return rows


if __name__ == "__main__":
    main()
