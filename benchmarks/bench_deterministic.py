"""What --enable-deterministic-inference costs: the recommendation paths and saturated
serving with the flag off and on, side by side in one run, on this machine.

    python benchmarks/bench_deterministic.py                       # SmolLM2-135M, --dtype auto
    python benchmarks/bench_deterministic.py --dtype float32 --rounds 2
    python benchmarks/bench_deterministic.py --skip-serving --num-items 20000
    python benchmarks/bench_deterministic.py --attention-backend native   # the same kernels, flag off

Paths (bench_vs_rev's, each side in its own process, the same prompts): prefill of --prefill-len
tokens; rank of --candidates items of 16 tokens for a --user-len-token user, item-as-prefix, cold
(item KV computed) and warm (items cached, a new user); retrieve of a --retrieve-prompt-token prompt
at beam widths 128 and 512 (ND 3, --num-items items). Each time is the best of --repeats; --rounds
alternates the two sides and keeps each side's best. Serving: bench_serving_ab's saturated run
(--num-prompts prompts of 256 tokens, 64 output tokens, rate inf) against a real server per side.
The table gives both times, the flag's cost (on / off - 1), and whether both sides ranked and
retrieved the same items (the flag changes rounding, so a near-tie may order differently). The flag
runs sgrec's C kernels whatever the CPU, while auto picks them only on AVX-512 CPUs: on others,
--attention-backend native isolates the cost of the deterministic mode from the change of kernels.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402
from bench_vs_rev import add_path_args, best_of_rounds, prepare  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

FLAG = "--enable-deterministic-inference"


def record_rows(off: dict, on: dict, serving: list | None, args) -> list[dict]:
    """The result record's rows: each path's best time with the flag on beside the flag off; saturated
    serving's output tok/s (bench_serving_ab's rows, on and off) the same way."""
    params = {"dtype": args.dtype, "model": os.path.basename(os.path.expanduser(args.model_path).rstrip("/"))}
    out = [row(k, "ms", on[k][0] * 1e3, off[k][0] * 1e3, params=params, higher_is_better=False) for k in on]
    if serving is not None:
        s_off, s_on = serving
        out.append(row("saturated serving output throughput", "tok/s", float(s_on[3]), float(s_off[3]),
                       params={**params, "input_len": 256, "output_len": 64, "num_prompts": args.num_prompts}))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_path_args(ap)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64, help="saturated serving's prompts")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--attention-backend", default="auto",
                    help="the flag-off side's backend (native: the flag's kernels in their default mode)")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    cmd = "python benchmarks/bench_deterministic.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    cmd = cmd.strip()
    print(header(cmd, "bench_deterministic"), flush=True)

    tmp, child = prepare(args)
    child["dtype"] = args.dtype
    sides = {"off": {"attention_backend": args.attention_backend}, "on": {"enable_deterministic_inference": True}}
    best = best_of_rounds({f"flag {name}": (ROOT, {**child, "engine_kw": kw}) for name, kw in sides.items()},
                          args.rounds)
    off, on = best["flag off"], best["flag on"]
    rows = [[k, f"{off[k][0] * 1e3:.1f}", f"{on[k][0] * 1e3:.1f}", f"{(on[k][0] / off[k][0] - 1) * 100:+.1f}%",
             "-" if on[k][1] is None else ("yes" if off[k][1] == on[k][1] else "no")] for k in on]
    serving = None
    if not args.skip_serving:
        from bench_serving_ab import run_all

        serve = argparse.Namespace(model_path=args.model_path, num_prompts=args.num_prompts, input_len=256,
                                   output_len=64)
        off_flags = ["--dtype", args.dtype, "--attention-backend", args.attention_backend]
        serving = run_all(serve, [("off", off_flags, None), ("on", ["--dtype", args.dtype, FLAG], None)], tmp)
        (s_off, s_on) = serving
        name = f"saturated serving 256 in / 64 out, {args.num_prompts} prompts (out tok/s)"
        rows.append([name, s_off[3], s_on[3], f"{(float(s_off[3]) / float(s_on[3]) - 1) * 100:+.1f}%", "-"])
    print()
    print(md_table(["path", "flag off ms", "flag on ms", "cost", "same result"], rows))
    print("(saturated serving: its columns are output tokens per second; cost = off / on - 1)")
    print(f"rerun: {cmd}")
    if not args.no_record:
        path = write_record(benchmark="bench_deterministic", title="What --enable-deterministic-inference costs",
                            command=cmd, results=record_rows(off, on, serving, args),
                            peer=f"sgrec with the flag off (--attention-backend {args.attention_backend})")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
