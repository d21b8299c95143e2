"""Bodies that break a documented request schema, one constraint at a time (for the conformance test).

`violations(doc, schema_name, base)` starts from `base`, a body the schema accepts, walks the schema
(the `$ref`s of `doc["components"]` resolved) and yields one `Case` per constraint it finds: each
property's type (a value of every JSON type the property does not take, null included), each `enum`
and `const`, each bound (`minimum`, `maximum`, `exclusiveMinimum`, `minLength`, `minItems`,
`maxItems`, `maxProperties`, `uniqueItems`, `pattern`), wrong elements in arrays and maps, each
required key removed, an unknown key where `additionalProperties` is false, and two `oneOf` branches
at once. A candidate is kept only if the schema itself rejects the whole body (checked with
jsonschema), so every case is a body the server must answer with a 400.

Properties absent from `base` are covered too: the bad value is put where the property would be.
A schema keyword this module does not know raises `UnknownKeyword`, so a constraint documented
tomorrow cannot go untested quietly.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Iterator

from jsonschema import Draft202012Validator

# keywords that constrain nothing (annotations) and those handled below
ANNOTATIONS = {"title", "description", "default", "examples", "format"}
HANDLED = {"$ref", "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
           "uniqueItems", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
           "pattern", "enum", "const", "anyOf", "oneOf", "allOf", "propertyNames", "maxProperties"}
# rules between fields (if / then / else, with not inside them): no single field breaks them, so this
# generator walks past them; tests/test_fuzz.py::test_openapi_document_states_the_rules_between_fields
# checks each against bodies that keep and break it, and the fuzz run's positive and negative data checks
# hold the server to them
CROSS_FIELD = {"if", "then", "else"}
# one value of each JSON type: the wrong-type candidates of every location
PALETTE = [None, True, 0, -1, 1.5, "x", "", [], {}, ["x"], [1.5]]
UNKNOWN_KEY = "no_such_field_xyz"


class UnknownKeyword(ValueError):
    pass


@dataclass
class Case:
    path: tuple  # keys (str) and indices (int) from the body's root to the broken value
    constraint: str  # e.g. "type", "minimum", "required", "additionalProperties", "items.type"
    body: Any
    names: tuple[tuple, ...]  # full paths of fields; the error message must name one of them

    @property
    def id(self) -> str:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in self.path) or "."
        return f"{where} {self.constraint}: {json.dumps(self._value(), sort_keys=True)[:60]}"

    @property
    def named(self) -> list[str]:
        """The field paths the message must name (one of them), dotted: `retrieve.beam_width`."""
        return [dotted(n) for n in self.names]

    def message_names_field(self, message: str) -> bool:
        """Whether `message` names one of the fields by its full path (any when there is none)."""
        return not self.names or any(names_path(message, n) for n in self.names)

    def _value(self):
        v = self.body
        for p in self.path:
            if (isinstance(v, dict) and p in v) or (isinstance(v, list) and isinstance(p, int) and p < len(v)):
                v = v[p]
            else:
                return "<removed>"
        return v


def dotted(path: tuple) -> str:
    """`("retrieve", "beam_width")` -> `retrieve.beam_width`; indices as `[i]`: `messages[0].role`."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def names_path(message: str, path: tuple) -> bool:
    """Whether `message` names the field at `path` by its full path, not just its last key: the
    dotted path as a whole word (an index either `[0]` or `.0`), not part of a longer key or of a
    deeper field (`retrieve.beam_width` does not name `retrieve`); an index after it may follow
    (`input_ids[0]` names `input_ids`)."""
    if not path:
        return True
    parts = []
    for i, p in enumerate(path):
        if isinstance(p, int):
            parts.append(rf"(?:\[{p}\]|\.{p})")
        else:
            parts.append(("" if i == 0 else r"\.") + re.escape(p))
    return re.search(r"(?<![\w.\[])" + "".join(parts) + r"(?![\w\]]|\.[^\W\d])", message) is not None


class Schemas:
    """The document's component schemas, with $ref resolution and a validator per component."""

    def __init__(self, doc: dict):
        self.doc = doc
        self.components = doc["components"]["schemas"]

    def resolve(self, s: dict) -> dict:
        while isinstance(s, dict) and "$ref" in s:
            s = self.components[s["$ref"].rsplit("/", 1)[-1]]
        return s

    def validator(self, s: dict) -> Draft202012Validator:
        return Draft202012Validator({**s, "components": self.doc["components"]})

    def accepts(self, s: dict, value) -> bool:
        return self.validator(s).is_valid(value)


def check_keywords(sch: Schemas, s: dict, path: str = "") -> None:
    """Raises UnknownKeyword for a keyword neither annotation nor handled, anywhere in `s`."""
    if not isinstance(s, dict):
        return
    for k, v in s.items():
        if k in CROSS_FIELD:
            continue
        if k not in HANDLED and k not in ANNOTATIONS:
            raise UnknownKeyword(f"{path or '/'}: schema keyword {k!r} has no violation generator")
        if k == "properties":
            for name, sub in v.items():
                check_keywords(sch, sub, f"{path}/{name}")
        elif k in ("anyOf", "oneOf", "allOf"):
            for sub in v:
                check_keywords(sch, sub, path)
        elif k in ("items", "additionalProperties", "propertyNames") and isinstance(v, dict):
            check_keywords(sch, v, f"{path}/{k}")


def example(sch: Schemas, s: dict):
    """A small value `s` accepts (used to build arrays and objects around a bad value); None if
    nothing simple fits."""
    s = sch.resolve(s)
    for branch in s.get("anyOf", []) + s.get("oneOf", []):
        if sch.resolve(branch).get("type") != "null":
            v = example(sch, branch)
            if v is not None and sch.accepts(s, v):
                return v
    if "const" in s:
        return s["const"]
    if "enum" in s:
        return next((e for e in s["enum"] if e is not None), None)
    t = s.get("type")
    if t in ("integer", "number"):
        lo = max(0, s.get("minimum", s.get("exclusiveMinimum", -1) + 1))
        return min(lo, s.get("maximum", lo))
    if t == "string":
        return "a" * max(1, s.get("minLength", 1))
    if t == "boolean":
        return True
    if t == "array":
        item = example(sch, s.get("items", {}))
        return [item] * max(1, s.get("minItems", 0)) if s.get("maxItems", 1) > 0 and item is not None else []
    if t == "object" or "properties" in s:
        return {k: example(sch, s["properties"][k]) for k in s.get("required", []) if k in s.get("properties", {})}
    return None


def _branches(sch: Schemas, s: dict) -> list[dict]:
    """`s` and, recursively, its anyOf / oneOf / allOf members, resolved."""
    s = sch.resolve(s)
    out = [s]
    for k in ("anyOf", "oneOf", "allOf"):
        for b in s.get(k, []):
            out += _branches(sch, b)
    return out


BOUNDS = {  # keyword -> the value just outside it
    "minimum": lambda b, step: b["minimum"] - step,
    "exclusiveMinimum": lambda b, step: b["exclusiveMinimum"],
    "maximum": lambda b, step: b["maximum"] + step,
    "exclusiveMaximum": lambda b, step: b["exclusiveMaximum"],
    "minLength": lambda b, step: "a" * (b["minLength"] - 1),
    "maxLength": lambda b, step: "a" * (b["maxLength"] + 1),
    "pattern": lambda b, step: "\u00a7 not matching",
    "enum": lambda b, step: "not-one-of-" + "-".join(map(str, b["enum"]))[:20],
    "const": lambda b, step: (b["const"] + 1) if isinstance(b["const"], int) else "not-the-const",
}


def _bad_values(sch: Schemas, s: dict) -> Iterator[tuple[str, Any, str | None, tuple]]:
    """(constraint, value, named key or None, sources) candidates for one location of schema `s`;
    sources: the constraints (id of the schema node, keyword, detail) the value breaks."""
    branches = _branches(sch, s)
    for b in branches:
        t = b.get("type")
        for kw, outside in BOUNDS.items():
            if kw in b:
                yield kw, outside(b, 1 if t == "integer" else 0.5), None, ((id(b), kw, None),)
        if t == "array" or "items" in b:
            item_schema = b.get("items", {})
            item = example(sch, item_schema) if item_schema else 1
            if item is not None:
                for kw, bad in (("minItems", lambda n: [item] * (n - 1)), ("maxItems", lambda n: [item] * (n + 1))):
                    if kw in b:
                        yield kw, bad(b[kw]), None, ((id(b), kw, None),)
                if b.get("uniqueItems"):
                    yield "uniqueItems", [item, item], None, ((id(b), "uniqueItems", None),)
            for constraint, bad, _, src in _bad_values(sch, item_schema):
                yield f"items.{constraint}", [bad], None, src
        if t == "object" or "properties" in b or "additionalProperties" in b:
            yield from _bad_objects(sch, b)
    types = tuple((id(b), "type", None) for b in branches if "type" in b)
    for v in PALETTE:
        yield "type", v, None, types


def _bad_objects(sch: Schemas, b: dict) -> Iterator[tuple[str, Any, str | None, tuple]]:
    extra = b.get("additionalProperties")
    if extra is False:
        yield "additionalProperties", {**(example(sch, b) or {}), UNKNOWN_KEY: 1}, UNKNOWN_KEY, \
            ((id(b), "additionalProperties", None),)
    elif isinstance(extra, dict):
        for constraint, bad, _, src in _bad_values(sch, extra):
            yield f"additionalProperties.{constraint}", {"5": bad}, None, src
    if "propertyNames" in b:
        value = example(sch, extra) if isinstance(extra, dict) else 1
        for constraint, bad, _, src in _bad_values(sch, b["propertyNames"]):
            if isinstance(bad, str):
                yield f"propertyNames.{constraint}", {bad: value}, None, src
    if "maxProperties" in b:
        yield "maxProperties", {f"k{i}": 1 for i in range(b["maxProperties"] + 1)}, None, \
            ((id(b), "maxProperties", None),)
    for name in b.get("required", []):
        base = example(sch, b) or {}  # the other required keys present, this one missing
        base.pop(name, None)
        yield "required", base, name, ((id(b), "required", name),)


def constraints(sch: Schemas, root: dict) -> dict[tuple, str]:
    """Every constraint reachable from `root`: (id of the node, keyword, detail) -> where it is."""
    out: dict[tuple, str] = {}
    seen: set[int] = set()

    def visit(s, where):
        if not isinstance(s, dict):
            return
        if "$ref" in s:
            where = s["$ref"].rsplit("/", 1)[-1]
            s = sch.resolve(s)
        if id(s) in seen:
            return
        seen.add(id(s))
        for kw in ("type", "uniqueItems", "minItems", "maxItems", "maxProperties", *BOUNDS):
            unbreakable = (kw == "uniqueItems" and s.get(kw) is False) or (kw in ("minItems", "minLength")
                                                                             and s.get(kw) == 0)
            if kw in s and not unbreakable:
                out[(id(s), kw, None)] = f"{where}: {kw}"
        if s.get("additionalProperties") is False:
            out[(id(s), "additionalProperties", None)] = f"{where}: additionalProperties false"
        for name in s.get("required", []):
            out[(id(s), "required", name)] = f"{where}: required {name}"
        if len([m for m in s.get("oneOf", []) if set(sch.resolve(m)) == {"required"}]) > 1:
            out[(id(s), "oneOf", None)] = f"{where}: oneOf"
        for name, sub in s.get("properties", {}).items():
            visit(sub, f"{where}/{name}")
        for kw in ("items", "additionalProperties", "propertyNames"):
            visit(s.get(kw), f"{where}/{kw}")
        for kw in ("anyOf", "oneOf", "allOf"):
            if kw == "anyOf" and any(sch.resolve(sub) == {} for sub in s.get(kw, [])):
                continue  # one alternative takes anything: the others constrain nothing
            for i, sub in enumerate(s.get(kw, [])):
                visit(sub, f"{where}/{kw}[{i}]")

    visit(root, "")
    return out


_REMOVE = object()


def _walk(sch: Schemas, s: dict, value, path: tuple) -> Iterator[tuple[tuple, str, Any, tuple, tuple]]:
    """(path, constraint, replacement or _REMOVE, names, sources) for the location `path` holding
    `value` (schema `s`) and every location below it."""
    # the field holding the location: its full path, up to its last key (an element of a list is
    # named by its list)
    last = max((i for i, p in enumerate(path) if isinstance(p, str)), default=None)
    named = (path[:last + 1],) if last is not None else ()
    own = [(path, constraint, bad, (path + (key,),) if key else named, src)
           for constraint, bad, key, src in _bad_values(sch, s)
           if path or constraint == "type"]  # the root's keys are walked below, each at its own path
    if path:
        yield from own
    if value is not None:
        yield from _walk_inside(sch, s, value, path)
    if not path:
        yield from own  # after the keys, so a body is named by its key's case first


def _walk_inside(sch: Schemas, s: dict, value, path: tuple) -> Iterator[tuple[tuple, str, Any, tuple, tuple]]:
    """The locations inside `value`, through the branches of `s` that it satisfies."""
    for b in _branches(sch, s):
        if isinstance(value, dict) and ("properties" in b or b.get("type") == "object"):
            if not sch.accepts(b, value):
                continue
            for name, sub in b.get("properties", {}).items():
                # a property absent from the base: its bad values go where it would be, and its
                # inner locations are walked in its example
                child = value[name] if name in value else example(sch, sub)
                yield from _walk(sch, sub, child, path + (name,))
            extra = b.get("additionalProperties")
            if isinstance(extra, dict):  # the base's own keys under additionalProperties: walked like properties
                for name in value:
                    if name not in b.get("properties", {}):
                        yield from _walk(sch, extra, value[name], path + (name,))
            for name in b.get("required", []):
                if name in value:
                    yield path + (name,), "required", _REMOVE, (path + (name,),), ((id(b), "required", name),)
            if b.get("additionalProperties") is False:
                yield path + (UNKNOWN_KEY,), "additionalProperties", 1, (path + (UNKNOWN_KEY,),), \
                    ((id(b), "additionalProperties", None),)
            for kw in ("anyOf", "oneOf"):  # alternatives of required keys: none of them, or all at once
                alts = [sch.resolve(m) for m in b.get(kw, []) if set(sch.resolve(m)) == {"required"}]
                keys = tuple(k for m in alts for k in m["required"])
                if not keys:
                    continue
                none = {k: v for k, v in value.items() if k not in keys}
                paths = tuple(path + (k,) for k in keys)
                yield path, "required", none, paths, tuple((id(m), "required", k) for m in alts for k in m["required"])
                if kw == "oneOf" and len(alts) > 1:
                    every = {**{k: example(sch, b["properties"][k]) for k in keys}, **value}
                    yield path, "oneOf", every, paths, ((id(b), "oneOf", None),)
        elif isinstance(value, list) and value and (b.get("type") == "array" or "items" in b):
            if not sch.accepts(b, value):
                continue
            # the element's own bad values are this location's items.* candidates: only its inner
            # locations are new
            for found in _walk(sch, b.get("items", {}), value[0], path + (0,)):
                if found[0] != path + (0,):
                    yield found


def violations(doc: dict, schema_name: str, base: dict) -> tuple[list[Case], list[str]]:
    """One Case per distinct body that breaks a constraint of the named schema (and that the schema
    rejects), and the constraints no case breaks (where they are)."""
    sch = Schemas(doc)
    root = sch.components[schema_name]
    check_keywords(sch, root)
    for name in _referenced(sch, root):
        check_keywords(sch, sch.components[name])
    top = {"$ref": f"#/components/schemas/{schema_name}"}
    validator = sch.validator(top)
    if not validator.is_valid(base):
        raise ValueError(f"the base body of {schema_name} is not valid: {next(validator.iter_errors(base)).message}")
    cases, seen, covered = [], set(), set()
    for path, constraint, bad, names, sources in _walk(sch, root, base, ()):
        body = _absent_parents(sch, root, base, path, bad) if path else bad
        if body is None or validator.is_valid(body):
            continue
        covered.update(sources)
        key = json.dumps(body, sort_keys=True)
        if key not in seen:
            seen.add(key)
            cases.append(Case(path, constraint, body, names))
    missing = [where for c, where in constraints(sch, root).items() if c not in covered]
    return cases, missing


def _absent_parents(sch: Schemas, root: dict, base: dict, path: tuple, bad):
    """`base` with `bad` put at `path`; parents missing from `base` are filled with their examples."""
    body = copy.deepcopy(base)
    target, s = body, root
    for p in path[:-1]:
        s = _child_schema(sch, s, p, target)
        if isinstance(target, dict) and p not in target:
            ex = example(sch, s)
            if ex is None:
                return None
            target[p] = ex
        target = target[p]
    if not isinstance(target, (dict, list)):
        return None
    if bad is _REMOVE:
        target.pop(path[-1], None)
    else:
        target[path[-1]] = bad
    return body


def _child_schema(sch: Schemas, s: dict, p, value) -> dict:
    for b in _branches(sch, s):
        if isinstance(p, str) and p in b.get("properties", {}):
            return b["properties"][p]
        if isinstance(p, str) and isinstance(b.get("additionalProperties"), dict):
            return b["additionalProperties"]
        if isinstance(p, int) and "items" in b and isinstance(value, list):
            return b["items"]
    return {}


def _referenced(sch: Schemas, s, seen=None) -> set[str]:
    seen = set() if seen is None else seen
    if isinstance(s, dict):
        if "$ref" in s:
            name = s["$ref"].rsplit("/", 1)[-1]
            if name not in seen:
                seen.add(name)
                _referenced(sch, sch.components[name], seen)
        for v in s.values():
            _referenced(sch, v, seen)
    elif isinstance(s, list):
        for v in s:
            _referenced(sch, v, seen)
    return seen
