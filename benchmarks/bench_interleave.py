"""Generation beside retrieve traffic: each retrieve batch run whole in its scheduler step (the
default) against interleaved rounds (`--interleave-rounds`: the batches under way advance a phase
per step, generation steps between them).

    python benchmarks/bench_interleave.py                                    # CPU defaults below
    python benchmarks/bench_interleave.py --retrieve-clients 4 --generate-clients 2 --history 1024

Two real servers on loopback serve the same random Llama (`make_tiny_model`, --hidden and --layers)
and a 27-item catalog of 3-level semantic IDs, one with the default and one with
--interleave-rounds, measured one after the other. Against each, --generate-clients closed-loop
clients send --gen-requests /generate requests each (a 32-token prompt, --gen-tokens greedy tokens,
ignore_eos), while --retrieve-clients closed-loop clients send /v1/retrieve requests (a new
--history-token user each time, beam width --beam-width) until the generation clients are done.
Prints per server: generate latency (mean and P99) and its time per output token, retrieve latency
(mean and P99) and retrieve requests per second over the window; and interleaved / whole ratios.
On one device the work is the same either way: interleaving moves where generation waits (one phase
instead of one whole round), so generation gains what retrieve gives up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header  # noqa: E402
from bench_concurrency import write_catalog  # noqa: E402
from sgrec.tools.local_server import LocalServer  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(0.99 * len(xs) + 0.5)) - 1))]


def run_load(url: str, args, seed: int) -> dict:
    """The mixed load against one server; latencies in seconds per kind and the window's length."""
    gen, ret, errors = [], [], []
    done = threading.Event()

    def client(route: str, body, client_seed: int, out: list, more) -> None:
        """Posts body(rng) to route while more(its latencies so far) holds; an error ends it."""
        rng, mine = random.Random(client_seed), []
        with httpx.Client(base_url=url, timeout=600) as c:
            while more(mine):
                b = body(rng)
                t0 = time.perf_counter()
                r = c.post(route, json=b)
                if r.status_code != 200:
                    errors.append(f"{route}: {r.status_code} {r.text[:200]}")
                    break
                mine.append(time.perf_counter() - t0)
        out.extend(mine)

    def generate(rng: random.Random) -> dict:
        return {"input_ids": [rng.randrange(3, 500) for _ in range(32)],
                "sampling_params": {"max_new_tokens": args.gen_tokens, "ignore_eos": True, "temperature": 0}}

    def retrieve(rng: random.Random) -> dict:  # a new user each time: no radix hit
        return {"user": {"token_ids": [rng.randrange(3, 500) for _ in range(args.history)]},
                "beam_width": args.beam_width, "num_items": 5}

    gens = [threading.Thread(target=client, args=("/generate", generate, seed * 7919 + i, gen,
                                                   lambda lat: len(lat) < args.gen_requests))
            for i in range(args.generate_clients)]
    rets = [threading.Thread(target=client, args=("/v1/retrieve", retrieve, seed * 104729 + i, ret,
                                                   lambda lat: not done.is_set()))
            for i in range(args.retrieve_clients)]
    t0 = time.perf_counter()
    for t in rets + gens:
        t.start()
    for t in gens:
        t.join()
    window = time.perf_counter() - t0
    done.set()
    for t in rets:
        t.join()
    if errors:
        raise RuntimeError(errors[0])
    return {"generate": gen, "retrieve": ret, "window_s": window}


def summary(load: dict, gen_tokens: int) -> dict:
    g, r = load["generate"], load["retrieve"]
    return {"generate_mean_ms": statistics.mean(g) * 1e3, "generate_p99_ms": p99(g) * 1e3,
            "ms_per_token": statistics.mean(g) / gen_tokens * 1e3,
            "retrieve_mean_ms": statistics.mean(r) * 1e3 if r else None,
            "retrieve_p99_ms": p99(r) * 1e3 if r else None,
            "retrieve_per_s": len(r) / load["window_s"], "retrieves": len(r), "generates": len(g)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256, help="the random model's hidden size")
    ap.add_argument("--layers", type=int, default=4, help="the random model's layers")
    ap.add_argument("--history", type=int, default=512, help="tokens of a retrieve request's user")
    ap.add_argument("--beam-width", type=int, default=16)
    ap.add_argument("--retrieve-clients", type=int, default=4)
    ap.add_argument("--generate-clients", type=int, default=2)
    ap.add_argument("--gen-requests", type=int, default=6, help="requests each generation client sends")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="the servers' --dtype")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args()
    cmd = ("python benchmarks/bench_interleave.py " + shlex.join(sys.argv[1:])).strip()
    print(header(cmd, "bench_interleave"), flush=True)

    from sgrec.tools.make_tiny_model import make_tiny_model

    tmp = tempfile.mkdtemp(prefix="bench_interleave_")
    model = make_tiny_model(os.path.join(tmp, "model"), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                            num_hidden_layers=args.layers)
    catalog = write_catalog(os.path.join(tmp, "catalog.jsonl"))
    flags = ["--model-path", model, "--device", "cpu", "--dtype", args.dtype, "--item-catalog", catalog,
             "--max-total-tokens", "65536", "--max-beam-width", str(args.beam_width)]
    out = {}
    for name, extra in (("whole", []), ("interleaved", ["--interleave-rounds"])):
        srv = LocalServer(flags + extra, log_path=os.path.join(tmp, f"{name}.log"))
        try:
            warm = argparse.Namespace(**{**vars(args), "gen_requests": 1, "gen_tokens": 4})
            run_load(srv.url, warm, seed=99)  # warm-up: every path once
            out[name] = summary(run_load(srv.url, args, seed=1), args.gen_tokens)
        finally:
            srv.stop()
        print(f"{name}: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out[name].items()})}",
              flush=True)
    w, i = out["whole"], out["interleaved"]
    print("| metric | whole batches | interleaved rounds | ratio (> 1: interleaved ahead) |")
    print("|---|--:|--:|--:|")
    metrics = [("generate mean latency", "generate_mean_ms", "ms", False),
               ("generate P99 latency", "generate_p99_ms", "ms", False),
               ("generate time per output token", "ms_per_token", "ms", False),
               ("retrieve mean latency", "retrieve_mean_ms", "ms", False),
               ("retrieve P99 latency", "retrieve_p99_ms", "ms", False),
               ("retrieve throughput beside generation", "retrieve_per_s", "req/s", True)]
    rows = []
    for label, key, unit, higher in metrics:
        ratio = (i[key] / w[key]) if higher else (w[key] / i[key])
        print(f"| {label} ({unit}) | {w[key]:.2f} | {i[key]:.2f} | {ratio:.2f}x |")
        rows.append(row(label, unit, i[key], w[key], higher_is_better=higher,
                        params={"retrieve_clients": args.retrieve_clients, "generate_clients": args.generate_clients,
                                "history": args.history, "beam_width": args.beam_width}))
    print(f"rerun: {cmd}")
    if not args.no_record:
        path = write_record("bench_interleave", "Generation beside retrieve traffic: interleaved rounds", cmd, rows,
                            peer="the same server running each retrieve batch whole in its step (the default)")
        print(f"recorded: {path}")


if __name__ == "__main__":
    main()
