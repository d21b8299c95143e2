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


# ---- all or nothing --------------------------------------------------------------------------------
def _errors_logged() -> list:
    """The plugin's ERROR records from here on."""
    import logging

    records: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.ERROR:
                records.append(record.getMessage())

    logging.getLogger("sgrec.sglang_plugin").addHandler(Keep())
    return records


def _sgrec_hooks() -> int:
    from sglang.srt.plugins.hook_registry import HookRegistry

    return sum(1 for hooks in HookRegistry._hooks.values() for _, hook, _ in hooks
               if getattr(hook, "__module__", "").startswith("sgrec."))


def _untouched(originals: dict) -> None:
    """Nothing of the plugin in SGLang: no eviction factory, grammar backend, CLI choice or hook, and
    the methods it would wrap are SGLang's own."""
    import argparse

    from sglang.srt.constrained.base_grammar_backend import GRAMMAR_BACKEND_REGISTRY
    from sglang.srt.mem_cache.utils import _EVICTION_POLICY_FACTORIES
    from sglang.srt.server_args import ServerArgs

    from sgrec.sglang_plugin import FLAGS

    assert "laru" not in _EVICTION_POLICY_FACTORIES and "sgrec-sid" not in GRAMMAR_BACKEND_REGISTRY
    assert _sgrec_hooks() == 0
    assert all(getattr(owner, name) is fn for (owner, name), fn in originals.items())
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for flag, name in FLAGS:
        try:
            parser.parse_args(["--model-path", "m", flag, name])
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{flag} {name} was accepted")


def _originals() -> dict:
    """Methods only the plugin hooks (ServerArgs.add_cli_args is not one: another installed plugin,
    smg-grpc-servicer, hooks it too)."""
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return {(RadixCache, "evict"): RadixCache.evict, (RadixCache, "_insert_helper"): RadixCache._insert_helper,
            (SchedulePolicy, "calc_priority"): SchedulePolicy.calc_priority}


def _remove_a_target() -> str:
    """A hook target gone, as a rename in another SGLang release would leave it."""
    from sglang.srt.beam_search.beam_group import BeamGroup

    del BeamGroup.finalize
    return "sglang.srt.beam_search.beam_group.BeamGroup.finalize"


@case
def missing_symbol():
    import sgrec.sglang_plugin as plugin
    from sglang.srt.plugins import load_plugins

    gone, originals, logged = _remove_a_target(), _originals(), _errors_logged()
    load_plugin()
    _untouched(originals)
    assert plugin.failure and f"missing symbol {gone}" in plugin.failure and logged == [plugin.failure]
    load_plugins()  # again: a no-op
    plugin.register()
    _untouched(originals)
    emit(failure=plugin.failure)


@case
def wrong_version():
    import sgrec.sglang_plugin as plugin

    originals, logged = _originals(), _errors_logged()
    plugin.sglang_version = lambda: "0.6.0"
    load_plugin()
    _untouched(originals)
    assert logged == [plugin.failure]
    emit(failure=plugin.failure)


@case
def asked_but_missing():
    """The launcher's command line asks for laru where the plugin could not install: it stops."""
    _remove_a_target()
    sys.argv = ["sglang.launch_server", "--model-path", "m", "--radix-eviction-policy", "laru"]
    try:
        load_plugin()
    except SystemExit as e:
        emit(message=str(e.code))
    else:
        raise AssertionError("the launcher went on")


@case
def twice():
    """A second load_plugins() or register() adds nothing: the same hooks, the same patched targets."""
    import sgrec.sglang_plugin as plugin
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugin()
    hooks, patched = _sgrec_hooks(), set(HookRegistry._patched)
    load_plugins()
    plugin.register()
    HookRegistry.apply_hooks()
    assert _sgrec_hooks() == hooks and HookRegistry._patched == patched and plugin.failure is None
    emit(hooks=hooks, targets=len({t for t, _, _ in plugin._hooks()}))


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


# ---- the sgrec-sid grammar backend -------------------------------------------------------------------
V, EOS, ND = 48, 2, 3


def write_catalog(path: Path, n: int = 40, seed: int = 0) -> list[dict]:
    """n items with 3-token semantic IDs in [8, V) (items 0 and 1 share a path, and item 1 has a
    `prior`), a year each."""
    import random

    rng = random.Random(seed)
    items, seen = [], set()
    while len(items) < n:
        sid = [rng.choice(range(8, 14)), rng.choice(range(14, 24)), rng.randrange(24, V)]
        if tuple(sid) in seen and len(items) != 1:
            continue
        if len(items) == 1:
            sid = list(items[0]["semantic_id"])
        seen.add(tuple(sid))
        attrs = {"year": 1980 + len(items), **({"prior": 2} if len(items) == 1 else {})}  # i1 before i0
        items.append({"id": f"i{len(items)}", "token_ids": [3 + len(items) % 5], "semantic_id": sid, "attrs": attrs})
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    return items


def sid_backend(items_path: Path | None):
    from sglang.srt.constrained.base_grammar_backend import GRAMMAR_BACKEND_REGISTRY

    if items_path is None:
        os.environ.pop("SGREC_CATALOG", None)
    else:
        os.environ["SGREC_CATALOG"] = str(items_path)
    return GRAMMAR_BACKEND_REGISTRY["sgrec-sid"](None, None, V, {EOS})


def compile_grammar(backend, spec: dict | str):
    """SGLang's path for a request's grammar: the backend's future on a cache miss, then the cache."""
    key = ("structural_tag", spec if isinstance(spec, str) else json.dumps(spec))
    value, hit = backend.get_cached_or_future_value(key, False)
    if hit:
        return value
    grammar = value.result(timeout=60)
    backend.set_cache(key, grammar.copy())
    return grammar


def batch_info(grammars):
    """SGLang's SamplingBatchInfo for a batch of these grammars (CPU), its vocab mask updated."""
    import torch
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    b = len(grammars)
    info = SamplingBatchInfo(temperatures=torch.ones(b, 1), top_ps=torch.ones(b), top_ks=torch.full((b,), 1 << 30),
                             min_ps=torch.zeros(b), is_all_greedy=False, is_any_greedy=False,
                             need_top_p_sampling=False, need_top_k_sampling=False, need_min_p_sampling=False,
                             vocab_size=V, grammars=list(grammars), device="cpu")
    info.update_regex_vocab_mask()
    return info


def allowed_after(items: list[dict], prefix: tuple) -> set[int]:
    """Brute force over the catalog: the tokens that continue `prefix` toward one of `items`."""
    if len(prefix) == ND:
        return {EOS}
    return {it["semantic_id"][len(prefix)] for it in items if tuple(it["semantic_id"][: len(prefix)]) == prefix}


@case
def grammar_paths():
    import random

    import torch
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject

    load_plugin()
    from sgrec.sglang_plugin.grammar import SidGrammar

    path = Path(tempfile.mkdtemp()) / "catalog.jsonl"
    items = write_catalog(path)
    backend = sid_backend(path)
    specs = {
        "all": ({"type": "sgrec-sid"}, items),
        "exclude": ({"type": "sgrec-sid", "exclude_items": ["i0", "i2", "i7", "i30", "gone"]},
                    [it for it in items if it["id"] not in ("i2", "i7", "i30")]),  # i1 keeps i0's path
        "include": ({"type": "sgrec-sid", "include_items": ["i3", "i4", "i5", "i9"], "exclude_items": ["i4"]},
                    [it for it in items if it["id"] in ("i3", "i5", "i9")]),
        "filter": ({"type": "sgrec-sid", "filter": {"year": {"gte": 2000}}, "exclude_items": ["i25"]},
                   [it for it in items if it["attrs"]["year"] >= 2000 and it["id"] != "i25"]),
    }
    checked_states = 0
    for name, (spec, allowed_items) in specs.items():
        g = compile_grammar(backend, spec)
        assert isinstance(g, SidGrammar), (name, g)
        again = compile_grammar(backend, spec)  # a cache hit: a fresh copy at the root
        assert isinstance(again, SidGrammar) and again is not g and again.depth == 0
        # every state reachable on the trie: the mask admits exactly the valid, allowed continuations
        stack = [g]
        while stack:
            gr = stack.pop()
            prefix = tuple(gr.tokens())
            want = allowed_after(allowed_items, prefix)
            info = batch_info([gr, None])  # a batch with an unconstrained row
            logits = torch.zeros(2, V)
            info.apply_logits_bias(logits)
            got = set(torch.isfinite(logits[0]).nonzero().flatten().tolist())
            assert got == want, (name, prefix, got, want)
            assert torch.isfinite(logits[1]).all()  # other rows untouched
            checked_states += 1
            if len(prefix) == ND:
                on_path = [it["id"] for it in allowed_items if tuple(it["semantic_id"]) == prefix
                           and it["id"] not in spec.get("exclude_items", ())]
                want_ids = sorted(on_path, key=lambda i: (i != "i1", i))  # i1 has the path's one prior
                assert gr.item_ids() == want_ids and want_ids, (name, prefix, gr.item_ids())
                gr.accept_token(EOS)
                assert gr.is_terminated()
                continue
            for tok in sorted(want):
                child = gr.copy()  # a copy for each beam: replays the path from the root
                for t in prefix + (tok,):
                    child.accept_token(t)
                stack.append(child)
            assert not gr.is_terminated()
            bad = next(t for t in range(V) if t not in want)
            try:
                gr.accept_token(bad)
            except ValueError:
                pass
            else:
                raise AssertionError(f"{name}: token {bad} accepted after {prefix}")
        # greedy and sampled decoding through SGLang's mask path: always a complete allowed path
        allowed_paths = {tuple(it["semantic_id"]) for it in allowed_items}
        gen = torch.Generator().manual_seed(7)
        for trial in range(30):
            beams = [g.copy() for _ in range(3)]  # three independent copies decoded side by side
            outs = [[] for _ in beams]
            while not all(b.is_terminated() for b in beams):
                info = batch_info(beams)
                logits = torch.randn(len(beams), V, generator=gen) * 3
                info.apply_logits_bias(logits)
                if trial % 2 == 0:
                    toks = logits.argmax(-1)
                else:
                    toks = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).flatten()
                for b, out, t in zip(beams, outs, toks.tolist()):
                    if not b.is_terminated():
                        b.accept_token(t)
                        out.append(t)
            for out in outs:
                assert out[-1] == EOS and tuple(out[:-1]) in allowed_paths, (name, out)
        # rollback (speculative decoding) returns to earlier states
        r = g.copy()
        first = next(iter(allowed_paths))
        for t in first + (EOS,):
            r.accept_token(t)
        r.rollback(2)
        assert r.tokens() == list(first[:2]) and not r.is_terminated()
    # bad requests: invalid grammars with a message (SGLang aborts those requests with 400)
    bad = {"not json": "{", "wrong type": {"type": "ebnf"}, "unknown key": {"type": "sgrec-sid", "beam": 3},
           "unknown include": {"type": "sgrec-sid", "include_items": ["nope"]},
           "ids not strings": {"type": "sgrec-sid", "exclude_items": [1]},
           "bad filter": {"type": "sgrec-sid", "filter": {"year": {"near": 3}}},
           "nothing left": {"type": "sgrec-sid", "include_items": ["i3"], "exclude_items": ["i3"]}}
    messages = {}
    for name, spec in bad.items():
        g = compile_grammar(backend, spec)
        assert isinstance(g, InvalidGrammarObject) and g.error_message.startswith("sgrec-sid"), (name, g)
        messages[name] = g.error_message
    for kind in ("json", "regex", "ebnf"):
        g, _ = backend.get_cached_or_future_value((kind, "x"), False)
        g = g.result(timeout=60)
        assert isinstance(g, InvalidGrammarObject) and "semantic-ID paths only" in g.error_message
    # a request that opts in to a server without a catalog
    none = compile_grammar(sid_backend(None), {"type": "sgrec-sid"})
    assert isinstance(none, InvalidGrammarObject) and "SGREC_CATALOG" in none.error_message
    emit(states=checked_states, messages=messages)


@case
def grammar_startup_errors():
    load_plugin()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "bad.jsonl").write_text('{"id": "a", "token_ids": [3], "semantic_id": [9, 10, 11]}\n{"id": \n')
    (tmp / "nosid.jsonl").write_text('{"id": "a", "token_ids": [3]}\n')
    (tmp / "range.jsonl").write_text('{"id": "a", "token_ids": [3], "semantic_id": [9, 10, 4000]}\n')
    errors = {}
    for name in ("missing.jsonl", "bad.jsonl", "nosid.jsonl", "range.jsonl"):
        try:
            sid_backend(tmp / name)
        except ValueError as e:
            assert str(e).startswith("--grammar-backend sgrec-sid: cannot use the catalog"), e
            errors[name] = str(e)
        else:
            raise AssertionError(f"{name} was accepted")
    emit(errors=errors)


# ---- beams on the trie ---------------------------------------------------------------------------
def _path_logits(path: tuple, vocab: int = V, only: tuple = ()):
    """Deterministic 'model' logits after a semantic-ID prefix; `only`: every other token -inf (as a
    logit bias may leave them)."""
    import torch

    x = torch.randn(vocab, generator=torch.Generator().manual_seed(hash(path) % (1 << 31))) * 2
    if only:
        keep = x[list(only)].clone()
        x.fill_(float("-inf"))
        x[list(only)] = keep
    return x


def sglang_coordinator(hybrid: bool = False):
    """SGLang's BeamCoordinator over stand-ins for the scheduler's parts its validate_and_init reads
    (model config, pools, tree cache), with a published default runtime config (page size 1, no
    disaggregation): the path a beam request takes when a real server admits it. hybrid: the tree
    cache of a model with recurrent layers (SGLang's mamba caches: Qwen3.5's Gated DeltaNet)."""
    from types import SimpleNamespace

    from sglang.srt.beam_search.coordinator import BeamCoordinator
    from sglang.srt.runtime_context import _CONTEXT
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    _CONTEXT.override_server_args(page_size=1).install()
    no = lambda: False  # noqa: E731
    return BeamCoordinator(model_config=SimpleNamespace(is_encoder_decoder=False, vocab_size=V),
                           spec_algorithm=SpeculativeAlgorithm.NONE, dllm_enabled=False, max_req_len=4096,
                           req_to_token_pool=SimpleNamespace(size=64, device="cpu"), token_to_kv_pool_allocator=None,
                           tree_cache=SimpleNamespace(supports_swa=no, supports_mamba=lambda: hybrid), future_map=None)


def admitted_beam(spec: dict | None, beam_width: int, max_new_tokens: int = ND + 3, hybrid: bool = False):
    """An sgrec-sid beam request admitted through SGLang's own BeamCoordinator.validate_and_init
    (wrapped by the plugin's hook): (the request, its beam group), or the request's error."""
    from array import array
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("beam", "", array("q", [5, 6, 7]),
              SamplingParams(max_new_tokens=max_new_tokens, beam_width=beam_width, stop_token_ids=[EOS],
                             structural_tag=None if spec is None else json.dumps(spec)))
    recv = SimpleNamespace(session_params=None, return_logprob=False, return_hidden_states=False,
                           return_sampling_mask=False, return_routed_experts=False)
    error = sglang_coordinator(hybrid).validate_and_init(req, recv)
    return error if error is not None else (req, req.beam_group)


def plugin_reads():
    """A HostReads (tests/kernel_refs.py) that records the plugin's own reads only."""
    import sgrec.sglang_plugin
    from tests.kernel_refs import HostReads

    where = os.path.dirname(sgrec.sglang_plugin.__file__) + os.sep

    class PluginReads(HostReads):
        def counts(self, caller: str) -> bool:
            return caller.startswith(where)

    return PluginReads()


def run_sglang_beam(g, beam_width: int, max_new_tokens: int = ND + 3, only: dict | None = None, admitted=None,
                    reads: list | None = None):
    """SGLang's beam selection driven step by step as its scheduler does: the worker's pre-sample
    capture (hooked: the trie mask), `_rows_topk_logprobs`, `BeamCoordinator._select_group`
    (joint_select; hooked: the rows' trie nodes), the group's commit, then finalize. admitted: a
    (request, group) from admitted_beam, else a group is made here (with g's trie attached by hand
    where g is given). reads: a list that gets the plugin's host reads during the steps (capture and
    selection), and then those of finalize as one more entry."""
    from array import array

    import torch
    from sglang.srt.beam_search.batch_tail import BeamTail, BeamTailEntry
    from sglang.srt.beam_search.beam_group import BeamGroup, BeamGroupState
    from sglang.srt.beam_search.coordinator import BeamCoordinator, _rows_topk_logprobs
    from sglang.srt.beam_search.logits_capture import capture_pre_sample_logits
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgrec.sglang_plugin.beam import BeamTrie

    if admitted is not None:
        req, group = admitted
    else:
        group = BeamGroup(beam_width=beam_width, stop_token_ids=[EOS], max_new_tokens=max_new_tokens)
        if g is not None:  # else a plain SGLang beam request
            group.sgrec_sid = BeamTrie(g, group.stop_token_ids)  # what the validate_and_init hook attaches
        req = Req("beam", "", array("q", [5, 6, 7]), SamplingParams(max_new_tokens=max_new_tokens))
        req.beam_group = group
    batch, fb = ScheduleBatch.__new__(ScheduleBatch), ForwardBatch.__new__(ForwardBatch)
    batch.reqs, batch.beam_tail = [req], None
    fb.forward_mode, fb.positions = ForwardMode.EXTEND, torch.zeros(1, dtype=torch.int64)
    paths = [()]
    tick = 0
    while group.state == BeamGroupState.DECODING:
        logits = torch.stack([_path_logits(p, only=(only or {}).get(len(p), ())) for p in paths])
        out = LogitsProcessorOutput(next_token_logits=logits.clone())
        with plugin_reads() as seen:
            capture_pre_sample_logits(batch, fb, out)
            cap = out.beam
            pieces = [cap.leader_logits[0:1]] + ([cap.tail_logits] if cap.tail_logits is not None else [])
            top_lp, top_tok = _rows_topk_logprobs(pieces, group.num_candidates)
            tokens, parents = BeamCoordinator._select_group(None, group, top_lp, top_tok, tick)
        if reads is not None:
            reads.extend(seen.reads)
        if parents is not None:
            paths = [paths[p] + (t,) for p, t in zip(parents.tolist(), tokens.tolist())]
        group.commit_pending()
        tick += 1
        # the next forward is a decode over the leader and its member rows
        batch.beam_tail = BeamTail(num_base_rows=1, entries=[BeamTailEntry(group, 0, 0, beam_width - 1)])
        fb.forward_mode, fb.positions = ForwardMode.DECODE, torch.zeros(beam_width, dtype=torch.int64)
    # one more forward after the group's last selection, as a live server's overlapped scheduler runs
    # (it crashed the capture hook past the trie's depth): rows past the trie are dead, nothing is masked
    logits = torch.randn(beam_width, V)
    out = LogitsProcessorOutput(next_token_logits=logits.clone())
    capture_pre_sample_logits(batch, fb, out)
    if out.beam is not None and getattr(group, "sgrec_sid", None) is not None:
        assert group.sgrec_sid.depth >= group.sgrec_sid.g.shared.trie.depth
        assert torch.isfinite(out.beam.leader_logits).all()
    with plugin_reads() as seen:
        results = group.finalize()
    if reads is not None:
        reads.append(seen.reads)
    return results, tick


def brute_force_top(items: list[dict], shared, filt, k: int) -> list[tuple[tuple, float]]:
    """Every allowed path scored as sgrec's children_logp does (log-softmax over the valid children)."""
    import torch

    from sgrec.sglang_plugin.grammar import SidGrammar

    scored = {}
    for it in items:
        path, total = tuple(it["semantic_id"]), 0.0
        g = SidGrammar(shared, filt)
        for d in range(ND):
            toks, _ = g.allowed_tokens()
            lp = torch.log_softmax(_path_logits(path[:d])[toks], 0)
            total += float(lp[(toks == path[d]).nonzero()[0, 0]])
            g.accept_token(path[d])
        scored[path] = total
    return sorted(scored.items(), key=lambda kv: -kv[1])[:k]


@case
def beam_paths():
    from array import array

    import torch
    from sglang.srt.beam_search.coordinator import BeamCoordinator
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    load_plugin()
    path = Path(tempfile.mkdtemp()) / "catalog.jsonl"
    items = write_catalog(path)
    backend = sid_backend(path)
    by_id = {it["id"]: it for it in items}
    summary = {}
    cases = {
        "include10": ({"type": "sgrec-sid", "include_items": [f"i{i}" for i in range(10, 20)]}, 10, True),
        "include3": ({"type": "sgrec-sid", "include_items": ["i4", "i8", "i9"]}, 6, True),  # fewer paths than beams
        "exclude": ({"type": "sgrec-sid", "exclude_items": [f"i{i}" for i in range(0, 40, 3)]}, 4, False),
        "all": ({"type": "sgrec-sid"}, 5, False),
    }
    for name, (spec, width, exhaustive) in cases.items():
        g = compile_grammar(backend, spec)
        # the allowed paths, from the request's filter by brute force over the catalog
        inc, exc = spec.get("include_items"), set(spec.get("exclude_items", []))
        ok_items = [it for it in items if (inc is None or it["id"] in inc) and it["id"] not in exc]
        allowed = {tuple(it["semantic_id"]) for it in ok_items}
        results, steps = run_sglang_beam(g, width)
        got = [(tuple(r.tokens[:-1]), r.cum_logprob) for r in results]
        for r in results:
            assert r.tokens[-1] == EOS and r.matched_token == EOS and tuple(r.tokens[:-1]) in allowed, (name, r)
        assert steps == ND + 1, (name, steps)  # every path ended with EOS: no length cut, no extra step
        if exhaustive:  # beam_width >= the allowed nodes of every level: the exact top paths
            want = brute_force_top(ok_items, g.shared, g.filt, width)
            assert [p for p, _ in got] == [p for p, _ in want], (name, got, want)
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(got, want)), (name, got, want)
        summary[name] = len(results)
    assert summary["include3"] == 3  # three items: three beams returned, no padding beam
    # requests SGLang's validate_and_init sees: invalid specs and ignore_eos are the request's error
    errors = {}
    for name, spec, extra in (("bad spec", {"type": "sgrec-sid", "include_items": ["nope"]}, {}),
                              ("ignore_eos", {"type": "sgrec-sid"}, {"ignore_eos": True})):
        req = Req("b", "", array("q", [5]), SamplingParams(max_new_tokens=8, beam_width=4,
                                                           structural_tag=json.dumps(spec), **extra))
        errors[name] = BeamCoordinator.validate_and_init(None, req, None)
        assert errors[name] and errors[name].startswith("sgrec-sid"), errors[name]
    sid_backend(None)
    req = Req("c", "", array("q", [5]), SamplingParams(max_new_tokens=8, beam_width=4,
                                                       structural_tag=json.dumps({"type": "sgrec-sid"})))
    errors["no catalog"] = BeamCoordinator.validate_and_init(None, req, None)
    assert "no item catalog" in errors["no catalog"]
    emit(beams=summary, errors=errors)


@case
def beam_admitted():
    """sgrec-sid beam requests admitted by SGLang's own validate_and_init (the hook compiles the
    spec and attaches the trie), then driven through SGLang's selection: only catalog paths that
    pass the request's filters, and with beam_width >= every level's allowed nodes exactly the top
    paths; a plain beam request admitted beside them has no trie."""
    from sgrec.sglang_plugin.beam import BeamTrie

    load_plugin()
    path = Path(tempfile.mkdtemp()) / "catalog.jsonl"
    items = write_catalog(path)
    backend = sid_backend(path)
    summary = {}
    for name, spec, width, exhaustive in (
        ("include10", {"type": "sgrec-sid", "include_items": [f"i{i}" for i in range(10, 20)]}, 10, True),
        ("exclude", {"type": "sgrec-sid", "exclude_items": [f"i{i}" for i in range(0, 40, 3)]}, 4, False),
    ):
        admitted = admitted_beam(spec, width)
        assert not isinstance(admitted, str), admitted
        req, group = admitted
        assert isinstance(group.sgrec_sid, BeamTrie) and req.sampling_params.structural_tag is None
        inc, exc = spec.get("include_items"), set(spec.get("exclude_items", []))
        ok_items = [it for it in items if (inc is None or it["id"] in inc) and it["id"] not in exc]
        allowed = {tuple(it["semantic_id"]) for it in ok_items}
        reads: list = []
        results, _ = run_sglang_beam(None, width, admitted=admitted, reads=reads)
        at_finalize = reads.pop()
        assert reads == [], reads  # the steps read nothing back
        assert len(at_finalize) == 1 and "__int__" in at_finalize[0], at_finalize  # the check sees reads
        assert results and all(r.tokens[-1] == EOS and tuple(r.tokens[:-1]) in allowed for r in results), name
        if exhaustive:
            want = brute_force_top(ok_items, group.sgrec_sid.g.shared, group.sgrec_sid.g.filt, width)
            assert [tuple(r.tokens[:-1]) for r in results] == [p for p, _ in want], name
        summary[name] = len(results)
    plain = admitted_beam(None, 4)
    assert not isinstance(plain, str) and getattr(plain[1], "sgrec_sid", None) is None, plain
    del backend
    emit(beams=summary)


@case
def beam_on_hybrid():
    """An sgrec-sid beam request on a model with recurrent layers (SGLang's mamba tree caches): the
    plugin's hook compiles the spec, then SGLang's own check refuses beams on such caches, and that
    refusal is the request's answer (no trie attached, the request's structural_tag as it came); a
    malformed spec is still the plugin's error first."""
    load_plugin()
    path = Path(tempfile.mkdtemp()) / "catalog.jsonl"
    write_catalog(path)
    backend = sid_backend(path)
    spec = {"type": "sgrec-sid", "include_items": ["i1", "i2"]}
    from array import array
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("beam", "", array("q", [5, 6, 7]),
              SamplingParams(max_new_tokens=ND + 3, beam_width=4, stop_token_ids=[EOS], structural_tag=json.dumps(spec)))
    recv = SimpleNamespace(session_params=None, return_logprob=False, return_hidden_states=False,
                           return_sampling_mask=False, return_routed_experts=False)
    refused = sglang_coordinator(hybrid=True).validate_and_init(req, recv)
    bad = admitted_beam({"type": "sgrec-sid", "include_items": "i1"}, 4, hybrid=True)
    del backend
    emit(refused=refused, tag_kept=req.sampling_params.structural_tag == json.dumps(spec),
         group=getattr(req, "beam_group", None) is not None, bad_is_plugins=isinstance(bad, str) and "mamba" not in bad)


@case
def plain_beam(plugin: str):
    """A plain SGLang beam request (no grammar) whose first step leaves fewer finite tokens than beams
    and whose second step has only the stop token finite (so every unfinished candidate is -inf, which
    the hook would end an sgrec-sid group on): its beams, scores and steps, in a process with the
    plugin loaded or without."""
    if plugin == "on":
        load_plugin()
        import sgrec.sglang_plugin as p

        assert p.failure is None
    results, steps = run_sglang_beam(None, 4, only={0: (30, 31), 1: (EOS,)})
    emit(beams=[[list(r.tokens), r.cum_logprob] for r in results], steps=steps)


# ---- srjf -------------------------------------------------------------------------------------------
@case
def srjf_order():
    import random
    from array import array

    load_plugin()
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import CacheAgnosticPolicy, SchedulePolicy
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgrec.policy.prefill_only import pick_prefill_only

    rng = random.Random(0)
    tree = RadixCache.create_simulated()
    cached_seqs = [[rng.randrange(10, 500) for _ in range(rng.randint(20, 200))] for _ in range(6)]
    for s in cached_seqs:
        tree.insert(InsertParams(key=RadixKey(array("q", s))))

    def lcp(ids):
        return max(next((i for i, (a, b) in enumerate(zip(ids, s)) if a != b), min(len(ids), len(s)))
                   for s in cached_seqs)

    class Job:  # sgrec's view of a request: what pick_prefill_only reads
        def __init__(self, n_input, cached, arrival):
            self.n_input, self.cached_on_arrival, self.arrival = n_input, cached, arrival

    orders = 0
    for trial in range(20):
        reqs, jobs = [], []
        for i in range(rng.randint(2, 40)):
            base = rng.choice(cached_seqs)
            keep = rng.randint(0, len(base))
            ids = base[:keep] + [rng.randrange(1000, 5000) for _ in range(rng.randint(1, 300))]
            r = Req(f"t{trial}r{i}", "", array("q", ids), SamplingParams(max_new_tokens=0))
            r.time_stats.wait_queue_entry_time = 100.0 + rng.random() * 50
            reqs.append(r)
            jobs.append(Job(len(ids), lcp(ids), r.time_stats.wait_queue_entry_time))
        fairness = [0.0, 5.0, 500.0][trial % 3]
        policy = SchedulePolicy("srjf", tree, False, False, False)
        policy.sgrec_srjf.fairness, policy.sgrec_srjf.clock = fairness, (lambda: 160.0)
        queue = list(reqs)
        rng.shuffle(queue)
        policy.calc_priority(queue)
        # sgrec's policy, run as its scheduler does: pick, take it out, pick again
        want, rest = [], list(range(len(jobs)))
        while rest:
            i = pick_prefill_only([jobs[j] for j in rest], "srjf", 160.0, lambda j: j.cached_on_arrival, fairness)
            want.append(rest.pop(i))
        assert [r.rid for r in queue] == [reqs[j].rid for j in want], trial
        assert [r.num_matched_prefix_tokens for r in reqs] == [j.cached_on_arrival for j in jobs]
        orders += 1
    # continuous JCT calibration: a prefix cached after arrival moves its request ahead at the next pick
    long_new = [rng.randrange(6000, 7000) for _ in range(400)]
    a = Req("long", "", array("q", long_new + [1]), SamplingParams(max_new_tokens=0))
    b = Req("short", "", array("q", [rng.randrange(7000, 8000) for _ in range(50)]), SamplingParams(max_new_tokens=0))
    for r, t in ((a, 1.0), (b, 2.0)):
        r.time_stats.wait_queue_entry_time = t
    policy = SchedulePolicy("srjf", tree, False, False, False)
    policy.sgrec_srjf.fairness, policy.sgrec_srjf.clock = 0.0, (lambda: 3.0)
    queue = [a, b]
    policy.calc_priority(queue)
    assert [r.rid for r in queue] == ["short", "long"]
    tree.insert(InsertParams(key=RadixKey(array("q", long_new))))
    policy.calc_priority(queue)
    assert [r.rid for r in queue] == ["long", "short"] and a.num_matched_prefix_tokens == 400
    # SGLang's in-batch prefix check still applies: of two requests sharing a new prefix, one waits
    shared = [rng.randrange(8000, 9000) for _ in range(100)]
    c1, c2 = (Req(f"c{i}", "", array("q", shared + [i]), SamplingParams(max_new_tokens=0)) for i in (1, 2))
    for i, r in enumerate((c1, c2, b)):
        r.time_stats.wait_queue_entry_time = 1.0 + i
    queue = [c1, c2, b]
    policy.calc_priority(queue)
    assert [r.rid for r in queue] == ["short", "c1", "c2"]
    # other policies are SGLang's own
    fcfs = SchedulePolicy("fcfs", tree, False, False, False)
    assert fcfs.policy == CacheAgnosticPolicy.FCFS and not hasattr(fcfs, "sgrec_srjf")
    queue = [c2, b, c1]
    os.environ["SGLANG_ENABLE_WAITING_PREFIX_REFRESH"] = "0"  # SGLang's refresh reads a published server config
    fcfs.calc_priority(queue)
    assert [r.rid for r in queue] == ["c2", "short", "c1"]
    # a bad SGREC_JCT_FAIRNESS stops the scheduler at start-up
    os.environ["SGREC_JCT_FAIRNESS"] = "-1"
    try:
        SchedulePolicy("srjf", tree, False, False, False)
    except ValueError as e:
        assert "SGREC_JCT_FAIRNESS" in str(e)
    else:
        raise AssertionError("negative fairness accepted")
    os.environ["SGREC_JCT_FAIRNESS"] = "250"
    assert SchedulePolicy("srjf", tree, False, False, False).sgrec_srjf.fairness == 250.0
    emit(orders=orders)


# ---- laru: bad configuration, and the tree SGLang builds ------------------------------------------------
@case
def laru_startup():
    load_plugin()
    from sglang.srt.mem_cache import registry
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from sgrec.radix.sim.simulator import _MockAllocator
    from sgrec.sglang_plugin.eviction import LaruStrategy

    errors = {}
    for name, cfg in (("unknown key", {"nope": 1}), ("bad b", {"b": 0.5}), ("bad reset", {"lambda_reset": "x"}),
                      ("bad mode", {"mode": "later"})):
        try:
            sglang_laru_cache(cfg)
        except ValueError as e:
            errors[name] = str(e)
        else:
            raise AssertionError(f"{name}: accepted")
    assert "unknown config key(s) ['nope'] for policy 'laru'" in errors["unknown key"]

    def ctx(**kw):
        params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=_MockAllocator(),
                                 page_size=1, eviction_policy=kw.pop("policy", "laru"))
        base = dict(server_args=None, params=params, is_hybrid_swa=False, is_hybrid_ssm=False,
                    enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None, model_config=None,
                    tp_size=1, tp_rank=0, tp_group=None)
        return registry.TreeCacheBuildContext(**{**base, **kw})

    tree = registry.default_radix_cache_factory(ctx())
    assert type(tree) is RadixCache and isinstance(tree.eviction_strategy, LaruStrategy)
    for kw in ({"is_hybrid_swa": True}, {"is_hybrid_ssm": True}, {"enable_hierarchical_cache": True}):
        try:
            registry.default_radix_cache_factory(ctx(**kw))
        except ValueError as e:
            errors[next(iter(kw))] = str(e)
            assert "laru runs on SGLang's RadixCache" in str(e)
        else:
            raise AssertionError(f"{kw}: accepted")
    emit(errors=errors)


if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
