"""The seam for model families: the registry and its capabilities, the memory object (KV layer map,
state slots, bytes per token once), the tree's one hand-off and its per-node states, and what a
family cannot do refused by name."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

from sgrec import layout as L
from sgrec.engine import Engine
from sgrec.mem.kv_pool import KVPool, TokenAllocator
from sgrec.mem.memory import Memory, StatePool
from sgrec.model import families, llama, registry
from sgrec.model.config import ModelConfig
from sgrec.radix.tree import RadixCache
from sgrec.rank.executor import RankExecutor
from sgrec.managers.io_struct import TokenizedGenerateReq
from sgrec.runner import ModelRunner
from sgrec.scheduler.scheduler import Scheduler
from sgrec.server_args import ServerArgs
from sgrec.tokenizer import Tokenizer

from test_rank import HEADER, INSTR, ids, make_catalog


def with_architecture(src: str, dst: str, arch: str) -> str:
    """A copy of a tiny model directory whose config.json names another architecture."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["architectures"] = [arch]
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


_REGISTERED: dict[str, registry.Family] = {}


def restricted_family(name: str, arch: str, of_config=lambda cfg: {}, **caps) -> registry.Family:
    """The dense decoder under another architecture name, with some capabilities replaced: `caps`,
    and those `of_config(cfg)` returns (registered once a test process)."""
    if arch in _REGISTERED:
        return _REGISTERED[arch]
    _REGISTERED[arch] = families.register(registry.Family(
        name=name, architectures={arch: "llama"}, config_flags=llama.config_flags, build=llama.CausalLM,
        capabilities=lambda cfg: dataclasses.replace(llama.capabilities(cfg), **caps, **of_config(cfg))))
    return _REGISTERED[arch]


def test_registry_maps_architectures_to_the_decoder_family():
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(families.supported_architectures())
    family, arch, variant = families.family_for(["Foo", "Qwen3ForCausalLM"])
    assert (family.name, arch, variant) == ("decoder", "Qwen3ForCausalLM", "qwen3")
    with pytest.raises(ValueError, match=r"Unsupported architecture \['BertModel'\] in x/y"):
        families.family_for(["BertModel"], "x/y")
    assert families.family_for(["T5ForConditionalGeneration"])[0].name == "encoder-decoder"
    assert llama.config_flags("qwen3", {}) == {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": True}
    assert llama.config_flags("qwen2", {"attention_bias": True})["qkv_bias"] is True
    assert llama.config_flags("llama", {"attention_bias": True})["o_bias"] is True
    with pytest.raises(ValueError, match="sliding-window"):
        llama.config_flags("qwen2", {"use_sliding_window": True})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        llama.config_flags("llama", {"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="already served by the decoder family"):
        families.register(registry.Family("other", {"LlamaForCausalLM": "x"}, llama.config_flags, llama.CausalLM,
                                          llama.capabilities))


def test_decoder_capabilities_and_config(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir("qwen3"))
    assert (cfg.family, cfg.arch, cfg.qk_norm) == ("decoder", "qwen3", True)
    caps = llama.capabilities(cfg)
    assert caps.layer_kinds == ("attention",) * cfg.num_layers and caps.attention_layers == list(range(cfg.num_layers))
    assert caps.prefix_reuse == "any" and caps.layouts == frozenset(L.KINDS) and not caps.encoder
    with pytest.raises(ValueError, match="prefix_reuse must be one of"):
        registry.Capabilities(layer_kinds=(), prefix_reuse="sometimes")
    with pytest.raises(ValueError, match="unknown layer kinds"):
        registry.Capabilities(layer_kinds=("attention", "conv"))
    with pytest.raises(ValueError, match=r"state_shapes must name the recurrent layers \[1\], got \[\]"):
        registry.Capabilities(layer_kinds=("attention", "recurrent"))


def test_runner_memory_is_the_pool_it_forwards_with(tiny_model_dir):
    runner = ModelRunner(ServerArgs(model_path=tiny_model_dir("qwen2"), device="cpu", dtype="float32",
                                    max_total_tokens=64))
    cfg, mem = runner.config, runner.memory
    assert runner.kv_pool is mem.kv and mem.allocator is mem.kv.allocator and mem.size == 64
    assert mem.bytes_per_token == KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    assert mem.kv_layers == list(range(cfg.num_layers)) and mem.states.size == 0 and mem.bytes_per_state == 0
    assert runner.kernels in ("native", "torch") and runner.capabilities == llama.capabilities(cfg)


def test_memory_maps_attention_layers_and_sizes_states():
    shapes = {1: {"conv": (3, 4), "ssm": (2, 4, 4)}}
    mem = Memory(16, ["attention", "recurrent", "attention"], 2, 8, torch.bfloat16, states=4, state_shapes=shapes,
                 state_dtype=torch.float32)
    assert mem.kv_layers == [0, None, 1] and mem.kv.num_layers == 2
    assert mem.bytes_per_token == 2 * 2 * 2 * 8 * 2  # K and V, 2 KV layers, 2 heads, dim 8, bf16
    assert mem.bytes_per_state == (3 * 4 + 2 * 4 * 4) * 4
    st = mem.states
    a = st.alloc(2)
    st.buffers[1]["ssm"][a] = torch.tensor([1.0, 2.0])[:, None, None, None].expand(2, 2, 4, 4)
    b = st.fork(a[1:])  # a beam taking its parent's state
    assert torch.equal(st.gather(b)[1]["ssm"], torch.full((1, 2, 4, 4), 2.0))
    assert st.alloc(2) is None and st.available_size() == 1  # 4 slots: 3 held
    st.free(a)
    c = st.alloc(3)
    assert c is not None and torch.count_nonzero(st.gather(c)[1]["ssm"]) == 0  # handed out zeroed


def test_hand_off_frees_duplicates_and_moves_the_lock():
    alloc = TokenAllocator(32)
    tree = RadixCache(alloc)
    a = alloc.alloc(4)
    tree.insert([1, 2, 3, 4], a)
    # another request computed [1, 2, 3, 4, 5, 6] matching only [1, 2]: its [3, 4] duplicate the tree's
    res = tree.match_prefix([1, 2])
    tree.inc_lock_ref(res.last_node)
    mine = alloc.alloc(4)
    value = torch.cat([res.indices, mine])
    free_before = alloc.available_size()
    full = tree.hand_off([1, 2, 3, 4, 5, 6], value, None, owned_from=2, lock=res.last_node)
    assert alloc.available_size() == free_before + 2  # the two duplicate slots went back
    assert torch.equal(full.indices, torch.cat([a, mine[2:]]))
    assert full.last_node.lock_ref == 1 and res.last_node.lock_ref == 1  # the lock moved down the path
    assert tree.protected_size() == 6
    tree.dec_lock_ref(full.last_node)
    tree.check_integrity()
    assert tree.protected_size() == 0 and tree.total_size() == 6


def test_tree_nodes_carry_states_with_their_own_lock_and_budget():
    alloc, states = TokenAllocator(8), StatePool(2, {0: {"h": (4,)}}, torch.float32)
    tree = RadixCache(alloc, states=states)
    kv = alloc.alloc(6)
    tree.insert([1, 2, 3, 4, 5, 6], kv)
    node = tree.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    tree.attach_state(node, states.alloc(1))
    tree.match_prefix([1, 2, 3])  # a split: the state stays after the last token, on the deeper node
    assert node.state is not None and node.parent.state is None and node.key == [4, 5, 6]
    other = alloc.alloc(2)
    tree.insert([7, 8], other)
    node2 = tree.match_prefix([7, 8]).last_node
    tree.attach_state(node2, states.alloc(1))
    tree.check_integrity()
    assert tree.state_count == 2 and states.available_size() == 0
    tree.inc_lock_ref(node2)  # a reader of a snapshot holds its KV too
    tree.lock_state(node2)
    assert tree.make_room(0, states=1)  # the policy's victim goes whole: node, its KV and its snapshot
    assert node.parent is None and node2.state is not None and tree.total_size() == 5
    assert not tree.make_room(0, states=2)  # one budget: the locked state cannot be freed
    assert tree.total_size() == 2  # [1, 2, 3], a leaf without a snapshot, went on the way
    tree.unlock_state(node2)
    tree.dec_lock_ref(node2)
    with pytest.raises(RuntimeError, match="unlock_state"):
        tree.unlock_state(node2)
    assert tree.evict_branch(node2) == 2 and node2.parent is None  # evicting a node frees its state too
    assert states.available_size() == 2 and tree.state_count == 0
    tree.insert([1, 2, 3, 4, 5, 6], alloc.alloc(6))
    tree.attach_state(tree.match_prefix([1, 2, 3, 4, 5, 6]).last_node, states.alloc(1))
    tree.reset()
    assert states.available_size() == 2 and tree.state_count == 0 and alloc.available_size() == 8


@pytest.mark.parametrize("policy", ["lru", "laru"])
def test_snapshots_are_evicted_in_the_trees_policy_order(policy):
    """A full state pool frees snapshots in the eviction policy's order: LARU with exact predictions
    (its lambda stays 1: the farthest next use among the least recent) keeps the snapshot needed
    next, where LRU drops the least recent one. Snapshots on inner nodes go last, their KV kept."""
    from sgrec.radix.eviction import make_policy
    from sgrec.radix.node import start_key
    from sgrec.radix.predictor import OraclePredictor

    alloc, states = TokenAllocator(32), StatePool(3, {0: {"h": (4,)}}, torch.float32)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9]}
    keys = {name: hash((None, tuple(p[:1]))) for name, p in prompts.items()}
    order = {keys["a"]: 1.0, keys["b"]: 3.0, keys["c"]: 2.0}  # a is needed first, b last
    pol = policy if policy == "lru" else make_policy(
        "laru", {"predictor": OraclePredictor(lambda k, t: order.get(k, float("inf")))})
    tree = RadixCache(alloc, policy=pol, states=states)
    nodes = {}
    for name, p in prompts.items():  # a least recent, c most
        tree.insert(p, alloc.alloc(3))
        nodes[name] = tree.match_prefix(p).last_node
        assert start_key(nodes[name]) == keys[name]
        tree.attach_state(nodes[name], states.alloc(1))
    assert tree.make_room(0, states=1)
    gone = {name for name, node in nodes.items() if node.parent is None}
    assert gone == ({"a"} if policy == "lru" else {"b"})  # whole: KV and snapshot
    assert tree.total_size() == 6 and tree.state_count == 2
    # an inner node's snapshot: a longer prompt below the survivors' first, locked by a reader
    first = sorted(set(prompts) - gone)[0]
    head = tree.match_prefix(prompts[first]).indices  # the tree's own slots, shared by the longer prompt
    tree.insert(prompts[first] + [20, 21], torch.cat([head, alloc.alloc(2)]))
    leaf = tree.match_prefix(prompts[first] + [20, 21]).last_node
    tree.inc_lock_ref(leaf)
    assert nodes[first].children and nodes[first].state is not None
    assert tree.make_room(0, states=3)  # the other leaf goes whole; the inner snapshot, its KV kept
    assert nodes[first].state is None and nodes[first].parent is not None and tree.state_count == 0
    assert tree.total_size() == 5
    tree.dec_lock_ref(leaf)
    tree.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: bfloat16 where the CPU has avx512_bf16 / AMX
def test_a_layout_the_family_does_not_run_is_refused_by_name(tiny_model_dir, tmp_path, dtype):
    restricted_family("decoder-user-only", "UserOnlyForCausalLM", layouts=frozenset({L.USER_PREFIX}))
    base = tiny_model_dir("llama", seed=0)
    path = with_architecture(base, str(tmp_path / "user_only"), "UserOnlyForCausalLM")
    cat = make_catalog(6, seed=1)
    cands = [it.id for it in cat.items]
    user = ids(3, 4)

    def executor(model_path):
        args = ServerArgs(model_path=model_path, device="cpu", dtype=dtype, max_total_tokens=256)
        runner = ModelRunner(args)
        return RankExecutor(runner, RadixCache(runner.memory.allocator), cat, args, header_ids=HEADER)

    ex, ref = executor(path), executor(base)
    assert ex.runner.family.name == "decoder-user-only"
    with pytest.raises(ValueError, match="prefix 'item' needs the item-as-prefix layout, which the "
                                         "decoder-user-only family does not run"):
        ex.run("u", user, cands, INSTR, prefix="item")
    assert ex.precompute() == 0 and ref.precompute() == len(cands)  # no item KV where it is never read
    assert ref.run("u", user, cands, INSTR, prefix="greedy")["meta_info"]["prefix"] == "item"  # a short user
    got = ex.run("u", user, cands, INSTR, prefix="greedy")
    assert got["meta_info"]["prefix"] == "user"  # greedy (and auto) choose among the layouts the family runs
    assert got["ranking"] == ref.run("v", user, cands, INSTR, prefix="user")["ranking"]


def test_a_family_without_cut_anywhere_prefixes_needs_the_radix_cache_off(tiny_model_dir, tmp_path):
    restricted_family("decoder-exact", "ExactOnlyForCausalLM", prefix_reuse="exact")
    path = with_architecture(tiny_model_dir("llama", seed=0), str(tmp_path / "exact"), "ExactOnlyForCausalLM")
    with pytest.raises(ValueError, match="reusable only as the whole sequence.*--disable-radix-cache"):
        Engine(path, device="cpu", dtype="float32", max_total_tokens=256)
    engine = Engine(path, device="cpu", dtype="float32", max_total_tokens=256, disable_radix_cache=True)
    try:
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 3
    finally:
        engine.shutdown()


def with_a_state_layer(cfg) -> dict:
    """The decoder's layers and one recurrent layer after them, which the model never reads: its
    memory has a state slot a running request, and nothing else changes."""
    n = cfg.num_layers
    return {"layer_kinds": ("attention",) * n + ("recurrent",), "state_shapes": {n: {"h": (4,)}}}


def drain(sch: Scheduler) -> dict[str, list[int]]:
    out = {}
    while sch.has_work():
        for req in sch.step():
            if req.finished:
                out[req.rid] = list(req.output_ids)
    return out


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_a_family_with_states_admits_each_request_with_a_state_slot(tiny_model_dir, tmp_path, dtype):
    restricted_family("decoder-stateful", "StatefulForCausalLM", of_config=with_a_state_layer)
    base = tiny_model_dir("llama", seed=0)
    path = with_architecture(base, str(tmp_path / "stateful"), "StatefulForCausalLM")

    def scheduler(model_path):
        args = ServerArgs(model_path=model_path, device="cpu", dtype=dtype, max_total_tokens=256,
                          max_running_requests=2, max_mamba_cache_size=2)
        runner = ModelRunner(args)
        return Scheduler(args, runner, Tokenizer(model_path))

    def submit(sch):
        for i in range(2):
            sch.add_request(TokenizedGenerateReq(f"g{i}", [5, 6, 7 + i], {"max_new_tokens": 3, "temperature": 0}))
        sch.add_request(TokenizedGenerateReq("p", [9, 10, 11], {"max_new_tokens": 0}))  # prefill-only

    sch, ref = scheduler(path), scheduler(base)
    mem = sch.runner.memory
    assert mem.states.size == 2 and mem.states_per_request == 1 and mem.bytes_per_state == 4 * mem.kv.attn_dtype.itemsize
    assert ref.runner.memory.states_per_request == 0
    held = mem.states.alloc(1)  # one of the two slots held elsewhere: one request can run at a time
    submit(sch)
    sch.step()
    assert len(sch.running) + len(sch.prefill_only) == 2 and len(sch.waiting) == 1  # the tokens fit; the state not
    assert mem.states.available_size() == 0
    got = drain(sch)
    assert mem.states.available_size() == 1 and sch.tree.state_count == 0
    mem.states.free(held)
    sch.check_memory()
    submit(ref)
    assert got == drain(ref) and len(got["g0"]) == 3 and got["p"] == []  # the state slots change no answer
