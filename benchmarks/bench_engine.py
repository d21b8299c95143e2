"""Engine-core throughput: sgrec vs HF transformers, same model, same machine, same prompts.

    python benchmarks/bench_engine.py                       # tiny + SmolLM2-135M-Instruct
    python benchmarks/bench_engine.py --models tiny --repeats 5 --json out.json

What is measured (identically on both sides, float32, greedy, batch of B equal-length prompts
of P seeded random token ids; every timing is the best (minimum) of --repeats runs):

* prefill tok/s = B * P / t_prefill
    - sgrec: t_prefill = one `Engine.generate(max_new_tokens=1)` call over the batch: the
      whole prompt forward, the lm_head on the last position only, sampling the first token,
      and the scheduler/Engine overhead. Nothing is subtracted.
    - HF:    t_prefill = one `model(input_ids, attention_mask).logits` forward over the batch
      (HF computes logits for all B*P positions: that is what a plain forward does).
* decode tok/s = B * (K - 1) / (t_gen(K) - t_gen(1))
    - t_gen(K) is a full generation of K new tokens (sgrec `Engine.generate` with
      max_new_tokens=K, ignore_eos; HF `model.generate` with max_new_tokens=min_new_tokens=K),
      t_gen(1) the same with one new token, so the difference is K - 1 decode steps
      (prefill, and any per-call setup, cancel out).

The radix cache is disabled so repeated prompts are really recomputed. Both sides run in this
one process with torch.set_num_threads(--threads), warmed up once on the same shapes before
timing, and the runs of the two sides are interleaved so that machine drift hits both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import warnings

import torch

TARGETS = {  # (batch, phase) -> minimum sgrec/HF ratio, from the issue
    (1, "prefill"): 1.0,
    (1, "decode"): 1.0,
    (16, "decode"): 2.0,
}
DEFAULT_PROMPT_LEN = {"tiny": 128, "smollm2": 256}
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
class SgrecSide:
    name = "sgrec"

    def __init__(self, path: str, max_tokens: int):
        from sgrec import Engine

        self.engine = Engine(
            path, device="cpu", dtype="float32", max_total_tokens=max_tokens, disable_radix_cache=True
        )

    def generate(self, prompts: list[list[int]], k: int) -> list[list[int]]:
        outs = self.engine.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": k, "temperature": 0, "ignore_eos": True},
        )
        ids = [o["output_ids"] for o in outs]
        assert all(len(x) == k for x in ids), [len(x) for x in ids]
        return ids

    prefill = None  # sgrec's prefill time is its generate(max_new_tokens=1) time


class HFSide:
    name = "HF"

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
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

    def generate(self, prompts: list[list[int]], k: int) -> list[list[int]]:
        ids, mask = self._tensors(prompts)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=k,
                min_new_tokens=k,
                pad_token_id=self.pad_token_id,
            )
        new = out[:, ids.shape[1]:]
        assert new.shape[1] == k, new.shape
        return new.tolist()

    def prefill(self, prompts: list[list[int]]) -> None:
        ids, mask = self._tensors(prompts)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        assert logits.shape[:2] == ids.shape


# ---- timing ---------------------------------------------------------------------------------
def timed(fn, *a) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def bench_model(label: str, path: str, args, prompt_len: int) -> list[dict]:
    vocab = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    max_b = max(args.batch_sizes)
    k = args.decode_tokens
    t0 = time.perf_counter()
    sides = [SgrecSide(path, max_tokens=max_b * (prompt_len + k) * 2 + 64), HFSide(path)]
    print(f"  loaded both sides in {time.perf_counter() - t0:.1f}s (HF attention: {sides[1].attn_impl})", flush=True)
    rows = []
    for b in args.batch_sizes:
        g = torch.Generator().manual_seed(args.seed + 1000 * b + prompt_len)
        prompts = torch.randint(0, vocab, (b, prompt_len), generator=g).tolist()
        times = {s.name: {"prefill": [], "gen1": [], "genK": []} for s in sides}
        outputs = {}
        for s in sides:  # warm-up on the same shapes
            if s.prefill:
                s.prefill(prompts)
            s.generate(prompts, 1)
            s.generate(prompts, min(k, 4))
        for r in range(args.repeats):
            order = sides if r % 2 == 0 else sides[::-1]
            for s in order:
                t1 = timed(s.generate, prompts, 1)
                times[s.name]["gen1"].append(t1)
                times[s.name]["prefill"].append(timed(s.prefill, prompts) if s.prefill else t1)
                t = time.perf_counter()
                outputs[s.name] = s.generate(prompts, k)
                times[s.name]["genK"].append(time.perf_counter() - t)
        agree = sum(a == h for a, h in zip(outputs["sgrec"], outputs["HF"])) / b
        for phase in ("prefill", "decode"):
            tps = {}
            for s in sides:
                t = {key: min(v) for key, v in times[s.name].items()}
                if phase == "prefill":
                    tps[s.name] = b * prompt_len / t["prefill"]
                else:
                    tps[s.name] = b * (k - 1) / max(t["genK"] - t["gen1"], 1e-9)
            target = TARGETS.get((b, phase))
            ratio = tps["sgrec"] / tps["HF"]
            row = dict(
                model=label, batch=b, phase=phase, prompt_len=prompt_len, decode_tokens=k,
                hf_tok_s=tps["HF"], sgrec_tok_s=tps["sgrec"], ratio=ratio,
                target=target, met=None if target is None else ratio >= target,
                greedy_agreement=agree,
                times_s={n: {key: [round(x, 5) for x in v] for key, v in d.items()} for n, d in times.items()},
            )
            rows.append(row)
            print(
                f"  batch {b:>2} {phase:<7}  HF {tps['HF']:>10.1f} tok/s   sgrec {tps['sgrec']:>10.1f} tok/s"
                f"   ratio {ratio:5.2f}",
                flush=True,
            )
        for s in sides:
            med = {key: statistics.median(v) for key, v in times[s.name].items()}
            print(
                f"    {s.name:>5} median s: prefill {med['prefill']:.4f}  gen(1) {med['gen1']:.4f}"
                f"  gen({k}) {med['genK']:.4f}",
                flush=True,
            )
        print(f"    identical greedy outputs (sgrec vs HF): {agree:.0%} of the batch", flush=True)
    del sides
    return rows


# ---- report ---------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    head = ["model", "prompt", "batch", "phase", "HF tok/s", "sgrec tok/s", "ratio", "target", "met?"]
    body = []
    for r in rows:
        t = r["target"]
        body.append([
            r["model"], str(r["prompt_len"]), str(r["batch"]), r["phase"],
            f"{r['hf_tok_s']:.1f}", f"{r['sgrec_tok_s']:.1f}", f"{r['ratio']:.2f}",
            "-" if t is None else f">= {t:g}x", "-" if t is None else ("yes" if r["met"] else "NO"),
        ])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep, *map(line, body)])


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
    ap.add_argument("--prompt-len", type=int, default=None,
                    help=f"prompt tokens per sequence (default: {DEFAULT_PROMPT_LEN})")
    ap.add_argument("--decode-tokens", type=int, default=64, help="new tokens per sequence in the decode run")
    ap.add_argument("--batch-sizes", type=ints, default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the best is kept")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smollm2-wait", type=int, default=SMOLLM2_WAIT_S,
                    help="seconds to keep retrying if SmolLM2 is not prepared yet")
    ap.add_argument("--json", default=None, help="write the results to this file")
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

    started = time.perf_counter()
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
            print(f"[{m}] {path}  prompt {plen} tokens, {args.decode_tokens} new tokens, "
                  f"best of {args.repeats}", flush=True)
            rows += bench_model(m, path, args, plen)
    elapsed = time.perf_counter() - started
    print()
    print(table(rows))
    cmd = "python benchmarks/bench_engine.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    print(f"\ntotal {elapsed:.0f}s")
    print(f"rerun: {cmd.strip()}")
    if args.json:
        meta = dict(
            date=datetime.date.today().isoformat(), cpu=cpu_model(), cores=os.cpu_count(),
            threads=args.threads, torch=torch.__version__, transformers=transformers.__version__,
            command=cmd.strip(), repeats=args.repeats, statistic="min", elapsed_s=elapsed,
        )
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
