"""The cases of tests/test_sglang_plugin.py, each run in its own process (`python
tests/sglang_plugin_cases.py CASE`), because the plugin patches SGLang's classes for the rest of the
process. Every case first loads the plugin through SGLang's own `load_plugins()`, which discovers it
by its entry point: the one pyproject.toml declares, written as an `sgrec` distribution's
entry_points.txt at the front of sys.path (so the worktree's declaration is what SGLang reads, also
where an installed sgrec predates it). A case checks its claims with assert and prints one JSON line
of numbers for the test to compare."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP = "sglang.srt.plugins"


def declared_entry_point() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["entry-points"][GROUP]["sgrec"]


def load_plugin() -> None:
    """SGLang's discovery and loading, of the entry point pyproject.toml declares."""
    dist = Path(tempfile.mkdtemp(prefix="sgrec-ep-")) / "sgrec-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sgrec\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(f"[{GROUP}]\nsgrec = {declared_entry_point()}\n")
    sys.path.insert(0, str(dist.parent))
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group=GROUP) if ep.name == "sgrec"]
    assert [ep.value for ep in eps] == [declared_entry_point()], eps

    from sglang.srt.plugins import load_plugins

    load_plugins()


def emit(**numbers) -> None:
    print("RESULT " + json.dumps(numbers))


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# ---- registration --------------------------------------------------------------------------------
@case
def registered():
    before = set(sys.modules)
    load_plugin()
    loaded = set(sys.modules) - before
    model_code = sorted(m for m in loaded if m.startswith(("sgrec.model", "sgrec.runner", "sgrec.beam.executor",
                                                           "sgrec.engine", "sgrec.scheduler.scheduler")))
    assert not model_code, model_code
    import argparse

    from sglang.srt.constrained.base_grammar_backend import GRAMMAR_BACKEND_REGISTRY
    from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES, get_eviction_strategy
    from sglang.srt.server_args import ServerArgs

    from sgrec.sglang_plugin.eviction import LaruStrategy

    assert "laru" in _EVICTION_POLICY_FACTORIES and "sgrec-sid" in GRAMMAR_BACKEND_REGISTRY
    assert isinstance(get_eviction_strategy("laru", {"lambda_reset": "bets"}), LaruStrategy)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--radix-eviction-policy", "laru", "--grammar-backend",
                              "sgrec-sid", "--schedule-policy", "srjf",
                              "--radix-eviction-policy-config", '{"lambda_reset": "carry"}'])
    assert (args.radix_eviction_policy, args.grammar_backend, args.schedule_policy) == ("laru", "sgrec-sid", "srjf")
    assert args.radix_eviction_policy_config == {"lambda_reset": "carry"}
    for flag, bad in (("--schedule-policy", "nope"), ("--radix-eviction-policy", "nope")):
        try:
            parser.parse_args(["--model-path", "m", flag, bad])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{flag} {bad} was accepted")
    threads_started = [t.name for t in __import__("threading").enumerate() if t.name.startswith("sgrec")]
    assert not threads_started, threads_started
    emit(model_modules=len(model_code))


# ---- laru on SGLang's RadixCache ---------------------------------------------------------------------
class _RequestClock:
    """Stands in for `time` inside SGLang's radix_cache: monotonic() is the request index, the clock
    sgrec's simulator gives its own tree (so the predictor sees the same times on both trees)."""

    def __init__(self) -> None:
        import time

        self.now, self.perf_counter = 0.0, time.perf_counter

    def monotonic(self) -> float:
        return self.now


def sglang_laru_cache(config: dict | None = None):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sgrec.radix.sim.simulator import _MockAllocator

    return RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=_MockAllocator(),
                                      page_size=1, eviction_policy="laru", eviction_policy_config=config))


def replay_sglang(trace, cache, capacity: int) -> tuple[float, int]:
    """The simulator's request steps (sgrec.radix.sim.SGLangReplay) on `cache`; (token hit rate, tokens evicted)."""
    from sglang.srt.mem_cache import radix_cache

    from sgrec.radix.sim.simulator import SGLangReplay

    rep = SGLangReplay("lru", capacity)
    rep.cache = cache
    clock, saved = _RequestClock(), radix_cache.time
    radix_cache.time = clock
    hits = tokens = evicted = 0
    try:
        for t, r in enumerate(trace):
            clock.now = float(t)
            hit, ev = rep.request(t, r.tokens, r.extra_key)
            hits, tokens, evicted = hits + hit, tokens + len(r.tokens), evicted + ev
    finally:
        radix_cache.time = saved
    return hits / tokens, evicted


@case
def laru_replay(trace_name: str, cache_tokens: str, requests: str, config: str = "{}"):
    load_plugin()
    from sgrec.radix.sim import load, simulate
    from sgrec.sglang_plugin.eviction import LaruStrategy

    cache_tokens, cfg = int(cache_tokens), json.loads(config)
    trace = load(trace_name, int(requests))
    cache = sglang_laru_cache(cfg)
    assert isinstance(cache.eviction_strategy, LaruStrategy)
    sglang_rate, evicted = replay_sglang(trace, cache, cache_tokens)
    pol = cache.eviction_strategy.policy
    pol.close()
    sgrec_rate = simulate(trace, "laru", cache_tokens, config=cfg).token_hit_rate
    lru_rate = simulate(trace, "lru", cache_tokens).token_hit_rate
    sglang_lru = simulate(trace, "sglang-lru", cache_tokens).token_hit_rate
    # the tree stayed consistent: what the policy tracks is exactly SGLang's tree
    nodes, stack = set(), [cache.root_node]
    while stack:
        n = stack.pop()
        nodes.add(n)
        stack.extend(n.children.values())
    assert set(pol.index.pos) == nodes - {cache.root_node}
    assert {n for n in pol.index.active_items()} == set(cache.evictable_leaves)
    assert cache.evictable_size() + cache.protected_size() == sum(len(n.key) for n in nodes) <= cache_tokens
    emit(sglang_laru=sglang_rate, sgrec_laru=sgrec_rate, sgrec_lru=lru_rate, sglang_lru=sglang_lru, evicted=evicted,
         trainings=pol.predictor.trainings, phases=pol.phases, prediction_evictions=pol.prediction_evictions)


if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
