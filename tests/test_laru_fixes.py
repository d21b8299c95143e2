"""Regression tests for the LARU review fixes: the online predictor trains before its steady
retrain interval is reached (a cold start used to stay plain LRU), predictions cached under an older
model are refreshed after a retrain, and the lambda rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sgrec.radix.eviction import LARUPolicy, make_policy
from sgrec.radix.predictor import LightGBMPredictor, Predictor
from sgrec.radix.sim import SgrecReplay, simulate
from sgrec.radix.traces import multiturn
from sgrec.radix.tree import RadixCache


def _feed(pred: LightGBMPredictor, cache: RadixCache, t0: int, t1: int) -> list:
    keys = [[1, 100 + i] for i in range(6)]
    nodes = []
    for key in keys:
        cache.insert(key, torch.empty(2, dtype=torch.int64))
        nodes.append(cache.match_prefix(key).last_node)
    for t in range(t0, t1):
        for i, n in enumerate(nodes):
            if t % (2 + 5 * i) == 0:
                pred.on_access(n, float(t))
    return nodes


def test_lightgbm_bootstraps_and_warms_up_before_the_retrain_interval():
    pred = LightGBMPredictor(retrain_interval=10**6, min_train=100, num_trees=4)
    cache = RadixCache(None)
    nodes = _feed(pred, cache, 1, 60)
    assert len(pred.samples) < 100
    pred.snapshot(nodes, [0] * len(nodes))
    assert pred.trainings == 0  # too few samples yet
    _feed(pred, cache, 60, 400)
    assert len(pred.samples) >= 100
    out = pred.predict(pred.snapshot(nodes, [0] * len(nodes)))
    assert pred.trainings == 1 and pred.version == 1  # bootstrapped at prediction time
    assert all(np.isfinite(out))  # real predictions, not UNKNOWN
    seen = pred.trained_on
    pred.snapshot(nodes, [0] * len(nodes))
    assert pred.trainings == 1  # nothing new: no retrain
    _feed(pred, cache, 400, 4000)
    assert pred.new_samples >= seen
    pred.snapshot(nodes, [0] * len(nodes))
    assert pred.trainings == 2  # the window doubled: warm-up retrain


def test_laru_learns_on_a_trace_shorter_than_the_retrain_interval():
    """multiturn yields ~5000 samples, fewer than the default retrain interval (10000): the policy
    used to keep every prediction UNKNOWN and tie LRU exactly."""
    trace = multiturn(num_conversations=300, seed=2)
    cap = 12000
    lru = simulate(trace, "lru", cap)
    laru = simulate(trace, "laru", cap, config={"num_trees": 8})
    assert laru.token_hit_rate != lru.token_hit_rate
    assert laru.token_hit_rate > lru.token_hit_rate


class Versioned(Predictor):
    """Predicts `base + first token`; `bump()` changes the model (base and version)."""

    def __init__(self) -> None:
        self.base, self.version, self.calls, self.items = 0.0, 0, 0, 0

    def bump(self, base: float) -> None:
        self.base, self.version = base, self.version + 1

    def snapshot(self, nodes, keys):
        return [n.key[0] for n in nodes]

    def predict(self, snap):
        return [self.base - t if self.version else self.base + t for t in snap]


def test_retrain_invalidates_cached_predictions():
    pred = Versioned()
    pol = LARUPolicy(pred, lambda_rule="every")
    sim = SgrecReplay(pol, capacity=4)
    for t, x in enumerate([1, 2, 3, 4, 5]):
        sim.request(t, [x], None)  # the eviction predicted 1..4 under version 0: 4 is farthest
    cached = {n.key[0]: n for n in sim.tree._nodes() if n is not sim.tree.root}
    assert set(cached) == {1, 2, 3, 5}
    assert pol.index.get_pred(cached[1]) == 1.0
    pred.bump(100.0)  # a retrain: untouched leaves must be predicted again by the new model
    sim.request(5, [6], None)
    cached = {n.key[0]: n for n in sim.tree._nodes() if n is not sim.tree.root}
    assert 1 not in cached  # under the new model 100 - 1 is the farthest
    assert pol.index.get_pred(cached[2]) == 98.0


@pytest.mark.parametrize("rule,k,expect", [("every", 64, 1), ("every", 5000, 1), ("k_div", 64, 2),
                                           ("k_div", 5000, 156), ("paper", 5000, 156), ("auto", 64, 1),
                                           ("auto", 1023, 1), ("auto", 1024, 32), ("auto", 5000, 156)])
def test_lambda_rule_thresholds(rule, k, expect):
    pol = make_policy("laru", {"lambda_rule": rule, "predictor": Versioned()})
    assert pol.halve_after(k) == expect
