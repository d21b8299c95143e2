"""Triton kernels against their torch references on CPU, under Triton's interpreter. Run by
tests/test_kernels.py in a subprocess with TRITON_INTERPRET=1 set before triton is imported (the
interpreter replaces triton.language's own jitted helpers at import, so it cannot be switched on
inside a process that already imported triton). Not collected by a plain `pytest` run."""

import importlib.util
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/test_kernels.py with TRITON_INTERPRET=1", allow_module_level=True)

from sgrec.mem.kv_pool import KVPool  # noqa: E402
from sgrec.model.attention import ForwardBatch, SeqLayout, TorchBackend, TritonBackend  # noqa: E402
from sgrec.model.kernels.bipartite_attention import bipartite_attention  # noqa: E402
from sgrec.beam import RetrieveExecutor, naive_retrieve  # noqa: E402
from sgrec.beam.attention import staged_attention as torch_staged  # noqa: E402
from sgrec.model.kernels.decode_attention import decode_attention  # noqa: E402
from sgrec.model.kernels.staged_attention import staged_attention  # noqa: E402
from sgrec.radix.tree import RadixCache  # noqa: E402
from sgrec.runner import ModelRunner  # noqa: E402
from sgrec.server_args import ServerArgs  # noqa: E402
import tests.kernel_refs as kernel_refs  # noqa: E402
from tests.kernel_refs import (bipartite_reference, case, decode_logits, pack, rank_case, rank_layouts,  # noqa: E402
                               reference, run_backends)
from tests.test_beam import assert_same, random_catalog  # noqa: E402


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (6, 2, 16), (9, 3, 32), (8, 1, 24)])
@pytest.mark.parametrize("lens,block_n", [([1], 16), ([5, 16, 17, 40], 16), ([3, 70, 1, 33], 32)])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_attention_equals_reference(hq, hkv, d, lens, block_n, splits):
    """GQA ratios 1, 3, 3, 8; head dims that are and are not powers of two; lengths below, at
    and across block boundaries; slots scattered over the pool; each sequence's slots in 1, 3 or 8
    runs merged by log-sum-exp (runs with no slot where a sequence is short)."""
    q, k_buf, v_buf, idx, ptr = case(hq, hkv, d, lens, torch.float32, seed=len(lens) + hq)
    scale = d ** -0.5
    out = decode_attention(q, k_buf, v_buf, idx, ptr, scale, block_n=block_n, splits=splits)
    assert out.shape == (len(lens), hq * d) and out.dtype == torch.float32
    assert (out.double() - reference(q, k_buf, v_buf, idx, ptr, scale)).abs().max() <= 1e-5


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_bfloat16(splits):
    q, k_buf, v_buf, idx, ptr = case(6, 2, 16, [9, 31, 64], torch.bfloat16, seed=5)
    out = decode_attention(q, k_buf, v_buf, idx, ptr, 0.25, splits=splits)
    assert out.dtype == torch.bfloat16
    assert (out.double() - reference(q, k_buf, v_buf, idx, ptr, 0.25)).abs().max() <= 2e-2


def test_the_comparison_can_fail():
    """A kernel reading one slot off (each sequence's first slot skipped) is caught."""
    q, k_buf, v_buf, idx, ptr = case(4, 2, 16, [6, 9], torch.float32, seed=2)
    wrong = decode_attention(q, k_buf, v_buf, idx, ptr + torch.tensor([1, 1, 0]), 0.25)
    assert (wrong.double() - reference(q, k_buf, v_buf, idx, ptr, 0.25)).abs().max() > 1e-3


def test_triton_backend_decode_equals_torch_backend():
    """The backend a runner uses with --attention-backend triton: same outputs as the torch
    backend's decode on one pool and batch (K/V written first, then read by slot)."""
    hq, hkv, d, lens = 6, 2, 16, [1, 13, 4, 30]
    pool = KVPool(200, 1, hkv, d, torch.float32)
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]))
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0]))
    slots = (torch.randperm(200)[: sum(lens)] + 1).split(lens)
    seqs = [SeqLayout(i, 1, sl) for i, sl in enumerate(slots)]
    new = torch.stack([sl[-1] for sl in slots])
    q, k, v = torch.randn(len(lens), hq, d), torch.randn(len(lens), hkv, d), torch.randn(len(lens), hkv, d)
    outs = []
    for backend in (TorchBackend(), TritonBackend()):
        batch = ForwardBatch(torch.zeros(len(lens), dtype=torch.int64), torch.zeros(len(lens), dtype=torch.int64),
                             new, seqs, pool)
        backend.prepare(batch)
        outs.append(backend.forward(q, k, v, 0, batch, d ** -0.5))
    assert (outs[0] - outs[1]).abs().max() <= 1e-5


def test_runner_with_the_triton_backend_decodes_like_torch(tiny_model_dir):
    """A tiny qwen3 (GQA, q/k norms): prefill, then 4 decode steps of two sequences of different
    lengths; logits of the triton-backend runner == the torch-backend runner's within 1e-4."""
    path = tiny_model_dir("qwen3")
    runners = [ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32", max_total_tokens=256,
                                                  attention_backend=name)) for name in ("torch", "triton")]
    assert isinstance(runners[1].backend, TritonBackend)
    logits = [decode_logits(r) for r in runners]
    assert (logits[0] - logits[1]).abs().max() <= 1e-4


def staged_case(hq, hkv, d, P, n, s, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    size = P + n * s + 9
    k_buf, v_buf = (torch.randn(size, hkv, d, generator=g).to(dtype) for _ in range(2))
    perm = torch.randperm(size, generator=g)
    return (torch.randn(n, hq, d, generator=g).to(dtype), k_buf, v_buf, perm[:P], perm[P : P + n * s].view(n, s))


@pytest.mark.parametrize("hq,hkv,d,P,n,s,block_b", [
    (6, 2, 16, 40, 7, 2, 4),  # GQA 3, beams not a multiple of the block
    (4, 4, 32, 1, 5, 1, 2),  # a one-token prompt
    (8, 1, 24, 70, 9, 0, 4),  # prompt only (no own token)
    (6, 3, 16, 0, 3, 2, 8),  # no prompt KV: own tokens only
    (9, 3, 64, 33, 16, 3, 16),
])
def test_staged_kernel_equals_torch_staged_attention(hq, hkv, d, P, n, s, block_b):
    """The kernel == sgrec.beam.attention.staged_attention (the torch stages and merge)."""
    q, k_buf, v_buf, sh, un = staged_case(hq, hkv, d, P, n, s, torch.float32, seed=P + n)
    out = staged_attention(q, k_buf, v_buf, sh, un, d ** -0.5, block_b=block_b, block_n=16)
    assert out.shape == (n, hq * d)
    assert (out - torch_staged(q, k_buf, v_buf, sh, un, d ** -0.5)).abs().max() <= 1e-5


def test_staged_kernel_low_precision_variant():
    """bench_staged_kernel.py's variant on 16-bit tiles (P rounded to the inputs' dtype): float16 here,
    as the interpreter's bfloat16 tl.dot is wrong (a 16x16 product off by 1e10 on CPU); within float16's
    rounding of the torch stages, and a float32 call ignores the option (bit for bit)."""
    from sgrec.model.kernels.staged_attention import beam_blocks, staged_attention_batched

    q, k_buf, v_buf, sh, un = staged_case(8, 4, 32, 90, 20, 2, torch.float16, seed=5)
    want = torch_staged(q.float(), k_buf.float(), v_buf.float(), sh, un, 32 ** -0.5)
    args = (sh, torch.tensor([0, 90]), un, beam_blocks([20], 16), 32 ** -0.5)
    out = staged_attention_batched(q, k_buf, v_buf, *args, low_precision=True, block_n=16)
    assert out.dtype == torch.float16 and (out.float() - want).abs().max() <= 2e-3
    q32, k32, v32 = q.float(), k_buf.float(), v_buf.float()
    assert torch.equal(staged_attention_batched(q32, k32, v32, *args, low_precision=True, block_n=16),
                       staged_attention_batched(q32, k32, v32, *args, block_n=16))


def test_staged_kernel_bfloat16_and_a_wrong_input_is_caught():
    q, k_buf, v_buf, sh, un = staged_case(6, 2, 16, 50, 6, 2, torch.bfloat16, seed=3)
    out = staged_attention(q, k_buf, v_buf, sh, un, 0.25)
    want = torch_staged(q.float(), k_buf.float(), v_buf.float(), sh, un, 0.25)
    assert out.dtype == torch.bfloat16 and (out.float() - want).abs().max() <= 2e-2
    wrong = staged_attention(q, k_buf, v_buf, sh, un[:, :1], 0.25)  # each beam's current token left out
    assert (wrong.float() - want).abs().max() > 1e-1


def torch_and_triton(path: str, tokens: int = 3000) -> dict[str, ModelRunner]:
    """float32 CPU runners of one model on the torch and the triton backends."""
    return {name: ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32",
                                                     max_total_tokens=tokens, attention_backend=name))
            for name in ("torch", "triton")}


def filtered_catalog(tiny_model_dir, seed: int, items: int, codes: int, dup: float, prompt_len: int):
    """The qwen3 runners (torch, triton), a seeded random 3-level catalog and prompt for the filtered
    retrieve tests: (runners, rng, catalog, its item ids, prompt); rng goes on to draw the filters."""
    import random

    from tests.test_retrieve_filters import make_catalog

    runners = torch_and_triton(tiny_model_dir("qwen3"))
    V = runners["torch"].config.vocab_size
    rng = random.Random(seed)
    cat = make_catalog(rng, items, 3, V, codes=codes, dup=dup)
    return runners, rng, cat, [it.id for it in cat.items], [rng.randrange(V) for _ in range(prompt_len)]


@pytest.mark.parametrize("programs", [None, 12])
def test_batched_staged_kernel_equals_torch_per_request(programs):
    """Four requests' beams in one launch (prompts of 40, 1, 0 and 70 slots; 7, 5, 3 and 9 beams;
    two own tokens each) == the torch staged attention of each request alone; with a block table
    padded by no-work programs (a static buffer's size) the same."""
    from sgrec.model.kernels.staged_attention import beam_blocks, staged_attention_batched

    hq, hkv, d, s = 6, 2, 16, 2
    g = torch.Generator().manual_seed(7)
    prompts, beams = [40, 1, 0, 70], [7, 5, 3, 9]
    size = sum(prompts) + sum(beams) * s + 5
    k_buf, v_buf = (torch.randn(size, hkv, d, generator=g) for _ in range(2))
    perm = torch.randperm(size, generator=g)
    sh = perm[: sum(prompts)]
    un = perm[sum(prompts) : sum(prompts) + sum(beams) * s].view(-1, s)
    q = torch.randn(sum(beams), hq, d, generator=g)
    ptr = torch.tensor([0, 40, 41, 41, 111])
    out = staged_attention_batched(q, k_buf, v_buf, sh, ptr, un, beam_blocks(beams, 4, programs), d ** -0.5)
    a = 0
    for r, n in enumerate(beams):
        want = torch_staged(q[a : a + n], k_buf, v_buf, sh[ptr[r] : ptr[r + 1]], un[a : a + n], d ** -0.5)
        assert (out[a : a + n] - want).abs().max() <= 1e-5
        a += n
    with pytest.raises(ValueError, match="do not fit"):
        beam_blocks(beams, 4, 5)


def test_trie_step_flat_dead_rows_change_nothing():
    """trie_step_flat with fixed output rows: a request whose beams come with dead rows (score
    -inf, any node) among them keeps what it keeps without them; its output rows past the kept
    ones are dead (-inf, parent its first beam); kept counts per request; a request given fewer
    output rows than it keeps writes only those."""
    import random

    from sgrec.beam.kernel_step import level
    from sgrec.beam.trie import SemanticIdTrie
    from sgrec.model.kernels.trie_step import plan_step, trie_step, trie_step_flat

    rng = random.Random(3)
    V = 50
    cat = random_catalog(rng, 120, 3, V, codes=9)
    trie, _ = SemanticIdTrie.from_catalog(cat, V)
    d = 1
    live = [torch.tensor(sorted(rng.sample(range(trie.num_nodes[d]), 5))), torch.tensor([0, 2, 3])]
    scores = [-torch.rand(5) * 3, -torch.rand(3) * 3]
    logits = [torch.randn(5, V), torch.randn(3, V)]
    want = trie_step(torch.cat(logits), level(trie, d), torch.cat(live), torch.cat(scores), [0, 5, 8], [3, 2], [6, 4])
    # request 0 with two dead rows interleaved, request 1 with one at its end
    nodes = torch.cat([live[0][:2], torch.tensor([0]), live[0][2:], torch.tensor([7]), live[1], torch.tensor([1])])
    sc = torch.cat([scores[0][:2], torch.tensor([-float("inf")]), scores[0][2:], torch.tensor([-float("inf")]),
                    scores[1], torch.tensor([-float("inf")])])
    lg = torch.cat([logits[0][:2], torch.randn(1, V), logits[0][2:], torch.randn(1, V), logits[1], torch.randn(1, V)])
    orig = [0, 1, 3, 4, 5, 7, 8, 9]  # the input row of each live beam
    for out_rows, first in (([9, 7], [0, 7]), ([9, 2], [0, 7])):
        plan = plan_step([0, 7, 11], [3, 2], [6, 4], None, "cpu", out_rows)
        p, t, s, n, kept = trie_step_flat(lg, level(trie, d), nodes, sc, plan)
        assert p.numel() == sum(out_rows) and kept.tolist() == [w[0].numel() for w in want]
        o = 0
        for r, (wp, wt, ws, wn) in enumerate(want):
            k = min(wp.numel(), out_rows[r])
            rows = slice(o, o + k)
            assert [orig[i] for i in (wp[:k] + [0, 5][r]).tolist()] == p[rows].tolist()
            assert t[rows].tolist() == wt[:k].tolist() and n[rows].tolist() == wn[:k].tolist()
            assert torch.equal(s[rows], ws[:k])
            dead = slice(o + k, o + out_rows[r])
            assert torch.isneginf(s[dead]).all() and (p[dead] == first[r]).all()
            o += out_rows[r]


TRITON_DIR = os.path.dirname(importlib.util.find_spec("triton").origin) + os.sep  # the triton package's files


class HostReads(kernel_refs.HostReads):
    """HostReads, less the interpreter's own reads (Triton's code) that are not the engine's."""

    def counts(self, caller: str) -> bool:
        return not caller.startswith(TRITON_DIR)


def test_device_round_steps_read_nothing_back(tiny_model_dir, monkeypatch):
    """A filtered round of three requests on --attention-backend triton: from the first selection
    on, no step (forward through the beam graphs' static buffers, trie step, reorder) reads a value
    back to the host (HostReads), until
    the one read of the kept counts at the round's end; the round had dead rows (a filter leaving
    fewer beams than rows) and equals the torch backend's. The same check on the per-step path
    (the trie step where a level fits, its kept counts and reorder schedules read back) finds reads."""

    import sgrec.beam.device_round as device_round
    import sgrec.beam.executor as executor
    import sgrec.beam.kernel_step as kernel_step

    reads: list[str] = []
    dead = []

    def guard(cls, name):
        real = getattr(cls, name)

        def run(self, step, phase, x):
            if name == "launch" and phase == "prefill":
                return real(self, step, phase, x)
            with HostReads() as g:
                out = real(self, step, phase, x)
            reads.extend(g.reads)
            return out
        monkeypatch.setattr(cls, name, run)

    real_finish = device_round.DeviceRound._finish
    pending = []
    monkeypatch.setattr(device_round.DeviceRound, "_finish", lambda self, kept: pending.append((self, kept)))
    for cls in (device_round.DeviceRound, executor._RoundHooks):
        guard(cls, "launch")
        guard(cls, "finish")
    runners, rng, cat, ids, prompt = filtered_catalog(tiny_model_dir, 11, 150, 10, 0.05, 10)
    reqs = [dict(input_ids=prompt, beam_width=16, top_k=4, num_items=10, include_items=rng.sample(ids, 5)),
            dict(input_ids=prompt[:6], beam_width=8, top_k=3, num_items=8, exclude_items=rng.sample(ids, 40)),
            dict(input_ids=prompt[2:], beam_width=5, top_k=5, num_items=5)]
    ex = RetrieveExecutor(runners["triton"], RadixCache(runners["triton"].kv_pool.allocator), cat)
    from sgrec.beam.graphs import BeamGraphs

    ex.graphs = BeamGraphs(ex.runner.model, ex.backend, ex.pool, 64, ex.pool.size, 4, capture=False)  # as on CUDA
    original = device_round.DeviceRound._setup

    def setup(self):
        original(self)
        dead.append(self)
    monkeypatch.setattr(device_round.DeviceRound, "_setup", setup)

    def finish_then_read(self, step, phase, x):
        out = device_round_finish(self, step, phase, x)
        while pending:
            real_finish(*pending.pop())
        return out
    device_round_finish = device_round.DeviceRound.finish
    monkeypatch.setattr(device_round.DeviceRound, "finish", finish_then_read)
    got = ex.run_batch(reqs)
    assert reads == []
    rnd = dead[0]
    live = [int(torch.isfinite(rnd.scores[b : b + x[-1]]).sum()) for b, x in zip(rnd.base, rnd.rows)]
    assert live[0] < rnd.rows[0][-1] == 10 and got[0].meta["exhausted"]  # the include list left dead rows
    want = RetrieveExecutor(runners["torch"], RadixCache(runners["torch"].kv_pool.allocator), cat).run_batch(reqs)
    for a, b in zip(got, want):
        assert_same(a, b)
    monkeypatch.setattr(kernel_step, "MAX_CHILDREN", 0)  # no level fits the kernel: the per-step (torch) path
    ex2 = RetrieveExecutor(runners["triton"], RadixCache(runners["triton"].kv_pool.allocator), cat)
    for a, b in zip(ex2.run_batch(reqs), want):
        assert_same(a, b)
    assert reads  # that path reads back every step


@pytest.mark.parametrize("nd", [1, 2, 4])
def test_device_round_at_other_depths_equals_torch(tiny_model_dir, nd, monkeypatch):
    """Device rounds over semantic IDs of 1 (no beam step), 2 (no K/V reorder) and 4 levels (two
    reorders) == the torch backend: two requests, one excluding a third of the catalog."""
    import random

    import sgrec.beam.device_round as device_round

    runners = torch_and_triton(tiny_model_dir("llama"))
    V = runners["torch"].config.vocab_size
    rng = random.Random(nd)
    cat = random_catalog(rng, {1: 12, 2: 60, 4: 150}[nd], nd, V, codes=12)
    prompt = [rng.randrange(V) for _ in range(9)]
    reqs = [dict(input_ids=prompt, beam_width=6, top_k=3, num_items=6),
            dict(input_ids=prompt[4:], beam_width=9, top_k=9, num_items=5,
                 exclude_items=[it.id for it in cat.items[::3]])]
    rounds = []
    real = device_round.DeviceRound._setup
    monkeypatch.setattr(device_round.DeviceRound, "_setup", lambda self: rounds.append(self) or real(self))
    got = {name: RetrieveExecutor(r, RadixCache(r.kv_pool.allocator), cat).run_batch(reqs)
           for name, r in runners.items()}
    assert len(rounds) == 1  # the triton runner's round was a device round
    for a, b in zip(got["triton"], got["torch"]):
        assert a.items and len(a.items) == len(b.items)
        assert_same(a, b)


def test_beam_steps_through_the_static_buffers_equal_plain_steps(tiny_model_dir, monkeypatch):
    """BeamGraphs without capture (what a CUDA graph replays: the step over static buffers, padded to
    its rows bucket by rows on slot 0 that no program attends): a round of three requests (one with
    an include list: dead rows) == the same round's plain steps, and == the torch backend; the
    steps ran padded (rows below their bucket) and one too wide for max_rows ran plain."""

    from sgrec.beam.graphs import BeamGraphs

    runners, rng, cat, ids, prompt = filtered_catalog(tiny_model_dir, 4, 150, 10, 0.05, 10)
    reqs = [dict(input_ids=prompt, beam_width=7, top_k=4, num_items=7, include_items=rng.sample(ids, 9)),
            dict(input_ids=prompt[:6], beam_width=5, top_k=3, num_items=5),
            dict(input_ids=prompt[2:], beam_width=2, top_k=4, num_items=2)]
    runner = runners["triton"]
    ex = RetrieveExecutor(runner, RadixCache(runner.kv_pool.allocator), cat)
    assert ex.graphs is None and min(ex.trie.num_nodes[1:]) >= 7  # CPU; every request's rows its beam width
    torch_ex = RetrieveExecutor(runners["torch"], RadixCache(runners["torch"].kv_pool.allocator), cat)
    wide = reqs[:2] + [dict(reqs[2], beam_width=4, num_items=4)]  # 16 rows a step
    plain = ex.run_batch(reqs)
    ex.graphs = BeamGraphs(runner.model, ex.backend, ex.pool, max_rows=15, max_shared=runner.kv_pool.size,
                           max_steps=4, capture=False)
    assert ex.graphs.buckets == [1, 2, 4, 8, 12, 15]
    rows = []
    real = BeamGraphs.run
    monkeypatch.setattr(BeamGraphs, "run", lambda self, t, *a: rows.append((t.numel(), self.bucket(t.numel())))
                        or real(self, t, *a))
    for batch, want_rows in ((reqs, [(14, 15)] * 2), (wide, [])):  # 14 rows: padded to 15; 16: past max_rows
        rows.clear()
        got = ex.run_batch(batch)
        assert rows == want_rows
        for a, b in zip(got, torch_ex.run_batch(batch)):
            assert_same(a, b)
    for a, b in zip(ex.run_batch(reqs), plain):
        assert_same(a, b)


@pytest.mark.parametrize("bw,top_k", [(8, 8), (24, 5)])
def test_retrieve_with_the_triton_backend_equals_naive_and_torch(tiny_model_dir, bw, top_k):
    """RetrieveExecutor on a runner with --attention-backend triton (the staged kernel in beam
    steps) == naive_retrieve on it (the decode kernel) == RetrieveExecutor on the torch backend."""
    import random

    path = tiny_model_dir("qwen2")
    runners = {name: ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32",
                                                        max_total_tokens=4000, attention_backend=name))
               for name in ("torch", "triton")}
    V = runners["torch"].config.vocab_size
    rng = random.Random(bw)
    cat = random_catalog(rng, 300, 3, V, codes=40)
    ids = [rng.randrange(V) for _ in range(21)]
    got = {name: RetrieveExecutor(r, RadixCache(r.kv_pool.allocator), cat).run(ids, bw, top_k, 6)
           for name, r in runners.items()}
    assert_same(got["triton"], naive_retrieve(runners["triton"], cat, ids, bw, top_k, 6))
    assert_same(got["triton"], got["torch"])


def test_retrieve_batch_with_filters_on_the_triton_backend_equals_torch(tiny_model_dir, monkeypatch):
    """A round of retrieve requests with exclusions, an include list, an attribute filter and none,
    on --attention-backend triton (a device round: every level's selection of the round in one trie
    step, dead rows where a filter leaves fewer beams; batched staged attention) == the same round on
    the torch backend: same items, paths and scores. A trie with a level too wide for the kernel
    takes the per-step path (the kernel where it fits, torch elsewhere), the same again."""

    import sgrec.beam.device_round as device_round
    import sgrec.beam.kernel_step as kernel_step

    calls, flat = [], []
    real, real_flat = kernel_step.trie_step, device_round.trie_step_flat
    monkeypatch.setattr(kernel_step, "trie_step", lambda *a, **kw: calls.append(len(a[4]) - 1) or real(*a, **kw))
    monkeypatch.setattr(device_round, "trie_step_flat",
                        lambda *a, **kw: flat.append(len(a[4].row_ptr) - 1) or real_flat(*a, **kw))
    runners, rng, cat, ids, prompt = filtered_catalog(tiny_model_dir, 5, 200, 14, 0.1, 12)
    reqs = [dict(input_ids=prompt, beam_width=12, top_k=4, num_items=8, exclude_items=rng.sample(ids, 50)),
            dict(input_ids=prompt[:7], beam_width=8, top_k=8, num_items=8, include_items=rng.sample(ids, 30)),
            dict(input_ids=[3, 1, 4], beam_width=10, top_k=3, num_items=5, filter={"year": {"gte": 1994}}),
            dict(input_ids=prompt[3:], beam_width=6, top_k=6, num_items=6)]
    got = {name: RetrieveExecutor(r, RadixCache(r.kv_pool.allocator), cat).run_batch(reqs)
           for name, r in runners.items()}
    for a, b in zip(got["triton"], got["torch"]):
        assert a.items and a.meta["exhausted"] == b.meta["exhausted"]
        assert_same(a, b)
    assert flat == [4, 4, 4] and not calls  # one trie step per level for the round's four requests (a device round)
    ex = RetrieveExecutor(runners["triton"], RadixCache(runners["triton"].kv_pool.allocator), cat)
    monkeypatch.setattr(kernel_step, "MAX_CHILDREN", max(ex.trie.max_children) - 1)  # the widest: torch
    calls.clear()
    for a, b in zip(ex.run_batch(reqs[2:]), got["torch"][2:]):
        assert_same(a, b)
    narrow = sum(w <= kernel_step.MAX_CHILDREN for w in ex.trie.max_children)
    assert 0 < narrow < ex.trie.depth and len(calls) == narrow


def catalog_update(rng, cat, V: int, codes: int, step: int):
    """A random update of a filtered_catalog's catalog: deletions, replacements (new paths) and new
    items, some on new paths, some on paths that exist; apply_update's result."""
    from sgrec.catalog.update import apply_update, parse_items

    live = [cat.ids[r] for r in cat.live_rows()]
    paths = [[int(x) for x in cat.semantic_ids[r]] for r in cat.live_rows()]
    delete = rng.sample(live, rng.randint(0, 12))
    ups = [{"id": rng.choice(live) if rng.random() < 0.3 else f"n{step}_{j}", "token_ids": [1, 2],
            "semantic_id": rng.choice(paths) if rng.random() < 0.2 else [rng.randrange(V - codes, V) for _ in range(3)],
            "attrs": {"year": rng.randint(1990, 1999)}} for j in range(rng.randint(1, 14))]
    ups = list({u["id"]: u for u in ups if u["id"] not in delete}.values())
    return apply_update(cat, parse_items(ups, None, V), delete)


@pytest.mark.parametrize("compact", [False, True], ids=["tails", "compacted"])
def test_trie_step_over_a_layered_trie_equals_the_dense_trie_through_updates(compact, monkeypatch):
    """The Triton trie step over a LayeredTrie whose beam-step arrays are on the device (here the
    CPU; its leaf level DeviceLeaves, runs over a base and tails) through four updates, never
    compacted or compacted after each: after each version, at every level, three requests in one
    launch (exclusions, an include list, an attribute filter) keep what the torch selection keeps
    on the same trie, and what the kernel keeps over the dense trie built from scratch (a leaf's
    slot mapped to its dense id); the device arrays equal the host's, array for array."""
    import random

    import sgrec.beam.layered
    from sgrec.beam.filters import FilterCache, build_filter
    from sgrec.beam.kernel_step import select_levels
    from sgrec.beam.layered import _ranges
    from sgrec.beam.trie import SemanticIdTrie
    from tests.test_catalog_updates import same_on_device
    from tests.test_retrieve_filters import make_catalog

    monkeypatch.setattr(sgrec.beam.layered, "COMPACT_MIN", 0 if compact else 10**9)
    monkeypatch.setattr(sgrec.beam.layered, "COMPACT_FRACTION", 0 if compact else 1.0)
    rng = random.Random(7 + compact)
    V, codes = 64, 9
    cat = make_catalog(rng, 150, 3, V, codes=codes, dup=0.1)
    trie, _ = sgrec.beam.layered.LayeredTrie.from_catalog(cat, V, "cpu")
    trie.background = False
    tails = 0
    for step in range(4):
        res = catalog_update(rng, cat, V, codes, step)
        cat = res.catalog
        trie, _ = trie.updated(None, cat, res.removed_rows, res.added_from)
        tails += trie.leaves.n_tail
        same_on_device(trie)
        dense, rows = SemanticIdTrie.from_catalog(cat, V)
        slots = trie._arena(_ranges(trie.run_start, trie.run_len))[1]  # the slot of each dense leaf id
        ids = [cat.ids[r] for r in cat.live_rows()]
        kinds = [dict(exclude=rng.sample(ids, 30)), dict(include=rng.sample(ids, 25)),
                 dict(attr_filter={"year": {"gte": 1994}})]
        lay_f = [build_filter(trie, None, cat, FilterCache(), **kw) for kw in kinds]
        den_f = [build_filter(dense, rows, cat, FilterCache(), **kw) for kw in kinds]
        for depth in range(trie.depth):
            nodes, scores, logits = level_requests(rng, dense, depth, den_f, [1, 1, 1] if depth == 0 else [3, 7, 5],
                                                   False)
            top_k, m = [3, 9, 2], [6, 12, 5]
            got = check_level(trie, depth, nodes, scores, logits, lay_f, top_k, m, False)
            want = select_levels(dense, depth, torch.cat(logits), nodes, scores, den_f, top_k, m, False, 256)
            for (p, t, s, n), (wp, wt, ws, wn) in zip(got, want):
                assert p.tolist() == wp.tolist() and t.tolist() == wt.tolist() and torch.equal(s, ws)
                assert n.tolist() == (slots[wn.numpy()].tolist() if depth == trie.depth - 1 else wn.tolist())
    assert (tails == 0) == compact  # the tails were read where the versions were not compacted


def test_retrieve_on_the_triton_backend_follows_catalog_updates(tiny_model_dir, monkeypatch):
    """A triton runner's RetrieveExecutor serving catalog versions as a server does (updated_trie,
    then use_catalog): its LayeredTrie's versions extend the device copy, one compacted on the
    background thread and caught up meanwhile; after every version a filtered round of three
    requests (device rounds) equals the torch backend's on the same version."""
    import random

    import sgrec.beam.layered
    from tests.test_catalog_updates import _HeldCompactor, same_on_device

    held = _HeldCompactor()
    monkeypatch.setattr(sgrec.beam.layered, "compactor", held)
    monkeypatch.setattr(sgrec.beam.layered, "COMPACT_MIN", 40)
    runners, rng, cat, ids, prompt = filtered_catalog(tiny_model_dir, 12, 150, 10, 0.05, 10)
    V = runners["torch"].config.vocab_size
    exs = {name: RetrieveExecutor(r, RadixCache(r.kv_pool.allocator), cat) for name, r in runners.items()}
    assert exs["triton"].trie.leaves is not None and exs["torch"].trie.leaves is None
    bases = set()
    for step in range(8):
        res = catalog_update(random.Random(step), cat, V, 10, step)
        cat = res.catalog
        for ex in exs.values():
            ex.use_catalog(cat, ex.updated_trie(res))
        if step == 3:
            held.run()  # the compaction finishes; the next updates catch up on it
        trie = exs["triton"].trie
        same_on_device(trie)
        bases.add(trie.base_id)
        live = [cat.ids[r] for r in cat.live_rows()]
        reqs = [dict(input_ids=prompt, beam_width=12, top_k=4, num_items=8, exclude_items=rng.sample(live, 30)),
                dict(input_ids=prompt[:7], beam_width=8, top_k=8, num_items=8, include_items=rng.sample(live, 20)),
                dict(input_ids=prompt[3:], beam_width=6, top_k=6, num_items=6, filter={"year": {"gte": 1994}})]
        got, want = (exs[name].run_batch(reqs) for name in ("triton", "torch"))
        for a, b in zip(got, want):
            assert a.items
            assert_same(a, b)
    assert len(bases) == 2  # served from the compacted base at the end


# ---- bipartite (rank) attention -------------------------------------------------------------------
def run_bipartite(q, k, v, k_buf, v_buf, meta, scale, block_m, block_n):
    return bipartite_attention(q, k, v, k_buf, v_buf, meta.q_start, meta.q_end, meta.q_order, meta.q_block,
                               meta.c_idx, meta.c_ptr, meta.c_order, meta.c_block, scale, block_m=block_m,
                               block_n=block_n)


@pytest.mark.parametrize("hq,hkv,d,block_m,block_n", [(4, 4, 16, 16, 32), (6, 2, 24, 4, 16), (8, 2, 16, 8, 16),
                                                      (3, 1, 40, 16, 16)])
def test_bipartite_attention_equals_reference(hq, hkv, d, block_m, block_n):
    """One batch of four rank sequences (user and item as prefix, cached columns in and out of layout
    order, a partial user prefix, no cache, an item longer than a tile) == float64 attention under
    each sequence's dense mask; GQA 1, 3, 4, 3; head dims 16, 24, 40 (not powers of two)."""
    q, k, v, k_buf, v_buf, seqs, locs = rank_case(hq, hkv, d, rank_layouts(), torch.float32, seed=hq + d)
    meta = pack(seqs, locs, q.shape[0], block_m)
    out = run_bipartite(q, k, v, k_buf, v_buf, meta, d ** -0.5, block_m, block_n)
    assert out.shape == (q.shape[0], hq * d) and out.dtype == torch.float32
    assert (out.double() - bipartite_reference(q, k, v, k_buf, v_buf, seqs, d ** -0.5)).abs().max() <= 1e-5


def test_bipartite_attention_bfloat16_and_a_wrong_mask_is_caught():
    q, k, v, k_buf, v_buf, seqs, locs = rank_case(6, 2, 16, rank_layouts(), torch.bfloat16, seed=11)
    meta = pack(seqs, locs, q.shape[0], 16)
    want = bipartite_reference(q, k, v, k_buf, v_buf, seqs, 0.25)
    out = run_bipartite(q, k, v, k_buf, v_buf, meta, 0.25, 16, 32)
    assert out.dtype == torch.bfloat16 and (out.double() - want).abs().max() <= 2e-2
    meta.q_block.fill_(-1)  # causal only: an item's tokens see the candidates before it
    meta.c_block.fill_(-1)
    wrong = run_bipartite(q.float(), k.float(), v.float(), k_buf.float(), v_buf.float(), meta, 0.25, 16, 32)
    assert (wrong.double() - want).abs().max() > 1e-1


def test_triton_backend_extend_with_bipartite_masks_equals_torch_backend():
    """The backend: a rank batch goes through the kernel (K/V of the new tokens written to the pool
    first, the cached read by slot), a batch with a sequence lacking a BipartiteMask through the
    torch path; both equal TorchBackend."""
    hq, hkv, d = 6, 2, 16
    q, k, v, k_buf, v_buf, seqs, locs = rank_case(hq, hkv, d, rank_layouts(), torch.float32, seed=3)
    plain = SeqLayout(seqs[0].q_start, seqs[0].q_len, seqs[0].kv_indices, seqs[0].mask)
    for batch_seqs, kernel in ((seqs, True), ([plain, *seqs[1:]], False)):
        outs, took = run_backends((TorchBackend(), TritonBackend()), q, k, v, k_buf, v_buf, batch_seqs, locs, d ** -0.5)
        assert took == [False, kernel]
        assert (outs[0] - outs[1]).abs().max() <= 1e-5


def test_rank_with_the_triton_backend_equals_torch(tiny_model_dir, monkeypatch):
    """RankExecutor on --attention-backend triton (rank forwards and the item store's item KV through
    the bipartite kernel) == on the torch backend: a batch of user- and item-as-prefix requests with
    cold caches, then the same again reading the cached user prefixes and item KV (scores <= 1e-5,
    same rankings and meta)."""
    import sgrec.model.kernels.bipartite_attention as kernel_module
    from tests.test_rank import INSTR, Setup, ids, make_catalog

    calls = []
    real = kernel_module.bipartite_attention
    monkeypatch.setattr(kernel_module, "bipartite_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cat = make_catalog(12)
    setups = {name: Setup(tiny_model_dir("qwen3"), cat, pool=1024, item_cache_tokens=16, attention_backend=name)
              for name in ("torch", "triton")}
    assert isinstance(setups["triton"].runner.backend, TritonBackend)
    reqs = [dict(user_key="a", user_ids=ids(19, 1), item_ids=["i3", "i1", "i7", "i0"], instruction_ids=INSTR,
                 prefix="user"),
            dict(user_key="b", user_ids=ids(6, 2), item_ids=["i2", "i5", "i9", "i4", "i11"], instruction_ids=INSTR,
                 prefix="item")]
    for rep in range(2):
        got = {name: s.ex.run_batch(reqs) for name, s in setups.items()}
        for a, b in zip(got["triton"], got["torch"]):
            assert a["meta_info"] == b["meta_info"]
            assert [r["item"] for r in a["ranking"]] == [r["item"] for r in b["ranking"]]
            assert max(abs(x["score"] - y["score"]) for x, y in zip(a["ranking"], b["ranking"])) <= 1e-5
        cached = [r["meta_info"]["cached_tokens"] for r in got["triton"]]
        assert cached == [0, 4] if rep == 0 else (cached[0] == 19 and cached[1] > 4)  # user prefix, then items
    assert calls
    for s in setups.values():
        s.check_accounting()


# ---- the trie step (a beam level's selection) -----------------------------------------------------
def allowed_nodes(trie, depth, filt):
    nodes = torch.arange(trie.num_nodes[depth])
    return nodes if filt is None or depth == 0 else nodes[filt.keep(depth, nodes)]


def level_requests(rng, trie, depth, filters, widths, restricted, tie_rows=False):
    """Per request: beams at `depth` (distinct allowed nodes, ascending, as beam search keeps them),
    their scores and logits rows. tie_rows: every beam twice over (same node's twin rows get the
    same score and logits: exact ties across beams), scores around -1000 (float32 steps of 6e-5, so
    nearby log-probs round to one score) and logits on a 1/4 grid (ties inside a beam)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    cols = trie.logit_columns(depth).numel() if restricted else trie.vocab_size
    nodes, scores, logits = [], [], []
    for filt, n in zip(filters, widths):
        pool = allowed_nodes(trie, depth, filt).tolist()
        pick = torch.tensor(sorted(rng.sample(pool, min(n, len(pool)))))
        s = torch.round(torch.randn(pick.numel(), generator=g) * 8) / 8 - 3
        x = torch.randn(pick.numel(), cols, generator=g) * 2
        if tie_rows:
            s = s - 1000 + torch.randn(pick.numel(), generator=g) * 1e-4
            x = torch.round(x * 4) / 4
        nodes.append(pick)
        scores.append(s.float())
        logits.append(x)
    return nodes, scores, logits


def check_level(trie, depth, nodes, scores, logits, filters, top_k, m, restricted, global_min_k=256):
    """The kernel's selection of every request at once == select_level (torch) of each alone."""
    from sgrec.beam import kernel_step, search

    got = kernel_step.select_levels(trie, depth, torch.cat(logits), nodes, scores, filters, top_k, m, restricted,
                                    global_min_k)
    kept = 0
    for r in range(len(nodes)):
        want = search.select_level(logits[r], trie, depth, nodes[r], scores[r], filters[r], top_k[r], m[r],
                                     restricted)
        p, t, s, nd = got[r]
        assert p.tolist() == want[0].tolist() and t.tolist() == want[1].tolist() and nd.tolist() == want[3].tolist()
        assert s.dtype == torch.float32 and (s - want[2]).abs().max().item() <= 1e-5 if s.numel() else True
        kept += p.numel()
    assert kept > 0
    return got


@pytest.mark.parametrize("seed", range(2))
def test_trie_step_equals_the_torch_selection_with_filters(seed):
    """Every level of a trie (repeated paths, up to 12 children per node, full or the level's
    columns) for three requests in one launch, unfiltered, with exclusions, with an include list
    and with an attribute filter, different widths, top-k and kept counts (a per-beam cap that
    binds, one that does not, one that leaves the pool short so every valid child competes)."""
    import random

    from sgrec.beam.filters import FilterCache, build_filter
    from sgrec.beam.trie import SemanticIdTrie
    from tests.test_retrieve_filters import make_catalog

    rng = random.Random(seed)
    V = 64
    cat = make_catalog(rng, 160, 3, V, codes=12, dup=0.1)
    trie, rows = SemanticIdTrie.from_catalog(cat, V)
    ids = [it.id for it in cat.items]
    cache = FilterCache()
    kinds = [dict(exclude=rng.sample(ids, 60)), dict(include=rng.sample(ids, 40)),
             dict(attr_filter={"year": {"gte": 1993}}), {}]
    for depth in range(trie.depth):
        for restricted in {False, depth > 0 and trie.logit_columns(depth) is not None}:
            reqs = rng.sample(kinds, 3)
            filters = [build_filter(trie, rows, cat, cache, **kw) for kw in reqs]
            widths = [rng.choice([1, 5, 16]) for _ in reqs] if depth else [1, 1, 1]
            nodes, scores, logits = level_requests(rng, trie, depth, filters, widths, restricted)
            top_k = [rng.choice([1, 3, 12]) for _ in reqs]
            m = [rng.choice([1, 4, 16, 40]) for _ in reqs]
            check_level(trie, depth, nodes, scores, logits, filters, top_k, m, restricted)


@pytest.mark.parametrize("global_min_k", [256, 2])
def test_trie_step_ties_equal_the_torch_selection(global_min_k, monkeypatch):
    """Exact ties everywhere: beams that are twins (same node, score and logits: ties across beams,
    broken by beam), log-probs tied inside a beam across its k-th place (broken by token), and
    different log-probs that round to one score (broken by token within a beam). With global_min_k
    2 the torch path takes its one-pass global selection (no per-beam cap), the kernel the same."""
    import random

    from sgrec.beam import search
    from sgrec.beam.trie import SemanticIdTrie
    from sgrec.catalog import Catalog, Item

    monkeypatch.setattr(search, "GLOBAL_SELECT_MIN_K", global_min_k)
    V = 40
    paths = [(a, b) for a in range(30, 36) for b in range(20, 30)]  # every depth-1 node: the same 10 children
    cat = Catalog([Item(f"i{i}", (1,), 1, p) for i, p in enumerate(paths)])
    trie, _ = SemanticIdTrie.from_catalog(cat, V)
    rng = random.Random(global_min_k)
    ties = 0
    for top_k, m in [(2, 5), (3, 12), (10, 4), (4, 30)]:
        nodes, scores, logits = level_requests(rng, trie, 1, [None, None], [3, 4], False, tie_rows=True)
        twin = [torch.cat([x, x]).sort().values for x in nodes]  # every node twice: twin beams
        order = [torch.cat([x, x]).argsort(stable=True) for x in nodes]
        scores = [torch.cat([s, s])[o] for s, o in zip(scores, order)]
        logits = [torch.cat([x, x])[o] for x, o in zip(logits, order)]
        check_level(trie, 1, twin, scores, logits, [None, None], [top_k] * 2, [m] * 2, False, global_min_k)
        for s, x in zip(scores, logits):
            full = s[:, None] + torch.log_softmax(x[:, 20:30], -1)
            ties += int((full[:, :, None] == full[:, None, :]).sum() - full.numel())
    assert ties > 0


@pytest.mark.parametrize("global_min_k", [256, 2])
def test_trie_step_takes_the_torch_paths_regime_on_rounding_ties(global_min_k, monkeypatch):
    """Three children whose log-probs differ by 1e-5 but round to one score next to -1000: the
    per-beam pool (the 2 best by log-prob) and the one-pass global selection (no cap: by score,
    then token) keep different pairs; the kernel keeps what the torch path keeps in either regime."""
    from sgrec.beam import search
    from sgrec.beam.trie import SemanticIdTrie
    from sgrec.catalog import Catalog, Item

    monkeypatch.setattr(search, "GLOBAL_SELECT_MIN_K", global_min_k)
    paths = [(a, b) for a in range(30, 33) for b in range(20, 30)]
    trie, _ = SemanticIdTrie.from_catalog(Catalog([Item(f"i{i}", (1,), 1, p) for i, p in enumerate(paths)]), 40)
    x = torch.zeros(2, 40)
    x[0, [21, 23, 25]] = torch.tensor([5.0, 5.0 + 1e-5, 5.0 + 2e-5])
    scores = torch.tensor([-1000.0, -1001.0])
    s = scores[0] + torch.log_softmax(x[0, 20:30], -1)
    assert s[1] == s[3] == s[5] and len({torch.log_softmax(x[0, 20:30], -1)[j].item() for j in (1, 3, 5)}) == 3
    got = check_level(trie, 1, [torch.tensor([0, 1])], [scores], [x], [None], [2], [2], False, global_min_k)
    assert got[0][1].tolist() == ([21, 23] if global_min_k == 2 else [23, 25])


def test_triton_decodes_checks_the_kernel(monkeypatch):
    """auto's check on CUDA (here on CPU, interpreted): the kernel runs and equals torch; a kernel that
    raises (as a Triton that cannot compile for the GPU would) or returns wrong values fails it."""
    import sgrec.model.kernels.decode_attention as da
    from sgrec.model.backends import triton_decodes

    assert triton_decodes(torch.device("cpu"))
    real = da.decode_attention
    monkeypatch.setattr(da, "decode_attention", lambda *a, **k: real(*a, **k) * 1.01)
    assert not triton_decodes(torch.device("cpu"))

    def broken(*a, **k):
        raise RuntimeError("PTX: unsupported architecture")

    monkeypatch.setattr(da, "decode_attention", broken)
    assert not triton_decodes(torch.device("cpu"))


# ---- the Triton glue (sgrec.model.kernels.glue) against the torch ops it replaces ------------------
# float32: the same operations up to summation order; bfloat16: the interpreter truncates where torch
# rounds to nearest (a GPU rounds too: tests/test_kernels.py holds the compiled kernels to one step)
GLUE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -6, atol=2e-2)}

def _torch_rmsnorm(x, w, eps):
    from sgrec.model.llama import RMSNorm

    m = RMSNorm(x.shape[-1], eps).to(x.dtype)
    m.weight.data.copy_(w)
    return m(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [576, 40, 7])
def test_glue_rmsnorm_equals_torch(dtype, n):
    """Rows of a strided view (every other row of a buffer); widths that are and are not powers of two."""
    from sgrec.model.kernels import glue

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(10, n, generator=g) * 3).to(dtype)[::2]
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    got, want = glue.rmsnorm(x, w, 1e-6), _torch_rmsnorm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **GLUE_TOL[dtype])
    assert glue.rmsnorm(x.double(), w.double(), 1e-6) is None  # not a kernel dtype: torch's path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (4, 4, 16), (6, 2, 24)])
def test_glue_rope_equals_torch(dtype, hq, hk, d):
    """q and k as the model makes them: views of one fused projection (token stride past the heads)."""
    from sgrec.model.kernels import glue
    from sgrec.model.rope import RotaryEmbedding, apply_rope

    T = 13
    g = torch.Generator().manual_seed(hq + d)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(T, hq, d), k.view(T, hk, d)
    cos, sin = RotaryEmbedding(d, 10000.0, None, 64, torch.device("cpu")).cos_sin(torch.arange(5, 5 + T), dtype)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert glue.rope_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, **GLUE_TOL[dtype])
    torch.testing.assert_close(k, want_k, **GLUE_TOL[dtype])
    assert not glue.rope_(q[..., :-1], k[..., :-1], cos[:, :-1], sin[:, :-1])  # odd head dim: torch's path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glue_silu_mul_equals_torch(dtype):
    import torch.nn.functional as F

    from sgrec.model.kernels import glue

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(7, 2 * 1500, generator=g) * 3).to(dtype)
    got = glue.silu_mul(x, 1500)
    want = F.silu(x[:, :1500]) * x[:, 1500:]
    torch.testing.assert_close(got, want, **GLUE_TOL[dtype])
    assert glue.silu_mul(x, 1499) is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_with_triton_glue_equals_plain(tiny_model_dir, arch):
    """A whole prefill of the model with the Triton glue (what the runner sets on CUDA with
    the triton backend) == without, float32: logits within 5e-5 (other summation orders; the C glue's
    bound, tests/test_native_kernels.py), the same greedy tokens."""
    from sgrec.model.kernels import glue

    runner = ModelRunner(ServerArgs.from_kwargs(model_path=tiny_model_dir(arch), device="cpu", dtype="float32",
                                                max_total_tokens=512, attention_backend="torch"))
    ids = list(range(3, 40))
    n = len(ids)

    def logits():
        slots = torch.arange(1, n + 1)
        return runner.forward(runner.make_batch(ids, list(range(n)), slots, [SeqLayout(0, n, slots)]), list(range(n)))

    plain = logits()
    runner.model.use_glue(glue)
    try:
        fused = logits()
    finally:
        runner.model.use_glue(None)
    assert (fused - plain).abs().max() <= 5e-5 and torch.equal(fused.argmax(-1), plain.argmax(-1))
