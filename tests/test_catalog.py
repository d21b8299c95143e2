"""The columnar catalog: JSON Lines and the binary bundle load the same items; optional id_token,
semantic_id and attrs; every bad line is a start-up error naming file and line; attribute filters
equal their plain-Python definition."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from sgrec.catalog import Catalog, CatalogError, Item, UnknownItemError, binary, load_catalog
from sgrec.catalog.jsonl import item_line
from tests.test_retrieve_filters import GENRES, make_catalog, passes, random_filter

VOCAB = 600


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def as_rows(items) -> list[dict]:
    return [item_line(it) for it in items]


def mixed_items(rng: random.Random, n: int) -> list[Item]:
    """Items with and without id_token, semantic_id, attrs and meta."""
    items = []
    for k in range(n):
        attrs = {}
        if rng.random() < 0.7:
            attrs["genre"] = rng.sample(GENRES, rng.randint(0, 3))
        if rng.random() < 0.7:
            attrs["year"] = rng.choice([rng.randint(1950, 2020), rng.random() * 10])
        if rng.random() < 0.5:
            attrs["adult"] = rng.random() < 0.5
        if rng.random() < 0.5:
            attrs["lang"] = rng.choice(["en", "fr", "ü"])
        items.append(Item(f"it{k}", tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))),
                          rng.randrange(VOCAB) if rng.random() < 0.6 else None,
                          tuple(rng.randrange(VOCAB) for _ in range(3)) if rng.random() < 0.8 else None,
                          {"title": f"t{k}"} if rng.random() < 0.5 else {}, attrs))
    return items


def same_items(a: Catalog, items: list[Item]) -> None:
    got = list(a.items)
    assert got == items  # id, token_ids, id_token, semantic_id
    assert [g.attrs for g in got] == [it.attrs for it in items]
    assert [g.meta for g in got] == [it.meta for it in items]
    assert len(a) == len(items) and sorted(a.index) == sorted(it.id for it in items)
    assert [a.get(it.id) for it in items] == items  # the index finds each item's live row


def test_jsonl_and_bundle_load_the_same_items(tmp_path):
    rng = random.Random(0)
    items = mixed_items(rng, 300)
    path = write_jsonl(tmp_path / "c.jsonl", as_rows(items))
    cat = load_catalog(path, vocab_size=VOCAB)
    same_items(cat, items)
    same_items(Catalog(items), items)
    assert cat.semantic_id_len == 3
    assert cat.has_semantic.sum() == sum(it.semantic_id is not None for it in items)
    assert cat.max_item_len == max(len(it.token_ids) for it in items)
    binary.save(cat, str(tmp_path / "c.npz"))
    back = load_catalog(str(tmp_path / "c.npz"), vocab_size=VOCAB)
    same_items(back, items)
    for spec in ({"genre": {"eq": "a"}}, {"year": {"gte": 1990}}, {"adult": {"eq": False}, "lang": {"in": ["ü"]}}):
        assert np.array_equal(back.filter_mask(spec), cat.filter_mask(spec))
    assert cat.rows(["it3", "it0"]) == [3, 0]
    with pytest.raises(UnknownItemError, match="'nope'"):
        cat.lookup(["it1", "nope"])


def test_a_format_1_bundle_still_loads(tmp_path):
    """Bundles written before the ids became a byte column (format 1: the ids as one JSON list)."""
    items = mixed_items(random.Random(2), 120)
    binary.save(Catalog(items), str(tmp_path / "new.npz"))
    with np.load(str(tmp_path / "new.npz")) as z:
        arrays = {k: z[k] for k in z.files if k not in ("id_flat", "id_ptr", "format")}
    arrays["format"] = np.array([1], dtype=np.int64)
    arrays["ids"] = np.frombuffer(json.dumps([it.id for it in items]).encode(), dtype=np.uint8)
    with open(tmp_path / "old.npz", "wb") as f:
        np.savez(f, **arrays)
    same_items(load_catalog(str(tmp_path / "old.npz"), vocab_size=VOCAB), items)


def test_convert_cli_round_trip(tmp_path):
    items = mixed_items(random.Random(1), 50)
    src = write_jsonl(tmp_path / "in.jsonl", as_rows(items))
    run = [sys.executable, "-m", "sgrec.catalog", "convert"]
    out = subprocess.run(run + [src, str(tmp_path / "out.npz"), "--vocab-size", str(VOCAB)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "50 items" in out.stdout
    back = subprocess.run(run + [str(tmp_path / "out.npz"), str(tmp_path / "back.jsonl")], capture_output=True, text=True)
    assert back.returncode == 0, back.stderr
    same_items(load_catalog(str(tmp_path / "back.jsonl")), items)
    bad = subprocess.run(run + [src, str(tmp_path / "x.npz"), "--vocab-size", "10"], capture_output=True, text=True)
    assert bad.returncode == 2 and "in.jsonl:1:" in bad.stderr


GOOD = {"id": "a", "token_ids": [1, 2]}


@pytest.mark.parametrize("line,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"token_ids": [1]}), "'id' must be a non-empty string"),
    (json.dumps({"id": "b"}), "exactly one of 'text' and 'token_ids'"),
    (json.dumps({"id": "b", "token_ids": []}), "'token_ids' must be a non-empty list"),
    (json.dumps({"id": "b", "token_ids": [1, True]}), "'token_ids' holds True"),
    (json.dumps({"id": "b", "token_ids": [1, 2.5]}), "'token_ids' holds 2.5"),
    (json.dumps({"id": "b", "token_ids": [1, 2**40]}), "'token_ids' holds"),
    (json.dumps({"id": "b", "token_ids": [1, VOCAB]}), f"'token_ids' holds {VOCAB}, not a token id"),
    (json.dumps({"id": "b", "token_ids": [1], "id_token": VOCAB}), "'id_token' holds"),
    (json.dumps({"id": "b", "token_ids": [1], "id_token": "x"}), "a string 'id_token' needs a tokenizer"),
    (json.dumps({"id": "b", "token_ids": [1], "semantic_id": [1, 2]}), "semantic_id has 2 tokens, earlier items 3"),
    (json.dumps({"id": "b", "token_ids": [1], "semantic_id": [1, 2, -1]}), "'semantic_id' holds -1"),
    (json.dumps({"id": "b", "token_ids": [1], "semantic_id": [1, 2, False]}), "'semantic_id' holds False"),
    (json.dumps({"id": "b", "token_ids": [1], "semantic_id": [1, 2.5, 2]}), "'semantic_id' holds 2.5"),
    (json.dumps({"id": "b", "token_ids": [1], "semantic_id": [1, 2, 2**40]}), f"'semantic_id' holds {2**40}"),
    (json.dumps({"id": "b", "token_ids": [1], "semantic_id": [1, 2, VOCAB]}), f"'semantic_id' holds {VOCAB}"),
    (json.dumps({"id": "b", "token_ids": [1], "id_token": -3}), "'id_token' holds -3"),
    (json.dumps({"id": "b", "token_ids": [1], "id_token": 2.0}), "'id_token' holds 2.0"),
    (json.dumps({"id": "b", "token_ids": [1], "id_token": True}), "'id_token' holds True"),
    (json.dumps({"id": "b", "token_ids": [1], "attrs": {"year": True}}), "attrs.year is bool here but num"),
    (json.dumps({"id": "b", "token_ids": [1], "attrs": {"year": "1999"}}), "attrs.year is str here but num"),
    (json.dumps({"id": "b", "token_ids": [1], "attrs": {"x": {"a": 1}}}), "attrs.x must be a string, a number"),
    (json.dumps({"id": "b", "token_ids": [1], "attrs": [1]}), "'attrs' must be a flat object"),
    (json.dumps({"id": "a", "token_ids": [1]}), "duplicate item id 'a' (first on line 1)"),
])
def test_a_bad_line_names_file_and_line(tmp_path, line, message):
    first = {**GOOD, "semantic_id": [1, 2, 3], "attrs": {"year": 1999}}
    path = write_jsonl(tmp_path / "c.jsonl", [first, "", line])  # the bad line is line 3
    with pytest.raises(CatalogError) as e:
        load_catalog(path, vocab_size=VOCAB)
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value), str(e.value)


def test_empty_and_missing_catalogs(tmp_path):
    with pytest.raises(CatalogError, match="has no items"):
        load_catalog(write_jsonl(tmp_path / "e.jsonl", ["", ""]))
    with pytest.raises(CatalogError, match="cannot read item catalog"):
        load_catalog(str(tmp_path / "missing.jsonl"))
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04junk")
    with pytest.raises(CatalogError, match="cannot read binary item catalog"):
        load_catalog(str(tmp_path / "junk.npz"))


def test_items_without_id_token_or_semantic_id_load():
    cat = Catalog([Item("a", (1,)), Item("b", (2, 3), 7), Item("c", (4,), None, (1, 2))])
    assert [it.id_token for it in cat.items] == [None, 7, None]
    assert [it.semantic_id for it in cat.items] == [None, None, (1, 2)]
    assert cat.semantic_rows().tolist() == [2]
    assert Catalog([Item("a", (1,))]).semantic_id_len is None


def test_filters_equal_their_plain_definition(tmp_path):
    for seed in range(30):
        rng = random.Random(seed)
        cat = make_catalog(rng, 80, 2, VOCAB, codes=4, dup=0.1)
        loaded = load_catalog(write_jsonl(tmp_path / f"c{seed}.jsonl", as_rows(cat.items)), vocab_size=VOCAB)
        spec = random_filter(rng)
        want = [passes(it.attrs, spec) for it in cat.items]
        assert cat.filter_mask(spec).tolist() == want
        assert loaded.filter_mask(spec).tolist() == want


def test_token_id_check_fast_path_agrees_with_the_exact_one():
    """plain_token_ids (one pass in C) decides only plain ints in range; everything else goes to the
    per-token check, whose answers and messages are unchanged: bools and floats rejected naming the
    culprit, an int subclass accepted, the range's ends exact."""
    import enum

    from sgrec.catalog.item import check_token_ids, plain_token_ids

    class Tok(enum.IntEnum):
        A = 3

    assert plain_token_ids([0, 9], 10) and plain_token_ids((5,), None)
    for value in ([], [1, True], [1, 1.0], [-1], [10], [Tok.A], "ab", None):
        assert not plain_token_ids(value, 10), value
    assert check_token_ids([0, 9], "x", 10) == (0, 9)
    assert check_token_ids([Tok.A], "x", 10) == (3,)
    for value, msg in (([1, True], "x holds True"), ([2, 10], "x holds 10"), ([-1], "x holds -1"),
                       ([1.0], "x holds 1.0"), ([], "non-empty"), ("ab", "non-empty")):
        with pytest.raises(ValueError, match=msg):
            check_token_ids(value, "x", 10)


@pytest.mark.parametrize("present", [
    list(range(9)),  # every row: the values' own array
    [0, 1, 2, 5, 6, 8],  # a run, then gaps
    [2, 3, 4, 7],  # the first rows without
    [],
])
@pytest.mark.parametrize("columnar", [False, True])
def test_attribute_columns_equal_their_scattered_values(present, columnar):
    """AttrBuilder, row by row (JSON Lines) or a column at a time (Parquet): each kind's column holds
    the given rows' values and marks the others absent, whether the rows are counted or listed."""
    from sgrec.catalog.attrs import AttrBuilder

    n = 9
    vals = {"num": [1.5 * r for r in present], "bool": [r % 2 == 0 for r in present],
            "str": [f"s{r % 3}" for r in present], "strs": [[f"t{r % 2}", f"t{r % 4}"][: r % 3] for r in present]}
    b = AttrBuilder()
    if columnar:
        for split in (present[:3], present[3:]):  # two batches
            k = len(split)
            off = present.index(split[0]) if split else 0
            rows = np.array(split, np.int64)
            b.add_column("num", "num", rows, np.array(vals["num"][off:off + k]))
            b.add_column("bool", "bool", rows, np.array(vals["bool"][off:off + k], np.int8))
            words = sorted(set(vals["str"]))
            b.add_column("str", "str", rows, np.array([words.index(v) for v in vals["str"][off:off + k]]), words)
            tags = sorted({w for v in vals["strs"] for w in v})
            flat = [tags.index(w) for v in vals["strs"][off:off + k] for w in v]
            b.add_column("strs", "strs", rows, np.array(flat, np.int64), tags,
                         np.array([len(v) for v in vals["strs"][off:off + k]]))
    else:
        for i, r in enumerate(present):
            b.add(r, {k: v[i] for k, v in vals.items()})
    table = b.build(n)
    for kind in ("num", "bool", "str", "strs") if present else ():
        got = [table.columns[kind].value(r) for r in range(n)]
        want = [vals[kind][present.index(r)] if r in present else None for r in range(n)]
        assert got == want, kind
    if not columnar:  # a column at a time: an all-absent column is still named (a Parquet column of nulls)
        assert set(table.columns) == ({"num", "bool", "str", "strs"} if present else set())
