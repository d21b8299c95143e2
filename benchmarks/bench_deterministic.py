"""What --enable-deterministic-inference costs (issue 36): the recommendation paths and saturated
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
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402
from bench_roofline import ND, write_catalog  # noqa: E402
from bench_vs_rev import run_side  # noqa: E402

FLAG = "--enable-deterministic-inference"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="~/.cache/sgrec/SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-items", type=int, default=100_000)
    ap.add_argument("--codes", type=int, default=1024)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, default=512)
    ap.add_argument("--candidates", type=int, default=100)
    ap.add_argument("--retrieve-prompt", type=int, default=1024)
    ap.add_argument("--beam-widths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64, help="saturated serving's prompts")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--attention-backend", default="auto",
                    help="the flag-off side's backend (native: the flag's kernels in their default mode)")
    args = ap.parse_args(argv)
    cmd = "python benchmarks/bench_deterministic.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    cmd = cmd.strip()
    print(header(cmd, "bench_deterministic"), flush=True)

    from sgrec.model.config import ModelConfig

    model = os.path.expanduser(args.model_path)
    base = ModelConfig.from_dir(model).vocab_size - ND * args.codes
    tmp = tempfile.mkdtemp()
    catalog = os.path.join(tmp, "items.jsonl")
    write_catalog(catalog, args.num_items, base, args.codes)
    child = {"model": model, "catalog": catalog, "base": base, "dtype": args.dtype, **{k: getattr(args, k) for k in (
        "num_items", "prefill_len", "user_len", "candidates", "retrieve_prompt", "beam_widths", "repeats", "threads")}}
    sides = {"off": {"attention_backend": args.attention_backend}, "on": {"enable_deterministic_inference": True}}
    best: dict[str, dict] = {name: {} for name in sides}
    for r in range(args.rounds):
        for name, kw in sides.items():
            res = run_side(ROOT, {**child, "engine_kw": kw})
            print(f"  round {r + 1}, flag {name}: " + ", ".join(f"{k} {v[0] * 1e3:.0f} ms" for k, v in res.items()),
                  flush=True)
            for k, v in res.items():
                if k not in best[name] or v[0] < best[name][k][0]:
                    best[name][k] = v
    off, on = best["off"], best["on"]
    rows = [[k, f"{off[k][0] * 1e3:.1f}", f"{on[k][0] * 1e3:.1f}", f"{(on[k][0] / off[k][0] - 1) * 100:+.1f}%",
             "-" if on[k][1] is None else ("yes" if off[k][1] == on[k][1] else "no")] for k in on]
    if not args.skip_serving:
        from bench_serving_ab import run_all

        serve = argparse.Namespace(model_path=args.model_path, num_prompts=args.num_prompts, input_len=256,
                                   output_len=64)
        off_flags = ["--dtype", args.dtype, "--attention-backend", args.attention_backend]
        (s_off, s_on) = run_all(serve, [("off", off_flags, None), ("on", ["--dtype", args.dtype, FLAG], None)], tmp)
        name = f"saturated serving 256 in / 64 out, {args.num_prompts} prompts (out tok/s)"
        rows.append([name, s_off[3], s_on[3], f"{(float(s_off[3]) / float(s_on[3]) - 1) * 100:+.1f}%", "-"])
    print()
    print(md_table(["path", "flag off ms", "flag on ms", "cost", "same result"], rows))
    print("(saturated serving: its columns are output tokens per second; cost = off / on - 1)")
    print(f"rerun: {cmd}")


if __name__ == "__main__":
    main()
