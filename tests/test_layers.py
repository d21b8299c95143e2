"""sgrec's rooms keep their order: no import cycle between modules, and no import from a lower layer
to a higher one (ARCHITECTURE.md's module map). Read from the source with ast, nothing is imported.

What counts as an import: every `import sgrec...` / `from sgrec... import ...` / relative import in
a module, function-local ones included (they are real dependencies that only run later); imports
under `if TYPE_CHECKING:` do not count (annotations only). `from pkg import name` is an import of
the module pkg.name when that is a module, else of pkg. A package's `__init__` is the module named
by the package; importing a submodule does not count as importing its parents.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sgrec"

# The layer order, bottom first: a module may import modules of its own layer and of the layers below.
# One folder (or top-level module) is one layer: every entry is `sgrec.X`, a direct child of the
# package (test_layers_are_folders), and a module's layer is the entry above it; "sgrec" is the
# package's own __init__ only. ARCHITECTURE.md's module map, read bottom-up:
# base (arguments, sampling, tokenizer, data) < mem (KV pool) < model < runner < catalog < radix
# (with its trace simulator radix/sim/, which nothing else imports) < policy (the scheduler's
# algorithms: prefill-only order and JCT models, batching, streams) < layout (the two bipartite rank
# layouts) < items (the item KV store) < beam (retrieve) < sglang_plugin (sgrec inside stock SGLang;
# nothing imports it) < rank < managers (the inter-process messages and the asyncio side, which never
# imports the scheduler) < scheduler (the loop, tasks, the process) < engine < the package's __init__ <
# demo < entrypoints (HTTP) < tools < launch_server.
LAYERS: list[tuple[str, ...]] = [
    ("sgrec.server_args", "sgrec.sampling", "sgrec.tokenizer", "sgrec.data"),
    ("sgrec.mem",),
    ("sgrec.model",),
    ("sgrec.runner",),
    ("sgrec.catalog",),
    ("sgrec.radix",),
    ("sgrec.policy",),
    ("sgrec.layout",),
    ("sgrec.items",),
    ("sgrec.beam",),
    ("sgrec.sglang_plugin",),
    ("sgrec.rank",),
    ("sgrec.managers",),
    ("sgrec.scheduler",),
    ("sgrec.engine",),
    ("sgrec",),
    ("sgrec.demo",),
    ("sgrec.entrypoints",),
    ("sgrec.tools", "sgrec.bench_serving"),
    ("sgrec.launch_server",),
]
OUTSIDE = ("tests", "benchmarks", "launch")  # import sgrec; sgrec never imports them


@dataclass(frozen=True)
class Import:
    src: str  # importing module
    dst: str  # imported module
    where: str  # file:line
    text: str  # the statement

    def __str__(self) -> str:
        return f"{self.where}: `{self.text}` ({self.src} -> {self.dst})"


# ---- reading the imports ---------------------------------------------------------------------------
def module_names(package: Path) -> dict[str, Path]:
    """Module name -> file, for every .py under `package` (a package's __init__ is the package)."""
    base = package.parent
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST):
    """Every import statement of a module, at any depth, except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def read_imports(module: str, path: Path, modules: dict[str, Path], outside: tuple[str, ...] = OUTSIDE) -> list[Import]:
    """The imports of `module` (file `path`) of modules in `modules`, and of the `outside` roots."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = []
    for node in _statements(tree):
        where, text = f"{rel}:{node.lineno}", ast.unparse(node)
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names]
        for target in dict.fromkeys(targets):
            name = target
            while name and name not in modules:  # `import a.b.c` names a.b.c, the deepest module there is
                name = name.rpartition(".")[0]
            if name and name != module:
                out.append(Import(module, name, where, text))
            elif target.split(".")[0] in outside:
                out.append(Import(module, target, where, text))
    return out


def import_graph(package: Path = PACKAGE) -> tuple[dict[str, Path], list[Import]]:
    modules = module_names(package)
    return modules, [imp for name, path in modules.items() for imp in read_imports(name, path, modules)]


# ---- checking them -----------------------------------------------------------------------------------
def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle [a, b, ..., a] of `graph` (node -> nodes it imports), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def layer_of(module: str, layers: list[tuple[str, ...]]) -> int | None:
    """Index of the layer of `module`'s longest entry ("sgrec" itself matches only the package)."""
    best, best_len = None, -1
    for i, entries in enumerate(layers):
        for entry in entries:
            if module == entry or ("." in entry and module.startswith(entry + ".")):
                if len(entry) > best_len:
                    best, best_len = i, len(entry)
    return best


def layer_problems(modules: list[str], imports: list[Import], layers: list[tuple[str, ...]]) -> list[str]:
    """Modules without a layer, entries without a module, and imports from a lower layer to a higher one."""
    problems = [f"{m} is in no layer: add it to LAYERS (tests/test_layers.py) and to ARCHITECTURE.md's map"
                for m in modules if layer_of(m, layers) is None]
    for entries in layers:
        for entry in entries:
            if not any(m == entry or m.startswith(entry + ".") for m in modules):
                problems.append(f"LAYERS names {entry}, which is no module: remove it")
    for imp in imports:
        if imp.dst.split(".")[0] in OUTSIDE:
            problems.append(f"{imp}: sgrec imports none of {', '.join(OUTSIDE)}")
            continue
        a, b = layer_of(imp.src, layers), layer_of(imp.dst, layers)
        if a is not None and b is not None and b > a:
            problems.append(f"{imp}: layer {a} ({', '.join(layers[a])}) imports layer {b} ({', '.join(layers[b])}), "
                            "a higher one")
    return problems


def cycle_message(cycle: list[str], imports: list[Import]) -> str:
    by_edge = {}
    for imp in imports:
        by_edge.setdefault((imp.src, imp.dst), imp)
    return "import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(
        f"  {by_edge[(a, b)]}" for a, b in zip(cycle, cycle[1:]))


# ---- sgrec -------------------------------------------------------------------------------------------
def test_no_import_cycle():
    modules, imports = import_graph()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        graph[imp.src].add(imp.dst)
    cycle = find_cycle(graph)
    assert cycle is None, cycle_message(cycle, imports)


def test_layers_are_folders():
    """No finer cuts: each layer is whole folders or top-level modules of the package, so the folder
    tree is the layer map."""
    finer = [e for layer in LAYERS for e in layer if e != "sgrec" and e.count(".") != 1]
    assert not finer, f"layers must be sgrec.X (a folder or a top-level module), not {finer}"


def test_imports_follow_the_layer_order():
    modules, imports = import_graph()
    problems = layer_problems(list(modules), imports, LAYERS)
    assert not problems, "\n".join(problems)


def test_radix_imports_neither_items_nor_rank():
    """The issue's own words: the prefix cache does not know about item KV or ranking."""
    _, imports = import_graph()
    bad = [str(i) for i in imports if i.src.startswith("sgrec.radix") and i.dst.startswith(("sgrec.items", "sgrec.rank"))]
    assert not bad, "\n".join(bad)


def test_no_module_imports_the_simulator():
    """The simulator is evaluation tooling: benchmarks and tests use it, sgrec's serving code does not."""
    _, imports = import_graph()
    bad = [str(i) for i in imports if i.dst.startswith("sgrec.radix.sim") and not i.src.startswith("sgrec.radix.sim")]
    assert not bad, "\n".join(bad)


def test_no_module_imports_the_sglang_plugin():
    """The plugin is an entry point that SGLang loads; sgrec itself never imports it, and it imports no
    model code (registering must stay cheap)."""
    _, imports = import_graph()
    bad = [str(i) for i in imports if i.dst.startswith("sgrec.sglang_plugin") and not i.src.startswith("sgrec.sglang_plugin")]
    assert not bad, "\n".join(bad)
    allowed = ("sgrec.radix", "sgrec.beam.trie", "sgrec.beam.filters", "sgrec.catalog", "sgrec.policy.prefill_only",
               "sgrec.sglang_plugin")
    used = [str(i) for i in imports if i.src.startswith("sgrec.sglang_plugin") and not i.dst.startswith(allowed)]
    assert not used, "\n".join(used)


def test_route_modules_share_helpers_and_the_helpers_import_no_route():
    _, imports = import_graph()
    routes = {"sgrec.entrypoints.native_api", "sgrec.entrypoints.openai_api", "sgrec.entrypoints.rec_api"}
    helpers = "sgrec.entrypoints.helpers"
    assert {i.src for i in imports if i.dst == helpers} >= routes
    assert not [str(i) for i in imports if i.src == helpers and i.dst.startswith("sgrec.entrypoints")]


# ---- the checker itself, on made-up modules -------------------------------------------------------
def test_checker_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"y"}}) == ["y", "y"]
    imports = [Import("a", "b", "a.py:3", "import b"), Import("b", "a", "b.py:9", "from a import f")]
    msg = cycle_message(find_cycle({"a": {"b"}, "b": {"a"}}), imports)
    assert "a -> b -> a" in msg and "b.py:9: `from a import f`" in msg


def test_checker_reads_imports(tmp_path):
    pkg = tmp_path / "sgrec"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "base.py").write_text("X = 1\n")
    (pkg / "low" / "user.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import base\n"  # relative, of a submodule
        "if TYPE_CHECKING:\n"
        "    from sgrec.high import Thing\n"  # annotations only: not counted
        "else:\n"
        "    import sgrec.other\n"  # counted
        "def f():\n"
        "    from sgrec.high import Thing\n"  # function-local: counted
        "    from tests.helpers import h\n"  # outside the package: counted
        "    return Thing\n")
    (pkg / "high.py").write_text("from sgrec.low import user\nThing = 1\n")
    (pkg / "other.py").write_text("from .low.base import X\n")
    modules = module_names(pkg)
    assert set(modules) == {"sgrec", "sgrec.low", "sgrec.low.base", "sgrec.low.user", "sgrec.high", "sgrec.other"}
    got = {(i.dst, i.where.rsplit(":", 1)[1]) for i in read_imports("sgrec.low.user", modules["sgrec.low.user"], modules)}
    assert got == {("sgrec.low.base", "2"), ("sgrec.other", "6"), ("sgrec.high", "8"), ("tests.helpers", "9")}
    assert [i.dst for i in read_imports("sgrec.other", modules["sgrec.other"], modules)] == ["sgrec.low.base"]

    imports = [i for m, p in modules.items() for i in read_imports(m, p, modules)]
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.src, set()).add(imp.dst)
    assert find_cycle(graph) == ["sgrec.high", "sgrec.low.user", "sgrec.high"]
    layers = [("sgrec.low",), ("sgrec.other", "sgrec.high"), ("sgrec",), ("sgrec.gone",)]
    problems = layer_problems(list(modules), imports, layers)
    assert any("user.py:8: `from sgrec.high import Thing`" in p and "a higher one" in p for p in problems)
    assert any("user.py:6: `import sgrec.other`" in p for p in problems)
    assert any("`from tests.helpers import h`" in p and "imports none of" in p for p in problems)
    assert any("LAYERS names sgrec.gone" in p for p in problems)
    assert len(problems) == 4
    assert layer_problems(list(modules), imports, layers[1:2]) == [
        "sgrec is in no layer: add it to LAYERS (tests/test_layers.py) and to ARCHITECTURE.md's map",
        "sgrec.low is in no layer: add it to LAYERS (tests/test_layers.py) and to ARCHITECTURE.md's map",
        "sgrec.low.base is in no layer: add it to LAYERS (tests/test_layers.py) and to ARCHITECTURE.md's map",
        "sgrec.low.user is in no layer: add it to LAYERS (tests/test_layers.py) and to ARCHITECTURE.md's map",
        f"{[i for i in imports if i.dst.startswith('tests')][0]}: sgrec imports none of tests, benchmarks, launch",
    ]


# ---- commands the README shows -------------------------------------------------------------------
@pytest.mark.parametrize("module", ["sgrec.radix.sim", "sgrec.items.hrcs", "sgrec.launch_server"])
def test_command_runs(module):
    """`python -m MODULE --help` works (the server's help renders every flag's text, where a bare %
    breaks argparse)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m " + module)


def test_every_server_flag_is_in_the_flag_reference():
    """Each ServerArgs field is a `--flag` of launch_server and appears, spelled so, in the docs' flag
    reference (generated from ServerArgs by `python -m sgrec.tools.docs_ref`)."""
    import argparse
    import dataclasses

    from sgrec.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = {a for action in parser._actions for a in action.option_strings if a.startswith("--") and a != "--help"}
    assert flags == {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ServerArgs)}
    reference = (ROOT / "docs" / "reference" / "flags.md").read_text()
    assert sorted(f for f in flags if f"`{f}`" not in reference) == []


def test_every_import_is_declared():
    """Each third-party package a module of sgrec imports is named in pyproject.toml: in the
    dependencies, or in an extra for the modules only that extra's users run (tests, tools, GPU)."""
    import importlib.metadata as md
    import re
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = cfg["dependencies"] + [r for extra in cfg["optional-dependencies"].values() for r in extra]
    declared = {re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in specs}
    dists = md.packages_distributions()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"sgrec", "__future__"}:
                dist = [d.lower().replace("_", "-") for d in dists.get(top, [top])]  # not installed: its own name
                if not any(d in declared for d in dist):
                    missing.append(f"{path.relative_to(ROOT)}: {top} ({', '.join(dist)})")
    assert not missing, "imported but in no dependency list of pyproject.toml:\n" + "\n".join(sorted(set(missing)))


def test_no_file_cites_a_document_outside_the_repository():
    """Every `*.md` a tracked file names is in the repository (the architecture and SGLang's wire
    format travel with a clone), and nothing points into a folder beside the checkout."""
    import re

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    docs = {p for p in tracked if p.endswith(".md")}
    names = {Path(p).name for p in docs}
    beside = "../" + "shared"  # the workplace's folder beside the checkout (spelled so as not to match itself)
    problems = []
    for rel in tracked:
        if not rel.endswith((".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml")) and "/" in rel:
            continue
        try:
            text = (ROOT / rel).read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if beside in line:
                problems.append(f"{rel}:{n}: points outside the repository ({beside})")
            for ref in re.findall(r"[A-Za-z0-9_./-]*[A-Za-z0-9_-]\.md\b", line):
                if ref not in docs and Path(ref).name not in names:
                    problems.append(f"{rel}:{n}: {ref} is not in the repository")
    assert not problems, "\n".join(problems)
