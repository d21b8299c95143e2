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
    return ModelRunner(ServerArgs(model_path=path, device="cpu", dtype=dtype, max_total_tokens=1024,
                                  disable_radix_cache=True, **kw))


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
    assert caps.prefix_reuse == "snapshot" and not caps.layouts and not caps.staged_beams


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunks_and_decode_steps_match_transformers(hybrid_dir, hf_hybrid, dtype):
    runner = runner_for(hybrid_dir, dtype)
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
        tol = tolerance(warm.runner.dtype)
        assert got[0] == ref[0] and abs(got_lp[0] - ref_lp[0]) <= tol
        if warm.runner.dtype == torch.float32:
            assert got == ref and max(abs(a - b) for a, b in zip(got_lp, ref_lp)) <= tol
        warm.check_memory()
        states = warm.runner.memory.states
        assert states.available_size() + warm.scheduler.tree.state_count == states.size
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


# ---- what the family does not serve ------------------------------------------------------------------
def test_the_host_tier_rank_layouts_and_beams_are_refused_by_name(hybrid_dir):
    with pytest.raises(ValueError, match="--enable-hierarchical-cache: the host and storage tiers keep KV, not "
                                         "the hybrid family's state snapshots"):
        Engine(hybrid_dir, device="cpu", dtype="float32", max_total_tokens=256, enable_hierarchical_cache=True)
    runner = runner_for(hybrid_dir, "float32")
    tree = RadixCache(runner.memory.allocator, disable=True)
    cat = make_catalog(6, seed=1)
    rank = RankExecutor(runner, tree, cat, runner.args, header_ids=HEADER)
    assert rank.precompute() == 0
    for prefix in ("user", "item", "auto"):
        with pytest.raises(ValueError, match="prefix '.*' needs the .* layout, which the hybrid family does not run"):
            rank.run("u", ids(3, 4), [it.id for it in cat.items], INSTR, prefix=prefix)
    rng = random.Random(0)
    sids = Catalog([Item(f"s{i}", (1,), 1, (rng.randrange(3, 60), rng.randrange(3, 60))) for i in range(8)])
    retrieve = RetrieveExecutor(runner, tree, sids)
    with pytest.raises(ValueError, match="retrieval by beam search is not served for hybrid models"):
        retrieve.run(ids(5, 2), beam_width=4, top_k=2, num_items=2)
    assert runner.memory.allocator.available_size() == runner.memory.size  # nothing was taken


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
