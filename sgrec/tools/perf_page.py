"""The documentation's performance page, generated from the benchmark records (`sgrec/tools/results.py`).

    python -m sgrec.tools.perf_page           writes docs/performance.md and its plots under docs/assets/perf/
    python -m sgrec.tools.perf_page --check   exits 1, naming each stale file, where what is on disk differs

For every benchmark the page shows, on each machine kind, the latest record that is not superseded
(latest by date, then by file name, numbers in a name compared as numbers: `...-2.json` after `....json`,
`-10` after `-9`); the other records stay in benchmarks/results/ and in git, the page only counts them.
Where a record's rows of one metric differ in exactly one numeric param (beam width, concurrency, batch
size...) over at least PLOT_MIN_POINTS values, the page also draws sgrec and its peer against that param
(an SVG, written byte for byte the same on every run: fixed hash salt, no date, fixed size and font).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import textwrap

from sgrec.tools.results import MACHINE_KINDS, RESULTS_DIR, ROOT, load_records

DOCS_DIR = os.path.join(ROOT, "docs")
PAGE = "performance.md"
PLOTS = os.path.join("assets", "perf")  # under the docs folder
COMMAND = "python -m sgrec.tools.perf_page"
PLOT_MIN_POINTS = 3  # two points: the table says as much as a line would
# params that number repetitions of one measurement, not an axis a curve says anything along
NOT_AN_AXIS = {"run", "repeat", "repetition", "trial", "seed", "round", "attempt", "iteration", "rep"}


# ----------------------------------------------------------------------------------------------- records

def script_for(benchmark: str, root: str = ROOT) -> str | None:
    """The script a record's `benchmark` names (benchmarks/<name>.py, scripts/<name>.sh, or the module
    sgrec/<name>.py run as `python -m sgrec.<name>`), or None."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", benchmark or ""):
        return None
    for rel in (os.path.join("benchmarks", benchmark + ".py"), os.path.join("scripts", benchmark + ".sh"),
                os.path.join("sgrec", benchmark + ".py")):
        if os.path.isfile(os.path.join(root, rel)):
            return rel
    return None


def _natural(text: str) -> list:
    """`text` split into strings and numbers (always str, int, str, ...), so that "a-10" sorts after "a-9"."""
    parts = re.split(r"(\d+)", text)
    return [int(p) if i % 2 else p for i, p in enumerate(parts)]


def latest_key(record: dict) -> tuple:
    """What "latest" orders by: the date, then the file name (write_record's `-N` suffixes in order)."""
    name = os.path.basename(record.get("_path", ""))
    return record["date"], _natural(name[:-5] if name.endswith(".json") else name)


def shown(records: list[dict]) -> dict[str, dict]:
    """One benchmark's records on the page: machine kind -> its latest non-superseded record (a kind with
    only superseded records has none), in MACHINE_KINDS' order."""
    out = {}
    for kind in MACHINE_KINDS:
        live = [r for r in records if r["machine"]["kind"] == kind and not r["superseded"]]
        if live:
            out[kind] = max(live, key=latest_key)
    return out


def by_benchmark(records: list[dict]) -> list[tuple[str, str, list[dict]]]:
    """(benchmark, title, its records) for every benchmark, sorted by title (then name). The title is the
    newest shown record's, else the newest record's."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["benchmark"], []).append(r)
    out = []
    for name, recs in groups.items():
        pick = list(shown(recs).values()) or recs
        title = str(max(pick, key=latest_key)["title"] or name).strip() or name
        out.append((name, title, recs))
    return sorted(out, key=lambda t: (t[1].lower(), t[0]))


# ----------------------------------------------------------------------------------------------- formatting

def _num(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int) or (v == int(v) and abs(v) < 1e15):
        return str(int(v))
    if abs(v) >= 1000:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.4g}"
    return f"{v:.3g}"


def _ratio(v) -> str:
    return "—" if v is None else f"{v:.2f}x" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _percent(v) -> str:
    if v is None:
        return "—"
    p = 100 * v
    return f"{p:.0f}%" if abs(p) >= 10 else f"{p:.1f}%"


def _cell(text) -> str:
    """Text safe inside a Markdown table cell."""
    text = " ".join(str(text).split())
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;") or " "


def _value(v) -> str:
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return _num(v) if isinstance(v, (int, float)) else str(v)


def _params(params: dict) -> str:
    return ", ".join(f"{k}={_value(v)}" for k, v in params.items()) or "—"


def common_params(rows: list[dict]) -> dict:
    """The params every one of several rows has with the same value (said once above the table)."""
    if len(rows) < 2:
        return {}
    first = rows[0]["params"]
    return {k: v for k, v in first.items() if all(k in r["params"] and r["params"][k] == v for r in rows[1:])}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or "metric"


def _machine(m: dict) -> str:
    cpu = str(m["cpu"] or "CPU not recorded")
    if m["cores"]:
        cpu += f", {m['cores']} cores"
    flags = ", ".join(m["flags"] or [])
    text = f"{m['gpu']} (host CPU: {cpu})" if m["gpu"] else cpu
    if flags:
        text += f"; ISA flags: {flags}"
    return text


def _fence(command: str) -> list[str]:
    ticks = "`" * max(3, 1 + max((len(t) for t in re.findall(r"`+", command)), default=0))
    return [ticks + "sh", command.strip(), ticks]


# ----------------------------------------------------------------------------------------------- plots

def sweeps(record: dict) -> list[dict]:
    """The curves a record's rows make: rows of one metric and unit whose params differ in exactly one
    key, every value of it a distinct number, over at least PLOT_MIN_POINTS rows with an sgrec number
    (not a repetition's number: NOT_AN_AXIS).
    Each: {"metric", "unit", "param", "fixed" (the params all share), "rows" (sorted by the param)}."""
    groups: dict[tuple, list[dict]] = {}
    for r in record["results"]:
        groups.setdefault((str(r["metric"]), str(r["unit"])), []).append(r)
    out = []
    for (metric, unit), rows in groups.items():
        rows = [r for r in rows if _is_num(r["sgrec"])]
        if len(rows) < PLOT_MIN_POINTS:
            continue
        keys = sorted({k for r in rows for k in r["params"]})
        missing = object()
        varying = [k for k in keys if len({repr(r["params"].get(k, missing)) for r in rows}) > 1]
        if len(varying) != 1:
            continue
        param = varying[0]
        if re.sub(r"[^a-z]", "", param.lower()).rstrip("s") in NOT_AN_AXIS:
            continue
        xs = [r["params"].get(param, missing) for r in rows]
        if not all(_is_num(x) for x in xs) or len(set(xs)) != len(xs):
            continue
        fixed = {k: v for k, v in rows[0]["params"].items() if k != param}
        out.append({"metric": metric, "unit": unit, "param": param, "fixed": fixed,
                    "rows": sorted(rows, key=lambda r: r["params"][param])})
    return out


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def plot_svg(sweep: dict, peer: str | None, fmt: str = "svg") -> bytes:
    """One sweep drawn as an SVG, the same bytes for the same sweep on every run (`fmt` "png": a look at it)."""
    import matplotlib
    from matplotlib.figure import Figure

    rc = {"svg.hashsalt": "sgrec-perf-page", "svg.fonttype": "path", "font.family": "DejaVu Sans",
          "font.size": 9, "axes.titlesize": 10, "figure.dpi": 100, "savefig.dpi": 100, "path.simplify": True,
          "axes.spines.top": False, "axes.spines.right": False}
    with matplotlib.rc_context(rc):
        fig = Figure(figsize=(6.4, 3.6), layout="constrained")
        ax = fig.add_subplot()
        rows = sweep["rows"]
        xs = [r["params"][sweep["param"]] for r in rows]
        ax.plot(xs, [r["sgrec"] for r in rows], marker="o", color="#1f6fb4", label="sgrec")
        peer_label = textwrap.fill(re.sub(r"`", "", peer or "peer"), 60)
        pts = [(x, r["peer"]) for x, r in zip(xs, rows) if _is_num(r["peer"])]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", linestyle="--", color="#d9822b",
                    label=peer_label)
        lo, hi = min(xs), max(xs)
        if lo > 0 and hi / lo >= 8:
            pow2 = all(float(x).is_integer() and int(x) & (int(x) - 1) == 0 for x in xs)
            ax.set_xscale("log", base=2 if pow2 else 10)
            ax.minorticks_off()
        if len(xs) <= 12:
            ax.set_xticks(xs, [_num(x) for x in xs])
        ys = [r["sgrec"] for r in rows] + [p[1] for p in pts]
        if min(ys) > 0 and max(ys) / min(ys) >= 50:  # sgrec and a peer an order of magnitude apart
            ax.set_yscale("log")
        elif min(ys) >= 0:
            ax.set_ylim(bottom=0, top=max(ys) * 1.08 if max(ys) > 0 else 1)
        ax.set_xlabel(sweep["param"])
        ax.set_ylabel(sweep["unit"] or sweep["metric"])
        title = sweep["metric"] + ("" if rows[0]["higher_is_better"] else " (lower is better)")
        title = textwrap.fill(title, 80)
        title += "\n" + textwrap.fill(_params(sweep["fixed"]), 90) if sweep["fixed"] else ""
        ax.set_title(title)
        ax.grid(True, color="#dddddd", linewidth=0.6)
        fig.legend(loc="outside lower center", ncols=2, frameon=False)
        buf = io.BytesIO()
        metadata = {"Date": None, "Creator": "matplotlib, sgrec.tools.perf_page"} if fmt == "svg" else None
        fig.savefig(buf, format=fmt, metadata=metadata)
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------- the page

def _record_block(record: dict, kind: str, plot_names: dict[str, bytes], plot_dir: str) -> list[str]:
    peer = record["peer"]
    commit = f"commit `{record['commit']}`" if record["commit"] else "no commit recorded"
    lines = [f"### {kind}", "",
             f"Run on {record['date']} at {commit}; "
             + (f"compared with: **{' '.join(str(peer).split())}**." if peer else "sgrec alone (no peer)."), "",
             "Machine: " + _machine(record["machine"]) + ".", ""]
    common = common_params(record["results"])
    if common:
        lines += ["In every row: " + _cell(_params(common)) + ".", ""]
    lines += ["| metric | params | sgrec | peer | ratio | efficiency | unit |",
              "|---|---|--:|--:|--:|--:|---|"]
    for r in record["results"]:
        unit = str(r["unit"] or "") + ("" if r["higher_is_better"] else ", lower is better")
        params = {k: v for k, v in r["params"].items() if k not in common}
        lines.append("| " + " | ".join(_cell(c) for c in (
            r["metric"], _params(params), _num(r["sgrec"]), _num(r["peer"]), _ratio(r["ratio"]),
            _percent(r["efficiency"]), unit.strip(", ") or "—")) + " |")
    lines.append("")
    if record["bounds"] and str(record["bounds"]).strip():
        lines += [str(record["bounds"]).strip(), ""]
    for sweep in sweeps(record):
        stem = f"{record['benchmark']}-{kind}-{_slug(sweep['metric'])}"
        name, n = stem + ".svg", 1
        while name in plot_names:
            n += 1
            name = f"{stem}-{n}.svg"
        plot_names[name] = plot_svg(sweep, peer)
        alt = re.sub(r"[\[\]\n]", " ", f"{sweep['metric']} against {sweep['param']}")
        lines += [f"![{alt}]({plot_dir}/{name})", ""]
    lines += ["Rerun it:", ""] + _fence(str(record["command"])) + [""]
    return lines


def render(records: list[dict]) -> tuple[str, dict[str, bytes]]:
    """The page's Markdown and its plots (file name -> SVG bytes) for these records."""
    plots: dict[str, bytes] = {}
    plot_dir = PLOTS.replace(os.sep, "/")
    benchmarks = by_benchmark(records)
    kinds = [k for k in MACHINE_KINDS if any(k in shown(recs) for _, _, recs in benchmarks)]
    lines = [f"<!-- Generated by `{COMMAND}` from benchmarks/results/: edit the records, not this page. -->", "",
             "# Performance", "",
             "Each benchmark runs sgrec and its peer side by side in one run (where the peer is a published "
             "figure, its record names it so) and reports the ratio; the command under each table reruns it. "
             "`ratio` is sgrec against the peer as the benchmark reports it (above 1: sgrec is ahead); "
             "`efficiency` is the share of the machine's measured limit, where one applies.", "",
             f"The page is generated from the records under `benchmarks/results/` (one JSON file per run) by "
             f"`{COMMAND}`. For each benchmark and machine kind it shows the latest run; earlier and superseded "
             "runs stay in the repository.", ""]
    if kinds:
        lines += ["Machine kinds on this page:", ""]
        lines += [f"- `{k}`: {MACHINE_KINDS[k]}" for k in kinds] + [""]
    if not benchmarks:
        lines += ["No benchmark has recorded a run yet.", ""]
    for name, title, recs in benchmarks:
        on_page = shown(recs)
        script = script_for(name)
        lines += [f"## {title}", ""]
        lines += [f"Script: `{script or name}`.", ""]
        if not on_page:
            lines += ["Every record of this benchmark is superseded: none is shown.", ""]
        for kind, record in on_page.items():
            lines += _record_block(record, kind, plots, plot_dir)
        superseded = sum(r["superseded"] for r in recs)
        earlier = len(recs) - superseded - len(on_page)
        if earlier or superseded:
            parts = [f"{n} {what} record{'s' if n != 1 else ''}" for n, what in
                     ((earlier, "earlier"), (superseded, "superseded")) if n]
            lines += [f"Not shown: {' and '.join(parts)}, kept in `benchmarks/results/{name}/` and in git.", ""]
        else:
            lines += ["No earlier or superseded records.", ""]
    return "\n".join(lines).rstrip("\n") + "\n", plots


def outputs(results_dir: str = RESULTS_DIR, out_dir: str = DOCS_DIR) -> dict[str, bytes]:
    """Every file the generator writes: path -> bytes."""
    page, plots = render(load_records(results_dir))
    files = {os.path.join(out_dir, PAGE): page.encode()}
    files.update({os.path.join(out_dir, PLOTS, name): svg for name, svg in plots.items()})
    return files


def _extra_plots(files: dict[str, bytes], out_dir: str) -> list[str]:
    folder = os.path.join(out_dir, PLOTS)
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, n) for n in os.listdir(folder)
                  if n.endswith(".svg") and os.path.join(folder, n) not in files
                  and os.path.isfile(os.path.join(folder, n)))


def _differs(path: str, data: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read() != data
    except OSError:
        return True


def stale(results_dir: str = RESULTS_DIR, out_dir: str = DOCS_DIR) -> list[str]:
    """The files on disk that differ from what the generator would write (a missing one, a changed one,
    a plot it no longer writes)."""
    files = outputs(results_dir, out_dir)
    return [path for path, data in sorted(files.items()) if _differs(path, data)] + _extra_plots(files, out_dir)


def generate(results_dir: str = RESULTS_DIR, out_dir: str = DOCS_DIR) -> tuple[list[str], list[str]]:
    """Writes the page and its plots, removes plots no longer written; (written, removed) paths."""
    files = outputs(results_dir, out_dir)
    written = [path for path, data in sorted(files.items()) if _differs(path, data)]
    for path in written:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(files[path])
    removed = _extra_plots(files, out_dir)
    for path in removed:
        os.remove(path)
    return written, removed


def regenerate_command(results_dir: str = RESULTS_DIR, out_dir: str = DOCS_DIR) -> str:
    cmd = COMMAND
    if os.path.abspath(results_dir) != os.path.abspath(RESULTS_DIR):
        cmd += f" --results-dir {results_dir}"
    if os.path.abspath(out_dir) != os.path.abspath(DOCS_DIR):
        cmd += f" --out {out_dir}"
    return cmd


def _rel(path: str) -> str:
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith("..") else rel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page or a plot on disk is stale")
    ap.add_argument("--results-dir", default=RESULTS_DIR, help="the records (default: benchmarks/results)")
    ap.add_argument("--out", default=DOCS_DIR, help=f"the docs folder: {PAGE} and {PLOTS}/ under it (default: docs)")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale(args.results_dir, args.out)
        for path in bad:
            print(f"{_rel(path)} is stale: run `{regenerate_command(args.results_dir, args.out)}`", file=sys.stderr)
        return 1 if bad else 0
    written, removed = generate(args.results_dir, args.out)
    for path in written:
        print(f"wrote {_rel(path)}")
    for path in removed:
        print(f"removed {_rel(path)}")
    if not written and not removed:
        print("up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
