"""The SGLang plugin's beam step against SGLang's own: one beam group's step as SGLang's
scheduler runs it (the worker's pre-sample capture, `_rows_topk_logprobs`, `BeamCoordinator._select_group`
with joint_select, the commit), for a plain beam request and for an sgrec-sid one (the capture hook
masks every row to its valid children from the trie, the selection hook advances the rows' trie
nodes: tensor operations, no host read per step), at beam widths 32 and 256, on CPU.

    python benchmarks/bench_plugin_beam.py [--vocab 32000] [--items 100000] [--steps 3] [--repeats 20]

Prints the CPU flags, then per width the median step time of each side and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sgrec.tools.results import row, write_record  # noqa: E402


def write_catalog(path: Path, items: int, vocab: int, seed: int = 0) -> None:
    """items with 3-token semantic IDs over 256 codes per level (distinct paths), in sgrec's JSONL."""
    rng = np.random.default_rng(seed)
    codes = rng.choice(256 ** 3, size=items, replace=False)
    base = 1000
    with open(path, "w") as f:
        for i, c in enumerate(codes.tolist()):
            sid = [base + c // 65536, base + 256 + (c // 256) % 256, base + 512 + c % 256]
            assert max(sid) < vocab
            f.write(json.dumps({"id": f"i{i}", "token_ids": [3], "semantic_id": sid}) + "\n")


def step_times(width: int, vocab: int, spec: dict | None, steps: int, repeats: int, seed: int = 0) -> list[float]:
    """Seconds per beam step of one group (the first `steps` decode steps after the prompt, repeated)."""
    from sglang.srt.beam_search.batch_tail import BeamTail, BeamTailEntry
    from sglang.srt.beam_search.beam_group import BeamGroup
    from sglang.srt.beam_search.coordinator import BeamCoordinator, _rows_topk_logprobs
    from sglang.srt.beam_search.logits_capture import capture_pre_sample_logits
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgrec.sglang_plugin import beam, grammar

    g = torch.Generator().manual_seed(seed)
    logits_of = [torch.randn(width, vocab, generator=g) for _ in range(steps + 1)]
    times = []
    for _ in range(repeats):
        group = BeamGroup(beam_width=width, stop_token_ids=[2], max_new_tokens=steps + 4)
        if spec is not None:
            group.sgrec_sid = beam.BeamTrie(grammar.shared_trie().compile(json.dumps(spec)), group.stop_token_ids)
        req = Req("beam", "", array("q", [5, 6, 7]), SamplingParams(max_new_tokens=steps + 4))
        req.beam_group = group
        batch, fb = ScheduleBatch.__new__(ScheduleBatch), ForwardBatch.__new__(ForwardBatch)
        batch.reqs, batch.beam_tail = [req], None
        fb.forward_mode, fb.positions = ForwardMode.EXTEND, torch.zeros(1, dtype=torch.int64)
        for step in range(steps + 1):
            rows = 1 if step == 0 else width
            out = LogitsProcessorOutput(next_token_logits=logits_of[step][:rows].clone())
            t0 = time.perf_counter()
            capture_pre_sample_logits(batch, fb, out)
            cap = out.beam
            pieces = [cap.leader_logits[0:1]] + ([cap.tail_logits] if cap.tail_logits is not None else [])
            top_lp, top_tok = _rows_topk_logprobs(pieces, group.num_candidates)
            BeamCoordinator._select_group(None, group, top_lp, top_tok, step)
            group.commit_pending()
            if step:  # the prompt's step is not a beam step
                times.append(time.perf_counter() - t0)
            batch.beam_tail = BeamTail(num_base_rows=1, entries=[BeamTailEntry(group, 0, 0, width - 1)])
            fb.forward_mode, fb.positions = ForwardMode.DECODE, torch.zeros(width, dtype=torch.int64)
    return times


def record_rows(steps: list[tuple[int, float, float]], args) -> list[dict]:
    """The result record's rows: the sgrec-sid step's median beside SGLang's plain one, per beam width
    (steps: (width, plain ms, sgrec-sid ms))."""
    return [row("beam step time (median)", "ms", sid, plain, higher_is_better=False,
                params={"vocab": args.vocab, "items": args.items, "beam_width": width}) for width, plain, sid in steps]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--items", type=int, default=100000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--widths", default="32,256")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0] if os.path.exists("/proc/cpuinfo") else ""
    print("CPU flags of note:", " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags.split()),
          f"| torch {torch.__version__}, {torch.get_num_threads()} threads")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sgrec.sglang_plugin as plugin

    if plugin.failure:
        sys.exit(plugin.failure)
    from sglang.srt.constrained.base_grammar_backend import GRAMMAR_BACKEND_REGISTRY

    path = Path(tempfile.mkdtemp()) / "catalog.jsonl"
    write_catalog(path, args.items, args.vocab)
    os.environ["SGREC_CATALOG"] = str(path)
    GRAMMAR_BACKEND_REGISTRY["sgrec-sid"](None, None, args.vocab, {2})
    print(f"vocab {args.vocab}, catalog {args.items} items (3 levels of 256 codes), {args.steps} beam steps x "
          f"{args.repeats} repeats per side")
    print("| beam width | SGLang plain step ms (median) | sgrec-sid step ms (median) | ratio |")
    print("|---:|---:|---:|---:|")
    steps = []
    for width in (int(w) for w in args.widths.split(",")):
        plain = statistics.median(step_times(width, args.vocab, None, args.steps, args.repeats)) * 1e3
        sid = statistics.median(step_times(width, args.vocab, {"type": "sgrec-sid"}, args.steps, args.repeats)) * 1e3
        print(f"| {width} | {plain:.2f} | {sid:.2f} | {sid / plain:.2f}x |")
        steps.append((width, plain, sid))
    if not args.no_record and steps:
        import sglang

        cmd = ("python benchmarks/bench_plugin_beam.py " + shlex.join(sys.argv[1:] if argv is None else argv)).strip()
        path = write_record(benchmark="bench_plugin_beam", title="The SGLang plugin's beam step against SGLang's own",
                            command=cmd, results=record_rows(steps, args),
                            peer=f"SGLang {sglang.__version__}'s plain beam step")
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
