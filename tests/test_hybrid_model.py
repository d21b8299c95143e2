"""The hybrid family (Qwen3.5 text models: Gated DeltaNet and gated attention) against transformers on
the same checkpoint: the gated delta rule's two forms, the logits of a prefill, of a chunked
prefill resumed from its state and of every decode step, batched decode, greedy generation through
the engine (chunked prefill, several requests at once), and what the family refuses by name."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from sgrec.beam import RetrieveExecutor
from sgrec.catalog import Catalog, Item
from sgrec.engine import Engine
from sgrec.model import delta_rule
from sgrec.model.attention import SeqLayout
from sgrec.model.config import ModelConfig
from sgrec.radix.tree import RadixCache
from sgrec.rank.executor import RankExecutor
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs

from test_rank import HEADER, INSTR, ids, make_catalog

DTYPES = ["float32", "auto"]  # auto: bfloat16 where the CPU has avx512_bf16 / AMX


@pytest.fixture(scope="module")
def hybrid_dir(tiny_model_dir):
    return tiny_model_dir("qwen3_5", seed=3)


@pytest.fixture(scope="module")
def hf_hybrid(hybrid_dir):
    from transformers import AutoModelForCausalLM

    made = {}

    def get(dtype: torch.dtype):
        if dtype not in made:
            made[dtype] = AutoModelForCausalLM.from_pretrained(hybrid_dir, dtype=dtype).eval()
        return made[dtype]

    return get


def runner_for(path: str, dtype: str, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, device="cpu", dtype=dtype,
                                  **{"max_total_tokens": 1024, "disable_radix_cache": True, **kw}))


def tolerance(dtype: torch.dtype) -> float:
    """Max |logit difference| from transformers: float32 rounding, or a few bfloat16 steps at the
    logits' scale (about 20 here: a step is 0.125)."""
    return 2e-3 if dtype == torch.float32 else 0.5


# ---- the gated delta rule ---------------------------------------------------------------------------
def rule_inputs(H=3, L=150, dk=16, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, L, dk, generator=g)
    k = torch.randn(H, L, dk, generator=g)
    v = torch.randn(H, L, dv, generator=g)
    decay = -torch.rand(H, L, generator=g) * 0.5
    beta = torch.rand(H, L, generator=g)
    s0 = torch.randn(H, dk, dv, generator=g) * 0.1
    return q, k, v, decay, beta, s0


def test_the_chunked_delta_rule_equals_the_step_by_step_one_and_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)

    q, k, v, decay, beta, s0 = rule_inputs()
    dk = q.shape[-1]
    qn, kn = delta_rule.l2norm(q) * dk**-0.5, delta_rule.l2norm(k)
    out, state = delta_rule.chunked(qn, kn, v, decay, beta, s0)
    steps, s = [], s0[None]
    for t in range(q.shape[1]):
        o, s = delta_rule.step(qn[None, :, t], kn[None, :, t], v[None, :, t], decay[None, :, t], beta[None, :, t], s)
        steps.append(o[0])
    assert torch.allclose(out, torch.stack(steps, 1), atol=1e-5) and torch.allclose(state, s[0], atol=1e-5)
    # transformers' two forms take [batch, L, heads, d] and normalise q and k themselves
    as_hf = dict(query=q.transpose(0, 1)[None], key=k.transpose(0, 1)[None], value=v.transpose(0, 1)[None],
                 g=decay.T[None], beta=beta.T[None], initial_state=s0[None], output_final_state=True,
                 use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = torch_chunk_gated_delta_rule(**as_hf)
    assert torch.allclose(out, ref_out[0].transpose(0, 1), atol=1e-6) and torch.allclose(state, ref_state[0], atol=1e-6)
    ref_out, ref_state = torch_recurrent_gated_delta_rule(**as_hf)
    assert torch.allclose(torch.stack(steps, 1), ref_out[0].transpose(0, 1), atol=1e-5)
    short = delta_rule.chunked(qn[:, :5], kn[:, :5], v[:, :5], decay[:, :5], beta[:, :5], s0)  # padded to a chunk
    assert torch.allclose(short[0], out[:, :5], atol=1e-6)


# ---- the model -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dk,dv", [(16, 16), (128, 128), (24, 40)])
def test_the_decode_step_kernel_equals_the_torch_step_on_the_pools_states_in_place(dk, dv):
    from sgrec.model import native

    g = torch.Generator().manual_seed(dk + dv)
    B, H = 5, 3
    q = delta_rule.l2norm(torch.randn(B, H, dk, generator=g)) * dk**-0.5
    k = delta_rule.l2norm(torch.randn(B, H, dk, generator=g))
    v = torch.randn(B, H, dv, generator=g)
    decay, beta = -torch.rand(B, H, generator=g) * 3, torch.rand(B, H, generator=g)
    pool = torch.randn(12, H, dk, dv, generator=g) * 0.2
    slots = torch.tensor([7, 2, 11, 4, 9])
    untouched, before = pool[[0, 1, 3, 5, 6, 8, 10]].clone(), pool.clone()
    want, want_states = delta_rule.step(q, k, v, decay, beta, pool[slots])
    got = native.gdr_step(q, k, v, decay, beta, pool, slots)
    assert (got - want).abs().max() <= 1e-5 and (pool[slots] - want_states).abs().max() <= 1e-5
    assert torch.equal(pool[[0, 1, 3, 5, 6, 8, 10]], untouched)  # only the slots' rows are written
    alone = native.gdr_step(q[2:3], k[2:3], v[2:3], decay[2:3], beta[2:3], before, slots[2:3])
    assert torch.equal(alone[0], got[2]) and torch.equal(before[11], pool[11])  # a row is the same in any batch


def test_the_decode_step_kernel_reads_a_forks_parent_before_the_parent_updates():
    """A beam step's forks (ForwardBatch.state_sources): a child reads its parent's slot and writes
    its own, in the same call in which the parent steps in place."""
    from sgrec.model import native
    from tests.kernel_refs import gdr_fork_case

    gdr_fork_case(native.gdr_step)
    gdr_fork_case(native.gdr_step, H=3, dk=128, dv=128, seed=1)


@pytest.mark.parametrize("H,L,dk,dv,chunk", [(3, 150, 16, 8, 64), (2, 64, 128, 128, 64), (3, 70, 24, 40, 64),
                                            (2, 1, 16, 16, 64), (2, 97, 32, 48, 16), (1, 33, 20, 17, 7)])
def test_the_chunked_kernel_equals_the_torch_forms_in_every_isa_build(H, L, dk, dv, chunk):
    """native.gdr_sequence (delta.c, the prefill's rule on CPU): the torch chunked form's values and the
    step-by-step form's to float32 rounding, in every ISA build this CPU runs (partial last chunks, dk
    and dv off the vector width, chunks shorter than 64), the input state untouched; a head's result
    is the same bits whatever other heads run beside it."""
    from sgrec.model import native
    from test_native_kernels import isa_builds

    q, k, v, decay, beta, s0 = rule_inputs(H, L, dk, dv, seed=L + dk)
    qn, kn = delta_rule.l2norm(q) * dk**-0.5, delta_rule.l2norm(k)
    want, want_state = delta_rule.chunked(qn, kn, v, decay, beta, s0)
    steps, s = [], s0[None]
    for t in range(L):
        o, s = delta_rule.step(qn[None, :, t], kn[None, :, t], v[None, :, t], decay[None, :, t], beta[None, :, t], s)
        steps.append(o[0])
    before = s0.clone()
    for march in isa_builds():
        lib = native.library(march)
        out, state = native.gdr_sequence(qn, kn, v, decay, beta, s0, chunk, lib)
        assert torch.equal(s0, before)
        assert (out - want).abs().max() <= 2e-6 and (state - want_state).abs().max() <= 2e-6, march
        assert (out - torch.stack(steps, 1)).abs().max() <= 1e-5 and (state - s[0]).abs().max() <= 1e-5, march
        one, one_state = native.gdr_sequence(qn[-1:], kn[-1:], v[-1:], decay[-1:], beta[-1:], s0[-1:], chunk, lib)
        assert torch.equal(one[0], out[-1]) and torch.equal(one_state[0], state[-1])
        for dtype in (torch.float32, torch.bfloat16):  # o written token-major into a strided home, rounded once
            home = torch.zeros(L, H + 1, dv, dtype=dtype)
            got, _ = native.gdr_sequence(qn, kn, v, decay, beta, s0, chunk, lib, out=home[:, 1:])
            assert got.data_ptr() == home[:, 1:].data_ptr() and torch.equal(home[:, 0], torch.zeros(L, dv, dtype=dtype))
            assert torch.equal(home[:, 1:], out.transpose(0, 1).to(dtype)), (march, dtype)
    with pytest.raises(ValueError, match="chunk must be 1..64"):
        native.gdr_sequence(qn, kn, v, decay, beta, s0, 65)
    with pytest.raises(ValueError, match="do not agree"):
        native.gdr_sequence(qn, kn, v, decay, beta, s0[:, :, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hk,Hv,dk,dv,K,L,chunk", [(2, 2, 16, 16, 4, 50, 64), (2, 4, 16, 24, 4, 2, 64),
                                                   (3, 3, 20, 17, 3, 33, 16), (1, 2, 128, 128, 4, 130, 64)])
def test_the_prefill_kernel_equals_the_convolution_heads_and_rule_of_the_torch_path(dtype, Hk, Hv, dk, dv, K, L, chunk):
    """native.gdr_prefill (a sequence's prefill of the layer: convolution, SiLU, q/k normalisation and
    the chunked rule in one kernel) against GatedDeltaNet's torch path (_convolve, _heads_first, then
    delta_rule.chunked) on strided projection rows, in every ISA build: float32 rounding (the norms and
    the rule sum in other orders); value heads sharing a key head (Hv > Hk), sequences shorter than the
    window, partial chunks, dk and dv off the vector width; o written token-major into a strided home,
    rounded once; the input state untouched."""
    from types import SimpleNamespace

    from sgrec.model import native
    from sgrec.model.qwen3_5 import GatedDeltaNet
    from test_native_kernels import isa_builds

    gen = torch.Generator().manual_seed(L + dk)
    C = 2 * Hk * dk + Hv * dv
    layer = SimpleNamespace(key_size=Hk * dk, value_size=Hv * dv, k_heads=Hk, v_heads=Hv, k_dim=dk, v_dim=dv,
                            kernel=K, conv_dim=C, conv_weight=torch.nn.Parameter(torch.randn(C, K, generator=gen).to(dtype)))
    x = torch.randn(L, C + 7, generator=gen).to(dtype)[:, :C]  # rows of the projection: strided
    window = torch.randn(1, C, K - 1, generator=gen).to(dtype)
    decay, beta = -torch.rand(Hv, L, generator=gen) * 0.5, torch.rand(Hv, L, generator=gen)
    s0 = torch.randn(Hv, dk, dv, generator=gen) * 0.1
    conv, _ = GatedDeltaNet._convolve(layer, x.T[None], window)
    want, want_state = delta_rule.chunked(*GatedDeltaNet._heads_first(layer, conv[0]), decay, beta, s0)
    before = s0.clone()
    for march in isa_builds():
        lib = native.library(march)
        got, state = native.gdr_prefill(x, window[0], layer.conv_weight, Hk, Hv, dk, dv, decay, beta, s0, chunk, lib)
        assert torch.equal(s0, before)
        assert (got - want).abs().max() <= 1e-5 and (state - want_state).abs().max() <= 1e-5, march
        for out_dtype in (torch.float32, torch.bfloat16):
            home = torch.zeros(L, Hv + 1, dv, dtype=out_dtype)
            o, _ = native.gdr_prefill(x, window[0], layer.conv_weight, Hk, Hv, dk, dv, decay, beta, s0, chunk, lib,
                                      out=home[:, 1:])
            assert o.data_ptr() == home[:, 1:].data_ptr() and not home[:, 0].any()
            assert torch.equal(home[:, 1:], got.transpose(0, 1).to(out_dtype)), (march, out_dtype)
    with pytest.raises(ValueError, match="do not fit"):
        native.gdr_prefill(x, window[0], layer.conv_weight, Hk, Hv, dk + 1, dv, decay, beta, s0)
    with pytest.raises(ValueError, match="do not fit"):
        native.gdr_prefill(x, window[0], layer.conv_weight, Hk, Hv, dk, dv, decay[:, 1:], beta, s0)


def test_a_runner_forwards_with_denormals_flushed_and_restores_the_mode_after(hybrid_dir):
    """The delta rule's decays underflow into denormal floats, tens of times slower on x86: a hybrid
    runner's forward runs with its calling thread's OpenMP team flushing them to zero, and leaves the
    mode as it found it (nothing else in the process sees it: a denormal parsed or printed after a
    forward keeps its value)."""
    import json
    import threading

    runner = runner_for(hybrid_dir, "float32")
    tiny = torch.full((1 << 20,), 1e-20)  # squared: 1e-40, a denormal; large enough to run on every thread
    seen = {}
    def inside(*_):  # runs at the end of the model's forward (returns None: the output stays)
        seen.setdefault("inside", int((tiny * tiny != 0).sum()))

    hook = runner.model.register_forward_hook(inside)

    def work():
        seen["before"] = int((tiny * tiny != 0).sum())
        prefill(runner, ids(8, seed=1), runner.memory.states.alloc(1), torch.empty(0, dtype=torch.int64))
        seen["after"] = int((tiny * tiny != 0).sum())
        seen["json"] = json.dumps(5e-324)

    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        hook.remove()
    assert seen == {"before": tiny.numel(), "inside": 0, "after": tiny.numel(), "json": "5e-324"}


def test_the_config_names_its_layers_and_states(hybrid_dir):
    cfg = ModelConfig.from_dir(hybrid_dir)
    runner = runner_for(hybrid_dir, "float32")
    caps = runner.capabilities
    assert (cfg.family, cfg.arch) == ("hybrid", "qwen3_5")
    assert caps.layer_kinds == ("recurrent", "recurrent", "recurrent", "attention")
    assert runner.memory.kv_layers == [None, None, None, 0] and runner.memory.kv.num_layers == 1
    conv_dim = 2 * 2 * 16 + 4 * 16  # q and k (2 heads of 16), v (4 heads of 16)
    assert caps.state_shapes[0] == {"conv": (conv_dim, 3), "ssm": (4, 16, 16)}
    ssm = runner.memory.states.buffers[0]["ssm"]
    assert ssm.dtype == torch.float32 and runner.memory.states.size == runner.args.max_running_requests
    assert runner.memory.bytes_per_state == 3 * (conv_dim * 3 * 4 + 4 * 16 * 16 * 4)
    assert caps.prefix_reuse == "snapshot" and caps.layouts == {"user"} and caps.rank_forks and caps.staged_beams


def test_an_unsupported_layer_kind_is_refused_naming_the_field(hybrid_dir, tmp_path):
    import shutil

    bad = shutil.copytree(hybrid_dir, tmp_path / "bad")
    with open(bad / "config.json") as f:
        cfg = json.load(f)
    cfg["layer_types"][0] = "sliding_attention"
    with open(bad / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"Unsupported layer_types \['sliding_attention'\]"):
        ModelConfig.from_dir(str(bad))


def test_the_text_model_of_a_multimodal_checkpoint_loads(hybrid_dir, tmp_path):
    """Qwen3_5ForConditionalGeneration: the text model's fields under text_config, its weights under
    model.language_model; the vision tower's weights are left unread."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    with open(os.path.join(hybrid_dir, "config.json")) as f:
        text = {k: v for k, v in json.load(f).items() if k not in ("architectures", "model_type", "dtype",
                                                                     "transformers_version")}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1)
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    path = str(tmp_path / "multimodal")
    hf.save_pretrained(path)
    runner = runner_for(path, "float32")
    prompt = ids(20, seed=9)
    logits, _ = prefill(runner, prompt, runner.memory.states.alloc(1), torch.empty(0, dtype=torch.int64))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0].float()
    assert runner.family.name == "hybrid" and (logits - ref).abs().max() <= tolerance(torch.float32)


def prefill(runner, tokens, state, kv, start=0):
    """Forward tokens after `start` cached ones (KV `kv`, state slot `state`); returns (logits of
    every new token, the KV now)."""
    slots = runner.memory.allocator.alloc(len(tokens))
    kv = torch.cat([kv, slots])
    batch = runner.make_batch(tokens, list(range(start, start + len(tokens))), slots,
                              [SeqLayout(0, len(tokens), kv)], [state])
    return runner.forward(batch, list(range(len(tokens)))), kv


def packed(runner, prompts):
    """The prompts as one flat batch's parts: (tokens, positions from 0, fresh KV slots, the layouts)."""
    slots = runner.memory.allocator.alloc(sum(map(len, prompts)))
    seqs, toks, pos, a = [], [], [], 0
    for p in prompts:
        seqs.append(SeqLayout(a, len(p), slots[a : a + len(p)]))
        toks += p
        pos += range(len(p))
        a += len(p)
    return toks, pos, slots, seqs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["native", "torch"])  # the decode step: native's C kernel, or torch's form
def test_prefill_chunks_and_decode_steps_match_transformers(hybrid_dir, hf_hybrid, dtype, backend):
    runner = runner_for(hybrid_dir, dtype, attention_backend=backend)
    assert (getattr(runner.model.layers[0].linear_attn.glue, "gdr_step", None) is not None) == (backend == "native")
    hf = hf_hybrid(runner.dtype)
    prompt = ids(100, seed=1)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        cache, ref = out.past_key_values, [out.logits[0].float()]
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(7):
            step = hf(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            ref.append(step.logits[0].float())
            tokens.append(int(step.logits[0, -1].argmax()))
    tol = tolerance(runner.dtype)
    # the whole prompt at once
    state = runner.memory.states.alloc(1)
    whole, _ = prefill(runner, prompt, state, torch.empty(0, dtype=torch.int64))
    assert (whole - ref[0]).abs().max() <= tol
    # in two chunks, the second resumed from the first's state and KV; then the decode steps
    state = runner.memory.states.alloc(1)
    first, kv = prefill(runner, prompt[:60], state, torch.empty(0, dtype=torch.int64))
    second, kv = prefill(runner, prompt[60:], state, kv, start=60)
    assert (torch.cat([first, second]) - ref[0]).abs().max() <= tol
    got = []
    for t, token in enumerate(tokens[:-1]):
        logits, kv = prefill(runner, [token], state, kv, start=100 + t)
        got.append(logits)
    assert max((g - r).abs().max() for g, r in zip(got, ref[1:])) <= tol
    assert [int(g.argmax()) for g in got] == tokens[1:]


def test_short_and_long_sequences_of_one_batch_match_transformers(hybrid_dir, hf_hybrid):
    """Sequences of up to STEPWISE_MAX tokens run the rule's step form token by token (all of them at
    once), longer ones the chunked form: every row of both equals transformers'."""
    from sgrec.model.qwen3_5 import STEPWISE_MAX

    runner = runner_for(hybrid_dir, "float32")
    hf = hf_hybrid(torch.float32)
    prompts = [ids(n, seed=n) for n in (2, 9, STEPWISE_MAX, STEPWISE_MAX + 1, 40)]
    toks, pos, slots, seqs = packed(runner, prompts)
    states = [runner.memory.states.alloc(1) for _ in prompts]
    logits = runner.forward(runner.make_batch(toks, pos, slots, seqs, states), list(range(len(toks))))
    a = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        assert (logits[a : a + len(p)] - ref).abs().max() <= tolerance(torch.float32), len(p)
        a += len(p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_the_hidden_states_of_some_rows_equal_those_rows_of_the_whole_forward(tiny_model_dir, family, dtype):
    """ModelRunner.hidden asks the model for its rows only (the hybrid family's last layer then
    projects and runs the MLP of those rows alone): the same numbers as those rows of the whole
    forward (within float32 rounding, or a bfloat16 step at the scale of the hidden states: the
    matrix products run on fewer rows), and every sequence's state still left as the whole forward
    leaves it."""
    runner = runner_for(tiny_model_dir(family, seed=3), dtype)
    prompts = [ids(n, seed=n) for n in (23, 40)]
    toks, pos, slots, seqs = packed(runner, prompts)
    T = len(toks)
    recurrent = bool(runner.capabilities.state_shapes)
    states = ([runner.memory.states.alloc(1) for _ in prompts] for _ in range(2)) if recurrent else ([None] * 2, [None] * 2)
    some, every = states
    rows = [0, 22, 23, T - 1]
    got = runner.hidden(runner.make_batch(toks, pos, slots, seqs, *([some] if recurrent else [])), rows)
    with runner._fp_mode():
        whole = runner.model(runner.make_batch(toks, pos, slots, seqs, *([every] if recurrent else [])), runner.backend)
    want = whole[torch.tensor(rows)]
    bound = 1e-5 if runner.dtype == torch.float32 else 2**-7
    assert got.shape == want.shape and (got.float() - want.float()).abs().max() <= bound * want.float().abs().max()
    if recurrent:  # each run left its states, the same
        for parts in runner.memory.states.buffers.values():
            for part in parts.values():
                for x, y in zip(some, every):
                    assert torch.allclose(part[x].float(), part[y].float(), atol=1e-5 if runner.dtype == torch.float32
                                          else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hybrid_prefilling_carries_each_state_across_its_chunks(hybrid_dir, dtype):
    """Prefill-only forwards in chunks of 16 tokens (sequences cut across chunks, one shorter than a
    chunk) give the whole forward's last logits and leave the same final states; a batch that keeps
    no state runs on temporary zero states."""
    runner = runner_for(hybrid_dir, dtype, hybrid_chunk_size=16)
    assert runner.capabilities.hybrid_prefill
    prompts = [ids(n, seed=n) for n in (37, 5, 60)]
    toks, pos, slots, seqs = packed(runner, prompts)
    rows = [s.q_start + s.q_len - 1 for s in seqs]
    chunked, whole = ([runner.memory.states.alloc(1) for _ in prompts] for _ in range(2))
    got = runner.forward_prefill_only(runner.make_batch(toks, pos, slots, seqs, chunked), rows)
    want = runner.forward(runner.make_batch(toks, pos, slots, seqs, whole), rows)
    bound = tolerance(runner.dtype) if runner.dtype == torch.float32 else tolerance(runner.dtype) / 4
    assert (got - want).abs().max() <= bound  # the rule's chunks and steps split differently: rounding
    for parts in runner.memory.states.buffers.values():
        for part in parts.values():
            for c, w in zip(chunked, whole):
                assert torch.allclose(part[c].float(), part[w].float(), atol=1e-3 if runner.dtype == torch.float32
                                      else 2e-2)
    free = runner.memory.states.available_size()
    stateless = runner.forward_prefill_only(runner.make_batch(toks, pos, slots, seqs), rows)
    assert (stateless - want).abs().max() <= bound
    assert runner.memory.states.available_size() == free


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_batch_gives_each_sequence_what_it_gets_alone(hybrid_dir, dtype):
    runner = runner_for(hybrid_dir, dtype)
    prompts = [ids(n, seed=n) for n in (5, 33, 70)]
    states, kvs, nexts = [], [], []
    for p in prompts:
        s = runner.memory.states.alloc(1)
        logits, kv = prefill(runner, p, s, torch.empty(0, dtype=torch.int64))
        states.append(s), kvs.append(kv), nexts.append(int(logits[-1].argmax()))
    alone_states = [runner.memory.states.fork(s) for s in states]  # the same states, for the one-by-one run
    slots = runner.memory.allocator.alloc(len(prompts))
    seqs = [SeqLayout(i, 1, torch.cat([kv, slots[i : i + 1]])) for i, kv in enumerate(kvs)]
    batched = runner.forward(runner.make_batch(nexts, [len(p) for p in prompts], slots, seqs, states), [0, 1, 2])
    for i, p in enumerate(prompts):
        alone, _ = prefill(runner, [nexts[i]], alone_states[i], kvs[i], start=len(p))
        assert (alone[0] - batched[i]).abs().max() <= tolerance(runner.dtype) / 4
        for name in ("conv", "ssm"):  # the state each leaves behind
            part = runner.memory.states.buffers[0][name]
            assert torch.allclose(part[states[i]].float(), part[alone_states[i]].float(), atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_engine_generates_transformers_greedy_tokens(hybrid_dir, hf_hybrid, dtype):
    """Several requests at once, prompts longer than a prefill chunk: every request's state is
    carried across its chunks and its decode steps, and given back when it is done."""
    engine = Engine(hybrid_dir, device="cpu", dtype=dtype, max_total_tokens=1024, disable_radix_cache=True,
                    chunked_prefill_size=32)
    try:
        hf = hf_hybrid(engine.runner.dtype)
        prompts = [ids(n, seed=10 + n) for n in (3, 40, 77)]
        out = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                  "ignore_eos": True})
        for p, o in zip(prompts, out):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)[0, len(p):].tolist()
            assert o["output_ids"] == ref
        states = engine.runner.memory.states
        assert states.available_size() == states.size
        engine.check_memory()
    finally:
        engine.shutdown()


# ---- prefix caching from state snapshots ---------------------------------------------------------
def generate(engine, prompt, n=6):
    out = engine.generate(input_ids=prompt, return_logprob=True,
                          sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
    return out["output_ids"], [lp[0] for lp in out["meta_info"]["output_token_logprobs"]], out["meta_info"]


def cold_numbers(warm, got, ref) -> None:
    """A resumed run's (tokens, logprobs) against a cold run's: the first token and its logprob within
    rounding, all of them in float32; the warm engine's memory balanced, its states all accounted."""
    tol = tolerance(warm.runner.dtype)
    assert got[0][0] == ref[0][0] and abs(got[1][0] - ref[1][0]) <= tol
    if warm.runner.dtype == torch.float32:
        assert got[0] == ref[0] and max(abs(a - b) for a, b in zip(got[1], ref[1])) <= tol
    warm.check_memory()
    states = warm.runner.memory.states
    assert states.available_size() + warm.scheduler.tree.state_count == states.size


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_returning_prompt_resumes_from_a_snapshot_with_a_cold_runs_numbers(hybrid_dir, dtype):
    """A second turn (the first prompt, its answer, a new message) matches the first request's
    snapshot, kept where its KV ends, and computes only what follows it; its tokens and logprobs
    are a cold run's (no cache) within rounding."""
    kw = dict(device="cpu", dtype=dtype, max_total_tokens=2048, chunked_prefill_size=32)
    warm, cold = Engine(hybrid_dir, **kw), Engine(hybrid_dir, disable_radix_cache=True, **kw)
    try:
        first = ids(70, seed=21)
        answer, _, meta = generate(warm, first)
        assert meta["cached_tokens"] == 0 and warm.scheduler.tree.state_count >= 3  # chunk ends and the finish
        second = first + answer + ids(20, seed=22)
        got, got_lp, meta = generate(warm, second)
        ref, ref_lp, _ = generate(cold, second)
        # the first request's KV ends before its last sampled token: its snapshot is there
        assert meta["cached_tokens"] == len(first) + len(answer) - 1
        cold_numbers(warm, (got, got_lp), (ref, ref_lp))
    finally:
        warm.shutdown()
        cold.shutdown()


def test_snapshots_make_room_for_running_requests_in_one_state_budget(hybrid_dir):
    """Three state slots, two requests at a time: snapshots are evicted (least recently used first)
    whenever a request needs a slot, and every answer is the cold run's."""
    kw = dict(device="cpu", dtype="float32", max_total_tokens=2048, chunked_prefill_size=32, max_running_requests=2)
    warm = Engine(hybrid_dir, max_mamba_cache_size=3, **kw)
    cold = Engine(hybrid_dir, disable_radix_cache=True, **kw)
    try:
        assert warm.runner.memory.states.size == 3 and cold.runner.memory.states.size == 2
        prompts = [ids(40 + 7 * i, seed=30 + i) for i in range(5)]
        prompts.append(prompts[0] + ids(5, seed=40))  # may find its prefix, or find it evicted
        params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        got = warm.generate(input_ids=prompts, sampling_params=params)
        ref = cold.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in got] == [o["output_ids"] for o in ref]
        warm.check_memory()
        assert warm.scheduler.tree.state_count <= 3
    finally:
        warm.shutdown()
        cold.shutdown()


# ---- the host tier: snapshots go down with their KV ------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_snapshot_evicted_to_the_host_tier_resumes_with_a_cold_runs_numbers(hybrid_dir, dtype):
    """With --enable-hierarchical-cache, an evicted node's snapshot goes to the host tier with its
    pages (the tokens past the last full page in the snapshot itself); a returning prompt whose
    prefix left the pool loads the pages and the deepest snapshot back and computes only what
    follows, with a cold run's numbers."""
    kw = dict(device="cpu", dtype=dtype, max_total_tokens=1024, chunked_prefill_size=32)
    warm = Engine(hybrid_dir, enable_hierarchical_cache=True, hicache_page_size=16, hicache_ratio=8.0, **kw)
    cold = Engine(hybrid_dir, disable_radix_cache=True, **kw)
    try:
        first = ids(70, seed=21)
        answer, _, _ = generate(warm, first)
        tree, hicache = warm.scheduler.tree, warm.scheduler.hicache
        saved = tree.state_count
        assert saved >= 3  # the chunks' ends (32, 64) and the finish (75)
        tree.evict(tree.evictable_size())  # every node leaves the pool: pages and snapshots to the host tier
        second = first + answer + ids(20, seed=22)
        assert tree.peek_prefix_len(second) == 0 and tree.state_count == 0
        assert hicache.stats()["snapshots"]["held"] == saved
        got, got_lp, meta = generate(warm, second)
        ref, ref_lp, _ = generate(cold, second)
        # pages 0..63 and the finish's snapshot (tail 64..74, state after token 74) came back
        assert meta["cached_tokens"] == len(first) + len(answer) - 1
        assert hicache.snapshot_counts["loaded"] == 1 and hicache.loaded_tokens["host"] == meta["cached_tokens"]
        cold_numbers(warm, (got, got_lp), (ref, ref_lp))
    finally:
        warm.shutdown()
        cold.shutdown()


def test_the_host_tiers_snapshots_are_bit_exact_and_weigh_their_bytes(hybrid_dir):
    """A snapshot loaded back is the state and KV it replaces, bit for bit: the same prompt resumed
    from the pool and from the host tier gives identical logprobs. Its weight in the host tier is
    its bytes in pages, and it leaves the tier (and the index) as pages do, least recent first."""
    kw = dict(device="cpu", dtype="float32", max_total_tokens=1024, chunked_prefill_size=32)
    eng = Engine(hybrid_dir, enable_hierarchical_cache=True, hicache_page_size=16, hicache_ratio=8.0, **kw)
    try:
        first = ids(50, seed=31)
        answer, _, _ = generate(eng, first)
        second = first + answer + ids(9, seed=32)
        from_pool = generate(eng, second)
        tree, hicache = eng.scheduler.tree, eng.scheduler.hicache
        tree.evict(tree.evictable_size())  # every node to the host tier, the snapshots with them
        from_host = generate(eng, second)  # the same snapshot as from_pool's (the first's finish), loaded back
        assert from_host[0] == from_pool[0] and from_host[1] == from_pool[1]  # bit for bit
        assert from_host[2]["cached_tokens"] == from_pool[2]["cached_tokens"] and hicache.snapshot_counts["loaded"]
        held = hicache.host
        page_bytes = hicache.like(16).nbytes
        weights = [w for w in held.weights.values()]
        state_bytes = eng.runner.memory.states.bytes_per_state
        assert weights and all(w >= -(-state_bytes // page_bytes) for w in weights)
        assert held.used == len(held) - len(held.weights) + sum(weights) <= held.capacity
        eng.check_memory()
    finally:
        eng.shutdown()


def test_the_storage_tier_is_refused_by_name(hybrid_dir, tmp_path):
    with pytest.raises(ValueError, match="--hicache-storage-backend: the storage tier keeps KV pages, not the "
                                         "hybrid family's state snapshots"):
        Engine(hybrid_dir, device="cpu", dtype="float32", max_total_tokens=256, enable_hierarchical_cache=True,
               hicache_storage_backend="file", hicache_storage_backend_extra_config=f'{{"file_storage_path": "{tmp_path}"}}')


# ---- rank: user-as-prefix, a state fork per candidate ---------------------------------------------
def ranker(runner, catalog: Catalog) -> RankExecutor:
    tree = RadixCache(runner.memory.allocator, states=runner.memory.states)
    return RankExecutor(runner, tree, catalog, runner.args, header_ids=HEADER)


def sid_items(n: int, seed: int) -> Catalog:
    """Candidates with item tokens, an id token and a semantic ID each."""
    rng = random.Random(seed)
    paths = sid_catalog(n, seed).items
    return Catalog([Item(f"c{k}", tuple(rng.randrange(3, 500) for _ in range(rng.randint(1, 5))),
                         rng.randrange(3, 500), p.semantic_id) for k, p in enumerate(paths)])


def forked_reference(hf, user: list[int], items, by_path: bool) -> dict[str, float]:
    """Each candidate scored on its own prompt [user, item tokens, instruction] by transformers: the
    last logit at its id token (then a softmax over the candidates), or its path's log-likelihood."""
    out = {}
    with torch.no_grad():
        for it in items:
            prompt = user + list(it.token_ids) + INSTR
            if by_path:
                seq = prompt + list(it.semantic_id)
                lp = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)
                out[it.id] = sum(float(lp[len(prompt) - 1 + k, t]) for k, t in enumerate(it.semantic_id))
            else:
                out[it.id] = float(hf(torch.tensor([prompt])).logits[0, -1, it.id_token].float())
    if not by_path:
        probs = torch.softmax(torch.tensor(list(out.values()), dtype=torch.float64), 0)
        out = dict(zip(out, probs.tolist()))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("score_by", ["id_token", "semantic_id"])
def test_rank_scores_each_candidate_on_its_own_fork_with_transformers_numbers(hybrid_dir, hf_hybrid, dtype,
                                                                              score_by):
    runner = runner_for(hybrid_dir, dtype, max_mamba_cache_size=40)
    ex = ranker(runner, sid_items(12, seed=5))
    user, cands = ids(31, seed=6), [f"c{k}" for k in (7, 2, 9, 0, 4, 11, 5)]
    out = ex.run("u", user, cands, INSTR, prefix="user", score_by=score_by)
    key = "log_likelihood" if score_by == "semantic_id" else "score"
    got = {r["item"]: r[key] for r in out["ranking"]}
    want = forked_reference(hf_hybrid(runner.dtype), user, ex.catalog.lookup(cands), score_by == "semantic_id")
    bf16 = runner.dtype == torch.bfloat16
    tol = (0.5 if bf16 else 2e-3) if score_by == "semantic_id" else (0.05 if bf16 else 1e-4)
    assert sorted(got) == sorted(cands) and max(abs(got[c] - want[c]) for c in cands) <= tol
    meta = out["meta_info"]
    assert meta["prefix"] == "user" and meta["cached_tokens"] == 0
    assert meta["prompt_tokens"] == len(user) + sum(len(it.token_ids) + len(INSTR) for it in ex.catalog.lookup(cands))
    # candidates never read one another: the caller's order changes no bit
    again = ex.run("u2", user, cands[::-1], INSTR, prefix="none", score_by=score_by)
    assert {r["item"]: r[key] for r in again["ranking"]} == got and again["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_returning_user_resumes_rank_from_its_snapshot(hybrid_dir, dtype):
    warm = ranker(runner_for(hybrid_dir, dtype, max_mamba_cache_size=40), sid_items(12, seed=5))
    cold = ranker(runner_for(hybrid_dir, dtype, max_mamba_cache_size=40), sid_items(12, seed=5))
    user, cands = ids(40, seed=7), [f"c{k}" for k in range(10)]
    warm.run("u", user, cands, INSTR)
    longer = user + ids(4, seed=8)
    got = warm.run("u", longer, cands, INSTR)
    ref = cold.run("u", longer, cands, INSTR, prefix="none")
    assert got["meta_info"]["cached_tokens"] == len(user) and ref["meta_info"]["cached_tokens"] == 0
    tol = 1e-5 if warm.runner.dtype == torch.float32 else 0.02
    want = {r["item"]: r["score"] for r in ref["ranking"]}
    assert max(abs(r["score"] - want[r["item"]]) for r in got["ranking"]) <= tol
    states = warm.runner.memory.states
    assert states.available_size() + warm.tree.state_count == states.size and warm.tree.state_count == 2
    assert warm.runner.memory.allocator.available_size() + warm.tree.total_size() == warm.runner.memory.size


def test_rank_refuses_item_as_prefix_and_more_candidates_than_state_slots(hybrid_dir):
    from sgrec.rank.executor import RankCapacityError

    runner = runner_for(hybrid_dir, "float32", max_mamba_cache_size=6)
    ex = ranker(runner, sid_items(12, seed=5))
    assert ex.precompute() == 0  # no item KV: a recurrent family never reads it
    with pytest.raises(ValueError, match="prefix 'item' needs the item-as-prefix layout, which the hybrid family "
                                         "does not run"):
        ex.run("u", ids(5, 1), ["c1", "c2"], INSTR, prefix="item")
    with pytest.raises(RankCapacityError,
                       match=r"needs 9 state slots \(one a candidate and the user.s\).*--max-mamba-cache-size"):
        ex.run("u", ids(5, 1), [f"c{k}" for k in range(8)], INSTR)
    states = runner.memory.states
    assert states.available_size() + ex.tree.state_count == states.size
    assert runner.memory.allocator.available_size() + ex.tree.total_size() == runner.memory.size
    assert len(ex.run("u", ids(5, 1), [f"c{k}" for k in range(5)], INSTR)["ranking"]) == 5  # what fits is served


# ---- retrieve: xBeam with a state a beam -------------------------------------------------------------
def sid_catalog(n: int, seed: int, fan=(4, 5, 40)) -> Catalog:
    rng = random.Random(seed)
    paths = set()
    while len(paths) < n:
        paths.add(tuple(3 + rng.randrange(f) for f in fan))
    return Catalog([Item(f"s{i}", (1,), 1, p) for i, p in enumerate(sorted(paths))])


def retriever(runner, cache: bool = True) -> RetrieveExecutor:
    tree = RadixCache(runner.memory.allocator, disable=not cache, states=runner.memory.states)
    return RetrieveExecutor(runner, tree, sid_catalog(60, seed=2))


def states_accounted(ex: RetrieveExecutor) -> bool:
    states = ex.runner.memory.states
    return states.available_size() + ex.tree.state_count == states.size


def exhaustive_scores(hf, catalog: Catalog, prompt: list[int]) -> dict[str, float]:
    """Every item's summed log-probability under transformers' logits, each level normalised over the
    valid children of the path so far (what retrieve documents): the whole catalog scored."""
    paths = {tuple(it.semantic_id): it.id for it in catalog.items}
    depth = len(next(iter(paths)))
    children: dict[tuple, list[int]] = {}
    for p in paths:
        for d in range(depth):
            children.setdefault(p[:d], []).append(p[d])
    logp: dict[tuple, dict[int, float]] = {}
    for d in range(depth):
        prefixes = sorted({p[:d] for p in paths})
        with torch.no_grad():
            last = hf(torch.tensor([prompt + list(q) for q in prefixes])).logits[:, -1].float()
        for q, row in zip(prefixes, last):
            kids = sorted(set(children[q]))
            lp = torch.log_softmax(row[kids], -1)
            logp[q] = dict(zip(kids, lp.tolist()))
    return {item: sum(logp[p[:d]][p[d]] for d in range(depth)) for p, item in paths.items()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_retrieve_over_the_whole_catalog_gives_transformers_scores(hybrid_dir, hf_hybrid, dtype):
    """Beams wide enough to keep every path: every item comes back with its exhaustive score under
    transformers' logits in the same dtype, best first (float32: rounding; bfloat16: a few steps of
    each level's logits; transformers' own bfloat16 and float32 scores differ by about 2 here)."""
    runner = runner_for(hybrid_dir, dtype, max_mamba_cache_size=80)
    ex = retriever(runner)
    prompt = ids(37, seed=11)
    want = exhaustive_scores(hf_hybrid(runner.dtype), ex.catalog, prompt)
    got = ex.run(prompt, beam_width=64, top_k=64, num_items=60)
    tol = 2e-3 if runner.dtype == torch.float32 else 0.3
    assert sorted(it["item"] for it in got.items) == sorted(want)
    assert max(abs(it["score"] - want[it["item"]]) for it in got.items) <= tol
    scores = [it["score"] for it in got.items]
    assert scores == sorted(scores, reverse=True)
    assert states_accounted(ex) and ex.tree.state_count == 1  # the prompt's snapshot


@pytest.mark.parametrize("bw,top_k", [(4, 2), (16, 16), (32, 5)])
def test_retrieve_equals_the_naive_beam_search_with_states_copied_per_beam(hybrid_dir, bw, top_k):
    from sgrec.beam.reference import naive_retrieve

    runner = runner_for(hybrid_dir, "float32", max_total_tokens=4096, max_mamba_cache_size=80)
    ex = retriever(runner, cache=False)
    prompt = ids(29, seed=bw)
    got = ex.run(prompt, beam_width=bw, top_k=top_k, num_items=bw // 2)
    ref = naive_retrieve(runner, ex.catalog, prompt, bw, top_k, bw // 2)
    assert [it["item"] for it in got.items] == [it["item"] for it in ref.items]
    assert [it["semantic_id"] for it in got.items] == [it["semantic_id"] for it in ref.items]
    assert max(abs(a["score"] - b["score"]) for a, b in zip(got.items, ref.items)) <= 1e-5
    assert states_accounted(ex) and runner.memory.allocator.available_size() == runner.memory.size


def test_excluded_items_are_the_catalog_without_them(hybrid_dir):
    from sgrec.beam.reference import naive_retrieve

    runner = runner_for(hybrid_dir, "float32", max_total_tokens=4096, max_mamba_cache_size=80)
    ex = retriever(runner, cache=False)
    prompt = ids(21, seed=4)
    first = [it["item"] for it in ex.run(prompt, beam_width=8, top_k=8, num_items=8).items]
    drop = set(first[:3])
    got = ex.run(prompt, beam_width=8, top_k=8, num_items=8, exclude_items=sorted(drop))
    rest = Catalog([it for it in ex.catalog.items if it.id not in drop])
    ref = naive_retrieve(runner, rest, prompt, 8, 8, 8)
    assert not drop & {it["item"] for it in got.items}
    assert [it["item"] for it in got.items] == [it["item"] for it in ref.items]
    assert max(abs(a["score"] - b["score"]) for a, b in zip(got.items, ref.items)) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_returning_users_retrieve_resumes_from_the_prompts_snapshot(hybrid_dir, dtype):
    """The first prompt's state is kept at its end; the user's longer prompt resumes from it and gets
    a cold run's items and scores (the resumed state is the cold one's to float32 rounding)."""
    warm = retriever(runner_for(hybrid_dir, dtype, max_total_tokens=4096, max_mamba_cache_size=80))
    cold = retriever(runner_for(hybrid_dir, dtype, max_total_tokens=4096, max_mamba_cache_size=80), cache=False)
    history = ids(40, seed=8)
    warm.run(history, beam_width=16, top_k=16, num_items=8)
    again = history + ids(6, seed=9)
    got = warm.run(again, beam_width=16, top_k=16, num_items=8)
    ref = cold.run(again, beam_width=16, top_k=16, num_items=8)
    assert got.meta["cached_tokens"] == len(history) and ref.meta["cached_tokens"] == 0
    # the resumed run reads the 6 new tokens in the rule's step form, the cold one all 46 in its chunked
    # form: float32 rounds the two orders apart (1.6e-4 on a path's 3 summed logprobs on a Zen CPU),
    # within the bound of the second turn's resume above
    tol = tolerance(torch.float32) if warm.runner.dtype == torch.float32 else 0.1
    assert [it["item"] for it in got.items] == [it["item"] for it in ref.items]
    assert max(abs(a["score"] - b["score"]) for a, b in zip(got.items, ref.items)) <= tol
    assert states_accounted(warm) and warm.tree.state_count == 2


def test_beam_reorders_copy_no_state_and_forks_read_their_parents_once():
    """BeamStates (sgrec.beam.attention): a reorder renames slots, a parent's first child keeps the
    parent's slot and each further child gets a slot no kept beam needs, with the parent's slot as
    its source for the next step; the slots stay the request's set; a step that reads each row from
    its source and writes its own (forks first, as the kernels do) leaves every row with its
    parent's state; a second reorder before any step copies the pending forks first."""
    from sgrec.beam.attention import BeamStates
    from sgrec.mem.memory import StatePool

    pool = StatePool(12, {0: {"ssm": (2,)}}, torch.float32, float32=frozenset({"ssm"}))
    copied = []
    real = pool.copy_pairs_
    pool.copy_pairs_ = lambda pairs, layers=None: (copied.extend(pairs), real(pairs, layers))
    slots = pool.take(6)
    beams = BeamStates(pool, slots)
    ssm = pool.buffers[0]["ssm"]
    ssm[slots] = torch.arange(6.0)[:, None].expand(6, 2).clone()  # row i's state: "i"
    held = list(range(6))  # what each row should hold, by original row name

    def step():  # the kernels' read-from-source, write-own (forks first), then the rows' own update
        n = len(held)
        src, dst = beams.step_sources(n).tolist(), beams.slots[:n].tolist()
        for d, s_ in sorted(zip(dst, src), key=lambda ds: ds[0] == ds[1]):
            ssm[d] = ssm[s_]
        beams.consumed()

    rng = random.Random(0)
    for level in range(6):
        n = len(held)
        m = rng.randint(1, 6)
        parents = sorted(rng.randrange(n) for _ in range(m)) if level else [0] * m
        copied.clear()
        beams.reorder_(torch.tensor(parents))
        held = [held[p] for p in parents]
        assert sorted(beams.slots.tolist()) == sorted(slots.tolist())  # a permutation of the request's slots
        assert copied == []  # no copies: forks are read by the step
        forks = beams.step_sources(m) != beams.slots[:m]
        assert int(forks.sum()) == m - len(set(parents))
        if level == 3:  # a reorder with no step since: the forks are copied first, then renamed again
            beams.reorder_(torch.arange(m))
            assert len(copied) == m - len(set(parents)) and beams.sources is None
        else:
            step()
        assert ssm[beams.slots[:m]][:, 0].tolist() == [float(h) for h in held]


def test_beams_beyond_the_state_pool_are_a_clear_error(hybrid_dir):
    from sgrec.beam import KVCacheFullError

    ex = retriever(runner_for(hybrid_dir, "float32", max_mamba_cache_size=6))
    with pytest.raises(KVCacheFullError, match=r"retrieve needs 8 state slots \(one a beam\).*--max-mamba-cache-size"):
        ex.run(ids(12, seed=1), beam_width=8, top_k=8, num_items=4)
    assert states_accounted(ex)
    assert len(ex.run(ids(12, seed=1), beam_width=6, top_k=6, num_items=4).items) == 4  # what fits is served


# ---- a real server ---------------------------------------------------------------------------------
def test_a_server_answers_generate_the_openai_routes_and_score_with_transformers_numbers(
        start_server, hybrid_dir, hf_hybrid):
    import openai

    srv = start_server(hybrid_dir, "--disable-radix-cache", "--max-total-tokens", "2048",
                       "--chunked-prefill-size", "32")
    hf = hf_hybrid(torch.float32)
    prompt = ids(45, seed=5)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
        ref_lp = torch.log_softmax(hf(torch.tensor([ref])).logits[0].float(), -1)
    ref_out = ref[len(prompt):]
    r = srv.client.post("/generate", json={"input_ids": prompt, "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                               "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == ref_out
    for t, (lp, token, *_) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert token == ref_out[t] and abs(lp - float(ref_lp[len(prompt) + t - 1, token])) < 1e-3

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="m", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == out["text"]
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == out["text"]

    items, labels = [[81, 82, 83], [90]], [7, 9, 11]
    r = srv.client.post("/v1/score", json={"query": prompt, "items": items, "label_token_ids": labels})
    assert r.status_code == 200, r.text
    for item, scores in zip(items, r.json()["scores"]):
        with torch.no_grad():
            last = torch.softmax(hf(torch.tensor([prompt + item])).logits[0, -1].float(), -1)
        assert scores == pytest.approx([float(last[t]) for t in labels], abs=1e-4)


def test_a_default_dtype_server_retrieves_ranks_and_recommends_with_transformers_numbers(
        start_server, hybrid_dir, hf_hybrid, tmp_path):
    """The dtype the defaults pick here (bfloat16 on AVX-512-BF16/AMX, else float32), the radix cache
    on: /v1/retrieve over the whole catalog gives transformers' exhaustive scores; the user's next,
    longer history resumes from the first one's snapshot; /generate's constrained beams are
    retrieve's; rank scores each candidate on its own fork (resuming from retrieve's snapshot) and
    recommend equals retrieve then rank; item-as-prefix is a 400 naming `prefix`, and the server goes
    on serving."""
    from sgrec.model import cpu_caps

    from test_rec_server import write_catalog

    catalog = write_catalog(tmp_path / "catalog.jsonl", n=27, seed=1, semantic=True)
    srv = start_server(hybrid_dir, "--dtype", "auto", "--max-total-tokens", "4096", "--item-catalog", catalog,
                       "--max-beam-width", "32")
    dtype = torch.bfloat16 if cpu_caps.cpu_bf16_support().native else torch.float32
    tol = 2e-3 if dtype == torch.float32 else 0.3
    history = ids(33, seed=21)
    r = srv.client.post("/v1/retrieve", json={"user": {"id": "u1", "token_ids": history}, "beam_width": 32,
                                              "num_items": 27})
    assert r.status_code == 200, r.text
    paths, items = {}, {}
    with open(catalog) as f:
        for line in f:
            item = json.loads(line)
            paths[item["id"]] = item["semantic_id"]
            items[item["id"]] = Item(item["id"], tuple(item["token_ids"]), item["id_token"], tuple(item["semantic_id"]))
    sids = Catalog([Item(i, (1,), 1, tuple(p)) for i, p in paths.items()])
    want = exhaustive_scores(hf_hybrid(dtype), sids, history)
    got = r.json()["items"]
    assert sorted(it["item"] for it in got) == sorted(want)
    assert all(it["semantic_id"] == paths[it["item"]] for it in got)
    assert max(abs(it["score"] - want[it["item"]]) for it in got) <= tol
    assert r.json()["meta_info"]["cached_tokens"] == 0

    longer = history + ids(5, seed=22)
    r = srv.client.post("/v1/retrieve", json={"user": {"id": "u1", "token_ids": longer}, "beam_width": 32,
                                              "num_items": 27})
    assert r.status_code == 200 and r.json()["meta_info"]["cached_tokens"] == len(history)
    want = exhaustive_scores(hf_hybrid(dtype), sids, longer)
    assert max(abs(it["score"] - want[it["item"]]) for it in r.json()["items"]) <= tol

    body = {"input_ids": longer, "sampling_params": {"beam_width": 8, "n": 3}, "constrain_to_catalog": True}
    beams = srv.client.post("/generate", json=body).json()["meta_info"]["beam_results"]
    ref = srv.client.post("/v1/retrieve", json={"user": {"token_ids": longer}, "beam_width": 8,
                                                "num_items": 3}).json()["items"]
    assert [b["meta_info"]["item"] for b in beams] == [x["item"] for x in ref]
    assert [b["output_ids"] for b in beams] == [x["semantic_id"] for x in ref]

    cands = ["i4", "i19", "i1", "i23", "i8"]
    rank = srv.client.post("/v1/rank", json={"user": {"id": "u2", "token_ids": history}, "items": cands,
                                             "instruction": INSTR})
    assert rank.status_code == 200, rank.text
    want = forked_reference(hf_hybrid(dtype), history, [items[c] for c in sorted(cands)], by_path=False)
    assert max(abs(x["score"] - want[x["item"]]) for x in rank.json()["ranking"]) <= (1e-4 if tol < 0.1 else 0.05)
    assert rank.json()["meta_info"]["cached_tokens"] == len(history)  # the snapshot retrieve kept
    item = srv.client.post("/v1/rank", json={"user": {"id": "u1", "token_ids": history}, "items": cands,
                                             "instruction": INSTR, "prefix": "item"})
    assert item.status_code == 400 and "prefix 'item'" in item.json()["message"], item.text
    rec = srv.client.post("/v1/recommend", json={"user": {"id": "u1", "token_ids": longer},
                                                 "rank": {"instruction": INSTR},
                                                 "retrieve": {"beam_width": 8, "num_candidates": 4}})
    assert rec.status_code == 200, rec.text
    retrieved = srv.client.post("/v1/retrieve", json={"user": {"token_ids": longer}, "beam_width": 8,
                                                      "num_items": 4}).json()["items"]
    ranked = srv.client.post("/v1/rank", json={"user": {"id": "u1", "token_ids": longer}, "instruction": INSTR,
                                               "items": [x["item"] for x in retrieved]}).json()["ranking"]
    assert [x["item"] for x in rec.json()["items"]] == [x["item"] for x in ranked]
    r = srv.client.post("/generate", json={"input_ids": history, "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 3


# ---- deterministic mode ------------------------------------------------------------------------------
def test_deterministic_mode_gives_each_request_its_bits_alone_in_any_batch(hybrid_dir):
    """--enable-deterministic-inference in the default dtype: the delta rule's step kernel, the
    token-by-token short sequences and the chunked form are per sequence, so generate's logprobs,
    retrieve's scores and rank's scores are the same bits alone and batched with other requests."""
    e = Engine(hybrid_dir, device="cpu", dtype="auto", enable_deterministic_inference=True, disable_radix_cache=True,
               max_total_tokens=4096, max_mamba_cache_size=120)
    try:
        prompts = [ids(n, seed=n) for n in (7, 30, 90)]
        sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

        def logprobs(out):
            return [x[0] for x in out["meta_info"]["output_token_logprobs"]]

        alone = [logprobs(e.generate(input_ids=p, sampling_params=sp, return_logprob=True)) for p in prompts]
        batched = [logprobs(o) for o in e.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)]
        assert alone == batched

        runner = e.runner
        ex = RetrieveExecutor(runner, RadixCache(runner.memory.allocator, disable=True, states=runner.memory.states),
                              sid_catalog(60, seed=2))
        reqs = [dict(input_ids=p, beam_width=16, top_k=16, num_items=8) for p in prompts]
        one = ex.run(**reqs[1]).items
        assert ex.run_batch(reqs)[1].items == one

        rank = ranker(runner, sid_items(12, seed=5))
        payload = dict(user_key="u", user_ids=prompts[1], item_ids=["c1", "c4", "c7"], instruction_ids=INSTR,
                       prefix="none")
        others = [dict(payload, user_key=f"o{k}", user_ids=p, item_ids=["c2", "c9"]) for k, p in enumerate(prompts)]
        assert rank.run_batch([others[0], payload, others[2]])[1]["ranking"] == rank.run_batch([payload])[0]["ranking"]
    finally:
        e.shutdown()
