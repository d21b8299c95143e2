"""Engine-core throughput: sgrec vs HF transformers, same model, same machine, same prompts.

    python benchmarks/bench_engine.py                       # tiny + SmolLM2-135M-Instruct
    python benchmarks/bench_engine.py --models tiny --repeats 5 --json out.json

What is measured (float32 unless --dtype bfloat16, greedy, a batch of B equal-length prompts of P seeded random token
ids, the same ids on both sides; each number uses the best (minimum) time of --repeats runs):

* prefill tok/s = B * P / t_prefill, for a prefill-only call
    - sgrec: one `Engine.generate(max_new_tokens=1)` over the batch: prompt forward, lm_head on
      the last position only, first-token sampling, scheduler/Engine overhead. Nothing subtracted.
      With the default chunked_prefill_size (2048) a batch of more tokens is prefilled in
      several scheduler steps.
    - HF:    one `model(input_ids, attention_mask).logits` forward over the batch. HF computes
      logits for all B * P positions (what a plain forward does), which sgrec does not.
* ttft tok/s = B * P / (time from the start of a K-token generate() call until every sequence
  has its first token). HF's generate() keeps only the last position's logits in prefill; no
  target.
* decode tok/s = tokens produced after that moment / (time of the last token - that moment),
  inside the same call. That is B * (K - 1) tokens in K - 1 decode steps when the prefill is one
  step (always for HF); each side's full per-step loop counts (model, sampling, bookkeeping),
  the prefill does not. HF `model.generate(max_new_tokens=K, min_new_tokens=K,
  do_sample=False)` is timed by a StoppingCriteria that never stops (called once per token);
  sgrec `Engine.generate(max_new_tokens=K, temperature=0, ignore_eos=True)` by wrapping the
  scheduler's step() on the instance (sgrec's source is not touched).

The radix cache is disabled so repeated prompts are really recomputed. Both sides run in this
one process with torch.set_num_threads(--threads), warmed up once on the same shapes before
timing, and the runs of the two sides are interleaved (order alternating per repeat) so that
machine drift hits both. On a shared 2-core machine other processes wreck the numbers (one busy
core made 2-thread runs ~10x slower), so each timed call records how many cores other processes
used meanwhile, such calls are retried, and the "quiet runs" column says how many were clean.
Results and method notes: docs/performance.md, section "bench_engine (engine core)".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import warnings

import torch

from sgrec.tools.results import row, write_record

TARGETS = {  # (batch, phase) -> minimum sgrec/HF ratio, from the issue
    (1, "prefill"): 1.0,
    (1, "decode"): 1.0,
    (16, "decode"): 2.0,
}
DEFAULT_PROMPT_LEN = {"tiny": 128, "smollm2": 256}
DEFAULT_REPEATS = {"tiny": 10, "smollm2": 3}  # tiny's calls take milliseconds: more of them
SMOLLM2_WAIT_S = 20 * 60
SMOLLM2_POLL_S = 60


# ---- models ---------------------------------------------------------------------------------
def tiny_model_path(tmp: str) -> str:
    from sgrec.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(os.path.join(tmp, "tiny-llama"), arch="llama")


def smollm2_path(wait_s: int) -> str:
    """prepare_smollm2() may not be usable yet (package or tool still being set up): retry."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            from sgrec.tools.prepare_smollm2 import prepare_smollm2

            return prepare_smollm2()
        except Exception as e:  # ImportError, RuntimeError("... not installed"), ...
            if time.monotonic() >= deadline:
                raise RuntimeError(f"SmolLM2 is not available: {e}") from e
            print(f"  SmolLM2 not ready ({e}); retrying in {SMOLLM2_POLL_S}s", flush=True)
            time.sleep(SMOLLM2_POLL_S)
            sys.modules.pop("sgrec.tools.prepare_smollm2", None)


# ---- the two sides --------------------------------------------------------------------------
# Each side's generate() returns (new token ids, Timeline). The timeline is measured inside the
# call: `first` is when every sequence had its first token, `last` when the last token came,
# and `window_tokens` how many tokens were produced in between (B * (K - 1) when all prompts
# are prefilled in one step; sgrec may split the prefill into several batches, run at most
# chunked_prefill_size tokens each, with decode steps of the already-started requests between
# them, and those tokens then fall before `first`).


@dataclasses.dataclass
class Timeline:
    first: float
    last: float
    window_tokens: int


class SgrecSide:
    name = "sgrec"

    def __init__(self, path: str, max_tokens: int, packed: bool = False, dtype: str = "float32"):
        from sgrec import Engine

        self.engine = Engine(
            path, device="cpu", dtype=dtype, max_total_tokens=max_tokens, disable_radix_cache=True,
            disable_weight_packing=not packed,
        )
        self.packed = self.engine.runner.packed  # oneDNN-prepacked weights (the CPU default)
        # Record the end of every scheduler step and how many requests got a token in it (wraps
        # the instance attribute; sgrec's source is untouched). step() returns the requests that
        # got a new token (or finished) in that step.
        sched, self._steps = self.engine.scheduler, []
        step = sched.step

        def recorded_step():
            reqs = step()
            self._steps.append((time.perf_counter(), [r.rid for r in reqs]))
            return reqs

        sched.step = recorded_step

    def generate(self, prompts: list[list[int]], k: int) -> tuple[list[list[int]], Timeline]:
        self._steps.clear()
        outs = self.engine.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": k, "temperature": 0, "ignore_eos": True},
        )
        ids = [o["output_ids"] for o in outs]
        assert all(len(x) == k for x in ids), [len(x) for x in ids]
        seen, produced, first = set(), 0, None
        for t, rids in self._steps:
            seen.update(rids)
            produced += len(rids)
            if len(seen) >= len(prompts):
                first = t
                break
        assert first is not None and sum(len(r) for _, r in self._steps) == len(prompts) * k
        return ids, Timeline(first, self._steps[-1][0], len(prompts) * k - produced)

    def prefill(self, prompts: list[list[int]]) -> None:
        """A prefill-only request: max_new_tokens=1 (prompt forward + first-token sampling)."""
        self.generate(prompts, 1)


class _Stamp:
    """A StoppingCriteria that never stops and records when each new token was chosen."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class HFSide:
    name = "HF"

    def __init__(self, path: str, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        cfg = self.model.config
        gc = self.model.generation_config
        pad = gc.pad_token_id if gc.pad_token_id is not None else cfg.pad_token_id
        if pad is None:
            eos = gc.eos_token_id if gc.eos_token_id is not None else cfg.eos_token_id
            pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        self.pad_token_id = pad
        self.attn_impl = getattr(cfg, "_attn_implementation", None)

    @staticmethod
    def _tensors(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        # Equal-length prompts: left padding is a no-op, the mask is all ones.
        ids = torch.tensor(prompts, dtype=torch.int64)
        return ids, torch.ones_like(ids)

    def generate(self, prompts: list[list[int]], k: int) -> tuple[list[list[int]], Timeline]:
        from transformers import StoppingCriteriaList

        ids, mask = self._tensors(prompts)
        stamp = _Stamp()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=k,
                min_new_tokens=k,
                pad_token_id=self.pad_token_id,
                stopping_criteria=StoppingCriteriaList([stamp]),
            )
        new = out[:, ids.shape[1]:]
        assert new.shape[1] == k and len(stamp.stamps) == k, (new.shape, len(stamp.stamps))
        return new.tolist(), Timeline(stamp.stamps[0], stamp.stamps[-1], len(prompts) * (k - 1))

    def prefill(self, prompts: list[list[int]]) -> None:
        """One forward over the batch; HF computes logits for every position."""
        ids, mask = self._tensors(prompts)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        assert logits.shape[:2] == ids.shape


# ---- timing ---------------------------------------------------------------------------------
# The machine may be shared: every timed call also records how many cores *other* processes
# kept busy meanwhile (machine-wide busy time from /proc/stat, steal included, minus this
# process's own CPU time, over the wall time). A call where that exceeds --max-others is
# retried (up to --retries times, after waiting up to --quiet-wait s for a quiet moment), and
# the best time is taken over the quiet calls if there are any.


def _cpu_snapshot() -> tuple[float, float] | None:
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    t = os.times()
    return (sum(v) - v[3] - v[4]) / hz, t.user + t.system


def _others(c0, c1, wall: float) -> float:
    """Other processes' average busy cores; 0 when unknown or the call was too short to tell
    (/proc/stat counts in 10 ms ticks)."""
    if c0 is None or c1 is None or wall < 0.2:
        return 0.0
    return max(0.0, ((c1[0] - c0[0]) - (c1[1] - c0[1])) / wall)


def wait_quiet(max_wait: float, threshold: float) -> tuple:
    """Sleeps in 0.5 s windows until other processes use <= threshold cores (or max_wait passes).
    Returns the CPU snapshot and time at the start of the last window."""
    start = time.perf_counter()
    while True:
        c0, t0 = _cpu_snapshot(), time.perf_counter()
        time.sleep(0.5)
        if time.perf_counter() - start >= max_wait or _others(c0, _cpu_snapshot(), time.perf_counter() - t0) <= threshold:
            return c0, t0


def measure(fn, args) -> tuple[object, float, float]:
    """(fn's result, wall seconds, cores used by other processes meanwhile). For a call too short
    to judge from /proc/stat, the window also covers the 0.5 s quiet check just before it."""
    for attempt in range(1 + args.retries):
        pre = None
        if args.quiet_wait > 0:
            pre = wait_quiet(args.quiet_wait if attempt else min(args.quiet_wait, 2.0), args.max_others)
        c0, t0 = _cpu_snapshot(), time.perf_counter()
        res = fn()
        end = time.perf_counter()
        c1, wall = _cpu_snapshot(), end - t0
        others = _others(c0, c1, wall) if wall >= 0.2 or pre is None else _others(pre[0], c1, end - pre[1])
        if others <= args.max_others:
            break
    return res, wall, others


def bench_model(label: str, path: str, args, prompt_len: int, repeats: int) -> list[dict]:
    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    max_b = max(args.batch_sizes)
    k = args.decode_tokens
    t0 = time.perf_counter()
    sides = [SgrecSide(path, max_tokens=max_b * (prompt_len + k) * 2 + 64, packed=not args.disable_weight_packing,
                       dtype=args.dtype),
             HFSide(path, dtype=args.dtype)]
    print(f"  loaded both sides in {time.perf_counter() - t0:.1f}s (HF attention: {sides[1].attn_impl}; sgrec weights "
          f"{'packed' if sides[0].packed else 'plain'})", flush=True)
    rows = []
    for b in args.batch_sizes:
        g = torch.Generator().manual_seed(args.seed + 1000 * b + prompt_len)
        prompts = torch.randint(0, vocab, (b, prompt_len), generator=g).tolist()
        # samples[side][phase] = [(seconds, other processes' cores during the call), ...]
        samples = {s.name: {"prefill": [], "ttft": [], "decode": []} for s in sides}
        outputs, window_tokens = {}, {}
        for s in sides:  # warm-up on the same shapes (sgrec's prefill is a generate call)
            if s.name == "HF":
                s.prefill(prompts)
            s.generate(prompts, min(k, 4))
        for r in range(repeats):
            for s in (sides if r % 2 == 0 else sides[::-1]):
                _, wall, others = measure(lambda: s.prefill(prompts), args)
                samples[s.name]["prefill"].append((wall, others))
                (start, (outputs[s.name], tl)), wall, others = measure(
                    lambda: (time.perf_counter(), s.generate(prompts, k)), args
                )
                samples[s.name]["ttft"].append((tl.first - start, others))
                samples[s.name]["decode"].append((tl.last - tl.first, others))
                window_tokens[s.name] = tl.window_tokens
        agree = sum(x == y for x, y in zip(outputs["sgrec"], outputs["HF"])) / b
        for phase in ("prefill", "ttft", "decode"):
            tps, quiet = {}, {}
            for s in sides:
                xs = samples[s.name][phase]
                ok = [t for t, o in xs if o <= args.max_others]
                quiet[s.name] = len(ok)
                best = min(ok or [t for t, _ in xs])
                tokens = window_tokens[s.name] if phase == "decode" else b * prompt_len
                tps[s.name] = tokens / max(best, 1e-9)
            target = TARGETS.get((b, phase))
            ratio = tps["sgrec"] / tps["HF"]
            rows.append(dict(
                model=label, batch=b, phase=phase, prompt_len=prompt_len, decode_tokens=k, repeats=repeats,
                hf_tok_s=tps["HF"], sgrec_tok_s=tps["sgrec"], ratio=ratio,
                target=target, met=None if target is None else ratio >= target,
                quiet_runs=f"{min(quiet.values())}/{repeats}", greedy_agreement=agree,
                samples={n: [[round(t, 5), round(o, 2)] for t, o in d[phase]] for n, d in samples.items()},
            ))
            print(
                f"  batch {b:>2} {phase:<7}  HF {tps['HF']:>10.1f} tok/s   sgrec {tps['sgrec']:>10.1f} tok/s"
                f"   ratio {ratio:5.2f}   [s (others' cores): HF {_fmt(samples['HF'][phase])};"
                f" sgrec {_fmt(samples['sgrec'][phase])}]",
                flush=True,
            )
        print(f"    identical greedy outputs (sgrec vs HF): {agree:.0%} of the batch", flush=True)
    del sides
    return rows


def _fmt(xs: list[tuple[float, float]]) -> str:
    return " ".join(f"{t:.3f}({o:.1f})" for t, o in xs)


# ---- report ---------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    head = ["model", "prompt", "batch", "phase", "HF tok/s", "sgrec tok/s", "ratio", "target", "met?", "quiet runs"]
    body = []
    for r in rows:
        t = r["target"]
        body.append([
            r["model"], str(r["prompt_len"]), str(r["batch"]), r["phase"],
            f"{r['hf_tok_s']:.1f}", f"{r['sgrec_tok_s']:.1f}", f"{r['ratio']:.2f}",
            "-" if t is None else f">= {t:g}x", "-" if t is None else ("yes" if r["met"] else "NO"),
            r["quiet_runs"],
        ])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *map(line, body)])


def record_rows(rows: list[dict], dtype: str) -> list[dict]:
    """The result record's rows: sgrec's tok/s beside HF's per model, batch size and phase."""
    return [row(f"{r['phase']} throughput", "tok/s", r["sgrec_tok_s"], r["hf_tok_s"], ratio=r["ratio"],
                params={"model": r["model"], "batch": r["batch"], "prompt_len": r["prompt_len"],
                        "decode_tokens": r["decode_tokens"], "dtype": dtype}) for r in rows]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--models", default="tiny,smollm2", help="comma list of: tiny, smollm2")
    ap.add_argument("--disable-weight-packing", action="store_true",
                    help="run sgrec with --disable-weight-packing (plain float32 weights, HF's summation order)")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help=f"prompt tokens per sequence (default: {DEFAULT_PROMPT_LEN})")
    ap.add_argument("--decode-tokens", type=int, default=64, help="new tokens per sequence in the decode run")
    ap.add_argument("--batch-sizes", type=ints, default=[1, 16])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="both sides' dtype (bfloat16: what --dtype auto picks on AVX-512-BF16/AMX CPUs; greedy "
                         "outputs may then part from HF's where bfloat16 rounds differently)")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"timed runs per measurement, the best is kept (default: {DEFAULT_REPEATS})")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-others", type=float, default=0.3,
                    help="a timed call is 'quiet' if other processes used at most this many cores meanwhile")
    ap.add_argument("--retries", type=int, default=1, help="extra tries for a call that was not quiet")
    ap.add_argument("--quiet-wait", type=float, default=20.0,
                    help="before a retry, wait up to this many seconds for other processes to go quiet (0: never)")
    ap.add_argument("--smollm2-wait", type=int, default=SMOLLM2_WAIT_S,
                    help="seconds to keep retrying if SmolLM2 is not prepared yet")
    ap.add_argument("--json", default=None, help="write the results to this file")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    a = ap.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    bad = set(a.models) - set(DEFAULT_PROMPT_LEN)
    if bad:
        ap.error(f"unknown model(s) {sorted(bad)}; choose from {sorted(DEFAULT_PROMPT_LEN)}")
    if a.decode_tokens < 2:
        ap.error("--decode-tokens must be at least 2")
    return a


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    import transformers

    started, cpu0 = time.perf_counter(), _cpu_snapshot()
    print(
        f"CPU: {cpu_model()} ({os.cpu_count()} cores), torch {torch.__version__} "
        f"({args.threads} threads), transformers {transformers.__version__}",
        flush=True,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.models:
            plen = args.prompt_len or DEFAULT_PROMPT_LEN[m]
            path = tiny_model_path(tmp) if m == "tiny" else smollm2_path(args.smollm2_wait)
            reps = args.repeats or DEFAULT_REPEATS[m]
            print(f"[{m}] {path}  prompt {plen} tokens, {args.decode_tokens} new tokens, "
                  f"best of {reps}", flush=True)
            rows += bench_model(m, path, args, plen, reps)
    elapsed = time.perf_counter() - started
    others = _others(cpu0, _cpu_snapshot(), elapsed)
    print()
    print(table(rows))
    print(
        "\nprefill: sgrec generate(max_new_tokens=1) vs HF model(...) forward (logits at all positions);"
        "\nttft: prompt tokens / time until every sequence has its first token inside generate();"
        "\ndecode: tokens after that moment / time to the last token, same call. Best of N runs;"
        f"\n'quiet runs': runs during which other processes used <= {args.max_others} cores"
        "\n(the best is taken among those when there are any)."
    )
    cmd = "python benchmarks/bench_engine.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    print(f"\ntotal {elapsed:.0f}s; other processes kept {others:.2f} of {os.cpu_count()} cores busy on average")
    print(f"rerun: {cmd.strip()}")
    if args.json:
        meta = dict(
            date=datetime.date.today().isoformat(), cpu=cpu_model(), cores=os.cpu_count(),
            threads=args.threads, torch=torch.__version__, transformers=transformers.__version__,
            command=cmd.strip(), statistic="min", elapsed_s=elapsed, others_cores_avg=others,
        )
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        print(f"wrote {args.json}")
    if not args.no_record:
        path = write_record(benchmark="bench_engine", title="Engine-core throughput against HF transformers",
                            command=cmd.strip(), results=record_rows(rows, args.dtype),
                            peer=f"HF transformers {transformers.__version__}")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
