"""The performance page (docs/performance.md and its plots, docs/assets/perf/) is generated from the
benchmark records under benchmarks/results/ (`python -m sgrec.tools.perf_page`): every record is valid
and names its script, the page on disk is current, and the generator shows what it should."""

import json
import os
import re

import pytest

from sgrec.tools import perf_page
from sgrec.tools.results import ROOT, load_records, row, write_record

AMD = {"kind": "x86-avx512-bf16", "cpu": "AMD EPYC (family 26, Zen 5)", "cores": 2,
       "flags": ["avx2", "avx512_bf16", "avx512f"], "gpu": None}
XEON = {"kind": "x86-amx", "cpu": "Intel Xeon Platinum 8480+", "cores": 2,
        "flags": ["amx_bf16", "amx_tile", "avx512_bf16", "avx512f"], "gpu": None}
OLD = {**AMD, "kind": "x86-avx2", "cpu": "Intel Xeon E5-2680 v4", "flags": ["avx2", "fma"]}


def _record(results_dir, value, *, date, machine=AMD, commit="abcdef1", benchmark="bench_vllm_cpu", rows=None,
            peer="vLLM 0.32 CPU backend"):
    rows = rows or [row("saturated output throughput", "tok/s", value, 300.0, params={"model": "SmolLM2-135M"})]
    return write_record(benchmark, "sgrec against vLLM's CPU backend", f"python benchmarks/{benchmark}.py",
                        rows, peer=peer, bounds=f"bounds of the {value} run", machine=machine, date=date,
                        commit=commit, results_dir=str(results_dir))


def _supersede(path):
    with open(path) as f:
        rec = json.load(f)
    rec["superseded"] = True
    with open(path, "w") as f:
        json.dump(rec, f)


def _page(results_dir, out_dir):
    perf_page.generate(str(results_dir), str(out_dir))
    with open(out_dir / "performance.md") as f:
        return f.read()


# ---------------------------------------------------------------------------------------- the real records

def test_every_record_is_valid_and_names_its_script():
    records = load_records(perf_page.RESULTS_DIR)  # raises, naming the file, on a record check() rejects
    for rec in records:
        rel = os.path.relpath(rec["_path"], ROOT)
        assert perf_page.script_for(rec["benchmark"]), f"{rel}: no benchmarks/{rec['benchmark']}.py, " \
                                                       f"scripts/{rec['benchmark']}.sh or sgrec/{rec['benchmark']}.py"
        assert os.path.basename(os.path.dirname(rec["_path"])) == rec["benchmark"], \
            f"{rel} is not under benchmarks/results/{rec['benchmark']}/"


def test_the_record_checks_can_fail(tmp_path):
    assert perf_page.script_for("bench_vllm_cpu") == os.path.join("benchmarks", "bench_vllm_cpu.py")
    assert perf_page.script_for("gpu_suite") == os.path.join("scripts", "gpu_suite.sh")
    assert perf_page.script_for("bench_serving") == os.path.join("sgrec", "bench_serving.py")
    assert perf_page.script_for("bench_no_such_thing") is None
    assert perf_page.script_for("../setup") is None
    path = _record(tmp_path, 1.0, date="2026-11-01")
    with open(path) as f:
        rec = json.load(f)
    del rec["bounds"]
    rec["machine"]["kind"] = "a-toaster"
    with open(path, "w") as f:
        json.dump(rec, f)
    with pytest.raises(ValueError, match="missing key 'bounds'"):
        load_records(str(tmp_path))


def test_the_page_and_plots_on_disk_are_current():
    bad = perf_page.stale()
    assert not bad, "stale: " + ", ".join(os.path.relpath(p, ROOT) for p in bad) + \
                    f"; run `{perf_page.COMMAND}`"
    with open(os.path.join(perf_page.DOCS_DIR, perf_page.PAGE)) as f:
        page = f.read()
    assert "side by side" in page and "reruns it" in page
    for link in re.findall(r"\]\((assets/perf/[^)]+)\)", page):
        assert os.path.isfile(os.path.join(perf_page.DOCS_DIR, link)), link


def test_check_names_a_stale_file_and_the_command(tmp_path, capsys):
    res, out = tmp_path / "results", tmp_path / "docs"
    _record(res, 412.0, date="2026-11-28", rows=[
        row("beam retrieve", "req/s", 10.0 * b, 5.0 * b, params={"beam width": b}) for b in (32, 64, 128)])
    assert perf_page.main(["--check", "--results-dir", str(res), "--out", str(out)]) == 1  # nothing written yet
    assert perf_page.main(["--results-dir", str(res), "--out", str(out)]) == 0
    assert perf_page.main(["--check", "--results-dir", str(res), "--out", str(out)]) == 0
    assert perf_page.stale(str(res), str(out)) == []

    with open(out / "performance.md", "a") as f:
        f.write("a hand edit\n")
    extra = out / "assets" / "perf" / "bench_gone-x86-amx-latency.svg"
    extra.write_text("<svg/>")
    capsys.readouterr()
    assert perf_page.main(["--check", "--results-dir", str(res), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "performance.md is stale" in err and "bench_gone-x86-amx-latency.svg is stale" in err
    assert f"python -m sgrec.tools.perf_page --results-dir {res} --out {out}" in err
    assert perf_page.regenerate_command() == "python -m sgrec.tools.perf_page"

    _, removed = perf_page.generate(str(res), str(out))
    assert removed == [str(extra)] and not extra.exists()
    assert perf_page.stale(str(res), str(out)) == []
    (out / "assets" / "perf" / "notes.txt").write_text("not a plot: left alone")
    assert perf_page.stale(str(res), str(out)) == []


# ---------------------------------------------------------------------------------------- what is shown

def test_the_latest_non_superseded_record_per_kind_is_shown(tmp_path):
    res = tmp_path / "results"
    _record(res, 111.5, date="2026-11-01")
    _record(res, 222.5, date="2026-11-05")
    _supersede(_record(res, 333.5, date="2026-11-09"))  # newer, but replaced: not shown
    _supersede(_record(res, 444.5, date="2026-11-09", machine=OLD))  # a kind with only superseded records
    page = _page(res, tmp_path / "docs")
    assert "| 222.5 |" in page and "bounds of the 222.5 run" in page
    for gone in ("111.5", "333.5", "444.5"):
        assert gone not in page
    assert "### x86-avx512-bf16" in page and "### x86-avx2" not in page and "`x86-avx2`" not in page
    assert "Not shown: 1 earlier record and 2 superseded records" in page
    assert page.count("## sgrec against vLLM's CPU backend") == 1

    # the same date: the later file name, write_record's -N suffixes in numeric order (-10 after -9)
    for i in range(10):
        _record(res, 500.5 + i, date="2026-11-20")
    by_string = sorted(os.listdir(res / "bench_vllm_cpu"))
    assert by_string[-1] == "2026-11-20-x86-avx512-bf16-abcdef1.json"  # the first of the ten, as a string
    page = _page(res, tmp_path / "docs")
    assert "| 509.5 |" in page and "| 508.5 |" not in page and "| 500.5 |" not in page
    assert "Not shown: 11 earlier records and 2 superseded records" in page

    # every record superseded: the section says so and shows none
    for name in os.listdir(res / "bench_vllm_cpu"):
        _supersede(res / "bench_vllm_cpu" / name)
    page = _page(res, tmp_path / "docs")
    assert "none is shown" in page and "###" not in page and "| metric |" not in page


def test_two_machine_kinds_give_two_tables(tmp_path):
    res = tmp_path / "results"
    _record(res, 412.5, date="2026-11-28", machine=AMD)
    _record(res, 515.5, date="2026-11-20", machine=XEON)
    page = _page(res, tmp_path / "docs")
    assert page.count("| metric | params | sgrec | peer | ratio | efficiency | unit |") == 2
    assert "### x86-amx" in page and "### x86-avx512-bf16" in page
    assert page.index("### x86-amx") < page.index("### x86-avx512-bf16")  # MACHINE_KINDS' order
    assert "| 412.5 |" in page and "| 515.5 |" in page
    assert "AMX (Intel Xeon, Sapphire Rapids and newer)" in page and "Intel Xeon Platinum 8480+" in page
    assert "No earlier or superseded records." in page
    assert page.count("```sh\npython benchmarks/bench_vllm_cpu.py\n```") == 2


def test_a_sweep_draws_a_plot_and_the_page_links_it(tmp_path):
    res, out = tmp_path / "results", tmp_path / "docs"
    _record(res, None, date="2026-11-28", benchmark="bench_xbeam", peer="vLLM's beam search", rows=[
        row("retrieve latency", "ms", 10.0 + b / 10, 20.0 + b / 2, params={"beam width": b, "model": "m"},
            higher_is_better=False) for b in (32, 64, 128, 256)] + [
        row("two points", "req/s", 1.0 * b, None, params={"beam width": b}) for b in (32, 64)] + [
        row("two params vary", "req/s", 1.0 * b, None, params={"beam width": b, "batch": b * 2})
        for b in (1, 2, 3)] + [
        row("not a number", "req/s", 1.0, None, params={"model": m}) for m in ("a", "b", "c")] + [
        row("repeated runs", "req/s", 1.0 + i, None, params={"run": i}) for i in (1, 2, 3)])
    page = _page(res, out)
    name = "bench_xbeam-x86-avx512-bf16-retrieve-latency.svg"
    assert f"![retrieve latency against beam width](assets/perf/{name})" in page
    assert os.listdir(out / "assets" / "perf") == [name]  # the other metrics are no curve
    svg = (out / "assets" / "perf" / name).read_bytes()
    assert svg.startswith(b"<?xml") and b"<svg" in svg and b"<dc:date>" not in svg
    sweep, = perf_page.sweeps(load_records(str(res))[0])
    assert sweep["param"] == "beam width" and sweep["fixed"] == {"model": "m"}
    assert perf_page.plot_svg(sweep, "vLLM's beam search") == svg  # the same bytes on every run
    assert perf_page.plot_svg(sweep, "another peer") != svg


def test_params_every_row_shares_are_said_once(tmp_path):
    res = tmp_path / "results"
    _record(res, None, date="2026-11-28", rows=[
        row("throughput", "tok/s", 1.0 * c, 2.0, params={"model": "SmolLM2-135M", "concurrency": c}) for c in (1, 2)])
    page = _page(res, tmp_path / "docs")
    assert "In every row: model=SmolLM2-135M." in page
    assert "| throughput | concurrency=2 | 2 | 2 |" in page and "model=SmolLM2-135M, concurrency" not in page
    assert perf_page.common_params([{"params": {"a": 1, "b": 2}}, {"params": {"a": 1, "b": 3}}]) == {"a": 1}
    assert perf_page.common_params([{"params": {"a": 1}}]) == {}  # one row: its params stay in the table


def test_no_records_give_a_page(tmp_path):
    page = _page(tmp_path / "none", tmp_path / "docs")
    assert page.startswith("<!-- Generated by") and "# Performance" in page and "No benchmark has recorded" in page
