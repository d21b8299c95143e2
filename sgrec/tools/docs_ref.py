"""Reference pages generated from the code, so that they cannot drift from it.

`python -m sgrec.tools.docs_ref` writes docs/reference/flags.md (every flag of `python -m
sgrec.launch_server`, from ServerArgs and the parser it builds) and docs/reference/http.md (every
route, from the server's own OpenAPI document, built in-process by create_app for the embedded demo
model with no scheduler behind it). `--check` writes nothing: it exits 1, naming each page that
differs from what it would write and the command that regenerates it (tests/test_docs.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import sys
import tempfile
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path

from sgrec.server_args import RETIRED, ServerArgs

ROOT = Path(__file__).resolve().parents[2]  # the source tree: docs/ beside the sgrec package
FLAGS_PAGE = "docs/reference/flags.md"
HTTP_PAGE = "docs/reference/http.md"
COMMAND = "python -m sgrec.tools.docs_ref"

# The sections of flags.md: every ServerArgs field in exactly one (flag_groups raises otherwise), in
# the order shown.
GROUPS = {
    "Model and device": (
        "model_path", "tokenizer_path", "served_model_name", "device", "dtype", "context_length", "random_seed",
        "enable_deterministic_inference"),
    "Memory and batching": (
        "max_total_tokens", "mem_fraction_static", "chunked_prefill_size", "max_prefill_tokens",
        "max_running_requests", "max_mamba_cache_size", "max_queued_requests", "max_input_len"),
    "Scheduling": ("schedule_policy", "jct_fairness", "jct_model", "prefill_only_batch_tokens", "hybrid_chunk_size"),
    "Caches: radix tree, LARU and hierarchical tiers": (
        "disable_radix_cache", "radix_eviction_policy", "radix_eviction_policy_config", "enable_hierarchical_cache",
        "hicache_ratio", "hicache_size", "hicache_write_policy", "hicache_page_size", "hicache_storage_backend",
        "hicache_storage_prefetch_policy", "hicache_storage_backend_extra_config", "item_cache_tokens"),
    "Ranking, retrieval and catalogs": (
        "item_catalog", "catalog_journal", "catalog_history", "semantic_id_tokens", "semantic_id_codebooks",
        "rank_prefix_policy", "max_rank_candidates",
        "max_beam_width", "max_filter_items"),
    "Concurrent execution of rank and retrieve (xGR)": (
        "max_batch_tokens", "batch_wait_ms", "slo_ms", "interleave_rounds", "stream_pool_mb", "num_streams"),
    "HTTP server and security": (
        "host", "port", "api_key", "admin_api_key", "max_request_bytes", "max_batch_size", "max_n",
        "timeout_keep_alive"),
    "Data-parallel ranks and CPU threads": ("dp_size", "cpu_threads", "catalog_update_cores"),
    "Kernels, GPU and quantization": (
        "attention_backend", "disable_cuda_graph", "cuda_graph_max_bs", "cuda_graph_max_beams",
        "disable_weight_packing", "disable_fused_decode", "quantization", "kv_cache_dtype"),
    "Logging and metrics": ("log_level", "enable_metrics"),
}
HTTP_METHODS = ("get", "post", "put", "patch", "delete", "head", "options")


# ---- Markdown -------------------------------------------------------------------------------------
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
FLAG_TOKEN = re.compile(r"(?<![\w`-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*(?![\w-])")


def text_cell(text: str) -> str:
    """`text` (help or a docstring) as Markdown on one line: whitespace collapsed, outside its code spans
    `--flags` put in code and the characters Markdown would read (`<`, `>`, `|`, `*`, `[`, `]`) escaped."""
    text = " ".join(text.split())
    out, at = [], 0
    for m in CODE_SPAN.finditer(text):
        out.append(_escape(text[at:m.start()]))
        out.append(m.group())
        at = m.end()
    out.append(_escape(text[at:]))
    return "".join(out)


def _escape(text: str) -> str:
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = re.sub(r"([|*\[\]])", r"\\\1", text)
    return FLAG_TOKEN.sub(lambda m: f"`{m.group()}`", text)


def code(text: str) -> str:
    """`text` as an inline code span (longer fences when it holds backticks)."""
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """A Markdown table's lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    value = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", value).strip().lower())


# ---- flags.md -------------------------------------------------------------------------------------
@dataclass
class Flag:
    field: str
    flag: str
    value: str  # "integer", "number", "string", "switch", or the choices
    default: str  # as --help shows it; "" where it shows none
    help: str  # the help text without the default --help appends


def server_parser() -> argparse.ArgumentParser:
    """The parser of `python -m sgrec.launch_server`'s flags (ServerArgs.add_cli_args)."""
    parser = argparse.ArgumentParser(prog="python -m sgrec.launch_server")
    ServerArgs.add_cli_args(parser)
    return parser


def server_flags() -> list[Flag]:
    """Every flag of the server, in ServerArgs' order, read from the argparse actions --help prints."""
    flags = []
    for action in server_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        help_text, default = action.help, ""
        shown = f" (default: {action.default})"
        if action.default is not None and help_text.endswith(shown):
            help_text, default = help_text[: -len(shown)], str(action.default)
        if action.nargs == 0:
            value = "switch"
        elif action.choices:
            value = ", ".join(code(str(c)) for c in action.choices if c is not None)
        else:
            value = {int: "integer", float: "number"}.get(action.type, "string")
        flags.append(Flag(action.dest, action.option_strings[0], value, default, help_text))
    return flags


def flag_groups(flags: list[Flag]) -> dict[str, list[Flag]]:
    """GROUPS with each name replaced by its Flag. Raises ValueError for a flag in no group (a new field
    of ServerArgs must be placed in GROUPS), in two, or a group naming a field that does not exist."""
    by_field = {f.field: f for f in flags}
    placed = [name for names in GROUPS.values() for name in names]
    unplaced = [f.flag for f in flags if f.field not in placed]
    twice = sorted({name for name in placed if placed.count(name) > 1})
    unknown = sorted(set(placed) - set(by_field))
    if unplaced or twice or unknown:
        raise ValueError(f"sgrec.tools.docs_ref.GROUPS: flags in no group {unplaced}, in two {twice}, "
                         f"not flags {unknown}; every ServerArgs field belongs to exactly one group")
    return {title: [by_field[name] for name in names] for title, names in GROUPS.items()}


def flags_page() -> str:
    """docs/reference/flags.md."""
    lines = [
        "# Server flags", "",
        f"This page is generated by `{COMMAND}` from `sgrec/server_args.py` and must not be edited by hand.", "",
        "Every flag of `python -m sgrec.launch_server` (its `--help` prints the same texts), grouped by what it "
        "controls. A switch takes no value and is off unless given; a default of \"-\" means the flag is unset "
        "unless given, and its text says what happens then. \"SGLang's flag\" marks a flag with the name and "
        "meaning it has in SGLang.", "",
    ]
    for title, flags in flag_groups(server_flags()).items():
        rows = [(code(f.flag), f.value, code(f.default) if f.default else ("off" if f.value == "switch" else "-"),
                 text_cell(f.help)) for f in flags]
        lines += [f"## {title}", "", *table(("Flag", "Value", "Default", "Description"), rows), ""]
    lines += ["## Retired flags", "",
              "Flags of earlier versions: the server refuses each with an error that says what replaced it.", "",
              *table(("Flag", "Replaced by"), [(code(flag), text_cell(why)) for flag, why in sorted(RETIRED.items())]),
              ""]
    return "\n".join(lines)


# ---- the OpenAPI document -------------------------------------------------------------------------
@dataclass
class HttpSurface:
    doc: dict  # the OpenAPI document, as GET /openapi.json returns it
    outside: dict[str, list[str]]  # paths served but left out of the document -> their methods
    vocab_size: int
    args: ServerArgs


@contextlib.contextmanager
def demo_app():
    """create_app's app for the embedded demo model (`sgrec.demo.model_path()`) and the default flags, with
    no scheduler behind it: a real TokenizerManager (the model's tokenizer; its sockets bound in a
    temporary folder, nothing connects) given the request limits its ranks would report (wait_ready),
    the vocabulary read from the model's config. Yields (app, args, vocab_size)."""
    from sgrec import demo
    from sgrec.entrypoints.http_server import create_app
    from sgrec.managers.generate import Limits, RequestBuilder
    from sgrec.managers.tokenizer_manager import TokenizerManager
    from sgrec.model.config import ModelConfig

    if not demo.available():
        raise RuntimeError(f"the embedded demo model is missing from {demo.model_path()} (python -m sgrec.demo.train)")
    args = ServerArgs(model_path=demo.model_path())
    cfg = ModelConfig.from_dir(args.model_path)
    with tempfile.TemporaryDirectory(prefix="sgrec-docs-ipc-") as ipc:
        tm = TokenizerManager(args, [f"ipc://{ipc}/scheduler-0"], f"ipc://{ipc}/tokenizer")
        try:
            n = cfg.max_position_embeddings  # context and pool sizes: not in the document
            tm.builder = RequestBuilder(tm.tokenizer, Limits(cfg.vocab_size, n, n, n, args.max_batch_size, args.max_n))
            yield create_app(tm, args, {}), args, cfg.vocab_size
        finally:
            tm.ctx.destroy(linger=0)


@functools.lru_cache(maxsize=1)
def http_surface() -> HttpSurface:
    """The demo app's OpenAPI document and the paths it serves outside it (built once per process;
    callers must not modify it)."""
    with demo_app() as (app, args, vocab_size), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FastAPI's duplicate operation ids of the multi-method routes
        doc = app.openapi()
        outside = {r.path: sorted(getattr(r, "methods", None) or ["GET"]) for r in app.routes
                   if not getattr(r, "include_in_schema", True)}
    return HttpSurface(doc, dict(sorted(outside.items())), vocab_size, args)


# ---- http.md --------------------------------------------------------------------------------------
def ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[1]


def resolve(doc: dict, schema: dict) -> dict:
    """`schema`, or the component its $ref names."""
    return doc["components"]["schemas"][ref_name(schema["$ref"])] if "$ref" in schema else schema


def alternatives(schema: dict) -> list[dict]:
    """The branches of a pure anyOf / oneOf union, nested unions flattened; [schema] for anything else."""
    alts = schema.get("anyOf") or schema.get("oneOf")
    if not alts or set(schema) - {"anyOf", "oneOf", "default", "title", "description"}:
        return [schema]
    return [leaf for alt in alts for leaf in alternatives(alt)]


def _count(lo, hi, what: str) -> str | None:
    if lo is None and hi is None:
        return None
    if hi == 0:
        return f"no {what}s"
    plural = lambda k: what if k == 1 else what + "s"  # noqa: E731
    if lo is None or lo == 0:
        return f"at most {hi} {plural(hi)}" if hi is not None else None
    if hi is None:
        return f"at least {lo} {plural(lo)}"
    return f"{lo} {plural(hi)}" if lo == hi else f"{lo} to {hi} {plural(hi)}"


def _bounds(s: dict) -> str:
    lo, hi = s.get("minimum"), s.get("maximum")
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    left = f"[{lo}" if lo is not None else f"({xlo}" if xlo is not None else None
    right = f"{hi}]" if hi is not None else f"{xhi})" if xhi is not None else None
    if left and right:
        return f" in {left}, {right}"
    if left:
        return f" ≥ {lo}" if lo is not None else f" > {xlo}"
    if right:
        return f" ≤ {hi}" if hi is not None else f" < {xhi}"
    return ""


def type_text(s: dict) -> str:
    """A schema's type with its bounds in words: `array (1 to 1024 items) of integer in [0, 4543]`;
    a component as a link to its section."""
    if not s:
        return "any"
    if "$ref" in s:
        return f"[{ref_name(s['$ref'])}](#{slug(ref_name(s['$ref']))})"
    alts = alternatives(s)
    if len(alts) > 1 or alts[0] is not s:
        texts = list(dict.fromkeys(type_text(a) for a in alts))
        return " or ".join([t for t in texts if t != "null"] + (["null"] if "null" in texts else []))
    if "const" in s:
        return code(json.dumps(s["const"]))
    if "enum" in s:
        return "one of " + ", ".join(code(json.dumps(v)) for v in s["enum"])
    kind = s.get("type")
    if kind == "array":
        extras = [x for x in (_count(s.get("minItems"), s.get("maxItems"), "item"),
                              "unique" if s.get("uniqueItems") else None) if x]
        return f"array{' (' + ', '.join(extras) + ')' if extras else ''} of {_inner(s.get('items', {}))}"
    if kind in ("integer", "number"):
        return kind + _bounds(s)
    if kind == "string":
        extras = [x for x in (_count(s.get("minLength"), s.get("maxLength"), "character"),
                              f"matching {code(s['pattern'])}" if "pattern" in s else None) if x]
        return "string" + (f" ({', '.join(extras)})" if extras else "")
    if kind in ("boolean", "null"):
        return kind
    if kind == "object" or "properties" in s or "additionalProperties" in s:
        if s.get("maxProperties") == 0:
            return "empty object"
        extra = s.get("additionalProperties")
        if isinstance(extra, dict) and not s.get("properties"):
            keys = s.get("propertyNames", {}).get("pattern")
            return f"object{f' (keys matching {code(keys)})' if keys else ''} of {_inner(extra)}"
        return "object"
    return code(json.dumps(s, sort_keys=True))


def _inner(s: dict) -> str:
    """type_text of an element type: a union in parentheses."""
    text = type_text(s)
    return f"({text})" if " or " in text else text


def object_notes(s: dict, where: str = "") -> list[str]:
    """The rules of an object schema beyond its fields, as sentences (each about `where`, a field path,
    when given): its description, which of its fields must be given, rules between fields (if / then /
    else), unknown fields rejected."""
    rules = []
    for key in ("anyOf", "oneOf"):
        branches = s.get(key)
        if not branches or "properties" not in s:
            continue
        names = [b.get("required", []) for b in branches]
        if all(len(n) == 1 and set(b) <= {"required", "properties"} for n, b in zip(names, branches)):
            nulls = any(b.get("properties") for b in branches)  # the others null in each branch: exactly one
            listed = ", ".join(code(n[0]) for n in names)
            rules.append(f"{'exactly' if key == 'oneOf' or nulls else 'at least'} one of {listed} must be given"
                         + (" (null counts as not given)" if nulls else "") + ".")
        else:
            rules.append(f"it must match {key}: " + ", ".join(code(json.dumps(b, sort_keys=True)) for b in branches))
    if "if" in s:
        cond = code(json.dumps(s["if"], sort_keys=True))
        if s.get("then"):
            rules.append(f"if it matches {cond}, it must also match {code(json.dumps(s['then'], sort_keys=True))}"
                         + (f", else {code(json.dumps(s['else'], sort_keys=True))}" if s.get("else") else "") + ".")
        elif s.get("else"):
            rules.append(f"unless it matches {cond}, it must match {code(json.dumps(s['else'], sort_keys=True))}.")
    if s.get("additionalProperties") is False:
        rules.append("other fields are rejected (400).")
    notes = [text_cell(s["description"])] if s.get("description") else []
    if where:
        return [f"{code(where)}: {n}" for n in notes + rules]
    return notes + [r[0].upper() + r[1:] for r in rules]


def field_rows(doc: dict, s: dict, prefix: str = "") -> tuple[list[tuple[str, ...]], list[str]]:
    """The table rows of an object schema's fields (inline objects' fields as `parent.child`, an array of
    objects' as `parent[].child`) and the notes of those objects."""
    rows, notes = [], object_notes(s, prefix.rstrip("."))
    required = set(s.get("required", []))
    for name, prop in s.get("properties", {}).items():
        default = code(json.dumps(prop["default"])) if "default" in prop else ""
        rows.append((code(prefix + name), type_text(prop), "yes" if name in required else "",
                     default, text_cell(prop.get("description", ""))))
        for alt in alternatives(prop):
            if alt.get("properties"):
                sub_rows, sub_notes = field_rows(doc, alt, f"{prefix}{name}.")
            elif alt.get("type") == "array" and alt.get("items", {}).get("properties"):
                sub_rows, sub_notes = field_rows(doc, alt["items"], f"{prefix}{name}[].")
            else:
                continue
            rows += sub_rows
            notes += sub_notes
    return rows, notes


def schema_block(doc: dict, s: dict) -> list[str]:
    """A body schema's lines: a union of components as links, else its fields' table and its notes."""
    if "properties" not in s:
        alts = alternatives(s)
        if all("$ref" in a for a in alts) and len(alts) > 1:
            return ["One of " + " or ".join(type_text(a) for a in alts) + ".", ""]
        return [f"Type: {type_text(s)}.", ""]
    rows, notes = field_rows(doc, s)
    header = ("Field", "Type", "Required", "Default", "Description")
    keep = [i for i in range(len(header)) if i < 2 or any(row[i] for row in rows)]  # no all-empty column
    lines = table(tuple(header[i] for i in keep), [tuple(row[i] for i in keep) for row in rows]) + [""]
    return lines + ([*(f"- {n}" for n in notes), ""] if notes else [])


def refs_in(value) -> set[str]:
    """The component names a schema (or any JSON value) refers to."""
    if isinstance(value, dict):
        found = {ref_name(value["$ref"])} if isinstance(value.get("$ref"), str) else set()
        return found.union(*(refs_in(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(refs_in(v) for v in value))
    return set()


def reachable(doc: dict, names: set[str]) -> set[str]:
    """`names` and every component they refer to, transitively."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += refs_in(doc["components"]["schemas"][name])
    return seen


def operations(doc: dict) -> list[tuple[str, list[str], dict]]:
    """(path, methods, operation) by path; the methods of a path that share one operation (all but its
    operationId) merged."""
    out = []
    for path in sorted(doc["paths"]):
        merged: list[tuple[list[str], dict]] = []
        for method in HTTP_METHODS:
            op = doc["paths"][path].get(method)
            if op is None:
                continue
            same = {k: v for k, v in op.items() if k != "operationId"}
            for methods, other in merged:
                if other == same:
                    methods.append(method.upper())
                    break
            else:
                merged.append(([method.upper()], same))
        out += [(path, methods, op) for methods, op in merged]
    return out


def route_heading(path: str, methods: list[str]) -> str:
    return f"{', '.join(methods)} {path}"


def route_section(doc: dict, path: str, methods: list[str], op: dict) -> list[str]:
    """One route's heading, summary, description, request body and responses."""
    lines = [f"## {route_heading(path, methods)}", "", f"**{op.get('summary', path)}**" + (
        f": {text_cell(op['description'])}" if op.get("description") else "."), ""]
    body = op.get("requestBody")
    if body:
        for media, content in sorted(body.get("content", {}).items()):
            schema = content.get("schema", {})
            name = f" `{schema['$ref'].rsplit('/', 1)[-1]}`" if "$ref" in schema else ""  # shown here, not under Schemas
            lines += [f"Request body ({code(media)}, {'required' if body.get('required') else 'optional'}):{name}", ""]
            lines += schema_block(doc, resolve(doc, schema))
    else:
        lines += ["No request body.", ""]
    if op.get("security"):
        lines += ["Needs `Authorization: Bearer KEY`.", ""]
    rows = [(code(status), text_cell(r.get("description", "")), ", ".join(map(code, sorted(r.get("content", {})))))
            for status, r in sorted(op.get("responses", {}).items())]
    return lines + table(("Status", "Meaning", "Body"), rows) + [""]


def http_page(surface: HttpSurface | None = None) -> str:
    """docs/reference/http.md."""
    from sgrec.entrypoints.http_server import ADMIN_PATHS, OPEN_PATHS

    surface = surface or http_surface()
    doc, args = surface.doc, surface.args
    ops = operations(doc)
    limits = ", ".join(f"{code('--' + k.replace('_', '-'))} {getattr(args, k)}" for k in
                       ("max_n", "max_batch_size", "max_rank_candidates", "max_beam_width", "max_filter_items"))
    lines = [
        "# HTTP routes", "",
        f"This page is generated by `{COMMAND}` from the server's OpenAPI document (what `GET /openapi.json` "
        "returns) and must not be edited by hand.", "",
        f"The document was built in-process by `create_app` (`sgrec/entrypoints/http_server.py`) for the embedded "
        f"demo model (`sgrec.demo.model_path()`, a vocabulary of {surface.vocab_size} tokens: token ids up to "
        f"{surface.vocab_size - 1}) and the default flags, so the bounds that come from flags show their defaults: "
        f"{limits}. A running server's `/openapi.json` has its own model's vocabulary and its own flags' bounds.", "",
        f"Without `--api-key` no route asks for a key. With it, every route but "
        f"{', '.join(code(p) for p in OPEN_PATHS)} needs `Authorization: Bearer KEY` and answers 401 without it; "
        f"with `--admin-api-key`, POST on {', '.join(code(p) for p in ADMIN_PATHS)} needs that key instead. "
        "The document then lists the 401s and the bearer scheme.", "",
        "Served outside the document: " + "; ".join(f"{', '.join(m)} {code(p)}" for p, m in surface.outside.items())
        + ".", "",
        *table(("Route", "Summary"), [(f"[{route_heading(p, m)}](#{slug(route_heading(p, m))})",
                                       text_cell(op.get("summary", ""))) for p, m, op in ops]), "",
    ]
    bodies = set()
    for path, methods, op in ops:
        lines += route_section(doc, path, methods, op)
        for content in op.get("requestBody", {}).get("content", {}).values():
            bodies |= refs_in(resolve(doc, content.get("schema", {})))
    names = sorted(reachable(doc, bodies))
    if names:
        lines += ["## Schemas", "", "The components the request bodies above refer to.", ""]
        for name in names:
            lines += [f"### {name}", "", *schema_block(doc, doc["components"]["schemas"][name])]
    return "\n".join(lines).rstrip("\n") + "\n"


# ---- writing and checking -------------------------------------------------------------------------
def pages() -> dict[str, str]:
    """Each generated page's path (relative to the source tree) -> its text."""
    return {FLAGS_PAGE: flags_page(), HTTP_PAGE: http_page()}


def stale(root: Path = ROOT) -> list[str]:
    """A line for each page on disk under `root` that differs from what `pages()` would write (or is
    missing); [] when all are current."""
    out = []
    for rel, text in pages().items():
        path = root / rel
        if not path.exists():
            out.append(f"{rel} is missing; write it with: {COMMAND}")
        elif path.read_text(encoding="utf-8") != text:
            out.append(f"{rel} differs from what the code generates; regenerate it with: {COMMAND}")
    return out


def write(root: Path = ROOT) -> list[str]:
    """Writes every page under `root`; returns the paths written."""
    written = pages()
    for rel, text in written.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    return list(written)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page differs from the code's")
    ap.add_argument("--root", type=Path, default=ROOT, help="the source tree (default: this checkout)")
    args = ap.parse_args(argv)
    if args.check:
        problems = stale(args.root)
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    for rel in write(args.root):
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
