"""The recommendation paths of bench_roofline timed on this tree and on an earlier commit, each in its
own process, one after the other in one run ("retrieve ... >= 2x today's sgrec", where
today's is the code before the issue's work).

    python benchmarks/bench_vs_rev.py                      # against bebe1e4, SmolLM2-135M, float32
    python benchmarks/bench_vs_rev.py --rev HEAD~3 --repeats 2 --rounds 2

Paths (SmolLM2-135M, float32, each side with its own defaults otherwise): prefill of --prefill-len
tokens; rank of --candidates items of 16 tokens for a --user-len-token user, item-as-prefix, cold
(cache flushed) and warm (items cached, a new user); retrieve with a --retrieve-prompt-token prompt
(cache flushed), beam widths --beam-widths, ND 3 over --num-items items (the catalog bench_roofline
writes, one file for both sides). The prompts are the same token ids on both sides. Each time is the
best of --repeats; --rounds runs the two sides that many times, alternating, and keeps each side's
best. The table prints both times, the ratio, and whether both sides returned the same items
(retrieve) or ranking (rank).
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
from bench_roofline import ND, write_catalog  # noqa: E402
from bench_serving_ab import BASELINE_REV, worktree  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

# Runs in the tree under test (cwd and PYTHONPATH there), so it may use only the Engine API both trees
# share: Engine(model, device, dtype, item_catalog, max_beam_width, log_level), generate, rank,
# retrieve, flush_cache, shutdown; "dtype" and "engine_kw" (more Engine arguments) are for callers
# that run one tree twice (bench_deterministic).
CHILD = r"""
import json, sys, time
import numpy as np
import torch
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
from sgrec import Engine
eng = Engine(a["model"], device="cpu", dtype=a.get("dtype", "float32"), item_catalog=a["catalog"],
             max_beam_width=max(a["beam_widths"]), log_level="warning", **a.get("engine_kw", {}))
rng = np.random.default_rng(1)
ids = lambda n: rng.integers(3, a["base"], n).tolist()

def best(fn):
    fn()  # warm-up
    ts = []
    for _ in range(a["repeats"]):
        t = time.perf_counter(); out = fn(); ts.append(time.perf_counter() - t)
    return min(ts), out

res = {}
prompt = ids(a["prefill_len"])
def prefill():
    eng.flush_cache()
    eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0})
res["prefill %d" % a["prefill_len"]] = [best(prefill)[0], None]
cands = ["i%d" % k for k in rng.choice(a["num_items"], a["candidates"], replace=False).tolist()]
user = ids(a["user_len"])
def rank_cold():
    eng.flush_cache()
    return eng.rank({"token_ids": user}, cands, prefix="item", score_by="id_token")
t, out = best(rank_cold)
res["rank %dx16, item-prefix, cold" % a["candidates"]] = [t, [r["item"] for r in out["ranking"]]]
users = [ids(a["user_len"]) for _ in range(a["repeats"] + 2)]  # one per call: a new user each time
def rank_warm():
    return eng.rank({"token_ids": users.pop()}, cands, prefix="item", score_by="id_token")
rank_warm()
t, out = best(rank_warm)
res["rank %dx16, item-prefix, warm" % a["candidates"]] = [t, [r["item"] for r in out["ranking"]]]
prompt = ids(a["retrieve_prompt"])
for bw in a["beam_widths"]:
    def retrieve():
        eng.flush_cache()
        return eng.retrieve({"token_ids": prompt}, beam_width=bw, num_items=10)
    t, out = best(retrieve)
    res["retrieve %d tok, BW %d" % (a["retrieve_prompt"], bw)] = [t, [r["item"] for r in out["items"]]]
eng.shutdown()
print("RESULT " + json.dumps(res))
"""


def run_side(tree: str, args: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=tree, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        sys.exit(f"the run in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def add_path_args(ap: argparse.ArgumentParser) -> None:
    """The model, catalog and paths' options (bench_deterministic's too)."""
    ap.add_argument("--model-path", default="~/.cache/sgrec/SmolLM2-135M-Instruct")
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


def child_args(args, model: str, catalog: str, base: int) -> dict:
    """What CHILD reads, from the parsed options."""
    return {"model": model, "catalog": catalog, "base": base, **{k: getattr(args, k) for k in (
        "num_items", "prefill_len", "user_len", "candidates", "retrieve_prompt", "beam_widths", "repeats", "threads")}}


def prepare(args) -> tuple[str, dict]:
    """A temporary folder holding the catalog both sides read, and CHILD's arguments."""
    from sgrec.model.config import ModelConfig

    model = os.path.expanduser(args.model_path)
    base = ModelConfig.from_dir(model).vocab_size - ND * args.codes
    tmp = tempfile.mkdtemp()
    catalog = os.path.join(tmp, "items.jsonl")
    write_catalog(catalog, args.num_items, base, args.codes)
    return tmp, child_args(args, model, catalog, base)


def best_of_rounds(sides: dict[str, tuple[str, dict]], rounds: int) -> dict[str, dict]:
    """Each side (name -> (tree, CHILD's arguments)) run `rounds` times, alternating; per side and path
    the best time (and that run's result)."""
    best: dict[str, dict] = {name: {} for name in sides}
    for r in range(rounds):
        for name, (tree, child) in sides.items():
            res = run_side(tree, child)
            print(f"  round {r + 1}, {name}: " + ", ".join(f"{k} {v[0] * 1e3:.0f} ms" for k, v in res.items()),
                  flush=True)
            for k, v in res.items():
                if k not in best[name] or v[0] < best[name][k][0]:
                    best[name][k] = v
    return best


def record_rows(old: dict, new: dict, args) -> list[dict]:
    """The result record's rows: each path's best time on this tree beside the earlier commit's."""
    params = {"model": os.path.basename(os.path.expanduser(args.model_path).rstrip("/")), "dtype": "float32"}
    return [row(k, "ms", new[k][0] * 1e3, old[k][0] * 1e3, params=params, higher_is_better=False) for k in new]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default=BASELINE_REV, help="the earlier commit (default: the last before the C kernels)")
    add_path_args(ap)
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    cmd = ("python benchmarks/bench_vs_rev.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))).strip()
    print(header(cmd, "bench_vs_rev"), flush=True)

    tmp, child = prepare(args)
    old_tree = worktree(args.rev, tmp)
    try:
        best = best_of_rounds({args.rev: (old_tree, child), "this tree": (ROOT, child)}, args.rounds)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", old_tree], cwd=ROOT, capture_output=True)
    old, new = best[args.rev], best["this tree"]
    rows = [[k, f"{old[k][0] * 1e3:.1f}", f"{new[k][0] * 1e3:.1f}", f"{old[k][0] / new[k][0]:.2f}",
             "-" if new[k][1] is None else ("yes" if old[k][1] == new[k][1] else "no")] for k in new]
    print()
    print(md_table(["path", f"{args.rev} ms", "this tree ms", "speed-up", "same result"], rows))
    print(f"rerun: {cmd}")
    if not args.no_record:
        path = write_record(benchmark="bench_vs_rev",
                            title="Recommendation paths against an earlier commit", command=cmd,
                            results=record_rows(old, new, args), peer=f"sgrec at {args.rev}")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
