"""One copy of the catalog for the DP ranks (sgrec/catalog/image.py): a catalog mapped from its image
reads as the catalog it was written from, takes updates like a loaded one (checked against catalogs
built from the expected items), and two mappings ("ranks") never see each other's updates or change
the files; a trie shared through `image.shared` (one rank makes it, every rank maps it read-only)
equals the one built from the catalog and follows updates; ranks in processes of their own make each
shared version once and keep only the newest's files."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import json
import os
import random
import shutil
import tempfile

import numpy as np
import pytest

from sgrec.beam.trie import SemanticIdTrie
from sgrec.catalog import Catalog, Item, image
from sgrec.catalog.update import apply_update, parse_items
from tests.test_catalog import VOCAB, as_rows, mixed_items, same_items
from tests.test_catalog_updates import _body, expected_after, same_trie


def digest(folder: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, name), folder): hashlib.sha256(open(os.path.join(d, name), "rb").read())
            .hexdigest() for d, _, names in os.walk(folder) for name in names}


def write_image(folder, items) -> Catalog:
    cat = Catalog(items)
    image.write(str(folder), cat)
    return cat


def trie_arrays(catalog):
    trie, rows = SemanticIdTrie.from_catalog(catalog, VOCAB)
    arrays, info = trie.arrays()
    return {**arrays, "trie_rows": rows}, info


def shared_trie(folder, key, catalog):
    arrays, info = image.shared(str(folder), "trie", key, lambda: trie_arrays(catalog))
    return SemanticIdTrie.from_arrays(arrays, info), arrays["trie_rows"]


def test_a_mapped_catalog_reads_as_written(tmp_path):
    rng = random.Random(0)
    items = mixed_items(rng, 300)
    cat = write_image(tmp_path, items)
    got = image.load(str(tmp_path))
    trie, rows = shared_trie(tmp_path, "v0", got)
    same_items(got, items)
    assert got.total_tokens == cat.total_tokens and got.semantic_id_len == cat.semantic_id_len
    assert [got.index.get(it.id) for it in items] == list(range(len(items))) and got.index.get("nope") is None
    for spec in ({"genre": {"eq": "a"}}, {"year": {"gte": 1990}}, {"adult": {"eq": False}, "lang": {"in": ["ü"]}}):
        assert np.array_equal(got.filter_mask(spec), cat.filter_mask(spec))
    ref, ref_rows = SemanticIdTrie.from_catalog(cat, VOCAB)
    same_trie(trie, ref)
    assert np.array_equal(rows, ref_rows)
    assert not rows.flags.writeable and not got._rows.hashes.flags.writeable


@pytest.mark.parametrize("seed", range(3))
def test_ranks_update_their_own_mapping(tmp_path, seed):
    """Two mappings of one image take different updates: each equals the catalog of its expected
    items after every update, its trie follows (from the read-only mapped one), and the files stay
    as written."""
    rng = random.Random(seed)
    items = mixed_items(rng, 200)
    write_image(tmp_path, items)
    shared_trie(tmp_path, "v0", image.load(str(tmp_path)))
    before = digest(str(tmp_path))
    ranks = []
    for _ in range(2):
        cat = image.load(str(tmp_path))
        ranks.append([cat, list(items), *shared_trie(tmp_path, "v0", cat)])
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
    cat = image.load(str(tmp_path))
    assert isinstance(cat._bufs["token_flat"].data, np.memmap)
    more = [Item(f"m{k}", tuple(range(3, 40)), None, (100, 101)) for k in range(60)]  # past 1,024 tokens of room
    res = apply_update(cat, Catalog(more))
    same_items(res.catalog, items + more)
    assert not isinstance(res.catalog._bufs["token_flat"].data, np.memmap)


def _rank(folder: str, seed: int, steps: int, barrier, results, layered: bool = False) -> None:
    """A DP rank in a process of its own: maps the image, serves the shared trie of each version
    (the same updates as every other rank: one seed), and reports the versions it made itself and
    whether each trie equals the one built from scratch. The barrier after each version stands for
    the update's commit round, which every rank finishes before the next update is sent. layered:
    LayeredTrie versions through the scheduler's share_trie (a base once, each version's own arrays
    beside), compacted every other update."""
    import sgrec.beam.layered
    from sgrec.beam.layered import LayeredTrie
    from sgrec.scheduler.scheduler import share_trie

    sgrec.beam.layered.COMPACT_MIN, sgrec.beam.layered.COMPACT_FRACTION = 25, 0.0
    rng = random.Random(seed)
    cat = image.load(folder)
    made, same, bases = [], [], []

    def serve(key, build):
        def counted():
            made.append(key)
            return build()

        if layered:
            got = share_trie(folder, lambda: key, counted)
            barrier.wait()
            return got

        def make():
            trie, rows = counted()
            arrays, info = trie.arrays()
            return {**arrays, "trie_rows": rows}, info

        arrays, info = image.shared(folder, "trie", key, make)
        barrier.wait()
        return SemanticIdTrie.from_arrays(arrays, info), arrays["trie_rows"]

    trie, rows = serve("v0", lambda: (LayeredTrie if layered else SemanticIdTrie).from_catalog(cat, VOCAB))
    for step in range(1, steps + 1):
        ids = [it.id for it in cat.items]
        delete = rng.sample(ids, rng.randint(0, 6))
        fresh = mixed_items(random.Random(rng.random()), rng.randint(1, 10))
        ups = list({u.id: u for u in (Item(rng.choice(ids) if rng.random() < 0.5 else f"s{step}n{j}", *_body(it))
                                      for j, it in enumerate(fresh))}.values())
        res = apply_update(cat, parse_items(as_rows([u for u in ups if u.id not in delete]), None, VOCAB), delete)
        trie, rows = serve(f"v{step}", lambda: trie.updated(rows, res.catalog, res.removed_rows, res.added_from))
        ref, ref_rows = SemanticIdTrie.from_catalog(res.catalog, VOCAB)
        try:
            got, got_rows = trie.dense(res.catalog) if layered else (trie, rows)
            same_trie(got, ref)
            same.append(bool(np.array_equal(got_rows, ref_rows)))
        except AssertionError:
            same.append(False)
        cat = res.catalog
        bases.append(getattr(trie, "base_id", None))
    results.put((made, same, bases))


@pytest.mark.parametrize("layered", [False, True], ids=["dense", "layered"])
def test_ranks_in_processes_make_each_shared_version_once(tmp_path, layered):
    """Three ranks in processes of their own ask for each version's trie at about the same time:
    one makes it, the others map its files (every rank's trie equals the one built from scratch),
    and once a version is served only its files are left (and, layered, its base's)."""
    write_image(tmp_path, mixed_items(random.Random(5), 150))
    ctx = mp.get_context("spawn")
    barrier, results, steps = ctx.Barrier(3), ctx.Queue(), 4
    procs = [ctx.Process(target=_rank, args=(str(tmp_path), 11, steps, barrier, results, layered)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    made = sorted(k for m, _, _ in got for k in m)
    assert made == sorted(f"v{s}" for s in range(steps + 1))  # each version made once, by one rank
    assert all(same == [True] * steps for _, same, _ in got)
    assert all(b == got[0][2] for _, _, b in got)  # every rank on the same bases
    assert (len(set(got[0][2])) > 1) == layered, got[0][2]  # layered: compacted (in place) along the way
    files = sorted(n for n in os.listdir(tmp_path) if n.startswith("trie"))
    if layered:  # one base left: the last version's (compactions made new ones, each written once)
        with open(tmp_path / "trie-v4" / image.MANIFEST) as f:
            base = json.load(f)["info"]["base"]
        assert files == ["trie-v4", "trie.lock", f"triebase-{base}", "triebase.lock"]
    else:
        assert files == ["trie-v4", "trie.lock"]


def test_the_image_folder_goes_to_shared_memory_when_it_has_room(tmp_path):
    """folder_for: in `shm` when it has room for 4 times the catalog, else the temporary folder; the
    folder's owner lock is held while its server runs, and folders whose owner is gone are removed."""
    import fcntl

    shm, cat = tmp_path / "shm", tmp_path / "catalog.jsonl"
    shm.mkdir()
    cat.write_text("{}\n")
    stale, live, making = (shm / f"{image.PREFIX}{name}" for name in ("stale", "live", "making"))
    for d in (stale, live, making):
        d.mkdir()
    (stale / image.OWNER).touch()  # its server was killed: nobody holds the lock
    held = open(live / image.OWNER, "a")  # another server, running (another PID namespace as well)
    fcntl.flock(held, fcntl.LOCK_EX)
    got = image.folder_for(str(cat), shm=str(shm))  # (making: no lock file yet, as between mkdtemp and the lock)
    assert os.path.dirname(got) == str(shm) and os.path.basename(got).startswith(image.PREFIX)
    assert not stale.exists() and live.exists() and making.exists()
    with open(os.path.join(got, image.OWNER)) as f, pytest.raises(BlockingIOError):
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # this process owns the new one
    held.close()
    with open(cat, "wb") as f:
        f.truncate(2**42)  # sparse: a catalog 4 times larger than any room here
    other = image.folder_for(str(cat), shm=str(shm))
    assert os.path.dirname(other) == os.path.realpath(tempfile.gettempdir()) or \
        os.path.dirname(other) == tempfile.gettempdir()
    assert not live.exists()  # its owner let go: removed by the next server
    shutil.rmtree(other)
