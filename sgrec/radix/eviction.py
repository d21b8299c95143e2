"""Pluggable eviction policies for the radix prefix cache. All evict leaves only, never a locked node.

Two kinds plug into `RadixCache.evict`:
- a *priority* policy returns a sort key per evictable leaf; the tree heap-orders all of them per
  evict() call (simple, O(n) per call; kept for custom policies);
- an *indexed* policy (`indexed = True`) keeps its own order of the evictable leaves up to date from
  the hooks and names each victim with `victim()` in O(log n). All built-in policies are indexed:

  lru   the least recently used leaf
  fpb   follow predictions blindly: the leaf with the farthest predicted next access
  hf    heuristic filter: the `candidates` (4) least recent leaves, then the farthest prediction
  laru  learning-augmented LRU, LCR Algorithm 1 (see LARUPolicy)
  opt   Belady over leaves: fpb with an oracle predictor (offline evaluation only)

Hooks (the tree calls them; they must not mutate the tree): on_access (a touch), on_insert (a new
leaf), on_split (an edge was cut), on_update (a node's children or lock_ref changed), on_evict,
on_reset.
"""

from __future__ import annotations

import json
from abc import ABC
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sgrec.radix.leaf_index import RecencyIndex
from sgrec.radix.node import TreeNode, start_key
from sgrec.radix.predictor import LIGHTGBM_KEYS, Predictor, make_predictor

if TYPE_CHECKING:
    from sgrec.radix.tree import RadixCache


class EvictionPolicy(ABC):
    """Chooses which evictable leaf goes first."""

    name: str = "base"
    indexed: bool = False
    config_keys: frozenset[str] = frozenset()

    def priority(self, node: TreeNode) -> tuple:
        """Sort key of an evictable leaf (lower = evicted first); priority policies only."""
        raise NotImplementedError

    def victim(self) -> TreeNode | None:
        """The next leaf to evict (unlocked, childless), or None; indexed policies only."""
        raise NotImplementedError

    def on_access(self, node: TreeNode) -> None:
        """A match/insert touched `node` (its time, tick and count are already updated)."""

    def on_insert(self, node: TreeNode) -> None:
        """`node` was created as a new leaf by insert."""

    def on_split(self, prefix: TreeNode, tail: TreeNode) -> None:
        """An edge was cut: `prefix` is new (it inherits the stats of `tail`, the old node, which now
        hangs below it with a fresh access_tick). By default reported as on_insert(prefix)."""
        self.on_insert(prefix)

    def on_update(self, node: TreeNode) -> None:
        """`node` gained or lost children, or its lock_ref moved between 0 and 1."""

    def on_evict(self, node: TreeNode) -> None:
        """`node` was evicted and detached from the tree."""

    def on_reset(self) -> None:
        """The whole tree was dropped (RadixCache.reset)."""

    def check_integrity(self, tree: RadixCache) -> None:
        """Raise RuntimeError if the policy's view of the tree is wrong."""


def is_evictable(node: TreeNode) -> bool:
    """An attached, childless, unlocked non-root node (the root is parentless)."""
    return node.parent is not None and not node.children and node.lock_ref == 0


class LRUPolicy(EvictionPolicy):
    """Least recently used leaf first. Recency is the access tick (the order of touches), which is
    the order of last_access_time under a monotonic clock."""

    name = "lru"
    indexed = True

    def __init__(self) -> None:
        self.index = RecencyIndex()
        self.evicted = 0

    def victim(self) -> TreeNode | None:
        return self.index.first()

    def on_access(self, node: TreeNode) -> None:
        if node in self.index:
            self.index.touch(node)

    def on_insert(self, node: TreeNode) -> None:
        self.index.add(node)
        self.index.set_active(node, is_evictable(node))

    def on_split(self, prefix: TreeNode, tail: TreeNode) -> None:
        self.index.touch(tail)
        self.index.add(prefix)  # has a child, so inactive; the walk touches it next

    def on_update(self, node: TreeNode) -> None:
        if node in self.index:
            self.index.set_active(node, is_evictable(node))

    def on_evict(self, node: TreeNode) -> None:
        self.index.remove(node)
        self.evicted += 1

    def on_reset(self) -> None:
        self.index.clear()

    def check_integrity(self, tree: RadixCache) -> None:
        nodes = [n for n in tree._nodes() if n is not tree.root]
        if set(self.index.pos) != set(nodes):
            raise RuntimeError(f"{self.name}: tracked nodes differ from the tree's nodes")
        active = self.index.active_items()
        if set(active) != {n for n in nodes if is_evictable(n)}:
            raise RuntimeError(f"{self.name}: active set differs from the evictable leaves")
        ticks = [n.access_tick for n in active]
        if ticks != sorted(ticks):
            raise RuntimeError(f"{self.name}: recency order differs from access-tick order")


class PredictivePolicy(LRUPolicy):
    """Shared machinery of fpb / hf / laru / opt: the predicted next-access time of every evictable
    leaf lives in the recency index, so "the farthest prediction among the l least recent leaves" is
    one O(log n) query.

    Predictions go stale when a node is touched. SYNC mode refreshes the stale evictable leaves in
    one batched predictor call when an eviction needs predictions; ASYNC mode hands them to a
    background thread after each touch, when the previous task has finished, and evictions use
    whatever predictions are in place (never-predicted leaves rank as least useful to keep last,
    i.e. LRU order among themselves)."""

    config_keys = frozenset({"mode", "predictor", "seed", *LIGHTGBM_KEYS})

    def __init__(self, predictor: Predictor, mode: str = "sync") -> None:
        super().__init__()
        if mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
        self.predictor, self.mode = predictor, mode
        self.keys: dict[TreeNode, int] = {}
        self.stale: dict[TreeNode, None] = {}  # evictable leaves whose prediction is out of date
        self.predicted_tick: dict[TreeNode, int] = {}
        self.predictor_calls = self.predicted_items = 0
        self.model_version = predictor.version
        self._pool: ThreadPoolExecutor | None = None
        self._task: Future | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PredictivePolicy:
        """The predictor from the shared keys; a subclass's own keys go to its __init__ by name."""
        own = {k: config[k] for k in cls.config_keys - PredictivePolicy.config_keys if k in config}
        return cls(make_predictor(config), mode=config.get("mode", "sync"), **own)

    # ---- hooks ---------------------------------------------------------------------------------
    def key(self, node: TreeNode) -> int:
        k = self.keys.get(node)
        if k is None:
            k = self.keys[node] = start_key(node)
        return k

    def on_access(self, node: TreeNode) -> None:
        super().on_access(node)
        self.predictor.on_access(node, node.last_access_time)
        self._mark(node)
        if self.mode == "async":
            self._async_step()

    def on_insert(self, node: TreeNode) -> None:
        super().on_insert(node)
        self.predictor.on_insert(node, self.key(node), node.last_access_time)
        self.predictor.on_access(node, node.last_access_time)
        self._mark(node)

    def on_split(self, prefix: TreeNode, tail: TreeNode) -> None:
        super().on_split(prefix, tail)
        k = self.keys.pop(tail, None)
        if k is not None:
            self.keys[prefix] = k
        self.predictor.on_split(prefix, tail)
        self._mark(tail)

    def on_update(self, node: TreeNode) -> None:
        super().on_update(node)
        if node in self.index:
            self._mark(node)

    def on_evict(self, node: TreeNode) -> None:
        self.predictor.on_evict(node, self.key(node))
        super().on_evict(node)
        self.keys.pop(node, None)
        self.stale.pop(node, None)
        self.predicted_tick.pop(node, None)

    def on_reset(self) -> None:
        self.flush()
        super().on_reset()
        self.keys.clear()
        self.stale.clear()
        self.predicted_tick.clear()

    def _mark(self, node: TreeNode) -> None:
        """Keep `stale` = evictable leaves whose prediction predates their last touch."""
        if self.index.is_active(node) and self.predicted_tick.get(node) != node.access_tick:
            self.stale[node] = None
        else:
            self.stale.pop(node, None)

    # ---- predictions ---------------------------------------------------------------------------
    def _check_version(self) -> None:
        """After a retrain every cached prediction is stale (it came from the old model, or was
        UNKNOWN before the first one): mark all evictable leaves for re-prediction (O(n) per retrain)."""
        v = self.predictor.version
        if v != self.model_version:
            self.model_version = v
            self.predicted_tick.clear()
            for node in self.index.active_items():
                self.stale[node] = None

    def refresh(self) -> None:
        """SYNC: predict every stale evictable leaf in one call. ASYNC: apply finished results."""
        self.predictor.warm_up()
        self._check_version()
        if self.mode == "async":
            self._async_step()
            return
        if not self.stale:
            return
        nodes = list(self.stale)
        self.stale.clear()
        preds = self.predictor.predict(self.predictor.snapshot(nodes, [self.key(n) for n in nodes]))
        self._apply(nodes, [n.access_tick for n in nodes], preds)

    def _apply(self, nodes: list[TreeNode], ticks: list[int], preds: list[float]) -> None:
        self.predictor_calls += 1
        self.predicted_items += len(nodes)
        for node, tick, pred in zip(nodes, ticks, preds):
            if node in self.index and node.access_tick == tick:
                self.index.set_pred(node, pred)
                self.predicted_tick[node] = tick

    def _async_step(self) -> None:
        task = self._task
        if task is not None:
            if not task.done():
                return
            self._task = None
            self._apply(*task.result())
        if self.stale:
            nodes = list(self.stale)
            self.stale.clear()
            ticks = [n.access_tick for n in nodes]
            snap = self.predictor.snapshot(nodes, [self.key(n) for n in nodes])
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sgrec-predict")
            self._task = self._pool.submit(lambda: (nodes, ticks, self.predictor.predict(snap)))

    def flush(self) -> None:
        """Wait for the background prediction (ASYNC) and apply it."""
        if self._task is not None:
            self._task.result()
            self._async_step()

    def close(self) -> None:
        self.flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.predictor.close()

    def victim(self) -> TreeNode | None:
        z = self._choose()
        if z is not None:
            self.key(z)  # cache the start key while the node still has its path
        return z

    def _choose(self) -> TreeNode | None:
        raise NotImplementedError

    def _farthest_among_oldest(self, l: int) -> TreeNode | None:
        self.refresh()
        return self.index.argmax_oldest(l)


class FPBPolicy(PredictivePolicy):
    """Follow predictions blindly: evict the leaf with the farthest predicted next access."""

    name = "fpb"

    def _choose(self) -> TreeNode | None:
        return self._farthest_among_oldest(len(self.index))


class OPTPolicy(FPBPolicy):
    """Belady over leaves: FPB with an oracle predictor that returns true next-access times."""

    name = "opt"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PredictivePolicy:
        if not isinstance(config.get("predictor"), Predictor):
            raise ValueError("opt needs the true next accesses: pass an OraclePredictor as config['predictor']")
        return super().from_config(config)


class HFPolicy(PredictivePolicy):
    """Heuristic filter (HALP): the `candidates` least recent leaves, then the farthest prediction."""

    name = "hf"
    config_keys = PredictivePolicy.config_keys | {"candidates"}

    def __init__(self, predictor: Predictor, mode: str = "sync", candidates: int = 4) -> None:
        super().__init__(predictor, mode)
        self.candidates = int(candidates)
        if self.candidates < 1:
            raise ValueError("candidates must be >= 1")

    def _choose(self) -> TreeNode | None:
        return self._farthest_among_oldest(self.candidates)


@dataclass(eq=False)  # a bet is itself: two on the same keys are two bets
class Bet:
    """LARU's lambda_reset "bets": evicting `z` by prediction while LRU would have evicted `h` bets
    that z is needed after h; `open` until either is requested or the bet lapses."""

    z: int  # start key of the leaf the prediction evicted
    h: int  # start key of the leaf LRU would have evicted
    open: bool = True


class LARUPolicy(PredictivePolicy):
    """Learning-augmented LRU, LCR Algorithm 1, over the tree's evictable leaves.

    Items are tree nodes and k is the number of evictable leaves at the eviction. A phase starts
    (at an eviction that finds no unrequested old node) by marking every unlocked node old (a locked
    node is in use by a request, so it counts as requested) and setting lambda = 1; a touch or an
    eviction removes a node from the old set. Each eviction:
    - if a miss was prediction-induced (a new leaf's content, by start key, was evicted by a
      prediction-driven eviction earlier in this phase), evict the LRU leaf and count line 14;
      lambda <- lambda / b once line 14 has run `halve_after(k)` times since the last decrease:
      max(1, k // k_div) under lambda_rule "k_div" alias "paper" (the default; LCR §5.1: k_div = 32,
      b = 2; for k < 64 it is Algorithm 1's per-miss rule), 1 under "every" (Algorithm 1 as
      written, for any k), and under "auto" 1 while k < large_k (1024), the §5.1 rule from there.
      Which one wins depends on the trace (bench_laru's records in docs/performance.md);
      under inverted predictions neither keeps LARU near LRU on long phases, because lambda
      restarts at 1 every phase and the first detection comes only when the first wrongly evicted
      leaf is requested again;
    - otherwise l = max(floor(lambda * k), 1): l = 1 evicts the LRU leaf, else the leaf with the
      largest predicted next access among the l least recent ones (a prediction-driven eviction).
    The miss is seen when its leaf is inserted; the LRU fallback it earns applies to the next
    eviction (inside the same request when the caller inserts before evicting, as the simulator
    does, with the new leaf locked).

    `lambda_reset` (opt-in robustness beyond Algorithm 1; the default "phase" is line 12, lambda = 1
    at every new phase). Under inverted predictions every phase restarts at lambda = 1 and keeps
    evicting the soonest-needed leaves until the first of them is requested again, so LARU stays
    below LRU (bench_laru). The options keep what earlier phases learned:
    - "carry": a new phase starts at min(1, b * lambda) instead of 1;
    - "bets": each prediction-driven eviction of z while LRU would have evicted h (the least recent
      leaf) is a bet that z is needed after h, settled by whichever start key is requested first
      (z first: lost, h first: won; bets older than the previous phase lapse). A new phase starts
      at lambda = 1 if the bets settled during the last phase were won more often than lost, else
      as "carry".
    Both keep 1-consistency (exact predictions never trigger line 14, so lambda stays 1) and the
    O(k) bound (lambda <= 1 at every phase start); both give up part of the gain of good but
    imperfect predictions (bench_laru's records in docs/performance.md)."""

    name = "laru"
    config_keys = PredictivePolicy.config_keys | {"b", "lambda_rule", "k_div", "large_k", "lambda_reset"}
    LAMBDA_RULES = ("auto", "every", "k_div")
    LAMBDA_RESETS = ("phase", "carry", "bets")

    def __init__(self, predictor: Predictor, mode: str = "sync", b: float = 2.0, lambda_rule: str = "k_div",
                 k_div: int = 32, large_k: int = 1024, lambda_reset: str = "phase") -> None:
        super().__init__(predictor, mode)
        b, k_div, large_k = float(b), int(k_div), int(large_k)
        if b <= 1.0:
            raise ValueError(f"b must be > 1, got {b}")
        lambda_rule = "k_div" if lambda_rule == "paper" else lambda_rule
        if lambda_rule not in self.LAMBDA_RULES:
            raise ValueError(f"lambda_rule must be 'auto', 'every' or 'k_div' (alias 'paper'), got {lambda_rule!r}")
        if k_div < 1 or large_k < 1:
            raise ValueError("k_div and large_k must be >= 1")
        if lambda_reset not in self.LAMBDA_RESETS:
            raise ValueError(f"lambda_reset must be 'phase', 'carry' or 'bets', got {lambda_reset!r}")
        self.b, self.lambda_rule, self.k_div, self.large_k = b, lambda_rule, k_div, large_k
        self.lambda_reset = lambda_reset
        self.open_bets: dict[int, list[Bet]] = {}  # start key -> the open bets naming it
        self.bet_phases: deque[list[Bet]] = deque([[]])  # bets made in the previous and current phase
        self.bets_won = self.bets_lost = 0  # settled since the current phase started
        self.lam = 1.0
        self.old: set[TreeNode] = set()
        self.predicted_out: set[int] = set()  # start keys evicted by predictions in this phase
        self.pending_lru = 0  # prediction-induced misses not yet answered by an LRU eviction
        self.prediction_misses = 0  # prediction-induced misses since lambda last decreased
        self.phases = self.lru_fallbacks = self.prediction_evictions = self.lru_evictions = 0
        self.last_l = 0

    def halve_after(self, k: int) -> int:
        """How many prediction-induced misses (line 14 runs) divide lambda by b, with k items."""
        if self.lambda_rule == "every" or (self.lambda_rule == "auto" and k < self.large_k):
            return 1
        return max(1, k // self.k_div)

    def on_access(self, node: TreeNode) -> None:
        super().on_access(node)
        self.old.discard(node)
        if self.open_bets:
            self._settle(self.key(node))

    def on_insert(self, node: TreeNode) -> None:
        super().on_insert(node)
        if self.open_bets:
            self._settle(self.key(node))
        if self.old and self.key(node) in self.predicted_out:
            self.pending_lru += 1

    def on_evict(self, node: TreeNode) -> None:
        super().on_evict(node)
        self.old.discard(node)

    def on_reset(self) -> None:
        super().on_reset()
        self.old.clear()
        self.predicted_out.clear()
        self.pending_lru = self.prediction_misses = 0
        self.lam = 1.0
        self.open_bets.clear()
        self.bet_phases = deque([[]])
        self.bets_won = self.bets_lost = 0

    # ---- lambda_reset "bets" -----------------------------------------------------------------
    def _bet(self, z: TreeNode, h: TreeNode) -> None:
        bet = Bet(self.key(z), self.key(h))
        self.open_bets.setdefault(bet.z, []).append(bet)
        self.open_bets.setdefault(bet.h, []).append(bet)
        self.bet_phases[-1].append(bet)

    def _settle(self, key: int) -> None:
        """Content starting at `key` is requested (a touch, or a new leaf after a miss)."""
        for bet in self.open_bets.pop(key, ()):
            bet.open = False
            if key == bet.z:
                self.bets_lost += 1
            else:
                self.bets_won += 1
            self._drop(bet, bet.h if key == bet.z else bet.z)

    def _drop(self, bet: Bet, key: int) -> None:
        lst = self.open_bets.get(key)
        if lst is not None:
            lst.remove(bet)
            if not lst:
                del self.open_bets[key]

    def _new_phase_bets(self) -> None:
        self.bet_phases.append([])
        if len(self.bet_phases) > 2:  # bets made two phases ago lapse
            for bet in self.bet_phases.popleft():
                if bet.open:
                    bet.open = False
                    self._drop(bet, bet.z)
                    self._drop(bet, bet.h)

    def _choose(self) -> TreeNode | None:
        k = len(self.index)
        if k == 0:
            return None
        if not self.old:  # lines 9-12
            self.old = {n for n in self.index.pos if n.lock_ref == 0}  # locked = in use = requested
            if self.lambda_reset == "phase" or (self.lambda_reset == "bets" and self.bets_won > self.bets_lost):
                self.lam = 1.0  # line 12
            else:
                self.lam = min(1.0, self.b * self.lam)
            if self.lambda_reset == "bets":
                self._new_phase_bets()
                self.bets_won = self.bets_lost = 0
            self.prediction_misses, self.pending_lru = 0, 0
            self.predicted_out.clear()
            self.phases += 1
        if self.pending_lru:  # lines 14-16
            self.pending_lru -= 1
            self.prediction_misses += 1
            if self.prediction_misses >= self.halve_after(k):
                self.lam /= self.b
                self.prediction_misses = 0
            self.lru_fallbacks += 1
            return self.index.first()
        l = max(int(self.lam * k), 1)  # line 18
        self.last_l = l
        if l == 1:  # line 20
            self.lru_evictions += 1
            return self.index.first()
        z = self._farthest_among_oldest(l)  # lines 22-25
        if self.lambda_reset == "bets":
            h = self.index.first()
            if h is not z:
                self._bet(z, h)
        self.prediction_evictions += 1
        self.predicted_out.add(self.key(z))
        return z


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "laru": LARUPolicy, "fpb": FPBPolicy,
                                              "hf": HFPolicy, "opt": OPTPolicy}


def parse_config(config: dict[str, Any] | str | None) -> dict[str, Any]:
    if config is None or config == "":
        return {}
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--radix-eviction-policy-config is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"eviction policy config must be a JSON object, got {config!r}")
    return dict(config)


def make_policy(name_or_policy: str | EvictionPolicy, config: dict[str, Any] | str | None = None) -> EvictionPolicy:
    """A policy instance from a registered name and its config (a dict or a JSON object string), or
    the given instance unchanged. Unknown names, unknown keys and bad values raise ValueError."""
    if isinstance(name_or_policy, EvictionPolicy):
        if config:
            raise ValueError("a policy instance takes no config")
        return name_or_policy
    name = str(name_or_policy).lower()
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown eviction policy {name_or_policy!r}; known: {', '.join(sorted(POLICIES))}")
    cfg = parse_config(config)
    unknown = set(cfg) - cls.config_keys
    if unknown:
        known = ", ".join(sorted(cls.config_keys)) or "none"
        raise ValueError(f"unknown config key(s) {sorted(unknown)} for policy {name!r}; known: {known}")
    if not issubclass(cls, PredictivePolicy):
        return cls()
    try:
        return cls.from_config(cfg)
    except TypeError as e:
        raise ValueError(f"bad config for policy {name!r}: {e}") from None
