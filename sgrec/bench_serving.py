"""Online serving benchmark against a running sgrec (or SGLang) server, in the spirit of SGLang's
`python -m sglang.bench_serving`.

    python -m sgrec.bench_serving --num-prompts 64 --random-input-len 256 --random-output-len 64 \\
        --random-range-ratio 1 --request-rate 1,2,4,inf --plot bench_out/latency.png

For each request rate (Poisson arrivals; `inf` sends everything at once) the same prompts are
streamed to the server (`--backend sgrec`: native `POST /generate`; `openai`: `/v1/completions`)
and per request it records TTFT (first chunk carrying at least one output token), the gaps between
later token-carrying chunks (a chunk with k new tokens counts as k inter-token latencies of gap/k),
E2E latency and the output-token count the server reports. Failed requests (non-200, an error
chunk, a broken stream, the overall --timeout) are counted and reported, never fatal.
The prefix cache is flushed (`/flush_cache`, or vLLM's `/reset_prefix_cache`) before every rate so a
rate does not reuse the KV of the previous one (or of the warm-up requests). Needs
`pip install -e ".[bench]"` (httpx; matplotlib for --plot).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class Request:
    prompt: str | list[int]  # text, or token ids
    prompt_len: int  # tokens; 0 = unknown until the server reports it
    output_len: int


@dataclass
class Record:
    """One request's outcome. Times in seconds; `start` is relative to the start of its rate's run."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0  # requested
    output_tokens: int = 0  # received
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0


# ---- metrics (pure) ----------------------------------------------------------------------------
def summarize(values: list[float], scale: float = 1000.0) -> dict:
    """mean and P50/P90/P99 (numpy's linear interpolation) of `values` * scale; None when empty."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float) * scale
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def compute_metrics(records: list[Record], duration: float) -> dict:
    """Aggregate metrics of one run: throughputs over `duration` seconds count completed requests
    only; latencies in ms. TPOT = (E2E - TTFT) / (output tokens - 1) per request."""
    ok = [r for r in records if r.success]
    tin, tout = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    m = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": tin,
        "total_output_tokens": tout,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(tin),
        "output_throughput": per_s(tout),
        "errors": dict(Counter(r.error for r in records if not r.success).most_common(5)),
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "itl": [x for r in ok for x in r.itl],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "e2e": [r.e2e for r in ok],
    }
    for name, values in series.items():
        for stat, v in summarize(values).items():
            m[f"{stat}_{name}_ms"] = v
    return m


# ---- datasets ----------------------------------------------------------------------------------
def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, vocab: list[int],
                    seed: int) -> list[Request]:
    """SGLang's random dataset: lengths uniform in [max(int(len * ratio), 1), len], token ids
    uniform over `vocab`."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(max(int(input_len * range_ratio), 1), input_len + 1, size=n)
    outs = rng.integers(max(int(output_len * range_ratio), 1), output_len + 1, size=n)
    vocab_arr = np.asarray(vocab)
    return [Request(rng.choice(vocab_arr, size=int(i)).tolist(), int(i), int(o)) for i, o in zip(ins, outs)]


def jsonl_requests(path: str, n: int) -> list[Request]:
    """The first n lines of a JSONL file of {"prompt": str, "output_len": int}."""
    reqs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                reqs.append(Request(obj["prompt"], 0, int(obj["output_len"])))
                if len(reqs) == n:
                    break
    if len(reqs) < n:
        print(f"warning: {path} has only {len(reqs)} prompts (asked for {n})", file=sys.stderr)
    return reqs


def vocab_ids(tokenizer_path: str) -> list[int]:
    """Token ids of the tokenizer that are not special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    special = set(tok.all_special_ids)
    return [i for i in range(len(tok)) if i not in special]


# ---- one request -------------------------------------------------------------------------------
def request_body(backend: str, req: Request, model: str, ignore_eos: bool) -> dict:
    if backend == "sgrec":
        key = "input_ids" if isinstance(req.prompt, list) else "text"
        return {key: req.prompt, "stream": True, "sampling_params": {
            "max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos}}
    return {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def token_counts(backend: str, chunk: dict, seen: int) -> tuple[int, int]:
    """(prompt tokens or 0, cumulative output tokens) reported by one stream chunk."""
    if backend == "sgrec":
        meta = chunk.get("meta_info") or {}
        return meta.get("prompt_tokens") or 0, meta.get("completion_tokens", len(chunk.get("output_ids") or []))
    usage = chunk.get("usage")
    if usage:
        return usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    # A server without continuous usage stats: count text-carrying chunks.
    return 0, seen + any(c.get("text") for c in chunk.get("choices") or [])


async def send(client: httpx.AsyncClient, backend: str, url: str, req: Request, model: str,
               ignore_eos: bool) -> Record:
    rec = Record(prompt_len=req.prompt_len, output_len=req.output_len)
    start = last = time.perf_counter()
    n, done = 0, False
    try:
        async with client.stream("POST", url, json=request_body(backend, req, model, ignore_eos)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"error chunk: {json.dumps(chunk['error'])[:200]}"
                    return rec
                now = time.perf_counter()
                prompt, count = token_counts(backend, chunk, n)
                rec.prompt_len = prompt or rec.prompt_len
                if count > n:
                    if n == 0:
                        rec.ttft = now - start
                    else:
                        rec.itl += [(now - last) / (count - n)] * (count - n)
                    n, last = count, now
    except Exception as e:  # noqa: BLE001 - any failure of one request is recorded, not raised
        rec.error = f"{type(e).__name__}: {e}"[:200]
        return rec
    rec.e2e, rec.output_tokens = time.perf_counter() - start, n
    if not done:
        rec.error = "stream ended without [DONE]"
    elif n == 0 and req.output_len > 0:
        rec.error = "no output tokens"
    else:
        rec.success = True
    return rec


# ---- one rate ----------------------------------------------------------------------------------
def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s) of n requests: Poisson arrivals at `rate` req/s, the first at 0; all 0 at inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()][:n]


async def run_rate(client: httpx.AsyncClient, args, url: str, model: str, requests: list[Request],
                   rate: float, deadline: float) -> tuple[list[Record], float]:
    from tqdm import tqdm

    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    pbar = tqdm(total=len(requests), desc=f"rate={rate:g}", disable=args.disable_tqdm)
    t0 = time.perf_counter()

    async def one(req: Request, at: float) -> Record:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        async with sem:
            started = time.perf_counter() - t0
            rec = await send(client, args.backend, url, req, model, not args.disable_ignore_eos)
        rec.start = started
        pbar.update(1)
        return rec

    tasks = [asyncio.create_task(one(r, at)) for r, at in zip(requests, arrival_times(len(requests), rate, args.seed))]
    await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
    duration = time.perf_counter() - t0
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    pbar.close()
    records = [t.result() if not t.cancelled() and t.exception() is None else
               Record(error="timeout (--timeout)", prompt_len=r.prompt_len, output_len=r.output_len)
               for t, r in zip(tasks, requests)]
    return records, duration


# ---- reporting ---------------------------------------------------------------------------------
def rate_label(rate) -> str:
    return f"{rate:g}" if isinstance(rate, (int, float)) else str(rate)


def fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def result_table(rate: float, m: dict, args) -> str:
    rows = [("Backend", args.backend), ("Request rate (req/s)", f"{rate:g}"),
            ("Max concurrency", args.max_concurrency or "none"),
            ("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", m["duration_s"]), ("Total input tokens", m["total_input_tokens"]),
            ("Total output tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"]),
            ("Input token throughput (tok/s)", m["input_throughput"]),
            ("Output token throughput (tok/s)", m["output_throughput"])]
    for name, title in (("ttft", "TTFT"), ("itl", "ITL"), ("tpot", "TPOT"), ("e2e", "E2E")):
        rows += [(f"{stat.capitalize()} {title} (ms)", m[f"{stat}_{name}_ms"])
                 for stat in ("mean", *(f"p{p}" for p in PERCENTILES))]
    lines = [f"{' Serving Benchmark Result ':=^60}"] + [f"{k + ':':<42}{fmt(v)}" for k, v in rows]
    lines += [f"{'Errors:':<42}{e!r} x{c}" for e, c in m["errors"].items()]
    return "\n".join(lines + ["=" * 60])


SUMMARY_COLS = [("rate", "request_rate"), ("done", "completed"), ("failed", "failed"), ("dur s", "duration_s"),
                ("req/s", "request_throughput"), ("in tok/s", "input_throughput"),
                ("out tok/s", "output_throughput")] + [
    (f"{t} {s}", f"{s}_{n}_ms") for n, t, stats in (("ttft", "TTFT", ("mean", "p50", "p90", "p99")),
                                                     ("itl", "ITL", ("mean", "p50", "p99")),
                                                     ("e2e", "E2E", ("mean", "p50", "p90", "p99")))
    for s in stats]


def summary_table(results: list[dict]) -> str:
    """A markdown table, one row per rate (latencies in ms)."""
    lines = ["| " + " | ".join(c for c, _ in SUMMARY_COLS) + " |", "|" + "---:|" * len(SUMMARY_COLS)]
    for res in results:
        cells = [fmt(res[k], 1) if k != "request_rate" else rate_label(res[k]) for _, k in SUMMARY_COLS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """P50/P99 TTFT and E2E against request rate (categorical x axis, so `inf` fits)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('--plot needs matplotlib: pip install -e ".[bench]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(results)))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name, title in ((axes[0], "ttft", "TTFT"), (axes[1], "e2e", "E2E latency")):
        for p, style in (("p50", "o-"), ("p99", "s--")):
            ys = [r[f"{p}_{name}_ms"] for r in results]
            ax.plot(x, [float("nan") if y is None else y for y in ys], style, label=p.upper())
        ax.set(title=title, xlabel="request rate (req/s)", ylabel="ms")
        ax.set_xticks(x, [rate_label(r["request_rate"]) for r in results])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def rerun_command(args, parser: argparse.ArgumentParser) -> str:
    """`python -m sgrec.bench_serving` with every option spelled out (host/port folded into --base-url)."""
    argv = []
    for a in parser._actions:
        if not a.option_strings or a.dest in ("help", "host", "port"):
            continue
        v = getattr(args, a.dest)
        if isinstance(a, argparse._StoreTrueAction):
            argv += [a.option_strings[0]] if v else []
        elif v is not None:
            argv += [a.option_strings[0], str(v)]
    return "python -m sgrec.bench_serving " + shlex.join(argv)


# ---- main --------------------------------------------------------------------------------------
def parse_rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None)" noise
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sgrec.bench_serving", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--base-url", help="Server URL; when unset, http://HOST:PORT.")
    p.add_argument("--host", default="127.0.0.1", help="Server host (without --base-url).")
    p.add_argument("--port", type=int, default=30000, help="Server port (without --base-url).")
    p.add_argument("--backend", choices=["sgrec", "openai"], default="sgrec",
                   help="sgrec: native /generate streaming; openai: /v1/completions streaming.")
    p.add_argument("--dataset", choices=["random"], default="random", help="Ignored when --dataset-path is given.")
    p.add_argument("--dataset-path", help='JSONL of {"prompt": str, "output_len": int} lines.')
    p.add_argument("--tokenizer", help="Tokenizer dir for random token ids; when unset, the server's tokenizer_path.")
    p.add_argument("--num-prompts", type=int, default=100, help="Requests per rate.")
    p.add_argument("--random-input-len", type=int, default=256, help="Most prompt tokens.")
    p.add_argument("--random-output-len", type=int, default=64, help="Most output tokens.")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Lengths are uniform in [len * ratio, len]; 1 = fixed lengths.")
    p.add_argument("--request-rate", default="inf",
                   help="Requests/s (Poisson); a comma list sweeps; inf = all at once.")
    p.add_argument("--max-concurrency", type=int, help="Most requests in flight at once.")
    p.add_argument("--disable-ignore-eos", action="store_true", help="Let requests stop at EOS.")
    p.add_argument("--disable-flush-cache", action="store_true", help="Do not POST /flush_cache before each rate.")
    p.add_argument("--warmup-requests", type=int, default=1, help="Unmeasured requests sent at once first.")
    p.add_argument("--seed", type=int, default=1, help="Seed of prompts and arrival times.")
    p.add_argument("--timeout", type=float, default=1800.0, help="Overall limit (s) of the whole run.")
    p.add_argument("--output-file", help="JSON results; when unset, bench_out/bench_serving_<timestamp>.json.")
    p.add_argument("--plot", help="PNG path of a latency-vs-rate plot (needs matplotlib).")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    return p


async def server_facts(client: httpx.AsyncClient, base: str) -> tuple[str, str | None]:
    """(served model name, tokenizer path) from the server; defaults when it does not say."""
    model, tok = "default", None
    with contextlib.suppress(Exception):
        model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
    with contextlib.suppress(Exception):
        tok = (await client.get(base + "/get_model_info")).json().get("tokenizer_path")
    return model, tok


async def flush_cache(client: httpx.AsyncClient, base: str) -> None:
    """Empties the server's prefix cache: SGLang's and sgrec's POST /flush_cache, else vLLM's POST
    /reset_prefix_cache (served in its dev mode, VLLM_SERVER_DEV_MODE=1); nothing where neither answers."""
    for path in ("/flush_cache", "/reset_prefix_cache"):
        with contextlib.suppress(httpx.HTTPError):
            if (await client.post(base + path)).status_code == 200:
                return


async def benchmark(args, parser) -> dict:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    args.base_url = base
    url = base + ("/generate" if args.backend == "sgrec" else "/v1/completions")
    rates = parse_rates(args.request_rate)
    deadline = time.monotonic() + args.timeout
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0), limits=limits,
                                 trust_env=False) as client:
        model, tok_path = await server_facts(client, base)
        if args.dataset_path:
            requests = jsonl_requests(args.dataset_path, args.num_prompts)
        else:
            if not (args.tokenizer or tok_path):
                raise SystemExit("the server did not say its tokenizer_path; pass --tokenizer DIR")
            vocab = vocab_ids(args.tokenizer or tok_path)
            requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                       args.random_range_ratio, vocab, args.seed)
        warm = await asyncio.gather(*(send(client, args.backend, url, requests[i % len(requests)], model,
                                           not args.disable_ignore_eos) for i in range(args.warmup_requests)))
        if failed := [r.error for r in warm if not r.success]:
            raise SystemExit(f"warmup request to {url} failed: {failed[0]}")
        results = []
        for rate in rates:
            if not args.disable_flush_cache:
                await flush_cache(client, base)
            records, duration = await run_rate(client, args, url, model, requests, rate, deadline)
            m = compute_metrics(records, duration)
            print(result_table(rate, m, args), flush=True)
            results.append({"request_rate": rate if math.isfinite(rate) else "inf",
                            "max_concurrency": args.max_concurrency, **m, "requests": [asdict(r) for r in records]})
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "backend": args.backend,
            "base_url": base, "model": model, "args": vars(args), "rerun": rerun_command(args, parser),
            "results": results}


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = asyncio.run(benchmark(args, parser))
    path = args.output_file or os.path.join("bench_out", f"bench_serving_{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("\n" + summary_table(out["results"]))
    if args.plot:
        plot(out["results"], args.plot)
        print(f"plot: {args.plot}")
    print(f"results: {path}")
    print(f"rerun: {out['rerun']}")
    return out


if __name__ == "__main__":
    main()
