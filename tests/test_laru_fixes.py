"""Regression tests for the LARU review fixes: the online predictor trains before its steady
retrain interval is reached (a cold start used to stay plain LRU), predictions cached under an older
model are refreshed after a retrain, and the lambda rules."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from sgrec.radix.eviction import LARUPolicy, make_policy
from sgrec.radix.predictor import LightGBMPredictor, Predictor
from sgrec.radix.sim import SgrecReplay, TraceIndex, replay, sim_policy, simulate
from sgrec.radix.sim.traces import multiturn
from sgrec.radix.tree import RadixCache
from test_laru import Scripted


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


# ---- fast paths give the slow paths' values -----------------------------------------------------
def test_fast_booster_paths_equal_booster_predict():
    """Per-row SingleRowFast, batched PredictForMat and the public Booster.predict agree exactly,
    NaN-padded rows included."""
    import lightgbm as lgb

    from sgrec.radix.predictor import N_FEATURES, _FastBooster

    rng = np.random.default_rng(0)
    x = rng.exponential(10.0, size=(3000, N_FEATURES))
    x[rng.random(x.shape) < 0.3] = np.nan
    y = np.log1p(np.nan_to_num(x[:, 0], nan=50.0) + rng.exponential(1.0, 3000))
    booster = lgb.train({"objective": "regression", "verbose": -1, "num_threads": 1, "deterministic": True},
                        lgb.Dataset(x, y), num_boost_round=16)
    fast = _FastBooster(booster)
    assert fast.single is not None and fast.raw is not None  # the C paths are in use, not the fallback
    rows = [tuple(r) for r in rng.exponential(10.0, size=(200, N_FEATURES))]
    rows[::3] = [tuple(np.where(rng.random(N_FEATURES) < 0.5, np.nan, r)) for r in rows[::3]]
    want = booster.predict(np.array(rows), num_threads=1).tolist()
    assert fast.predict_rows(rows, small=True) == want
    assert fast.predict_rows(rows, small=False) == want
    assert fast.predict_rows(rows[:5]) == want[:5]  # the default choice for a small batch
    assert fast.predict_rows([]) == []


def test_history_rows_match_a_plain_reference():
    """The tuple-based feature rows equal a list-based recomputation: newest-first deltas padded
    with NaN to 10, the 10 EDCs (1 + c * exp(-rate * delta)), then the depth; every access but the
    first labels the previous row with log1p(delta)."""
    import math

    pred = LightGBMPredictor(retrain_interval=10**9, min_train=10**9, edc_base=3.0)
    cache = RadixCache(None)
    cache.insert([7, 8, 9], torch.empty(3, dtype=torch.int64))
    node = cache.match_prefix([7, 8, 9]).last_node
    rng = np.random.default_rng(1)
    times = np.cumsum(rng.integers(1, 50, size=25)).astype(float)
    deltas: list[float] = []
    edcs = [0.0] * 10
    prev_row = None
    for i, t in enumerate(times):
        pred.on_access(node, float(t))
        if i:
            d = float(t - times[i - 1])
            assert pred.samples[-1] == (prev_row, math.log1p(d))
            deltas = ([d] + deltas)[:10]
            edcs = [1.0 + c * math.exp(-r * d) for c, r in zip(edcs, pred.edc_rates)]
        else:
            edcs = [1.0] * 10
        want = tuple(deltas + [math.nan] * (10 - len(deltas)) + edcs + [3.0])
        got = pred.hist[node].row
        assert len(got) == len(want) and all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(got, want))
        prev_row = got
    assert len(pred.samples) == len(times) - 1


# ---- lambda_reset: opt-in robustness beyond Algorithm 1 -----------------------------------------
def _laru_run(reset: str, trace: list[int], **kw) -> tuple[LARUPolicy, SgrecReplay]:
    pol = LARUPolicy(Scripted({1: 1, 2: 50, 3: 40, 4: 100}), lambda_rule="every", lambda_reset=reset, **kw)
    sim = SgrecReplay(pol, capacity=4)
    for t, x in enumerate(trace):
        sim.request(t, [x], None)
    return pol, sim


def test_bets_settle_by_which_start_key_is_requested_first():
    """k = 4 one-token items. Request 5 starts phase 1 and evicts 4 (farthest) while LRU would have
    evicted 1: a bet that 4 is needed after 1."""
    pol, _ = _laru_run("bets", [1, 2, 3, 4, 5])
    assert pol.bets_won == pol.bets_lost == 0 and len(pol.bet_phases[-1]) == 1
    pol, _ = _laru_run("bets", [1, 2, 3, 4, 5, 4])  # 4 first: lost (and the usual detection)
    assert (pol.bets_won, pol.bets_lost, pol.lru_fallbacks) == (0, 1, 1) and not pol.open_bets
    pol, _ = _laru_run("bets", [1, 2, 3, 4, 5, 1, 4])  # 1 first: won; 4 later settles nothing
    assert (pol.bets_won, pol.bets_lost) == (1, 0) and not pol.open_bets
    for reset in ("phase", "carry"):  # no bookkeeping in the other modes
        pol, _ = _laru_run(reset, [1, 2, 3, 4, 5])
        assert not pol.open_bets and pol.bet_phases == deque([[]])


def test_unsettled_bets_lapse_after_the_next_phase():
    pol, sim = _laru_run("bets", [1, 2, 3, 4, 5])
    bet = pol.bet_phases[-1][0]
    one = next(n for n in sim.tree._nodes() if n.key == [1])
    assert bet.h == pol.keys[one] and set(pol.open_bets) == {bet.z, bet.h}  # z = 4 (evicted), h = 1
    pol._new_phase_bets()  # phase 2: still open
    assert bet.open and pol.open_bets
    pol._new_phase_bets()  # phase 3: made two phases ago, so it lapses
    assert not bet.open and not pol.open_bets and len(pol.bet_phases) == 2


@pytest.mark.parametrize("reset,won,lost,want", [("phase", 0, 3, 1.0), ("carry", 5, 0, 0.5), ("bets", 0, 0, 0.5),
                                                 ("bets", 1, 1, 0.5), ("bets", 0, 2, 0.5), ("bets", 2, 1, 1.0)])
def test_lambda_at_a_new_phase(reset, won, lost, want):
    """Line 12 sets lambda = 1; "carry" starts the phase at min(1, b * lambda); "bets" at 1 only if the
    bets settled in the last phase were won more often than lost."""
    pol, sim = _laru_run(reset, [1, 2, 3, 4], b=2.0)
    pol.lam, pol.bets_won, pol.bets_lost = 0.25, won, lost
    sim.request(4, [5], None)  # the first eviction finds O empty: a new phase
    assert pol.phases == 1 and pol.lam == want
    if reset == "bets":
        assert pol.bets_won == pol.bets_lost == 0


def test_lambda_reset_keeps_consistency_and_limits_inverted_predictions():
    """Exact predictions: the same hits as Algorithm 1 (= OPT here). Inverted ones (noise p = 1):
    "carry" and "bets" lose less than the per-phase reset."""
    trace = multiturn(num_conversations=300, seed=2)
    index = TraceIndex(trace)
    hits = {(reset, p): simulate(trace, "laru", 12000, noise=p, index=index,
                                 config={"lambda_reset": reset}).hit_tokens
            for reset in ("phase", "carry", "bets") for p in (0.0, 1.0)}
    assert hits[("carry", 0.0)] == hits[("bets", 0.0)] == hits[("phase", 0.0)] == \
        simulate(trace, "opt", 12000, index=index).hit_tokens
    assert hits[("carry", 1.0)] > hits[("phase", 1.0)] and hits[("bets", 1.0)] > hits[("phase", 1.0)]
    lru = simulate(trace, "lru", 12000).hit_tokens
    assert hits[("bets", 1.0)] >= 0.95 * lru > hits[("phase", 1.0)]


def test_lambda_reset_config():
    assert make_policy("laru", {"lambda_reset": "bets", "predictor": Versioned()}).lambda_reset == "bets"
    with pytest.raises(ValueError, match="lambda_reset"):
        make_policy("laru", {"lambda_reset": "never", "predictor": Versioned()})


# ---- train_async: background retrains installed at a fixed access count ----------------------------
def test_train_async_installs_the_model_half_an_interval_later():
    """Steady retrains go to a thread; the model trained on the window at the retrain replaces the
    old one exactly retrain_interval // 2 accesses later (waiting for the thread if needed)."""
    bg = LightGBMPredictor(retrain_interval=400, min_train=100, num_trees=4, train_async=True)
    cache = RadixCache(None)
    nodes = _feed(bg, cache, 1, 200)
    bg.snapshot(nodes, [0] * len(nodes))  # the bootstrap stays synchronous
    assert bg.trainings == 1 and bg._training is None and bg.model is not None
    starts, installs = [], []
    for t in range(200, 4000):
        for i, n in enumerate(nodes):
            if t % (2 + 5 * i) == 0:
                job, version, model = bg._training, bg.trainings, bg.model
                bg.on_access(n, float(t))
                if bg._training is not None and bg._training is not job:
                    starts.append((bg.accesses, bg._training[1]))
                    assert bg.model is model  # the old model serves until the install
                if bg.trainings != version:
                    installs.append(bg.accesses)
                    assert bg.model is not model
    assert len(installs) >= 3
    for (start, due), at in zip(starts, installs):
        assert due == start + 200 and at == due
    bg.close()
    assert bg._train_pool is None and bg._training is None


def test_train_async_results_are_deterministic():
    trace = multiturn(num_conversations=300, seed=4)
    cfg = {"train_async": True, "retrain_interval": 200, "min_train": 100, "num_trees": 4}
    runs = []
    for _ in range(2):
        pol = sim_policy("laru", config=cfg)
        r = replay(trace, SgrecReplay(pol, 12000), "laru")
        runs.append((r.hit_tokens, r.predictor_calls, r.evicted_tokens, pol.predictor.trainings))
        assert pol.predictor.background_trainings >= 2
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="train_async"):
        make_policy("laru", {"train_async": "yes"})


def test_fast_booster_falls_back_without_the_c_paths():
    """With the private C paths disabled, predictions come from Booster.predict, same values."""
    import lightgbm as lgb

    from sgrec.radix.predictor import _FastBooster

    rng = np.random.default_rng(2)
    x = rng.random((500, 5))
    booster = lgb.train({"objective": "regression", "verbose": -1, "num_threads": 1}, lgb.Dataset(x, x[:, 0]),
                        num_boost_round=4)
    fast = _FastBooster(booster)
    want = booster.predict(x[:40], num_threads=1).tolist()
    fast.single = None
    assert fast.predict_rows([tuple(r) for r in x[:40]], small=True) == want  # small batch, batched C call
    fast.raw = None
    assert fast.predict_rows([tuple(r) for r in x[:40]]) == want  # the public path
