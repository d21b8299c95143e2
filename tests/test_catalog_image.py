"""One copy of the catalog for the DP ranks (sgrec/catalog/image.py): a catalog mapped from its image
reads as the catalog it was written from, takes updates like a loaded one (checked against catalogs
built from the expected items), and two mappings ("ranks") never see each other's updates or change
the files; the trie mapped read-only equals the one built from the catalog and follows updates."""

from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import pytest

from sgrec.beam.trie import SemanticIdTrie
from sgrec.catalog import Catalog, Item, image
from sgrec.catalog.update import apply_update, parse_items
from tests.test_catalog import VOCAB, as_rows, mixed_items, same_items
from tests.test_catalog_updates import _body, expected_after, same_trie


def digest(folder: str) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder))}


def write_image(folder, items) -> Catalog:
    cat = Catalog(items)
    trie, rows = SemanticIdTrie.from_catalog(cat, VOCAB)
    arrays, info = trie.arrays()
    image.write(str(folder), cat, {**arrays, "trie_rows": rows}, info)
    return cat


def test_a_mapped_catalog_reads_as_written(tmp_path):
    rng = random.Random(0)
    items = mixed_items(rng, 300)
    cat = write_image(tmp_path, items)
    got, arrays, info = image.load(str(tmp_path))
    same_items(got, items)
    assert got.total_tokens == cat.total_tokens and got.semantic_id_len == cat.semantic_id_len
    assert [got.index.get(it.id) for it in items] == list(range(len(items))) and got.index.get("nope") is None
    for spec in ({"genre": {"eq": "a"}}, {"year": {"gte": 1990}}, {"adult": {"eq": False}, "lang": {"in": ["ü"]}}):
        assert np.array_equal(got.filter_mask(spec), cat.filter_mask(spec))
    ref, ref_rows = SemanticIdTrie.from_catalog(cat, VOCAB)
    same_trie(SemanticIdTrie.from_arrays(arrays, info), ref)
    assert np.array_equal(arrays["trie_rows"], ref_rows)
    assert not arrays["trie_rows"].flags.writeable and not got._rows.hashes.flags.writeable


@pytest.mark.parametrize("seed", range(3))
def test_ranks_update_their_own_mapping(tmp_path, seed):
    """Two mappings of one image take different updates: each equals the catalog of its expected
    items after every update, its trie follows (from the read-only mapped one), and the files stay
    as written."""
    rng = random.Random(seed)
    items = mixed_items(rng, 200)
    write_image(tmp_path, items)
    before = digest(str(tmp_path))
    ranks = []
    for _ in range(2):
        cat, arrays, info = image.load(str(tmp_path))
        ranks.append([cat, list(items), SemanticIdTrie.from_arrays(arrays, info), arrays["trie_rows"]])
    for step in range(6):
        for k, state in enumerate(ranks):
            cat, want, trie, rows = state
            ids = [it.id for it in want]
            delete = rng.sample(ids, rng.randint(0, 8))
            fresh = mixed_items(random.Random(rng.random()), rng.randint(1, 40 if step == 3 else 12))
            ups = list({u.id: u for u in (Item(rng.choice(ids) if rng.random() < 0.5 else f"r{k}s{step}n{j}", *_body(it))
                                          for j, it in enumerate(fresh))}.values())
            ups = [u for u in ups if u.id not in delete]
            res = apply_update(cat, parse_items(as_rows(ups), None, VOCAB), delete)
            want = expected_after(want, ups, delete)
            same_items(res.catalog, want)
            same_items(res.catalog.compacted(), want)
            trie, rows = trie.updated(rows, res.catalog, res.removed_rows, res.added_from)
            ref, ref_rows = SemanticIdTrie.from_catalog(res.catalog, VOCAB)
            same_trie(trie, ref)
            assert np.array_equal(rows, ref_rows)
            state[:] = [res.catalog, want, trie, rows]
    assert digest(str(tmp_path)) == before  # appends went to each rank's own pages
    a, b = ranks[0][0], ranks[1][0]
    assert "r0s0n0" not in b.index or "r1s0n0" not in a.index  # neither sees the other's new items


def test_a_column_past_its_room_moves_to_memory_of_its_own(tmp_path):
    items = [Item(f"i{k}", (3,), None, (100, 101 + k % 5)) for k in range(10)]
    write_image(tmp_path, items)
    cat, _, _ = image.load(str(tmp_path))
    assert isinstance(cat._bufs["token_flat"].data, np.memmap)
    more = [Item(f"m{k}", tuple(range(3, 40)), None, (100, 101)) for k in range(60)]  # past 1,024 tokens of room
    res = apply_update(cat, Catalog(more))
    same_items(res.catalog, items + more)
    assert not isinstance(res.catalog._bufs["token_flat"].data, np.memmap)
