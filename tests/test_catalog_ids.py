"""Item ids as arrays (sgrec/catalog/ids.py): the byte column and the hashed index against a dict, the
obviously-right reference, including hash collisions, which real 64-bit hashes make too rare to meet."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sgrec.catalog import Catalog, CatalogError, Item
from sgrec.catalog import ids as idsmod
from sgrec.catalog.ids import DuplicateIdError, IdColumn, IdIndex, encode, fnv1a, fnv1a_many


def random_ids(rng: random.Random, n: int) -> list[str]:
    alphabet = "ab01é€😀-_"  # 1- to 4-byte UTF-8 characters
    out = {"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12))) for _ in range(n)}
    return sorted(out, key=lambda _: rng.random())


def test_fnv1a_numpy_equals_python():
    rng = random.Random(0)
    ids = random_ids(rng, 500) + ["x" * 300]  # one long id among short ones
    flat, ptr = encode(ids)
    assert fnv1a_many(flat, ptr).tolist() == [fnv1a(i.encode()) for i in ids]
    assert fnv1a(b"") == idsmod.FNV_OFFSET and fnv1a(b"a") == 0xAF63DC4C8601EC8C  # FNV-1a 64's published values


def test_column_reads_back_every_id():
    ids = random_ids(random.Random(1), 300)
    col = IdColumn.of(ids)
    assert len(col) == len(ids) and list(col) == ids and col[-1] == ids[-1] and col[2:5] == ids[2:5]
    assert [col[r] for r in range(len(ids))] == ids
    with pytest.raises(IndexError):
        col[len(ids)]


@pytest.mark.parametrize("collide", [False, True])
def test_index_equals_a_dict(monkeypatch, collide):
    """get / get_many against {id: row}; with `collide` every hash is forced into 4 values, so most
    lookups walk runs of equal hashes and compare bytes."""
    if collide:
        real = idsmod.fnv1a_many
        monkeypatch.setattr(idsmod, "fnv1a_many", lambda f, p: real(f, p) & np.uint64(3))
        monkeypatch.setattr(idsmod, "fnv1a", lambda raw: fnv1a(raw) & 3)
    rng = random.Random(2)
    ids = random_ids(rng, 400)
    ref = {i: r for r, i in enumerate(ids)}
    index = IdIndex.build(IdColumn.of(ids))
    queries = ids + random_ids(rng, 100) + ["", 7, None]
    want = [ref.get(q) if isinstance(q, str) else None for q in queries]
    assert [index.get(q) for q in queries] == want
    assert index.get_many(queries) == want
    index["new"] = 400  # a change beside the base
    index[ids[0]] = (0, 401)
    assert index.get("new") == 400 and index.get_many([ids[0], "new"]) == [(0, 401), 400]
    assert sorted(index) == sorted([*ids, "new"])


@pytest.mark.parametrize("collide", [False, True])
def test_duplicate_ids_are_refused(monkeypatch, collide):
    if collide:
        real = idsmod.fnv1a_many
        monkeypatch.setattr(idsmod, "fnv1a_many", lambda f, p: real(f, p) & np.uint64(1))
    ids = random_ids(random.Random(3), 200)
    IdIndex.build(IdColumn.of(ids))  # distinct: fine, colliding hashes or not
    with pytest.raises(DuplicateIdError, match=repr(ids[17])):
        IdIndex.build(IdColumn.of(ids + [ids[17]]))
    with pytest.raises(CatalogError, match="duplicate item id 'a'"):
        Catalog([Item("a", (1,)), Item("b", (2,)), Item("a", (3,))])


def test_branch_keeps_the_changes_below_its_rows():
    index = IdIndex.build(IdColumn.of(["a", "b", "c"]))
    index["d"] = 3
    index["a"] = (0, 4)
    index["e"] = 5
    index.top = 6
    b = index.branch(4)
    assert b.top == 4 and b.get("d") == 3 and b.get("a") == 0 and b.get("e") is None and b.get("b") == 1
    assert index.get("a") == (0, 4)  # the line it branched from is left as it was
