"""Decode steps through static, padded buffers (sgrec.model.cuda_graph.DecodeGraphs): on CPU the
same step runs eagerly (what the CUDA graph captures), against the runner's plain decode; on CUDA
(scripts/gpu_suite.sh) the captured graphs' replays against eager steps."""

from types import SimpleNamespace

import pytest
import torch

from sgrec.model import native
from sgrec.model.attention import SeqLayout, TritonBackend
from sgrec.model.cuda_graph import BUCKETS, DecodeGraphs, buckets_up_to, try_capture
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs


def test_buckets():
    assert buckets_up_to(1) == [1]
    assert buckets_up_to(20) == [1, 2, 4, 8, 12, 16, 20]
    assert buckets_up_to(512) == list(BUCKETS)
    with pytest.raises(ValueError, match="at least 1"):
        buckets_up_to(0)


def oom(*_a, **_k):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def sticky(*_a, **_k):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_capture_falls_back_only_when_out_of_memory(caplog):
    """try_capture: out of memory (the known, recoverable failure) -> None and a warning naming what runs
    instead; a CUDA error or a bug in the step is raised, not hidden behind an eager run."""
    assert try_capture(lambda: 7, "x") == 7
    with caplog.at_level("WARNING"):
        assert try_capture(oom, "decode runs without graphs") is None
    assert "out of device memory, decode runs without graphs" in caplog.text
    with pytest.raises(RuntimeError, match="illegal memory access"):
        try_capture(sticky, "x")
    with pytest.raises(TypeError):
        try_capture(lambda: None + 1, "x")


@pytest.mark.parametrize("fail,raised", [(oom, None), (sticky, RuntimeError)])
def test_decode_and_beam_graph_captures_use_it(monkeypatch, fail, raised):
    """The runner's decode graphs and a beam step's graph: out of memory runs eagerly, a CUDA error
    reaches the caller (before: both were caught, leaving a sticky error behind an eager run)."""
    import sgrec.beam.graphs as bg
    import sgrec.model.cuda_graph as cg

    monkeypatch.setattr(cg, "DecodeGraphs", fail)
    args = ServerArgs.from_kwargs(model_path="unused", device="cpu")
    runner = SimpleNamespace(device=torch.device("cuda"), args=args, backend=TritonBackend(), model=None,
                             kv_pool=SimpleNamespace(size=8), context_len=16)
    monkeypatch.setattr(bg, "capture", fail)
    beams = object.__new__(bg.BeamGraphs)
    beams.capture, beams.graphs, beams.outputs, beams.device, beams._mem = True, {}, {}, None, None
    if raised is None:
        assert ModelRunner._decode_graphs(runner) is None
        beams._capture((8, 1))
        assert beams.capture is False and not beams.graphs
    else:
        with pytest.raises(raised):
            ModelRunner._decode_graphs(runner)
        with pytest.raises(raised):
            beams._capture((8, 1))


def prefilled(runner: ModelRunner, lens: list[int], seed: int) -> list[tuple[torch.Tensor, int]]:
    """Sequences of the given lengths prefilled into the pool: (their slots, a next token) each."""
    g = torch.Generator().manual_seed(seed)
    V, out = runner.config.vocab_size, []
    for n in lens:
        slots = runner.kv_pool.allocator.alloc(n)
        ids = torch.randint(0, V, (n,), generator=g).tolist()
        runner.forward(runner.make_batch(ids, list(range(n)), slots, [SeqLayout(0, n, slots)]), [n - 1])
        out.append((slots, int(torch.randint(0, V, (1,), generator=g))))
    return out


def decode_batch(runner: ModelRunner, seqs: list[tuple[torch.Tensor, int]]):
    """One decode step's batch over the sequences (a new slot each), and the new slots."""
    new = runner.kv_pool.allocator.alloc(len(seqs))
    layouts = [SeqLayout(i, 1, torch.cat([s, new[i:i + 1]])) for i, (s, _) in enumerate(seqs)]
    return runner.make_batch([t for _, t in seqs], [s.numel() for s, _ in seqs], new, layouts), new


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler: no kernel backend decodes by slot on CPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_static_step_equals_plain_decode(tiny_model_dir, arch):
    """Batches of 1..9 sequences of mixed lengths through the static buffers, padded to their bucket
    (1, 2, 4, 8, 9) by one-token sequences on slot 0: the real rows' logits equal the runner's own
    decode within 1e-5 (relative), and the new tokens' K/V land in the same slots."""
    runner = ModelRunner(ServerArgs.from_kwargs(model_path=tiny_model_dir(arch), device="cpu", dtype="float32",
                                                max_total_tokens=4096, attention_backend="native"))
    graphs = DecodeGraphs(runner.model, runner.backend, runner.kv_pool, max_bs=9, max_kv_tokens=2000,
                          context_len=runner.context_len, capture=False)
    assert graphs.buckets == [1, 2, 4, 8, 9] and not graphs.graphs
    seqs = prefilled(runner, [5, 1, 40, 17, 3, 64, 2, 9, 30], seed=1)
    k_buf = runner.kv_pool.get_kv(0)[0]
    for n in range(1, 10):
        batch, new = decode_batch(runner, seqs[:n])
        assert graphs.takes(batch) and graphs.bucket(n) == next(b for b in graphs.buckets if b >= n)
        want = runner.forward(batch, list(range(n)))
        k_want = k_buf[new].clone()
        k_buf[new] = 0
        got = graphs.run(batch)
        # the padded rows change the matmuls' row count, so their float32 rounding: logits within 1e-5 of
        # their scale (the rounding of a sum is relative to its terms, not to a logit that cancels to ~0)
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert torch.allclose(k_buf[new], k_want, rtol=1e-5, atol=1e-6)
        runner.kv_pool.allocator.free(new)
    too_many, new = decode_batch(runner, seqs + seqs[:1])
    assert not graphs.takes(too_many)  # 10 sequences: no bucket
    runner.kv_pool.allocator.free(new)
    prefill = runner.make_batch([1, 2], [0, 1], seqs[0][0][:2], [SeqLayout(0, 2, seqs[0][0][:2])])
    assert not graphs.takes(prefill)
    small = DecodeGraphs(runner.model, runner.backend, runner.kv_pool, max_bs=4, max_kv_tokens=20,
                         context_len=runner.context_len, capture=False)
    batch, new = decode_batch(runner, seqs[:2])  # 5 + 1 + 2 new slots + 4 padding = 12 <= 24
    assert small.takes(batch)
    batch, new2 = decode_batch(runner, seqs[2:4])  # 41 + 18 > 24: past the slot buffer
    assert not small.takes(batch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_replay_the_eager_step(tiny_model_dir, dtype):
    """The runner captures a graph per bucket (triton backend); replays with batches of 1..20
    sequences equal the same padded step run eagerly (float32: within 1e-5; bfloat16: 2e-2)."""
    runner = ModelRunner(ServerArgs.from_kwargs(model_path=tiny_model_dir("llama"), device="cuda", dtype=dtype,
                                                max_total_tokens=8192, attention_backend="triton",
                                                cuda_graph_max_bs=24))
    graphs = runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == graphs.buckets == [1, 2, 4, 8, 12, 16, 24]
    eager = DecodeGraphs(runner.model, runner.backend, runner.kv_pool, max_bs=24, max_kv_tokens=16384,
                         context_len=runner.context_len, capture=False)
    seqs = prefilled(runner, [(7 * i) % 97 + 1 for i in range(20)], seed=2)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for n in (1, 3, 8, 13, 20):
        batch, new = decode_batch(runner, seqs[:n])
        want = eager.run(batch).clone()
        got = runner.forward(batch, list(range(n)))
        assert (got - want).abs().max() <= tol
        runner.kv_pool.allocator.free(new)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_beam_steps_replayed_from_graphs_equal_eager_rounds(tiny_model_dir):
    """Retrieve rounds on CUDA (triton backend: device rounds): with beam-step graphs captured on
    first use, twice over (capture, then replay), the same items, paths and scores (float32, 1e-4)
    as with --disable-cuda-graph; graphs were captured for the steps' (rows bucket, step)."""
    import random

    from sgrec.beam import RetrieveExecutor
    from sgrec.radix.tree import RadixCache
    from tests.test_retrieve_filters import make_catalog

    out = {}
    for off in (False, True):
        runner = ModelRunner(ServerArgs.from_kwargs(model_path=tiny_model_dir("qwen3"), device="cuda", dtype="float32",
                                                    max_total_tokens=8192, attention_backend="triton",
                                                    disable_cuda_graph=off))
        V = runner.config.vocab_size
        cat = make_catalog(random.Random(1), 300, 3, V, codes=12, dup=0.05)
        ex = RetrieveExecutor(runner, RadixCache(runner.kv_pool.allocator), cat)
        assert (ex.graphs is None) == off
        prompt = [random.Random(2).randrange(V) for _ in range(30)]
        reqs = [dict(input_ids=prompt, beam_width=16, top_k=8, num_items=10),
                dict(input_ids=prompt[5:], beam_width=9, top_k=4, num_items=9,
                     exclude_items=[it.id for it in cat.items[::3]])]
        out[off] = [ex.run_batch(reqs) for _ in range(2)]
        if not off:
            assert ex.graphs.graphs and all(s in (1, 2) for _, s in ex.graphs.graphs)
    for rounds_on, rounds_off in zip(out[False], out[True]):
        for a, b in zip(rounds_on, rounds_off):
            assert [x["item"] for x in a.items] == [x["item"] for x in b.items]
            assert max(abs(x["score"] - y["score"]) for x, y in zip(a.items, b.items)) <= 1e-4
