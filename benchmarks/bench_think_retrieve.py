"""Think-then-retrieve in one request against the two calls it replaces, on one server, the same
model and the same prompts: `/v1/retrieve` with `"reason": {"max_tokens": N, "until": MARKER}`
against `/generate` (greedy, stop_token_ids = the marker, max_new_tokens N) followed by
`/v1/retrieve` on the prompt, the generated tokens and the marker (what a client glues today).

    python benchmarks/bench_think_retrieve.py                       # the demo model, 32 and 128 reasoning tokens
    python benchmarks/bench_think_retrieve.py --max-tokens 64 --beam-width 64 --model-path MODEL_DIR \\
        --item-catalog items.jsonl

Closed-loop clients at concurrency 1 and 8 over MovieLens-100K users; in each round both ways send
the same users, the radix cache flushed before each way's run (nothing cached from an earlier
request), and the way that goes first alternates between rounds. A request's latency for the two calls is the sum of both
calls' (the client's wait). Prints the median and P90 latency of each and their ratio (target:
one request at most 0.9x the two calls' median), and whether both return the same items.

Results: docs/performance.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shlex
import statistics
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_catalog import header  # noqa: E402
from sgrec.tools.local_server import LocalServer  # noqa: E402
from sgrec.tools.results import row, write_record  # noqa: E402


def prompts(model_path: str, n: int) -> tuple[list[list[int]], int]:
    """n users' histories as token ids (the demo's prompt without its retrieve instruction) and the
    marker: the instruction's last token, which ends the reasoning where the model emits it."""
    from transformers import AutoTokenizer

    from sgrec.demo import NAMES, RETRIEVE_INSTRUCTION
    from sgrec.demo.data import load_split, user_text

    tok = AutoTokenizer.from_pretrained(NAMES.get(model_path, model_path))
    split = load_split()
    users = split.users
    out = [tok.encode(user_text(split.test_case(users[i % len(users)])[0])) for i in range(n)]
    return out, tok.encode(RETRIEVE_INSTRUCTION, add_special_tokens=False)[-1]


class Paths:
    def __init__(self, url: str, max_tokens: int, marker: int, beam_width: int, num_items: int):
        self.client = httpx.Client(base_url=url, timeout=600)
        self.max_tokens, self.marker, self.beam_width, self.num_items = max_tokens, marker, beam_width, num_items
        self.reasoned: list[int] = []  # the reasonings' lengths (tokens)

    def _retrieve(self, body: dict) -> dict:
        r = self.client.post("/v1/retrieve", json={"beam_width": self.beam_width, "num_items": self.num_items, **body})
        r.raise_for_status()
        return r.json()

    def one(self, ids: list[int]) -> tuple[float, list]:
        t = time.perf_counter()
        got = self._retrieve({"user": {"token_ids": ids},
                              "reason": {"max_tokens": self.max_tokens, "until": self.marker, "temperature": 0}})
        self.reasoned.append(len(got["meta_info"]["reasoning"]["token_ids"]))
        return time.perf_counter() - t, [x["item"] for x in got["items"]]

    def two(self, ids: list[int]) -> tuple[float, list]:
        t = time.perf_counter()
        r = self.client.post("/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": self.max_tokens, "temperature": 0, "stop_token_ids": [self.marker]}})
        r.raise_for_status()
        out = r.json()["output_ids"]
        ext = ids + out + ([] if out and out[-1] == self.marker else [self.marker])
        got = self._retrieve({"user": {"token_ids": ext}})
        return time.perf_counter() - t, [x["item"] for x in got["items"]]

    def flush(self) -> None:
        assert self.client.post("/flush_cache").status_code == 200


def closed_loop(fn, users: list[list[int]], concurrency: int) -> list[tuple[float, list]]:
    """`concurrency` clients, each sending its share of the users one after another."""
    shares = [users[i::concurrency] for i in range(concurrency)]
    with cf.ThreadPoolExecutor(concurrency) as pool:
        done = pool.map(lambda share: [fn(ids) for ids in share], shares)
        return [x for share in done for x in share]


def p90(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(round(0.9 * len(xs))) - 1)]


def measure(paths: "Paths", users: list[list[int]], c: int, rounds: int, requests: int) -> dict:
    """One level: the two ways alternating for `rounds` rounds, each way on the same users in a round
    (the cache flushed before each). Latencies per way, and how often both returned the same items."""
    lat: dict[str, list[float]] = {"one": [], "two": []}
    same = total = 0
    for rnd in range(rounds):
        batch = users[rnd * requests: (rnd + 1) * requests]
        order = ("one", "two") if rnd % 2 == 0 else ("two", "one")
        results = {}
        for way in order:
            paths.flush()
            results[way] = closed_loop(getattr(paths, way), batch, c)
            lat[way] += [t for t, _ in results[way]]
        same += sum(a[1] == b[1] for a, b in zip(results["one"], results["two"]))
        total += len(batch)
    return {"lat": lat, "same": same, "total": total}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="demo")
    ap.add_argument("--item-catalog", default=None, help="default: the demo's catalog (with --model-path demo)")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[32, 128], help="the reasoning budgets")
    ap.add_argument("--beam-width", type=int, default=32)
    ap.add_argument("--num-items", type=int, default=10)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=24, help="users per level and round (each way sends them all)")
    ap.add_argument("--rounds", type=int, default=2, help="the two ways alternate this many times per level")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-record", action="store_true", help="do not write a result record under benchmarks/results/")
    args = ap.parse_args(argv)
    cmd = ("python benchmarks/bench_think_retrieve.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))).strip()
    print(header(cmd, "bench_think_retrieve"), flush=True)
    per_level = args.requests * args.rounds
    levels = [(n, c) for n in args.max_tokens for c in args.concurrency]
    users, marker = prompts(args.model_path, per_level * len(levels) + 4)
    flags = ["--model-path", args.model_path, "--device", "cpu", "--dtype", args.dtype]
    if args.item_catalog:
        flags += ["--item-catalog", args.item_catalog]
    from sgrec.model.cpu_caps import cpu_bf16_support

    dtype = args.dtype if args.dtype != "auto" else "bfloat16" if cpu_bf16_support().native else "float32"
    rows, work = [], tempfile.mkdtemp(prefix="bench_think_")
    with LocalServer(flags, log_path=os.path.join(work, "server.log")) as srv:
        print(f"model {args.model_path} ({dtype}), marker token {marker}, beam width {args.beam_width}, "
              f"{args.num_items} items")
        for k, (n, c) in enumerate(levels):
            paths = Paths(srv.url, n, marker, args.beam_width, args.num_items)
            if c == args.concurrency[0]:
                for ids in users[-4:]:  # warm both code paths at this budget
                    paths.one(ids), paths.two(ids)
                paths.reasoned.clear()
            m = measure(paths, users[k * per_level: (k + 1) * per_level], c, args.rounds, args.requests)
            lat = m["lat"]
            med = {w: statistics.median(v) for w, v in lat.items()}
            print(f"budget {n} (reasonings of {statistics.mean(paths.reasoned):.1f} tokens on average), concurrency "
                  f"{c}: one request median {med['one'] * 1e3:.1f} ms (P90 {p90(lat['one']) * 1e3:.1f}); two calls "
                  f"median {med['two'] * 1e3:.1f} ms (P90 {p90(lat['two']) * 1e3:.1f}); ratio "
                  f"{med['one'] / med['two']:.2f}x (target at most 0.90x); the same items for {m['same']}/{m['total']} "
                  f"users", flush=True)
            params = {"max_tokens": n, "concurrency": c, "dtype": dtype, "beam_width": args.beam_width}
            rows.append(row("think-then-retrieve median latency", "ms", round(med["one"] * 1e3, 2),
                            round(med["two"] * 1e3, 2), params=params, higher_is_better=False))
            rows.append(row("think-then-retrieve P90 latency", "ms", round(p90(lat["one"]) * 1e3, 2),
                            round(p90(lat["two"]) * 1e3, 2), params=params, higher_is_better=False))
    print(f"rerun: {cmd}")
    if not args.no_record:
        path = write_record(
            benchmark="bench_think_retrieve", title="Think-then-retrieve: one request against two calls",
            command=cmd, results=rows,
            peer="the two calls on the same server (/generate stopping at the marker, then /v1/retrieve on the "
                 "prompt and the reasoning)",
            bounds="Both ways decode the same reasoning and run the same beams; the one request saves the second "
                   "HTTP round trip, the second queue wait, the client's glue and the per-token streaming of the "
                   "reasoning to the front, and its beams read the reasoning's KV where the decode left it.")
        print(f"recorded: {path}")


if __name__ == "__main__":
    main()
