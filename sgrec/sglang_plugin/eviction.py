"""`--radix-eviction-policy laru` inside SGLang: sgrec's LARU policy (sgrec.radix.eviction, with its
LightGBM predictor and lambda_reset robustness rule) driving SGLang's own `RadixCache`.

SGLang's strategies only answer `get_priority(node)` and `RadixCache.evict` heap-orders the
evictable leaves once per call. LARU is stateful (phases, lambda, prediction-induced misses) and names
each victim itself, and its predictor learns from every access, split and eviction. So the strategy
holds one sgrec `LARUPolicy` and these hooks on `sglang.srt.mem_cache.radix_cache.RadixCache` feed it
exactly the events sgrec's own tree reports (same order, same access ticks):

  _match_prefix_helper  after: touch every node of the matched path, root first (on_access)
  _insert_helper        after: touch the walked path, then report the new leaf (on_insert, on_update)
  _split_node           after: the cut edge (on_split; the tail gets a fresh tick, as in sgrec)
  inc_lock_ref / dec_lock_ref  after: nodes whose lock crossed 0 <-> 1 (on_update)
  _delete_leaf          after: on_evict, and on_update of the parent
  reset                 after: on_reset
  evict                 around: for a LARU cache, victims come from `policy.victim()`; the freeing,
                        KV events and metrics are RadixCache's own calls

Each hook returns at once for a cache whose strategy is not LARU. SGLang's default tree (the
UnifiedRadixCache, with its Rust core) has no per-node Python hooks, so `default_radix_cache_factory`
is wrapped to build the classic `RadixCache` when the policy is laru (refused, at start-up, for the
configurations that need the unified tree: SWA, mamba, hierarchical cache).

SGLang's nodes are used as they are; the policy reads three attributes the adapter sets on them:
`depth` (tokens from the root), `extra_key` (the namespace: extra_key and cache_salt) and
`access_tick` (the order of touches).
"""

from __future__ import annotations

import time
from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from sgrec.radix.eviction import LARUPolicy, make_policy

NAME = "laru"
RADIX_CACHE = "sglang.srt.mem_cache.radix_cache.RadixCache"


class LaruStrategy(EvictionStrategy):
    """The SGLang eviction strategy `laru`: an sgrec LARUPolicy plus the adapter's tick counter.
    Built by SGLang from `--radix-eviction-policy-config` (keyword arguments: sgrec's LARU config
    keys; an unknown key or bad value is a ValueError when the cache is built, i.e. at start-up)."""

    def __init__(self, **config: Any) -> None:
        policy = make_policy(NAME, config)
        assert isinstance(policy, LARUPolicy)
        self.policy: LARUPolicy = policy
        self.tick = 0

    def get_priority(self, node) -> float:
        """Only for code that orders leaves itself instead of calling RadixCache.evict (hooked): the
        leaf's recency, i.e. LRU."""
        return node.last_access_time

    # ---- the events sgrec's tree reports -------------------------------------------------------
    def touch(self, node) -> None:
        self.tick += 1
        node.access_tick = self.tick
        self.policy.on_access(node)

    def touch_path(self, last) -> None:
        """Touch last and its ancestors (root excluded), root first, as sgrec's walk does."""
        path = []
        while last.parent is not None:
            path.append(last)
            last = last.parent
        for node in reversed(path):
            self.touch(node)

    def new_leaf(self, node) -> None:
        parent = node.parent
        _label(node, parent.depth + len(node.key))
        self.tick += 1
        node.access_tick = self.tick
        self.policy.on_insert(node)
        self.policy.on_update(parent)

    def split(self, prefix, tail) -> None:
        _label(prefix, prefix.parent.depth + len(prefix.key))
        prefix.access_tick = getattr(tail, "access_tick", 0)
        self.tick += 1
        tail.access_tick = self.tick
        self.policy.on_split(prefix, tail)


def _label(node, depth: int) -> None:
    node.depth = depth
    k = node.key
    node.extra_key = k.extra_key if k.cache_salt is None else (k.extra_key, k.cache_salt)


def _laru(cache) -> LaruStrategy | None:
    s = getattr(cache, "eviction_strategy", None)
    return s if isinstance(s, LaruStrategy) else None


# ---- hooks on RadixCache ---------------------------------------------------------------------------
def after_match(result, cache, node, key):
    s = _laru(cache)
    if s is not None:
        s.touch_path(result[1])
    return result


def after_insert(result, cache, node, key, value, priority=0, inserted_len=0):
    s = _laru(cache)
    if s is not None:
        last = result[1]
        if last.parent is None:  # empty key: nothing walked
            return result
        if hasattr(last, "access_tick"):  # fully matched: a touch of the path
            s.touch_path(last)
        else:
            s.touch_path(last.parent)
            s.new_leaf(last)
    return result


def after_split(new_node, cache, key, child, split_len):
    s = _laru(cache)
    if s is not None:
        s.split(new_node, child)
    return new_node


def after_lock(result, cache, node, *args, **kwargs):
    s = _laru(cache)
    if s is not None:
        update = s.policy.on_update
        while node.parent is not None:
            if node.lock_ref <= 1:  # crossed 0 <-> 1 in this call (inc: now 1; dec: now 0)
                update(node)
            node = node.parent
    return result


def after_delete_leaf(result, cache, node):
    s = _laru(cache)
    if s is not None:
        s.policy.on_evict(node)
        s.policy.on_update(node.parent)
    return result


def after_reset(result, cache):
    s = _laru(cache)
    if s is not None:
        s.policy.on_reset()
        cache.root_node.depth = 0
        cache.root_node.extra_key = None
    return result


def around_evict(original, cache, params):
    s = _laru(cache)
    if s is None or cache.disable:
        return original(cache, params)
    from sglang.srt.mem_cache.base_prefix_cache import EvictResult

    start, evicted = time.perf_counter(), 0
    while evicted < params.num_tokens:
        node = s.policy.victim()
        if node is None:
            break
        if node not in cache.evictable_leaves:
            raise RuntimeError(f"laru chose a node that is not an evictable leaf (lock_ref={node.lock_ref})")
        cache.token_to_kv_pool_allocator.free_segment(node.value, start_pos=0)
        evicted += len(node.value)
        cache._delete_leaf(node)
        cache.kv_events.record_remove(node)
    cache.update_eviction_metrics(evicted, start)
    return EvictResult(num_tokens_evicted=evicted)


# ---- which tree SGLang builds -------------------------------------------------------------------------
def around_default_factory(original, ctx):
    """laru runs on the classic RadixCache (per-node Python hooks), not the unified tree."""
    if ctx.params.eviction_policy.lower() != NAME or ctx.disable_radix_cache:
        return original(ctx)
    unsupported = [name for name, on in (("sliding-window (SWA) models", ctx.is_hybrid_swa),
                                         ("mamba models", ctx.is_hybrid_ssm),
                                         ("--enable-hierarchical-cache", ctx.enable_hierarchical_cache)) if on]
    if unsupported:
        raise ValueError(f"--radix-eviction-policy laru runs on SGLang's RadixCache and does not support "
                         f"{', '.join(unsupported)}")
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(ctx.params)


def after_create_tree_cache(cache, ctx):
    """Any other route to a tree (--radix-cache-backend, LMCache, ...) must still be a RadixCache."""
    if ctx.params.eviction_policy.lower() == NAME and not ctx.disable_radix_cache:
        from sglang.srt.mem_cache.radix_cache import RadixCache

        if not isinstance(cache, RadixCache) or _laru(cache) is None:
            raise ValueError(f"--radix-eviction-policy laru needs SGLang's RadixCache, but the tree is "
                             f"{type(cache).__name__}")
    return cache


HOOKS = [  # (target, hook, type)
    (f"{RADIX_CACHE}._match_prefix_helper", after_match, "after"),
    (f"{RADIX_CACHE}._insert_helper", after_insert, "after"),
    (f"{RADIX_CACHE}._split_node", after_split, "after"),
    (f"{RADIX_CACHE}.inc_lock_ref", after_lock, "after"),
    (f"{RADIX_CACHE}.dec_lock_ref", after_lock, "after"),
    (f"{RADIX_CACHE}._delete_leaf", after_delete_leaf, "after"),
    (f"{RADIX_CACHE}.reset", after_reset, "after"),
    (f"{RADIX_CACHE}.evict", around_evict, "around"),
    ("sglang.srt.mem_cache.registry.default_radix_cache_factory", around_default_factory, "around"),
    ("sglang.srt.mem_cache.registry.create_tree_cache", after_create_tree_cache, "after"),
]
