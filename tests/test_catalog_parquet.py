"""Parquet item catalogs (pyarrow): the same items as JSON Lines and the .npz bundle, written by sgrec or
by another tool (attributes as an `attrs` struct or as the remaining columns, several row groups,
nulls as absent values), the convert CLI both ways, the same answers from a server's engine, and
every bad column or row a start-up error naming it."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sgrec.catalog import Catalog, CatalogError, binary, load_catalog, parquet
from tests.test_catalog import VOCAB, as_rows, mixed_items, same_items, write_jsonl


def test_parquet_jsonl_and_bundle_load_the_same_items(tmp_path):
    items = mixed_items(random.Random(3), 300)
    cat = load_catalog(write_jsonl(tmp_path / "c.jsonl", as_rows(items)), vocab_size=VOCAB)
    parquet.write(cat, str(tmp_path / "c.parquet"), row_group_size=64)  # five row groups
    assert pq.ParquetFile(tmp_path / "c.parquet").num_row_groups == 5
    back = load_catalog(str(tmp_path / "c.parquet"), vocab_size=VOCAB)
    same_items(back, items)
    binary.save(back, str(tmp_path / "c.npz"))
    same_items(load_catalog(str(tmp_path / "c.npz"), vocab_size=VOCAB), items)
    for spec in ({"genre": {"eq": "a"}}, {"year": {"gte": 1990}}, {"adult": {"eq": False}, "lang": {"in": ["ü"]}}):
        assert np.array_equal(back.filter_mask(spec), cat.filter_mask(spec))


def test_a_table_written_by_another_tool_reads_its_other_columns_as_attributes(tmp_path, tiny_model_dir):
    """What a pandas or Spark export looks like: int32 token lists, a fixed-size semantic ID column,
    plain columns for the attributes, text for some items, nulls where a value is missing."""
    from sgrec.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir("llama"))
    table = pa.table({
        "id": ["a", "b", "c", "d"],
        "token_ids": pa.array([[5, 6], None, [7], [8, 9, 10]], pa.list_(pa.int32())),
        "text": [None, "a red chair", None, None],
        "id_token": pa.array([11, None, 12, 13], pa.int64()),
        "semantic_id": pa.array([[1, 2], [3, 4], None, [5, 6]], pa.list_(pa.int16(), 2)),
        "genre": pa.array(["x", None, "y", "x"]).dictionary_encode(),  # a pandas categorical
        "year": pa.array([1999, 2004, None, 2010], pa.int32()),
        "tags": [["p", "q"], [], None, ["q"]],
        "adult": [False, None, True, False],
    })
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=3)
    got = load_catalog(str(tmp_path / "t.parquet"), tok, VOCAB)
    text_ids = tuple(tok.encode("a red chair", add_special_tokens=False))
    assert [(it.id, it.token_ids, it.id_token, it.semantic_id) for it in got.items] == [
        ("a", (5, 6), 11, (1, 2)), ("b", text_ids, None, (3, 4)), ("c", (7,), 12, None), ("d", (8, 9, 10), 13, (5, 6))]
    assert [it.attrs for it in got.items] == [{"genre": "x", "year": 1999, "tags": ["p", "q"], "adult": False},
                                             {"year": 2004, "tags": []}, {"genre": "y", "adult": True},
                                             {"genre": "x", "year": 2010, "tags": ["q"], "adult": False}]
    assert all(not it.meta for it in got.items)
    # with an attrs struct, the other columns are the items' other fields
    with_struct = pa.table({"id": table["id"], "token_ids": [[5], [6], [7], [8]],
                            "attrs": pa.StructArray.from_arrays([pa.array(["x", None, "y", "x"])], names=["genre"]),
                            "title": ["A", None, "C", "D"]})
    pq.write_table(with_struct, tmp_path / "s.parquet")
    got = load_catalog(str(tmp_path / "s.parquet"), tok, VOCAB)
    assert [it.attrs for it in got.items] == [{"genre": "x"}, {}, {"genre": "y"}, {"genre": "x"}]
    assert [it.meta for it in got.items] == [{"title": "A"}, {}, {"title": "C"}, {"title": "D"}]


def test_the_convert_cli_goes_both_ways(tmp_path):
    items = mixed_items(random.Random(4), 50)
    src = write_jsonl(tmp_path / "c.jsonl", as_rows(items))
    run = [sys.executable, "-m", "sgrec.catalog", "convert"]
    out = subprocess.run([*run, src, str(tmp_path / "c.parquet"), "--vocab-size", str(VOCAB)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert parquet.is_parquet(str(tmp_path / "c.parquet"))
    out = subprocess.run([*run, str(tmp_path / "c.parquet"), str(tmp_path / "back.jsonl")], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    same_items(load_catalog(str(tmp_path / "back.jsonl"), vocab_size=VOCAB), items)


@pytest.mark.parametrize("column, value, words", [
    ("semantic_id", pa.array(["1,2", "3,4"]), "column 'semantic_id' is string, it must be a list of integers"),
    ("token_ids", pa.array([1, 2]), "column 'token_ids' is int64, it must be a list of integers"),
    ("id", pa.array([1, 2]), "column 'id' is int64, it must be a string"),
    ("year", pa.array([{"a": 1}, {"a": 2}]), "attribute column 'year' is struct"),
    ("token_ids", pa.array([[1], [VOCAB]]), r"row 1 \(item 'b'\): 'token_ids' holds 600, not a token id"),
    ("semantic_id", pa.array([[1, 2], [3]]), r"row 1 \(item 'b'\): semantic_id has 1 tokens, earlier items 2"),
    ("id", pa.array(["a", "a"]), "duplicate item id 'a'"),
    ("id", pa.array(["a", None]), "row 1: 'id' is null"),
    ("text", pa.array(["x", None]), r"row 0 \(item 'a'\): give exactly one of 'text' and 'token_ids'"),
    ("year", pa.array([float("nan"), 1.0]), "row 0: attrs.year must be a finite number"),
])
def test_every_bad_column_or_row_is_an_error_naming_it(tmp_path, column, value, words):
    base = {"id": pa.array(["a", "b"]), "token_ids": pa.array([[1], [2]])}
    pq.write_table(pa.table({**base, column: value}), tmp_path / "bad.parquet")
    with pytest.raises(CatalogError, match=words):
        load_catalog(str(tmp_path / "bad.parquet"), vocab_size=VOCAB)


def test_an_engine_gives_the_same_answers_on_each_form_of_one_catalog(tmp_path, tiny_model_dir):
    from sgrec import Engine

    from tests.test_rec_server import write_catalog

    src = write_catalog(tmp_path / "catalog.jsonl", n=27, seed=2, semantic=True)
    parquet.write(load_catalog(src), str(tmp_path / "catalog.parquet"))
    binary.save(load_catalog(src), str(tmp_path / "catalog.npz"))
    model = tiny_model_dir("llama")
    answers = []
    for form in ("jsonl", "parquet", "npz"):
        e = Engine(model, device="cpu", dtype="float32", max_total_tokens=4096,
                   item_catalog=str(tmp_path / f"catalog.{form}"))
        user = {"id": "u1", "token_ids": list(range(20, 50))}
        answers.append((e.retrieve(user=user, beam_width=8, num_items=5)["items"],
                        e.rank(user=user, items=["i1", "i5", "i20"])["ranking"]))
    assert answers[1] == answers[0] and answers[2] == answers[0]
    assert isinstance(load_catalog(str(tmp_path / "catalog.parquet")), Catalog)
