"""Next-access predictors for learning-augmented eviction (LCR §3.2, §5.1).

A predictor returns, for tree nodes, the absolute time of their predicted next access (in the
tree's clock units); larger means "needed later". Work is split in two so that ASYNC mode can run
the second half on a background thread:

- `snapshot(nodes, keys)`: on the caller's thread, copy what the prediction needs (features).
- `predict(snapshot)`: pure computation on the copy; returns one float per node.

`LightGBMPredictor` learns online: every access of a node labels the feature row recorded at its
previous access with the time in between; rows not followed by an access within the recent window
become censored samples ("at least a window away"). Features (LCR §5.1): the last 10 inter-access
deltas, 10 exponentially decayed counters and the node's depth in tokens; all tokens of a node share
them. `OraclePredictor` wraps the true next access of a trace, optionally with the §5.3 noise.
"""

from __future__ import annotations

import math
import random
import threading
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from sgrec.radix.node import TreeNode

N_DELTAS = 10
N_EDCS = 10
N_FEATURES = N_DELTAS + N_EDCS + 1
UNKNOWN = float("-inf")  # no prediction yet: ranks first in LRU order, never above a real prediction


class Predictor:
    """Interface. The hooks see every touch, new leaf, split and eviction of the tree."""

    calls = 0  # predict() invocations
    items = 0  # nodes predicted in all
    version = 0  # bumped when the model changes (a retrain): every cached prediction is then stale

    def on_access(self, node: TreeNode, now: float) -> None:
        pass

    def on_insert(self, node: TreeNode, key: int, now: float) -> None:
        """A new leaf whose content has start key `key` (see tree.start_key) was loaded."""

    def on_split(self, prefix: TreeNode, tail: TreeNode) -> None:
        pass

    def on_evict(self, node: TreeNode, key: int) -> None:
        pass

    def reuse_horizon(self) -> float | None:
        """How far ahead a predicted next access counts as reuse (write_through_selective writes such
        a node down early): the horizon beyond which the predictor cannot tell; None when unknown."""
        return math.inf

    def warm_up(self) -> None:
        """Called before predictions are asked for (a learned predictor may train here)."""

    def snapshot(self, nodes: Sequence[TreeNode], keys: Sequence[int]) -> Any:
        raise NotImplementedError

    def predict(self, snap: Any) -> list[float]:
        raise NotImplementedError

    def close(self) -> None:
        """Release background resources (the policy's close calls it)."""


class OraclePredictor(Predictor):
    """True next access from `next_access(key, after)` (absolute time, inf if never). With
    probability `noise` a prediction is replaced by the negative of the true next-access time
    (LCR §5.3), so p = 1 ranks every item exactly backwards."""

    def __init__(self, next_access: Callable[[int, float], float], noise: float = 0.0, seed: int = 0):
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise}")
        self.next_access, self.noise, self.rng = next_access, noise, random.Random(seed)
        self.calls = self.items = 0

    def snapshot(self, nodes: Sequence[TreeNode], keys: Sequence[int]) -> list[tuple[int, float]]:
        return [(k, n.last_access_time) for n, k in zip(nodes, keys)]

    def predict(self, snap: list[tuple[int, float]]) -> list[float]:
        self.calls += 1
        self.items += len(snap)
        out = []
        for key, last in snap:
            t = self.next_access(key, last)
            out.append(-t if self.noise and self.rng.random() < self.noise else t)
        return out


_NAN_PAD = tuple((math.nan,) * (N_DELTAS - n) for n in range(N_DELTAS + 1))  # delta slots not yet seen
_FIRST_EDCS = (1.0,) * N_EDCS


class _History:
    """A node's access history. `row` is its feature tuple as of the last access (the deltas, newest
    first, NaN-padded to N_DELTAS, then the EDCs, then the depth); `nd` of its delta slots are real.
    Tuples of floats, not lists: they are immutable (a split's copy shares them) and the garbage
    collector stops tracking them, which matters with ~10^4 histories and a 20000-row window."""

    __slots__ = ("last", "nd", "row")

    def __init__(self) -> None:
        self.last: float | None = None
        self.nd = 0
        self.row: tuple[float, ...] | None = None

    def copy(self) -> _History:
        h = _History()
        h.last, h.nd, h.row = self.last, self.nd, self.row
        return h


class _FastBooster:
    """Prediction straight through LightGBM's C API. `Booster.predict` rebuilds an inner predictor
    and re-reads the model's parameters on every call (~20 us before the first tree), far more than
    evaluating 32 trees on the ~10 rows an eviction asks about. So:

    - up to `SMALL` rows: one LGBM_BoosterPredictForMatSingleRowFast call per row on a FastConfig
      prepared once per model (~1 us a row);
    - more rows (all leaves after a retrain): one LGBM_BoosterPredictForMat call with a prepared
      parameter string.

    Both give exactly `Booster.predict`'s values (checked on a probe at construction, and in the
    tests); if the private API moved or disagrees, the public `Booster.predict` is used."""

    SMALL = 32

    def __init__(self, booster: Any) -> None:
        self.booster = booster  # keeps the handle alive
        self.raw = self.single = None
        self.fast_config: Any = None
        self.lock = threading.Lock()  # one FastConfig: one single-row prediction at a time
        nf = booster.num_feature()
        probe = np.array([[math.nan] * nf, [0.0] * nf, list(range(nf))], dtype=np.float64)
        want = booster.predict(probe, num_threads=1).tolist()
        try:
            import ctypes

            from lightgbm.basic import _LIB

            self.ctypes, self.lib, self.handle, self.nf = ctypes, _LIB, booster._handle, nf
            self.param = ctypes.c_char_p(b"num_threads=1")
            self.raw = _LIB.LGBM_BoosterPredictForMat
            if self.predict_rows(probe.tolist(), small=False) != want:
                self.raw = None
        except Exception:  # noqa: BLE001 - any trouble: the public path
            self.raw = None
            return
        try:
            fast = ctypes.c_void_p()
            rc = _LIB.LGBM_BoosterPredictForMatSingleRowFastInit(
                self.handle, ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(-1), ctypes.c_int(1),
                ctypes.c_int32(nf), self.param, ctypes.byref(fast))
            if rc == 0 and fast.value:
                self.fast_config = fast
                self.n_out = ctypes.c_int64(0)
                self.out1 = (ctypes.c_double * 1)()
                self.single = _LIB.LGBM_BoosterPredictForMatSingleRowFast
                if self.predict_rows(probe.tolist(), small=True) != want:
                    self.single = None
        except Exception:  # noqa: BLE001 - no single-row path: batches only
            self.single = None

    def __del__(self) -> None:
        fast = getattr(self, "fast_config", None)
        if fast is not None:
            try:
                self.lib.LGBM_FastConfigFree(fast)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def predict_rows(self, rows: Sequence[Sequence[float]], small: bool | None = None) -> list[float]:
        """Raw model outputs for feature rows (`small`: force the per-row / batched path; tests)."""
        if not len(rows):
            return []
        if small is None:
            small = len(rows) <= self.SMALL
        ct = self.ctypes if (self.single or self.raw) else None
        if small and self.single is not None:
            single, fast, n_ref, out1 = self.single, self.fast_config, ct.byref(self.n_out), self.out1
            res = []
            with self.lock:
                for row in rows:
                    buf = array("d", row)
                    if single(fast, ct.c_void_p(buf.buffer_info()[0]), n_ref, out1) != 0:
                        return self.booster.predict(np.array(rows, dtype=np.float64), num_threads=1).tolist()
                    res.append(out1[0])
            return res
        mat = np.ascontiguousarray(np.array(rows, dtype=np.float64).reshape(len(rows), -1))
        if self.raw is None:
            return self.booster.predict(mat, num_threads=1).tolist()
        out = np.empty(len(mat), dtype=np.float64)
        n = ct.c_int64(0)
        rc = self.raw(self.handle, mat.ctypes.data_as(ct.c_void_p), ct.c_int(1), ct.c_int32(mat.shape[0]),
                      ct.c_int32(mat.shape[1]), ct.c_int(1), ct.c_int(0), ct.c_int(0), ct.c_int(-1), self.param,
                      ct.byref(n), out.ctypes.data_as(ct.POINTER(ct.c_double)))
        if rc != 0 or n.value != len(mat):
            return self.booster.predict(mat, num_threads=1).tolist()
        return out.tolist()

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        return np.array(self.predict_rows(rows.tolist()), dtype=np.float64)


class LightGBMPredictor(Predictor):
    """Online LightGBM regressor of log(1 + time to next access).

    `train_async` (opt-in): the steady retrains (every `retrain_interval` new samples) run on a
    background thread (LightGBM's C code releases the GIL) and the new model replaces the old one
    exactly `retrain_interval // 2` accesses after the retrain started, waiting for the thread if
    it is not done by then. So results do not depend on thread timing; the price is a model up to
    half an interval older. Bootstrap and warm-up trainings stay synchronous."""

    def __init__(self, window: int = 20000, retrain_interval: int = 10000, num_trees: int = 32,
                 min_train: int = 256, edc_base: float = 1.0, horizon: float | None = None, seed: int = 0,
                 train_async: bool = False):
        if window < 1 or retrain_interval < 1 or num_trees < 1 or min_train < 1 or edc_base <= 0:
            raise ValueError("window, retrain_interval, num_trees, min_train and edc_base must be positive")
        if not isinstance(train_async, bool):
            raise ValueError(f"train_async must be true or false, got {train_async!r}")
        import lightgbm  # noqa: F401 - import now (about a second), not inside the first eviction

        self.window, self.retrain_interval, self.num_trees = window, retrain_interval, num_trees
        self.min_train, self.horizon, self.seed = min_train, horizon, seed
        self.edc_rates = [math.log(2.0) / (edc_base * 2.0**i) for i in range(N_EDCS)]
        self.hist: dict[TreeNode, _History] = {}
        self.ghosts: OrderedDict[int, _History] = OrderedDict()  # histories of evicted content
        self.pending: OrderedDict[_History, None] = OrderedDict()  # rows waiting for a label, oldest first
        self.samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self.times: deque[float] = deque(maxlen=window)  # recent access times, for the censoring horizon
        self.model: Any = None
        self.new_samples = 0
        self.trained_on = 0  # samples in the window at the last training
        self.calls = self.items = self.trainings = 0
        self.train_async = train_async
        self.accesses = 0
        self.background_trainings = 0  # models trained on the thread and installed
        self._training: tuple[Future, int, int] | None = None  # (result, install at access #, rows)
        self._train_pool: ThreadPoolExecutor | None = None

    # ---- learning ------------------------------------------------------------------------------
    def on_access(self, node: TreeNode, now: float) -> None:
        h = self.hist.get(node)
        if h is None:
            h = self.hist[node] = _History()
        last, row = h.last, h.row
        if last is not None and row is not None:
            delta = now - last
            if delta <= 0:  # the same request touching the node twice
                return
            self.samples.append((row, math.log1p(delta)))
            self.new_samples += 1
            nd = h.nd
            exp = math.exp
            edcs = tuple([1.0 + c * exp(-r * delta) for c, r in zip(row[N_DELTAS:N_DELTAS + N_EDCS], self.edc_rates)])
            deltas = (delta,) + row[:nd if nd < N_DELTAS else N_DELTAS - 1]
            h.nd = nd = len(deltas)
        else:
            deltas, edcs, nd = (), _FIRST_EDCS, h.nd
        h.last = now
        h.row = deltas + _NAN_PAD[nd] + edcs + (float(node.depth),)
        pending = self.pending
        if h in pending:
            pending.move_to_end(h)
        else:
            pending[h] = None
        self.times.append(now)
        self._censor(now)
        self.accesses += 1
        if self._training is not None and self.accesses >= self._training[1]:
            self._install()
        if self.new_samples >= self.retrain_interval and len(self.samples) >= self.min_train:
            if not self.train_async:
                self.train()
            elif self._training is None:
                self._start_training()

    def warm_up(self) -> None:
        """Bootstrap and warm-up training, run when a prediction is asked for: the first model as
        soon as `min_train` samples exist, then a retrain whenever the window holds as many new
        samples as the last model saw, until models see `retrain_interval` samples (from then on
        on_access retrains every `retrain_interval` new samples). Without this a cold cache, or a
        trace shorter than the interval, never gets a model: every prediction stays UNKNOWN and
        the learned policies are plain LRU."""
        if (len(self.samples) >= self.min_train and self.trained_on < self.retrain_interval
                and self.new_samples >= max(self.min_train, self.trained_on)):
            self.train()

    @property
    def version(self) -> int:
        """Changes whenever the model does: predictions made under an older model are stale."""
        return self.trainings

    def reuse_horizon(self) -> float | None:
        """The censoring horizon: a node not accessed again within it is labelled with it, so a
        prediction below it means "accessed again"."""
        if self.horizon is not None:
            return self.horizon
        return self.times[-1] - self.times[0] if len(self.times) >= self.window else None

    def on_insert(self, node: TreeNode, key: int, now: float) -> None:
        ghost = self.ghosts.pop(key, None)
        if ghost is not None:
            self.hist[node] = ghost

    def on_split(self, prefix: TreeNode, tail: TreeNode) -> None:
        h = self.hist.get(tail)
        if h is not None:
            self.hist[prefix] = h.copy()

    def on_evict(self, node: TreeNode, key: int) -> None:
        h = self.hist.pop(node, None)
        if h is not None:
            self.ghosts.pop(key, None)
            self.ghosts[key] = h
            while len(self.ghosts) > self.window:
                self.ghosts.popitem(last=False)

    def _add_sample(self, row: tuple[float, ...] | None, delta: float) -> None:
        if row is not None:
            self.samples.append((row, math.log1p(delta)))
            self.new_samples += 1

    def _censor(self, now: float) -> None:
        """Rows not re-accessed within the horizon become samples labelled with the horizon."""
        horizon = self.horizon
        if horizon is None:
            if len(self.times) < self.window:
                return
            horizon = max(self.times[-1] - self.times[0], 1e-9)
        while self.pending:
            h = next(iter(self.pending))
            if h.last is None or now - h.last <= horizon:
                break
            self.pending.popitem(last=False)
            self._add_sample(h.row, horizon)

    def _fit(self, samples: list[tuple[tuple[float, ...], float]]) -> _FastBooster:
        import lightgbm as lgb

        x = np.array([r for r, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        params = {"objective": "regression", "learning_rate": 0.1, "num_leaves": 31, "min_data_in_leaf": 20,
                  "verbose": -1, "num_threads": 1, "seed": self.seed, "deterministic": True,
                  "force_row_wise": True}
        return _FastBooster(lgb.train(params, lgb.Dataset(x, y), num_boost_round=self.num_trees))

    def train(self) -> None:
        """Train on the window now (synchronously)."""
        self.model = self._fit(list(self.samples))
        self.new_samples = 0
        self.trained_on = len(self.samples)
        self.trainings += 1

    def _start_training(self) -> None:
        samples = list(self.samples)  # the rows are immutable tuples: a cheap, safe copy
        if self._train_pool is None:
            self._train_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sgrec-train")
        self._training = (self._train_pool.submit(self._fit, samples), self.accesses + self.retrain_interval // 2,
                          len(samples))
        self.new_samples = 0

    def _install(self) -> None:
        future, _, rows = self._training
        self._training = None
        self.model = future.result()
        self.trained_on = rows
        self.trainings += 1
        self.background_trainings += 1

    def close(self) -> None:
        """Stop the training thread (a pending model is dropped)."""
        if self._train_pool is not None:
            self._train_pool.shutdown(wait=True)
            self._train_pool = None
        self._training = None

    # ---- inference -----------------------------------------------------------------------------
    def snapshot(self, nodes: Sequence[TreeNode], keys: Sequence[int]) -> tuple[Any, list, list[float]]:
        """(model, feature rows, last access times): the rows are immutable tuples, so references
        are a copy the background thread may read while the tree moves on."""
        self.warm_up()
        rows, lasts = [], []
        for n in nodes:
            h = self.hist.get(n)
            ok = h is not None and h.row is not None
            rows.append(h.row if ok else _NAN_PAD[0] + (math.nan,) * N_EDCS + (float(n.depth),))
            lasts.append(h.last if ok else n.last_access_time)
        return self.model, rows, lasts

    def predict(self, snap: tuple[Any, list, list[float]]) -> list[float]:
        """last access + expm1(predicted log1p interval), the interval clipped at 0."""
        model, rows, lasts = snap
        self.calls += 1
        self.items += len(rows)
        if model is None or len(rows) == 0:
            return [UNKNOWN] * len(rows)
        expm1 = math.expm1
        return [last + expm1(y if y > 0.0 else 0.0) for y, last in zip(model.predict_rows(rows), lasts)]


LIGHTGBM_KEYS = ("window", "retrain_interval", "num_trees", "min_train", "edc_base", "horizon", "train_async")


def make_predictor(config: dict[str, Any]) -> Predictor:
    """A predictor from policy config: an injected Predictor under "predictor", else LightGBM with
    the config's LIGHTGBM_KEYS and seed."""
    injected = config.get("predictor", "lightgbm")
    if isinstance(injected, Predictor):
        return injected
    if injected != "lightgbm":
        raise ValueError(f"unknown predictor {injected!r}: use 'lightgbm' or pass a Predictor instance")
    return LightGBMPredictor(**{k: config[k] for k in LIGHTGBM_KEYS if k in config}, seed=config.get("seed", 0))
