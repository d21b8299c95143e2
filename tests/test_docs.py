"""The documentation against the code: the generated reference pages (sgrec.tools.docs_ref) are current,
and every server flag and HTTP route the documentation names exists. In-process, no server: the routes
come from the OpenAPI document create_app builds (docs_ref.http_surface)."""

from __future__ import annotations

import ast
import bisect
import re
from pathlib import Path

import pytest

from sgrec.server_args import RETIRED
from sgrec.tools import docs_ref

ROOT = Path(__file__).resolve().parents[1]
TOP_DOCS = ("README.md", "CHANGELOG.md")  # besides docs/ (ARCHITECTURE.md links into it)
PROGRAM_SOURCES = ("sgrec/**/*.py", "benchmarks/*.py", "launch/*.py")  # the project's own command lines
EXTERNAL_PAGES = {  # pages about another program's interface: its flags and routes, not sgrec's
    "docs/reference/sglang-api.md": "SGLang 0.5.23's wire format and routes, read from its source",
}
EXTERNAL_FLAGS = {  # flags of other programs that the docs quote, and whose they are
    "--no-deps": "pip install",
    "--strict": "mkdocs build",
    "--format": "pip list --format=freeze",
    "--grammar-backend": "python -m sglang.launch_server (the plugin's sgrec-sid backend)",
    "--prefill-max-requests": "python -m sglang.launch_server",
    "--gil": "py-spy",
    "--native": "py-spy",
    "--rpc_port": "mooncake_master",
    "--checks": "schemathesis",
    "--continue-on-failure": "schemathesis",
    "--generation-deterministic": "schemathesis",
}
NOT_ROUTES = {  # paths the docs name because the server must not serve them
    "/metrics/x": "docs/reliability.md: only the exact open paths skip the API key, not their prefixes",
}
HTTP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")

FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_]*(?:-[a-z0-9_]+)*")
PATH = re.compile(r"/(?:[\w.*~-]|\{[^{}\s]*\})+(?:/(?:[\w.*~-]|\{[^{}\s]*\})*)*")
_METHOD = f"(?:{'|'.join(HTTP_METHODS)})"
METHOD_PATH = re.compile(rf"\b({_METHOD}(?:\s*[|,]\s*{_METHOD})*)\s+`?({PATH.pattern})")  # POST /v1/rank
BOUNDARY = set(" \t\n`'\"([{=<>,;")
HOST_PORT = re.compile(r"[\w.\]-]:\d{1,5}$")  # localhost:30000/v1/rank, [::1]:30000/generate


# ---- the documentation ----------------------------------------------------------------------------
def doc_files() -> dict[str, str]:
    """Path (relative to the checkout) -> text of every documentation page: the top-level pages that
    exist and docs/**/*.md, each file once and under its real path (ARCHITECTURE.md may be a link to a
    docs page), less EXTERNAL_PAGES."""
    paths = [ROOT / name for name in TOP_DOCS if (ROOT / name).exists()] + sorted((ROOT / "docs").rglob("*.md"))
    out = {}
    for path in paths:
        rel = path.resolve().relative_to(ROOT.resolve()).as_posix()
        if rel not in EXTERNAL_PAGES:
            out.setdefault(rel, path.read_text(encoding="utf-8"))
    return out


def code_spans(text: str) -> list[tuple[int, str]]:
    """(offset, code) of each code block's body (fenced, or indented by 4 spaces after a blank line) and
    of each inline code span outside them."""
    kinds, pos, fence, prev = [], 0, None, ""  # per line: (offset, line, "code" | "prose")
    for line in text.splitlines(keepends=True):
        m = FENCE.match(line)
        if fence is None and m:
            fence, kind = m.group(1), "fence"
        elif fence is not None:
            closing = m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                and not line.strip().strip(fence[0])
            fence, kind = (None, "fence") if closing else (fence, "code")
        elif re.match(r"( {4}|\t)", line) and (not prev.strip() or kinds[-1][2] == "code"):
            kind = "code"
        else:
            kind = "prose" if line.strip() or not kinds or kinds[-1][2] != "code" else "code"
        kinds.append((pos, line, kind))
        pos, prev = pos + len(line), line
    spans, run = [], []
    for at, line, kind in kinds + [(pos, "", "end")]:
        if run and (kind != run[0][2]):
            start, body = run[0][0], "".join(r[1] for r in run)
            if run[0][2] == "code":
                spans.append((start, body))
            elif run[0][2] == "prose":
                spans += [(start + m.start(2), m.group(2)) for m in INLINE_CODE.finditer(body)
                          if not re.search(r"\n[ \t]*\n", m.group(2))]
            run = []
        run.append((at, line, kind))
    return spans


def line_of(text: str):
    """A function: offset in `text` -> its line number (1-based)."""
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    return lambda offset: bisect.bisect_right(starts, offset)


def flag_mentions(text: str) -> list[tuple[int, str]]:
    """(line, flag) of every `--flag` token in the code (blocks and spans) of a Markdown text."""
    line = line_of(text)
    return [(line(at + m.start()), m.group()) for at, code in code_spans(text) for m in FLAG.finditer(code)]


def route_mentions(text: str, first_segments: set[str]) -> list[tuple[int, str | None, str]]:
    """(line, methods or None, path) of every route a Markdown text names: anywhere, a path after an HTTP
    method (`POST /v1/rank`, `GET|POST /flush_cache`); in code and prose, a path standing alone (after a
    space, quote, bracket, backtick or `host:port`) whose first segment starts a route of the server
    (`/generate`, `localhost:30000/v1/rank`), so that file paths (`/tmp/x`, `/proc/cpuinfo`) are not
    taken for routes."""
    line, found = line_of(text), {}
    for m in METHOD_PATH.finditer(text):
        found[m.start(2)] = (line(m.start(2)), re.sub(r"\s*[|,]\s*", "|", m.group(1)), m.group(2))
    for m in PATH.finditer(text):
        before = text[max(0, m.start() - 40):m.start()]
        standalone = m.start() == 0 or before[-1] in BOUNDARY or HOST_PORT.search(before)
        first = m.group().split("/")[1].rstrip(".*")
        if m.start() not in found and standalone and first in first_segments:
            found[m.start()] = (line(m.start()), None, m.group())
    return [found[at] for at in sorted(found)]


# ---- what exists ----------------------------------------------------------------------------------
def program_flags() -> set[str]:
    """The flags of the project's own command-line programs: every `add_argument("--...")` in
    PROGRAM_SOURCES, ServerArgs' flags (built in a loop) and its retired ones, and argparse's --help."""
    flags = {"--help", *RETIRED, *(f.flag for f in docs_ref.server_flags())}
    for pattern in PROGRAM_SOURCES:
        for path in ROOT.glob(pattern):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                    flags |= {a.value for a in node.args if isinstance(a, ast.Constant)
                              and isinstance(a.value, str) and a.value.startswith("--")}
    return flags


def served_routes() -> dict[str, set[str]]:
    """Path template (`/v1/models/{model_id}`) -> the methods the server answers there: the OpenAPI
    document's operations and the routes FastAPI serves outside it (/openapi.json, /docs ...)."""
    surface = docs_ref.http_surface()
    routes = {path: {m.upper() for m in ops if m.upper() in HTTP_METHODS} for path, ops in surface.doc["paths"].items()}
    for path, methods in surface.outside.items():
        routes.setdefault(path, set()).update(methods)
    return routes


def _segments(path: str) -> list[str]:
    return ["{}" if re.fullmatch(r"\{[^{},]*\}", s) else s for s in path.strip("/").split("/")]


def _expand(path: str) -> list[str]:
    """`/v1/catalog/{items,delete}` -> both paths; other paths as they are."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[:m.start()] + alt.strip() + path[m.end():])]


def _fits(named: list[str], have: list[str], under: bool) -> bool:
    """Whether a route's segments `have` match the named ones (a template matches any segment); `under`:
    the named path is a prefix, its last segment possibly partial (`ready` of `/ready*`, "" of `/v1/...`)."""
    same = lambda a, b: a == b or "{}" in (a, b)  # noqa: E731
    if not under:
        return len(have) == len(named) and all(map(same, named, have))
    last = len(named) - 1
    return len(have) > last and all(map(same, named[:last], have)) and (
        have[last].startswith(named[last]) or (have[last] == "{}" and named[last] != ""))


def route_known(path: str, methods: str | None, routes: dict[str, set[str]]) -> bool:
    """Whether a named route exists (with each method named): a template segment matches any segment;
    a path ending in `...` or `*` names the routes under it (`/v1/catalog/...`, `/ready*`), and so does
    a bare first segment named without a method that is no route itself (`/v1`)."""
    if path in NOT_ROUTES:
        return True
    under = path.endswith(("...", "*"))
    path = path.rstrip("*").removesuffix("...") if under else path.rstrip(".,:;")
    if methods is None and not under and path not in routes and path.count("/") == 1:
        path, under = path + "/", True
    wanted = set(methods.split("|")) if methods else set()
    for one in _expand(path):
        named = one.lstrip("/").split("/")
        named = ["{}" if re.fullmatch(r"\{[^{},]*\}", s) else s for s in named]
        if not any(_fits(named, _segments(route), under) and wanted <= allowed for route, allowed in routes.items()):
            return False
    return True


def unknown_flags(files: dict[str, str], known: set[str]) -> list[str]:
    """`file:line: --flag` for each flag the texts name that is not in `known`."""
    return [f"{name}:{line}: {flag}" for name, text in files.items() for line, flag in flag_mentions(text)
            if flag not in known]


def unknown_routes(files: dict[str, str], routes: dict[str, set[str]]) -> list[str]:
    """`file:line: [METHOD ]path` for each route the texts name that the server does not serve."""
    # what starts a path standing alone: the document's routes and /openapi.json (not FastAPI's /docs, as
    # this repository's docs/ folder would be taken for routes)
    first = {_segments(p)[0] for p in docs_ref.http_surface().doc["paths"]} | {"openapi.json"}
    return [f"{name}:{line}: {(methods + ' ') if methods else ''}{path}" for name, text in files.items()
            for line, methods, path in route_mentions(text, first) if not route_known(path, methods, routes)]


# ---- the tests ------------------------------------------------------------------------------------
def test_generated_reference_pages_are_current():
    problems = docs_ref.stale()
    assert not problems, "\n".join(problems)


def test_the_page_check_reports_a_stale_page(tmp_path):
    docs_ref.write(tmp_path)
    assert docs_ref.stale(tmp_path) == []
    page = tmp_path / docs_ref.FLAGS_PAGE
    page.write_text(page.read_text(encoding="utf-8").replace("`--port`", "`--prot`"), encoding="utf-8")
    (tmp_path / docs_ref.HTTP_PAGE).unlink()
    assert docs_ref.stale(tmp_path) == [
        f"{docs_ref.FLAGS_PAGE} differs from what the code generates; regenerate it with: {docs_ref.COMMAND}",
        f"{docs_ref.HTTP_PAGE} is missing; write it with: {docs_ref.COMMAND}"]
    assert docs_ref.main(["--check", "--root", str(tmp_path)]) == 1


def test_every_server_flag_is_in_one_group():
    groups = docs_ref.flag_groups(docs_ref.server_flags())
    assert sorted(f.flag for fs in groups.values() for f in fs) == sorted(f.flag for f in docs_ref.server_flags())
    new = docs_ref.Flag("new_knob", "--new-knob", "integer", "", "A flag nobody placed.")
    with pytest.raises(ValueError, match="--new-knob"):
        docs_ref.flag_groups([*docs_ref.server_flags(), new])


def test_every_flag_named_in_the_docs_exists():
    problems = unknown_flags(doc_files(), program_flags() | set(EXTERNAL_FLAGS))
    assert not problems, "flags the documentation names that no program has:\n" + "\n".join(problems)


def test_the_flag_check_reports_an_unknown_flag():
    text = ("Start it with `python -m sgrec.launch_server --port 1 --no-such-flag`; prose --not-code is not read.\n"
            "```bash\n"
            "pip install --no-deps x\n"
            "python benchmarks/bench_rank.py --also-missing=3\n"
            "```\n")
    known = program_flags() | set(EXTERNAL_FLAGS)
    assert unknown_flags({"sample-page": text}, known) == ["sample-page:1: --no-such-flag", "sample-page:4: --also-missing"]


def test_every_route_named_in_the_docs_exists():
    problems = unknown_routes(doc_files(), served_routes())
    assert not problems, "routes the documentation names that the server does not serve:\n" + "\n".join(problems)


def test_the_route_check_reports_an_unknown_route():
    text = ("`POST /v1/rank` and `GET /v1/models/{id}`, `curl localhost:30000/v1/catalog/items`, `/v1/catalog/...`,\n"
            "`GET|POST /flush_cache?timeout=0`, /health in prose; files `/tmp/x`, /proc/cpuinfo, `docs/v1/x.txt`.\n"
            "Wrong: `POST /v1/no_such_route`, `/generate/extra`,\n"
            "GET /v1/rank (a POST route), `curl localhost:30000/v1/catalog/itemz`, `/v1/{rank,rnk}`.\n")
    assert unknown_routes({"sample-page": text}, served_routes()) == [
        "sample-page:3: POST /v1/no_such_route", "sample-page:3: /generate/extra", "sample-page:4: GET /v1/rank",
        "sample-page:4: /v1/catalog/itemz", "sample-page:4: /v1/{rank,rnk}"]
