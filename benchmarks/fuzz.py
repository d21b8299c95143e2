"""Fuzz every route of a real sgrec server with schemathesis against its own /openapi.json.

Starts `python -m sgrec.launch_server` on loopback (the embedded demo model and catalog, so
/v1/rank and /v1/retrieve run too; small limits so no generated request runs long), runs
`st run` with every check schemathesis has but max_response_time (a wall-clock bound) and
object_level_authorization (it needs two users), either for --max-time seconds (the long run) or for
a fixed number of derandomized examples per operation (--max-examples: the same cases on every
machine, what CI runs). Among them:

  not_a_server_error         no 5xx, whatever the body
  negative_data_rejection    a body the schema rejects gets a 4xx
  positive_data_acceptance   a body the schema accepts is not a 400 (ST202), except the rejections
                             that depend on data the schema cannot know (DATA_DEPENDENT_400S)
  status_code_conformance    only documented status codes
  content_type_conformance   only documented content types
  ignored_auth               (with --api-key) no route but health and metrics answers without the key

then checks the server survived: /health is 200, the same scheduler processes are alive, no
request runs or waits, every KV slot is free after a flush, and the thread count did not grow.

    python benchmarks/fuzz.py                     # 10 minutes
    python benchmarks/fuzz.py --max-examples 100  # what CI runs (tests/test_fuzz.py): examples, not time

Prints a summary and writes it as JSON (--out); exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import glob
import html
import json
import os
import re
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sgrec.tools.local_server import LocalServer  # noqa: E402
from sgrec.tools.probe import alive, kv_after_drain, proc_tree  # noqa: E402

SERVER_FLAGS = ["--device", "cpu", "--dtype", "float32", "--context-length", "256", "--max-total-tokens", "8192", "--max-n", "4",
                "--max-batch-size", "8", "--max-rank-candidates", "50", "--max-beam-width", "16",
                "--max-queued-requests", "64", "--max-request-bytes", "262144"]
CHECKS = ["not_a_server_error", "negative_data_rejection", "positive_data_acceptance", "status_code_conformance",
          "content_type_conformance", "response_headers_conformance", "response_schema_conformance",
          "missing_required_header", "unsupported_method", "allow_header_conformance", "use_after_free",
          "ensure_resource_availability"]
# Schema-valid bodies the server rightly answers 400: what makes them wrong is data the schema
# cannot hold (docs/reliability.md, "What the schema cannot say"). (operation pattern, message pattern): reason
DATA_DEPENDENT_400S = [
    (r"POST /v1/(rank|retrieve|recommend)|(POST|PUT) /generate", r"^Unknown item id\(s\) not in the catalog",
     "an item id the catalog does not hold (items, include_items)"),
    (r"POST /v1/(rank|retrieve|recommend)|(POST|PUT) /generate",
     r"^filter\..*(no catalog item has the attribute|\(the attribute is \w+\)|a range needs a numeric attribute)",
     "a filter on an attribute no catalog item has, or a value of another kind than the attribute's"),
    (r"POST /v1/catalog/items", r"'text' encodes to no tokens",
     "an item text the tokenizer turns into no tokens"),
    (r"POST /v1/catalog/items", r"is \w+ here but \w+ in the catalog; one kind per attribute",
     "an attribute value of another kind than the catalog's items have"),
    (r"POST /v1/catalog/items", r"semantic_id has \d+ tokens",
     "a semantic ID of another length than the catalog's"),
    (r"POST /v1/(completions|chat/completions)", r"token id \d+ is out of the vocabulary range",
     "a token id past the model's vocabulary (the OpenAI models do not carry the vocabulary size)"),
    (r"POST /v1/(completions|chat/completions|score|rank|retrieve|recommend)|(POST|PUT) /generate",
     r"^The input \(\d+ tokens\) is longer than the model's context length",
     "a prompt longer than the model's context (its token count depends on the tokenizer and chat template)"),
    (r"POST /v1/(retrieve|recommend)", r"^reason\.max_tokens \(\d+\) exceeds what the user's \d+ tokens",
     "a reasoning budget past what the prompt leaves of the context (its token count depends on the tokenizer)"),
    (r"POST /v1/(retrieve|recommend)", r"^reason\.until .* is not one token of the vocabulary",
     "a reasoning marker text that is not one token (the schema does not carry the vocabulary)"),
    (r"POST /v1/completions", r"^best_of \(\d+\) other than n \(\d+\)",
     "best_of other than n (JSON Schema cannot require two fields' values to be equal)"),
    (r"POST /v1/score", r"^label_token_ids must have one list per item",
     "per-item label lists other in number than the items (JSON Schema cannot relate two arrays' lengths)"),
    (r"POST /v1/(retrieve|recommend)|(POST|PUT) /generate", r"\(\d+\) must not exceed (\w+\.)?beam_width \(\d+\)",
     "more items asked for than beams (JSON Schema cannot compare two fields' values)"),
    (r"POST /v1/(completions|chat/completions|retrieve|recommend)|(POST|PUT) /generate", r"min_new_tokens must be in \[0, max_new_tokens\]",
     "min_tokens above max_tokens (JSON Schema cannot compare two fields' values)"),
]
THREAD_SLACK = 4  # uvicorn/asyncio helper threads may come and go


def run_schemathesis(url: str, max_time: int | None, seed: int, workers: int, report_dir: str,
                     api_key: str | None, max_examples: int | None = None) -> dict:
    """`st run` against the document; bounded by `max_examples` per operation (derandomized, no
    example database, no timing-based health check: the same cases on any machine) or else by
    `max_time` seconds."""
    checks = CHECKS + (["ignored_auth"] if api_key else [])  # --checks all would add max_response_time
    cmd = [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()", "run",
           f"{url}/openapi.json", "--checks", ",".join(checks), "--seed", str(seed),
           "--workers", str(workers), "--request-timeout", "60", "--report", "json,junit", "--report-dir", report_dir,
           "--no-color", "--output-sanitize", "false",
           # every failure of an operation, not the first: an allowed data-dependent 400 must not hide
           # a 500 or another check's failure on the same route (measured: 13 min instead of 4 at 60
           # examples per operation on a 2-core EPYC)
           "--continue-on-failure",
           # /pause_generation stops every batch until /continue_generation: fuzzed among the others it
           # would stall them (tests/test_server.py covers it, tests/test_schema_conformance.py its body)
           "--exclude-path", "/pause_generation"]
    if max_examples is not None:
        cmd += ["--max-examples", str(max_examples), "--generation-deterministic",
                "--suppress-health-check", "all"]
    else:
        cmd += ["--max-time", str(max_time)]
    if api_key:
        cmd += ["-H", f"Authorization: Bearer {api_key}"]
    import subprocess

    proc = subprocess.run(cmd, capture_output=True, text=True)
    reports = sorted(glob.glob(os.path.join(report_dir, "*.json")))
    if not reports:
        raise RuntimeError(f"schemathesis wrote no report (exit {proc.returncode}):\n{proc.stdout[-4000:]}"
                           f"\n{proc.stderr[-2000:]}")
    with open(reports[-1]) as f:
        report = json.load(f)
    report["_stdout_tail"] = proc.stdout[-6000:]
    junit = sorted(glob.glob(os.path.join(report_dir, "*.xml")))
    report["_rejected"] = rejected_valid(open(junit[-1]).read()) if junit else []
    return report


def rejected_valid(junit: str) -> list[dict]:
    """The ST202 failures of a JUnit report: {operation, status, message (the error's), body}."""
    out = []
    for op, text in re.findall(r'<testcase name="([^"]+)"[^>]*?(?<!/)>(.*?)</testcase>', junit, re.S):
        for case in re.split(r"\n(?=\d+\. Test Case ID)", html.unescape(text)):
            if "ST202" not in case:
                continue
            m = re.search(r"\[(\d+)\][^\n]*:\n\n\s*`(.*?)`\n", case, re.S)
            status, raw = (int(m.group(1)), m.group(2)) if m else (None, "")
            try:
                err = json.loads(raw)
                err = err.get("message") or err.get("error") if isinstance(err, dict) else err
                msg = err.get("message", "") if isinstance(err, dict) else str(err)
            except ValueError:
                msg = raw
            body = re.search(r"-d '(.*?)' http", case, re.S)
            out.append({"operation": op, "status": status, "message": msg, "body": body.group(1) if body else None})
    return out


def data_dependent(rejection: dict) -> str | None:
    """The reason a rejected schema-valid body is a rightful 400 (DATA_DEPENDENT_400S), or None."""
    for op, msg, why in DATA_DEPENDENT_400S:
        if re.fullmatch(op, rejection["operation"]) and re.search(msg, rejection["message"]):
            return why
    return None


def fuzz(max_time: int | None = 600, seed: int = 0, workers: int = 1, api_key: str | None = None,
         extra_flags: list[str] | None = None, workdir: str | None = None, max_examples: int | None = None) -> dict:
    workdir = workdir or tempfile.mkdtemp(prefix="sgrec-fuzz-")
    flags = SERVER_FLAGS + (["--api-key", api_key] if api_key else []) + (extra_flags or [])
    flags += ["--catalog-journal", os.path.join(workdir, "catalog.journal")]  # the catalog updates it sends
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with LocalServer(flags, log_path=os.path.join(workdir, "server.log")) as srv:
        before = proc_tree(srv.pid)
        t0 = time.monotonic()
        report = run_schemathesis(srv.url, max_time, seed, workers, os.path.join(workdir, "report"), api_key,
                                  max_examples)
        elapsed = time.monotonic() - t0
        with httpx.Client(base_url=srv.url, headers=headers, timeout=60) as c:
            health = c.get("/health").status_code
            kv = kv_after_drain(c)
        after = proc_tree(srv.pid)
        schedulers_alive = alive(before.pids[1:]) == before.pids[1:]
        log = srv.read_log()
    # ST202 is judged per case below: the data-dependent rejections are the server's to make
    failures = [{"code": f["code"], "title": f["title"], "operations": f["operations"]} for f in report["failures"]
                if f["code"] != "ST202"]
    rejected = [dict(r, reason=data_dependent(r)) for r in report["_rejected"]]
    failures += [{"code": "ST202", "title": "Schema-valid request rejected", **r} for r in rejected if not r["reason"]]
    if any(f["code"] == "ST202" for f in report["failures"]) and not rejected:
        failures.append({"code": "ST202", "title": "Schema-valid request rejected (not in the JUnit report)"})
    result = {
        "max_time_s": None if max_examples else max_time, "max_examples": max_examples,
        "elapsed_s": round(elapsed, 1), "seed": seed,
        "test_cases": report["test_cases"]["generated"], "operations": report["operations"]["tested"],
        "failures": failures, "errors": report["errors"],
        "data_dependent_400s": [r for r in rejected if r["reason"]],
        "health_after": health, "schedulers_alive": schedulers_alive,
        "kv_after_drain": kv.__dict__, "threads_before": before.threads, "threads_after": after.threads,
        "rss_mb_before": round(before.rss_mb), "rss_mb_after": round(after.rss_mb),
        "tracebacks_in_log": log.count("Traceback"), "workdir": workdir,
    }
    result["ok"] = (not failures and not report["errors"] and health == 200 and result["schedulers_alive"]
                    and kv.empty and after.threads <= before.threads + THREAD_SLACK and not result["tracebacks_in_log"])
    if not result["ok"]:
        result["schemathesis_output"] = report["_stdout_tail"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-time", type=int, default=600, help="seconds of fuzzing (default 600)")
    ap.add_argument("--max-examples", type=int,
                    help="instead of --max-time: this many derandomized examples per operation (what CI runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1,
                    help="schemathesis workers (threads); >1 can hit a CPython 3.11 ast race inside hypothesis")
    ap.add_argument("--api-key", default="fuzz-key", help="run the server with this key ('' for none)")
    ap.add_argument("--out", help="write the summary JSON here")
    ap.add_argument("server_flags", nargs="*", help="extra launch_server flags (after --)")
    args = ap.parse_args(argv)
    res = fuzz(args.max_time, args.seed, args.workers, args.api_key or None, args.server_flags,
               max_examples=args.max_examples)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    for k, v in res.items():
        if k != "schemathesis_output":
            print(f"{k:>20}: {v}")
    if not res["ok"]:
        print(res.get("schemathesis_output", ""))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
