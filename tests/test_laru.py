"""LARU and the other learned eviction policies: Algorithm 1 on hand-made sequences, lock safety,
equality with SGLang's RadixCache, consistency against OPT, the leaf index, predictors and config."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings

from sgrec.mem.kv_pool import TokenAllocator
from sgrec.radix.eviction import FPBPolicy, HFPolicy, LARUPolicy, LRUPolicy, make_policy
from sgrec.radix.leaf_index import RecencyIndex
from sgrec.radix.predictor import LightGBMPredictor, OraclePredictor, Predictor
from sgrec.radix.sim import SGLangReplay, SgrecReplay, TraceIndex, replay, sglang_counter_clock, sim_policy, simulate
from sgrec.radix.sim.traces import TraceRequest, multiturn, profile_tokens, zipf
from sgrec.radix.tree import RadixCache
from test_radix_tree import RadixMachine, path_values


class Scripted(Predictor):
    """Predicts a fixed value per first token of a node (0 when not listed)."""

    def __init__(self, table: dict[int, float]) -> None:
        self.table, self.calls, self.items = table, 0, 0

    def snapshot(self, nodes, keys):
        return [n.key[0] for n in nodes]

    def predict(self, snap):
        self.calls += 1
        return [self.table.get(t, 0.0) for t in snap]


class RandomPredictor(Predictor):
    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def snapshot(self, nodes, keys):
        return len(nodes)

    def predict(self, n):
        return [self.rng.random() for _ in range(n)]


def run(replay: SgrecReplay, tokens: list[int], t: int) -> int:
    return replay.request(t, tokens, None)[0]


def cached(replay: SgrecReplay) -> set[int]:
    return {n.key[0] for n in replay.tree._nodes() if n is not replay.tree.root}


# ---- Algorithm 1 on hand-made sequences -------------------------------------------------------------
def test_phases_fallback_and_candidate_set():
    """k = 4 one-token items A..H = 1..8; predictions: A farthest, then D, C, B, ..."""
    pol = LARUPolicy(Scripted({1: 100, 2: 10, 3: 50, 4: 60, 5: 5, 6: 6, 7: 7, 8: 8}), lambda_rule="every")
    sim = SgrecReplay(pol, capacity=4)
    for t, x in enumerate([1, 2, 3, 4]):
        assert run(sim, [x], t) == 0
    assert pol.phases == 0 and cached(sim) == {1, 2, 3, 4}
    run(sim, [5], 4)  # miss on a full cache: phase 1 starts with O = {A,B,C,D}; l = 4 -> A (farthest)
    assert pol.phases == 1 and pol.last_l == 4 and pol.lam == 1.0
    assert cached(sim) == {2, 3, 4, 5} and pol.prediction_evictions == 1
    assert {n.key[0] for n in pol.old} == {2, 3, 4}  # A left O when evicted; E was in use
    run(sim, [1], 5)  # A was evicted by a prediction in this phase: LRU fallback (B), lambda / 2
    assert pol.lru_fallbacks == 1 and pol.lam == 0.5 and cached(sim) == {1, 3, 4, 5}
    run(sim, [6], 6)  # l = max(floor(0.5 * 4), 1) = 2: of C, D (the two least recent) evict D (60 > 50)
    assert pol.last_l == 2 and cached(sim) == {1, 3, 5, 6}
    run(sim, [7], 7)  # l = 2 again: C (50) vs E (5) -> C; O is now empty
    assert pol.last_l == 2 and cached(sim) == {1, 5, 6, 7} and not pol.old and pol.phases == 1
    run(sim, [8], 8)  # next eviction starts phase 2: lambda = 1, l = 4, A (100) is farthest
    assert pol.phases == 2 and pol.lam == 1.0 and pol.last_l == 4 and cached(sim) == {5, 6, 7, 8}
    assert pol.lru_fallbacks == 1 and pol.prediction_evictions == 4


def test_hit_removes_from_old_and_no_fallback_for_lru_evicted():
    pol = LARUPolicy(Scripted({1: 100, 2: 1, 3: 1, 4: 1}), lambda_rule="every")
    sim = SgrecReplay(pol, capacity=4)
    for t, x in enumerate([1, 2, 3, 4, 5]):
        run(sim, [x], t)
    assert {n.key[0] for n in pol.old} == {2, 3, 4}
    assert run(sim, [2], 5) == 1  # a hit: B is requested, so no longer old
    assert {n.key[0] for n in pol.old} == {3, 4}
    run(sim, [6], 6)  # prediction-driven among all 4 candidates: all tie at 1 -> least recent (C)
    assert cached(sim) == {2, 4, 5, 6}
    run(sim, [3], 7)  # C was evicted by a prediction (ties count too): fallback
    assert pol.lru_fallbacks == 1 and pol.lam == 0.5


def test_lambda_halves_after_k_div_detections():
    """k = 64 leaves, k_div = 32: lambda halves once line 14 has run 64 // 32 = 2 times."""
    table = {x: float(x) for x in range(1, 200)}  # later items look farther
    pol = LARUPolicy(Scripted(table), lambda_rule="k_div", k_div=32, b=2.0)
    sim = SgrecReplay(pol, capacity=64)
    t = 0
    for x in range(1, 65):
        run(sim, [x], t)
        t += 1
    run(sim, [100], t)  # phase 1; evicts the farthest, item 64
    t += 1
    assert 64 not in cached(sim) and pol.lam == 1.0
    run(sim, [64], t)  # detection 1: LRU fallback, no halving yet (64 // 32 = 2)
    t += 1
    assert pol.lru_fallbacks == 1 and pol.lam == 1.0 and pol.prediction_misses == 1 and 1 not in cached(sim)
    run(sim, [150], t)  # prediction-driven again: 150 is locked, so 100 is the farthest
    t += 1
    assert 100 not in cached(sim)
    run(sim, [100], t)  # detection 2: halves
    t += 1
    assert pol.lru_fallbacks == 2 and pol.lam == 0.5 and pol.prediction_misses == 0
    run(sim, [151], t)
    assert pol.last_l == 32  # floor(0.5 * 64)


def test_small_lambda_degenerates_to_lru_without_predictor_calls():
    table = {x: -float(x) for x in range(1, 100)}  # adversarial: the most recent looks farthest
    pol = LARUPolicy(Scripted(table), lambda_rule="every", b=4.0)
    sim = SgrecReplay(pol, capacity=4)
    for t, x in enumerate([1, 2, 3, 4, 5]):
        run(sim, [x], t)  # -1 is the largest prediction of A..D: A goes
    assert 1 not in cached(sim)
    run(sim, [1], 5)  # prediction-induced: LRU fallback evicts B, lambda 1 -> 1/4
    assert pol.lam == 0.25 and {n.key[0] for n in pol.old} == {3, 4}
    calls = pol.predictor_calls
    for t, x in enumerate([6, 7], start=6):  # l = max(floor(4 / 4), 1) = 1: plain LRU, no predictor
        run(sim, [x], t)
        assert pol.last_l == 1
    assert pol.predictor_calls == calls and pol.lru_evictions == 2 and cached(sim) == {1, 5, 6, 7}
    assert not pol.old and pol.phases == 1
    run(sim, [8], 8)  # O ran empty (C, D evicted): a new phase resets lambda to 1
    assert pol.phases == 2 and pol.lam == 1.0 and pol.last_l == 4 and pol.predictor_calls == calls + 1


def test_fpb_hf_choices():
    table = {1: 5, 2: 1, 3: 9, 4: 2, 5: 3, 6: 0}
    for cls, expect in ((FPBPolicy, 3), (HFPolicy, 3)):
        sim = SgrecReplay(cls(Scripted(table)), capacity=5)
        for t, x in enumerate([1, 2, 3, 4, 5, 6]):
            run(sim, [x], t)
        assert expect not in cached(sim)
    hf = HFPolicy(Scripted({1: 1, 2: 2, 3: 3, 4: 4, 5: 99}), candidates=2)
    sim = SgrecReplay(hf, capacity=5)
    for t, x in enumerate([1, 2, 3, 4, 5, 6]):
        run(sim, [x], t)
    assert cached(sim) == {1, 3, 4, 5, 6}  # only A, B are candidates: B (2) is farther


# ---- lock safety ------------------------------------------------------------------------------------
class LaruMachine(RadixMachine):
    """The radix-tree state machine (random inserts, matches, locks, unlocks, evictions) with LARU and
    random predictions: accounting, integrity (incl. the policy's leaf index) and locked paths hold."""

    mode = "sync"
    lambda_reset = "phase"

    def __init__(self) -> None:
        super().__init__()
        pol = LARUPolicy(RandomPredictor(len(self.seen)), mode=self.mode, lambda_rule="every",
                         lambda_reset=self.lambda_reset)
        self.cache = RadixCache(self.alloc, policy=pol, clock=self.clock)

    def teardown(self) -> None:
        self.cache.policy.close()
        super().teardown()


class LaruAsyncMachine(LaruMachine):
    mode = "async"


class LaruBetsMachine(LaruMachine):
    lambda_reset = "bets"


_machine_settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
LaruMachine.TestCase.settings = _machine_settings
LaruAsyncMachine.TestCase.settings = _machine_settings
LaruBetsMachine.TestCase.settings = _machine_settings
TestLaruMachine = LaruMachine.TestCase
TestLaruAsyncMachine = LaruAsyncMachine.TestCase
TestLaruBetsMachine = LaruBetsMachine.TestCase


@pytest.mark.parametrize("policy", ["laru", "laru-bets", "fpb", "hf", "lru"])
def test_concurrent_requests_keep_locked_paths(policy):
    """Many requests in flight hold locks while others force evictions; nothing they hold moves."""
    rng = random.Random(1)
    alloc = TokenAllocator(200)
    extra = {"lambda_reset": "bets"} if policy == "laru-bets" else {}
    policy = policy.removesuffix("-bets")
    pol = make_policy(policy) if policy == "lru" else make_policy(policy, {"predictor": RandomPredictor(2), **extra})
    cache = RadixCache(alloc, policy=pol)
    running: list[tuple[object, list[int]]] = []
    for step in range(400):
        key = [rng.randrange(6) for _ in range(rng.randint(1, 12))]
        m = cache.match_prefix(key)
        cache.inc_lock_ref(m.last_node)
        need = len(key) - len(m.indices)
        if alloc.available_size() < need:
            cache.evict(need - alloc.available_size())
        value = alloc.alloc(need)
        if value is None:  # everything left is locked
            cache.dec_lock_ref(m.last_node)
            continue
        full = torch.cat([m.indices, value])
        prefix = cache.insert(key, full)
        assert prefix == len(m.indices)
        node = cache.match_prefix(key).last_node
        cache.inc_lock_ref(node)
        cache.dec_lock_ref(m.last_node)
        running.append((node, full.tolist()))
        if len(running) > 6 or rng.random() < 0.3:  # a request finishes
            done, _ = running.pop(rng.randrange(len(running)))
            cache.dec_lock_ref(done)
        for n, slots in running:
            assert n.lock_ref > 0 and path_values(cache, n).tolist() == slots
        if step % 25 == 0:
            cache.check_integrity()
    for n, _ in running:
        cache.dec_lock_ref(n)
    assert cache.protected_size() == 0
    cache.check_integrity()
    cache.evict(10**9)
    assert cache.total_size() == 0 and alloc.available_size() == alloc.size


# ---- equality with SGLang's RadixCache ------------------------------------------------------------------
def _random_prefix_trace(seed: int, n: int = 400) -> list[TraceRequest]:
    rng = random.Random(seed)
    bases = [[rng.randrange(5) for _ in range(rng.randint(1, 20))] for _ in range(12)]
    out = []
    for _ in range(n):
        b = rng.choice(bases)
        toks = b[: rng.randint(1, len(b))] + [rng.randrange(5) for _ in range(rng.randint(0, 10))]
        out.append(TraceRequest(toks))
    return out


@pytest.mark.parametrize("seed,capacity", [(0, 40), (1, 80), (2, 150), (3, 25)])
def test_lru_hits_equal_sglang(seed, capacity):
    trace = _random_prefix_trace(seed) + multiturn(num_conversations=15, gap_mean=6, gap_std=3, first_len=(4, 30),
                                                   answer_len=5, followup_len=(1, 8), system_len=6, seed=seed)
    ours, theirs = SgrecReplay(LRUPolicy(), capacity * 4), SGLangReplay("lru", capacity * 4)
    hits = evicted = 0
    with sglang_counter_clock():
        for t, r in enumerate(trace):
            a, ea = ours.request(t, r.tokens, None)
            b, eb = theirs.request(t, r.tokens, None)
            assert (a, ea) == (b, eb), f"request {t}: sgrec hit/evicted {a}/{ea}, sglang {b}/{eb}"
            hits, evicted = hits + a, evicted + ea
    assert hits > 0 and evicted > 0
    ours.tree.check_integrity()


# ---- consistency: oracle LARU vs OPT ---------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_laru_close_to_opt_on_zipf(seed):
    trace = zipf(num_requests=1500, num_items=150, item_len=8, alpha=0.9, seed=seed)
    index = TraceIndex(trace)
    results = {p: simulate(trace, p, 30 * 8, predictor="oracle", index=index) for p in ("laru", "opt")}
    lru = simulate(trace, "lru", 30 * 8)
    miss = {p: r.tokens - r.hit_tokens for p, r in results.items()}
    assert miss["laru"] <= 1.05 * miss["opt"]
    assert miss["opt"] < lru.tokens - lru.hit_tokens


def test_noise_one_inverts_predictions():
    trace = zipf(num_requests=300, num_items=40, item_len=4, seed=3)
    index = TraceIndex(trace)
    pred = OraclePredictor(index.next_access, noise=1.0)
    clean = OraclePredictor(index.next_access, noise=0.0)
    keys = list(index.times)[:10]
    snap = [(k, 5.0) for k in keys]
    assert pred.predict(snap) == [-t for t in clean.predict(snap)]
    assert all(t > 5.0 for t in clean.predict(snap))


# ---- the leaf index -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recency_index_matches_brute_force(seed):
    rng = random.Random(seed)
    idx = RecencyIndex(capacity=8)  # small, so compaction runs often
    order: list[int] = []  # recency order of tracked items
    active: dict[int, bool] = {}
    pred: dict[int, float] = {}
    nxt = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.25 or not order:
            idx.add(nxt)
            order.append(nxt)
            active[nxt], pred[nxt] = False, float("-inf")
            nxt += 1
        elif op < 0.45:
            x = rng.choice(order)
            idx.touch(x)
            order.remove(x)
            order.append(x)
        elif op < 0.65:
            x = rng.choice(order)
            on = rng.random() < 0.7
            idx.set_active(x, on)
            active[x] = on
        elif op < 0.8:
            x = rng.choice(order)
            p = float(rng.randrange(10))
            idx.set_pred(x, p)
            pred[x] = p
        else:
            x = rng.choice(order)
            idx.remove(x)
            order.remove(x)
        live = [x for x in order if active[x]]
        assert len(idx) == len(live) and idx.first() == (live[0] if live else None)
        if live:
            l = rng.randint(1, len(live) + 2)
            cand = live[:l]
            best = max(cand, key=lambda x: (pred[x], -cand.index(x)))
            assert idx.argmax_oldest(l) == best
            assert idx.oldest(l) == cand


# ---- predictors --------------------------------------------------------------------------------------------
def test_lightgbm_learns_short_and_long_reuse():
    """Two kinds of leaves: 'fast' ones re-accessed every 2 ticks, 'slow' ones every 40."""
    pred = LightGBMPredictor(window=4000, retrain_interval=10**9, min_train=50, num_trees=20)
    cache = RadixCache(None)
    fast = [[1, 100 + i] for i in range(4)]
    slow = [[2, 200 + i] for i in range(4)]
    nodes = {}
    for key in fast + slow:
        cache.insert(key, torch.empty(2, dtype=torch.int64))
        nodes[key[1]] = cache.match_prefix(key).last_node
    for t in range(1, 801):
        for key in fast if t % 2 == 0 else []:
            pred.on_access(nodes[key[1]], float(t))
        for key in slow if t % 40 == 0 else []:
            pred.on_access(nodes[key[1]], float(t))
    pred.train()
    leaves = [nodes[k[1]] for k in fast + slow]
    out = pred.predict(pred.snapshot(leaves, [0] * len(leaves)))
    lasts = [800.0] * 4 + [800.0] * 4
    deltas = [p - last for p, last in zip(out, lasts)]
    assert max(deltas[:4]) < 5 < 20 < min(deltas[4:])
    assert pred.trainings == 1 and pred.calls == 1


def test_lightgbm_policy_runs_end_to_end():
    trace = zipf(num_requests=1200, num_items=100, item_len=4, seed=5)
    pol = sim_policy("laru", config={"retrain_interval": 300, "window": 2000, "num_trees": 8})
    r = replay(trace, SgrecReplay(pol, 120), "laru")  # what simulate() does, keeping the policy
    assert r.requests == 1200 and r.predictor_calls > 0 and 0.0 < r.token_hit_rate < 1.0
    assert pol.predictor.trainings > 0  # a model was trained: not every prediction stayed UNKNOWN


# ---- config and traces ---------------------------------------------------------------------------------------
def test_make_policy_config():
    p = make_policy("laru", '{"b": 4, "lambda_rule": "every", "mode": "async", "retrain_interval": 50}')
    assert isinstance(p, LARUPolicy) and p.b == 4.0 and p.lambda_rule == "every" and p.mode == "async"
    assert p.predictor.retrain_interval == 50
    p.close()
    assert make_policy("hf", {"candidates": 8}).candidates == 8
    with pytest.raises(ValueError, match="not valid JSON"):
        make_policy("laru", "{b: 2")
    with pytest.raises(ValueError, match="unknown config key"):
        make_policy("laru", {"lamda": 1})
    with pytest.raises(ValueError, match="unknown config key"):
        make_policy("lru", {"b": 2})
    with pytest.raises(ValueError, match="mode"):
        make_policy("fpb", {"mode": "sometimes"})
    with pytest.raises(ValueError, match="OraclePredictor"):
        make_policy("opt")
    with pytest.raises(ValueError, match="JSON object"):
        make_policy("laru", "[1, 2]")


def test_scheduler_builds_policy_from_server_args():
    from sgrec.server_args import ServerArgs

    args = ServerArgs(model_path="x", radix_eviction_policy="laru", radix_eviction_policy_config='{"b": 3}')
    pol = make_policy(args.radix_eviction_policy, args.radix_eviction_policy_config)
    assert isinstance(pol, LARUPolicy) and pol.b == 3.0


def test_profile_tokens_grow_and_truncate_in_blocks():
    hist = [(i, 4.0) for i in range(1, 30)]
    p5 = profile_tokens(7, hist[:5], max_history=10, block=4, system_len=2)
    p6 = profile_tokens(7, hist[:6], max_history=10, block=4, system_len=2)
    assert p6[: len(p5)] == p5 and len(p6) == len(p5) + 2  # grows with the history
    p11 = profile_tokens(7, hist[:11], max_history=10, block=4, system_len=2)
    p13 = profile_tokens(7, hist[:13], max_history=10, block=4, system_len=2)
    assert len(p11) == 3 + 2 * 7 and p13[: len(p11)] == p11  # dropped 4, then grows again


def test_multiturn_shape():
    tr = multiturn(num_conversations=300, seed=1)
    assert 3.3 < len(tr) / 300 < 3.9
    by_prefix = sum(1 for a, b in zip(tr, tr[1:]) if b.tokens[: len(a.tokens)] == a.tokens)
    assert by_prefix < len(tr) // 10  # turns of one conversation are far apart
