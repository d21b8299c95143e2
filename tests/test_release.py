"""Freeing an old catalog version's trie off the step (sgrec/scheduler/release.py)."""

import weakref

import numpy as np
import torch

from sgrec.scheduler.release import Releaser, take_apart


class Part:
    pass


def old_trie() -> tuple[object, list]:
    """A trie-like object (arrays and tensors as attributes, in lists and dicts) and weak references
    to its arrays; one more array (shared) is also held by the caller."""
    t = Part()
    t.ptr = np.ones(1000)
    t.levels = [torch.ones(300), torch.ones(400)]
    t.cols = {"a": np.zeros(200), "b": [np.zeros(7)]}
    t.inner = Part()  # an attribute that is an object: dropped whole, not walked
    t.inner.big = np.ones(50)
    refs = [weakref.ref(x) for x in (t.ptr, *t.levels)] + [weakref.ref(t.cols["a"]), weakref.ref(t.cols["b"][0])]
    return t, refs


def test_parts_are_freed_one_at_a_time_and_shared_ones_kept():
    t, refs = old_trie()
    shared = np.arange(5)
    t.shared = shared
    rows = np.arange(10)
    rows_ref = weakref.ref(rows)
    freed_at_pause: list[int] = []

    def pause():
        freed_at_pause.append(sum(r() is None for r in [*refs, rows_ref]))

    box = [(t, rows, Part())]
    del t, rows
    n = take_apart(box, pause)
    assert all(r() is None for r in [*refs, rows_ref])
    assert shared.tolist() == [0, 1, 2, 3, 4]  # still the caller's
    steps = np.diff([0, *freed_at_pause])
    assert steps.max() == 1 and steps.sum() == len(refs) + 1  # never two arrays in one go
    assert n == len(freed_at_pause)


def test_the_releaser_drops_what_it_is_handed():
    rel = Releaser()
    refs = []

    def garbage():  # handed over with no other reference left here
        t, r = old_trie()
        refs.extend(r)
        return t, None

    rel.drop(garbage())
    assert rel.wait_idle(timeout=60)
    assert all(r() is None for r in refs)
    assert rel.wait_idle(timeout=0)  # nothing pending
