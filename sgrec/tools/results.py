"""Benchmark results as data: one JSON record per run under `benchmarks/results/<benchmark>/`, from
which the documentation's performance page is generated (`python -m sgrec.tools.perf_page`).

A record (every key present; `null` where it does not apply):

    {
      "benchmark": "bench_vllm_cpu",            the script's name (benchmarks/<name>.py), or "gpu_suite"
      "title": "sgrec against vLLM's CPU backend",
      "date": "2026-11-28",                     when it ran
      "commit": "bd5edbe",                      the code it ran (git rev-parse --short HEAD)
      "machine": {
        "kind": "x86-avx512-bf16",              one of MACHINE_KINDS
        "cpu": "AMD EPYC (family 26, Zen 5)",   the model name, as /proc/cpuinfo or the run's notes say
        "cores": 2,
        "flags": ["avx2", "avx512_bf16", ...],  the ISA flags of FLAGS_SHOWN the CPU reports
        "gpu": null                             "NVIDIA H200" on a GPU machine
      },
      "command": "python benchmarks/bench_vllm_cpu.py --vllm-python ~/vllm-cpu/bin/python",
      "peer": "vLLM 0.32 CPU backend",          what sgrec was run beside (null: none)
      "results": [                              one row per number
        {"metric": "saturated output throughput", "unit": "tok/s",
         "params": {"model": "SmolLM2-135M", "dtype": "bfloat16"},   what the row varies (a sweep: the x axis)
         "sgrec": 412.0, "peer": 300.7,         the numbers side by side (peer null without one)
         "ratio": 1.37,                         sgrec / peer, or the ratio the benchmark itself reports
         "efficiency": null,                    share of the machine's measured limit (0..1), where it applies
         "higher_is_better": true}
      ],
      "bounds": "prose: what bounds the number, why it is what it is (kept on the page)",
      "superseded": false                       true: a later run or a code change replaced it (not shown)
    }
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")  # where write_record writes: $SGREC_RESULTS_DIR if set
MACHINE_KINDS = {
    "x86-amx": "x86 CPU with AVX-512, AVX-512-BF16 and AMX (Intel Xeon, Sapphire Rapids and newer)",
    "x86-avx512-bf16": "x86 CPU with AVX-512 and AVX-512-BF16, no AMX (AMD EPYC Zen 4 and newer)",
    "x86-avx512": "x86 CPU with AVX-512, no bf16 instructions",
    "x86-avx2": "x86 CPU with AVX2, no AVX-512",
    "nvidia-h100": "NVIDIA H100 GPU",
    "nvidia-h200": "NVIDIA H200 GPU",
    "other": "another machine",
}
FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
               "amx_tile", "amx_bf16", "amx_int8")
RECORD_KEYS = ("benchmark", "title", "date", "commit", "machine", "command", "peer", "results", "bounds", "superseded")
ROW_KEYS = ("metric", "unit", "params", "sgrec", "peer", "ratio", "efficiency", "higher_is_better")
MACHINE_KEYS = ("kind", "cpu", "cores", "flags", "gpu")


def cpu_kind(flags: set[str]) -> str:
    """The machine kind of a CPU from its /proc/cpuinfo flags."""
    if {"amx_tile", "amx_bf16"} <= flags:
        return "x86-amx"
    if "avx512f" in flags:
        return "x86-avx512-bf16" if "avx512_bf16" in flags else "x86-avx512"
    return "x86-avx2" if "avx2" in flags else "other"


def this_machine() -> dict:
    """The `machine` of a record for the machine this runs on (a CUDA GPU if torch sees one)."""
    import torch

    from sgrec.model.cpu_caps import cpu_flags

    flags, model = set(cpu_flags()), "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    kind = cpu_kind(flags)
    if gpu:
        m = re.search(r"\b(H100|H200)\b", gpu)
        kind = f"nvidia-{m.group(1).lower()}" if m else "other"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"kind": kind, "cpu": model, "cores": cores, "flags": sorted(flags & set(FLAGS_SHOWN)), "gpu": gpu}


def head_commit() -> str | None:
    """The checkout's commit (short), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def row(metric: str, unit: str, sgrec: float | None, peer: float | None = None, *, params: dict | None = None,
        ratio: float | None = None, efficiency: float | None = None, higher_is_better: bool = True) -> dict:
    """One result row; `ratio` defaults to sgrec / peer (inverted where lower is better, so > 1 means
    sgrec is ahead)."""
    if ratio is None and sgrec is not None and peer:
        ratio = sgrec / peer if higher_is_better else peer / sgrec
    return {"metric": metric, "unit": unit, "params": params or {}, "sgrec": sgrec, "peer": peer,
            "ratio": None if ratio is None else round(ratio, 4), "efficiency": efficiency,
            "higher_is_better": higher_is_better}


def check(record: dict) -> list[str]:
    """What is wrong with a record (empty: nothing)."""
    errs = [f"missing key {k!r}" for k in RECORD_KEYS if k not in record]
    errs += [f"unknown key {k!r}" for k in record if k not in RECORD_KEYS]
    if errs:
        return errs
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(record["date"])):
        errs.append(f"date {record['date']!r} is not YYYY-MM-DD")
    if record["commit"] is not None and not re.fullmatch(r"[0-9a-f]{7,40}", str(record["commit"])):
        errs.append(f"commit {record['commit']!r} is not a git hash")
    m = record["machine"]
    if not isinstance(m, dict) or set(m) != set(MACHINE_KEYS):
        errs.append(f"machine must have exactly the keys {MACHINE_KEYS}")
    elif m["kind"] not in MACHINE_KINDS:
        errs.append(f"machine kind {m['kind']!r} is not one of {sorted(MACHINE_KINDS)}")
    if not isinstance(record["results"], list) or not record["results"]:
        errs.append("results must be a non-empty list")
    else:
        for i, r in enumerate(record["results"]):
            if not isinstance(r, dict) or set(r) != set(ROW_KEYS):
                errs.append(f"results[{i}] must have exactly the keys {ROW_KEYS}")
            elif not isinstance(r["params"], dict):
                errs.append(f"results[{i}].params must be an object")
            elif r["efficiency"] is not None and not 0 <= r["efficiency"] <= 1.5:
                errs.append(f"results[{i}].efficiency {r['efficiency']} is not a share of the limit")
    if not isinstance(record["superseded"], bool):
        errs.append("superseded must be true or false")
    if not str(record["command"]).strip():
        errs.append("command must say how to rerun it")
    return errs


def write_record(benchmark: str, title: str, command: str, results: list[dict], *, peer: str | None = None,
                 bounds: str | None = None, machine: dict | None = None, date: str | None = None,
                 commit: str | None = None, results_dir: str | None = None) -> str:
    """Writes one run's record (this machine, today, this checkout's commit unless given) and returns
    its path: `<results_dir>/<benchmark>/<date>-<kind>-<commit>[-N].json`, results_dir defaulting to
    $SGREC_RESULTS_DIR, else RESULTS_DIR (the test suite sets the variable: its runs leave no record)."""
    results_dir = results_dir or os.environ.get("SGREC_RESULTS_DIR") or RESULTS_DIR
    record = {"benchmark": benchmark, "title": title, "date": date or datetime.date.today().isoformat(),
              "commit": commit if commit is not None else head_commit(), "machine": machine or this_machine(),
              "command": command, "peer": peer, "results": results, "bounds": bounds, "superseded": False}
    errs = check(record)
    if errs:
        raise ValueError(f"bad {benchmark} record: " + "; ".join(errs))
    folder = os.path.join(results_dir, benchmark)
    os.makedirs(folder, exist_ok=True)
    stem = f"{record['date']}-{record['machine']['kind']}-{record['commit'] or 'nogit'}"
    path, n = os.path.join(folder, stem + ".json"), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(folder, f"{stem}-{n}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return path


def load_records(results_dir: str = RESULTS_DIR) -> list[dict]:
    """Every record under `results_dir`, each with its file as `_path` (ValueError naming a bad one)."""
    out = []
    for folder, _, names in sorted(os.walk(results_dir)):
        for name in sorted(n for n in names if n.endswith(".json")):
            path = os.path.join(folder, name)
            with open(path) as f:
                record = json.load(f)
            errs = check(record)
            if errs:
                raise ValueError(f"{os.path.relpath(path, ROOT)}: " + "; ".join(errs))
            out.append({**record, "_path": path})
    return out
