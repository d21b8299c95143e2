"""sgrec's C kernels for CPU (sgrec.model.native): the decode and extend attention kernels against the
float64 references (the extend kernel in every ISA build this CPU runs), the backends that use them
against the torch backend, auto's choice, and the build's fallback."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from sgrec.mem.kv_pool import KVPool
from sgrec.model import native
from sgrec.model.attention import ColumnMeta, ForwardBatch, NativeBackend, SeqLayout, TorchBackend, TritonBackend
from sgrec.model.backends import make_backend
from sgrec.model.cpu_caps import cpu_flags
from sgrec import layout as L
from sgrec.runner import ModelRunner
from sgrec.server_args import ServerArgs
from tests.kernel_refs import (bipartite_reference, case, decode_logits, pack, rank_case, rank_layouts, reference,
                               run_backends)

needs_kernels = pytest.mark.skipif(native.compiler() is None and not os.environ.get("CI"),
                                   reason="no C compiler on this machine")


def isa_builds():
    """Every -march this CPU can run the extend kernel under, its best first (AMX implies avx512_bf16 here,
    x86-64-v4 with avx512_bf16 implies x86-64-v4, which implies v3)."""
    order = [["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"], ["-march=x86-64-v4", "-mavx512bf16"],
             ["-march=x86-64-v4"], ["-march=x86-64-v3"], []]
    return order[order.index(native.march_flags(cpu_flags())):]


def isa_id(march: list[str]) -> str:
    return "+".join(f.split("=")[-1].removeprefix("-m") for f in march) if march else "default"


every_isa = pytest.mark.parametrize("march", isa_builds(), ids=isa_id)


@needs_kernels
@every_isa
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (6, 2, 16), (9, 3, 64), (8, 1, 24), (14, 2, 96), (16, 8, 128)])
@pytest.mark.parametrize("lens", [[1], [5, 16, 17, 40], [3, 300, 1, 33, 129]])
def test_decode_attention_equals_reference(march, hq, hkv, d, lens):
    """GQA ratios 1, 3, 8, 7, 2; head dims that are and are not multiples of the vector width; one-token
    and long sequences in one batch; slots scattered over the pool; every ISA build this CPU runs."""
    q, k_buf, v_buf, idx, ptr = case(hq, hkv, d, lens, torch.float32, seed=len(lens) + hq)
    out = native.decode_attention(q, k_buf, v_buf, idx, ptr, d ** -0.5, native.library(march))
    assert out.shape == (len(lens), hq * d) and out.dtype == torch.float32
    assert (out.double() - reference(q, k_buf, v_buf, idx, ptr, d ** -0.5)).abs().max() <= 1e-5


@needs_kernels
@every_isa
@pytest.mark.parametrize("d", [16, 64, 24, 128])
def test_decode_attention_bfloat16_and_a_wrong_input_is_caught(march, d):
    """bfloat16 rows widened a vector at a time (head dims a multiple of the width) or one by one; with
    avx512_bf16 built in, Q.K of head dims a multiple of 32 on the bf16 dot products."""
    q, k_buf, v_buf, idx, ptr = case(6, 2, d, [9, 31, 64], torch.bfloat16, seed=5)
    out = native.decode_attention(q, k_buf, v_buf, idx, ptr, 0.25, native.library(march))
    want = reference(q.float(), k_buf.float(), v_buf.float(), idx, ptr, 0.25)
    assert out.dtype == torch.bfloat16 and (out.double() - want).abs().max() <= 2e-2
    wrong = native.decode_attention(q, k_buf, v_buf, idx.flip(0), ptr, 0.25, native.library(march))  # other slots
    assert (wrong.double() - want).abs().max() > 1e-1


@needs_kernels
def test_a_sequence_gets_the_same_bits_in_any_batch():
    """Each (sequence, KV head) is one task whatever else the batch holds: no padding, no batch
    dependence (SDPA over a padded batch gives no such guarantee)."""
    q, k_buf, v_buf, idx, ptr = case(6, 2, 32, [7, 200, 3], torch.float32, seed=11)
    together = native.decode_attention(q, k_buf, v_buf, idx, ptr, 0.2)
    for b in range(3):
        alone = native.decode_attention(q[b : b + 1], k_buf, v_buf, idx[ptr[b] : ptr[b + 1]],
                                        torch.tensor([0, int(ptr[b + 1] - ptr[b])]), 0.2)
        assert torch.equal(alone[0], together[b])


@needs_kernels
def test_bad_inputs_are_refused_before_the_kernel():
    q, k_buf, v_buf, idx, ptr = case(6, 2, 16, [4, 5], torch.float32, seed=1)
    with pytest.raises(TypeError, match="one dtype"):
        native.decode_attention(q.double(), k_buf, v_buf, idx, ptr, 0.25)
    with pytest.raises(ValueError, match="shapes"):
        native.decode_attention(q[:, :5], k_buf, v_buf, idx, ptr, 0.25)  # 5 query heads over 2 KV heads
    with pytest.raises(ValueError, match="shapes"):
        native.decode_attention(q, k_buf, v_buf, idx, ptr[:2], 0.25)


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_backend_decode_equals_torch_backend(dtype, tol):
    """K/V written into one pool, then read by slot: the same outputs as the torch backend's decode."""
    hq, hkv, d, lens = 6, 2, 16, [1, 13, 4, 30]
    pool = KVPool(200, 1, hkv, d, dtype)
    pool.k_buffer[0].copy_(torch.randn_like(pool.k_buffer[0]))
    pool.v_buffer[0].copy_(torch.randn_like(pool.v_buffer[0]))
    slots = (torch.randperm(200)[: sum(lens)] + 1).split(lens)
    seqs = [SeqLayout(i, 1, sl) for i, sl in enumerate(slots)]
    new = torch.stack([sl[-1] for sl in slots])
    q, k, v = (torch.randn(len(lens), h, d).to(dtype) for h in (hq, hkv, hkv))
    outs = []
    for backend in (TorchBackend(), NativeBackend()):
        batch = ForwardBatch(torch.zeros(len(lens), dtype=torch.int64), torch.zeros(len(lens), dtype=torch.int64),
                             new, seqs, pool)
        backend.prepare(batch)
        outs.append(backend.forward(q, k, v, 0, batch, d ** -0.5).float())
    assert (outs[0] - outs[1]).abs().max() <= tol


@needs_kernels
def test_runner_with_the_native_backend_decodes_like_torch(tiny_model_dir):
    """A tiny qwen3 (GQA, q/k norms): prefill, then 4 decode steps of two sequences of different
    lengths; the native-backend runner's logits == the torch-backend runner's within 1e-5."""
    path = tiny_model_dir("qwen3")
    runners = [ModelRunner(ServerArgs.from_kwargs(model_path=path, device="cpu", dtype="float32", max_total_tokens=256,
                                                  attention_backend=name)) for name in ("torch", "native")]
    assert type(runners[0].backend) is TorchBackend and isinstance(runners[1].backend, NativeBackend)
    logits = [decode_logits(r) for r in runners]
    assert (logits[0] - logits[1]).abs().max() <= 1e-5


def test_without_a_compiler_native_is_a_clear_error(monkeypatch, tmp_path, caplog):
    """No compiler on PATH and none in CC: one warning, auto is still the torch backend, native is a
    clear error, and nothing is cached."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SGREC_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="sgrec.model.native"):
        assert native.load() is None
        assert type(make_backend("auto", "cpu")) is TorchBackend
    assert [r.getMessage() for r in caplog.records].count(
        "CPU kernels unavailable, using the pure-torch paths: no C compiler found (set CC, or install cc/gcc/clang)") == 1
    with pytest.raises(ValueError, match="needs a C compiler"):
        make_backend("native", "cpu")
    assert not (tmp_path / "cache").exists()


def test_a_compiler_that_fails_is_a_fallback_too(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CC", "false")  # exists, fails every build
    monkeypatch.setenv("SGREC_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="sgrec.model.native"):
        assert native.load() is None
    assert any("false could not build attention.c" in r.getMessage() for r in caplog.records)
    assert list((tmp_path / "native").iterdir()) == []  # no half-written library left behind


@needs_kernels
def test_the_build_command_caches_the_library(tmp_path):
    """`python -m sgrec.model.native` builds into $SGREC_CACHE_DIR/native and prints the path; a second
    run loads the same file without rebuilding it."""
    env = {**os.environ, "SGREC_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-m", "sgrec.model.native"], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    path = first.stdout.strip()
    assert os.path.dirname(path) == str(tmp_path / "native") and os.path.exists(path)
    mtime = os.stat(path).st_mtime_ns
    second = subprocess.run([sys.executable, "-m", "sgrec.model.native"], env=env, capture_output=True, text=True)
    assert second.stdout.strip() == path and os.stat(path).st_mtime_ns == mtime


# ---- extend (prefill) attention -------------------------------------------------------------------
def big_rank_layouts():
    """Layouts larger than the kernel's tiles (64 tokens x 32 columns): 40 items of 1-20 tokens, users
    of 100 and 70 tokens, cold, with items cached out of layout order, with the user cached."""
    items = [[100 + j] * (1 + (7 * j) % 20) for j in range(40)]
    item = L.item_as_prefix([5, 6], items, list(range(200, 300)), [9, 8])
    cached = [0, 1] + [c for s in item.items()[::3] for c in range(s.start, s.stop)]
    user = L.user_as_prefix(list(range(300, 370)), items[:25], [9])
    return [(item, []), (item, cached), (user, list(range(50)))]


def causal_case(hq, hkv, d, specs, dtype, seed):
    """Plain causal sequences, (cached prefix length, new tokens) each: the kernel's SeqLayouts (no
    mask) and the reference's (the dense causal mask), q/k/v of the new tokens and the pool."""
    g = torch.Generator().manual_seed(seed)
    total = sum(p + n for p, n in specs)
    k_buf, v_buf = (torch.randn(total + 5, hkv, d, generator=g).to(dtype) for _ in range(2))
    perm = torch.randperm(total + 4, generator=g) + 1
    seqs, refs, locs, T, used = [], [], [], 0, 0
    for p, n in specs:
        slots = perm[used : used + p + n]
        used += p + n
        seqs.append(SeqLayout(T, n, slots))
        refs.append(SeqLayout(T, n, slots, torch.ones(n, p + n, dtype=torch.bool).tril(p)))
        locs.append(slots[p:])
        T += n
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    k, v = (torch.randn(T, hkv, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, k_buf, v_buf, seqs, refs, torch.cat(locs)


def run_extend(q, k, v, k_buf, v_buf, meta, scale, lib=None):
    return native.extend_attention(q, k, v, k_buf, v_buf, meta.q_start, meta.q_end - meta.q_start, meta.q_order,
                                   meta.q_block, meta.c_idx, meta.c_order, meta.c_block, meta.c_ptr, scale, lib=lib)


@needs_kernels
@every_isa
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (6, 2, 24), (9, 3, 64), (8, 1, 40), (16, 8, 128)])
def test_extend_attention_equals_reference_under_rank_masks(march, hq, hkv, d):
    """Rank layouts (user and item as prefix; cached columns in and out of layout order; partial user
    prefixes; items longer than a tile; many items per tile) == float64 attention under each dense
    mask, 1e-5; GQA 1, 3, 8, 2; head dims that are and are not multiples of the vector width; every
    ISA build this CPU runs (AVX-512, AVX2, the compiler's default)."""
    lib = native.library(march)
    for layouts in (rank_layouts(), big_rank_layouts()):
        q, k, v, k_buf, v_buf, seqs, locs = rank_case(hq, hkv, d, layouts, torch.float32, seed=hq + d)
        out = run_extend(q, k, v, k_buf, v_buf, pack(seqs, locs, q.shape[0]), d ** -0.5, lib)
        assert out.shape == (q.shape[0], hq * d) and out.dtype == torch.float32
        assert (out.double() - bipartite_reference(q, k, v, k_buf, v_buf, seqs, d ** -0.5)).abs().max() <= 1e-5


@needs_kernels
@every_isa
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (6, 2, 24), (2, 2, 96)])
def test_extend_attention_equals_reference_causal(march, hq, hkv, d):
    """Causal sequences in one batch: a fresh prefill of 300 tokens (several row and column tiles), one
    token after a 70-token prefix, 40 after 129, 1 fresh, none after 5, 33 after 1; 1e-5 against float64."""
    specs = [(0, 300), (70, 1), (129, 40), (0, 1), (5, 0), (1, 33)]  # (5, 0): nothing new, no task
    q, k, v, k_buf, v_buf, seqs, refs, locs = causal_case(hq, hkv, d, specs, torch.float32, seed=d)
    out = run_extend(q, k, v, k_buf, v_buf, pack(seqs, locs, q.shape[0], causal=True), 0.3,
                     native.library(march))
    assert (out.double() - bipartite_reference(q, k, v, k_buf, v_buf, refs, 0.3)).abs().max() <= 1e-5


@needs_kernels
@every_isa
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (6, 2, 24), (8, 1, 40), (2, 2, 128), (4, 2, 15)])
def test_extend_attention_bfloat16_equals_reference(march, hq, hkv, d):
    """bfloat16 q/k/v and pool, rank layouts and causal sequences: the bf16 dot-product build (P rounded
    to bfloat16, float32 sums) and the widening builds both within 2e-2 of float64 attention over the
    same bfloat16 inputs; an odd head dim (15) takes the widening path in every build."""
    lib = native.library(march)
    assert native.bf16_dot(lib) == ("-mavx512bf16" in march)
    if "-mamx-bf16" not in march:  # (with it: AMX where Linux grants the process the tile data, else the dot products)
        assert not native.bf16_amx(lib)
    for layouts in (rank_layouts(), big_rank_layouts()):
        q, k, v, k_buf, v_buf, seqs, locs = rank_case(hq, hkv, d, layouts, torch.bfloat16, seed=hq + d)
        out = run_extend(q, k, v, k_buf, v_buf, pack(seqs, locs, q.shape[0]), d ** -0.5, lib)
        assert out.shape == (q.shape[0], hq * d) and out.dtype == torch.bfloat16
        assert (out.double() - bipartite_reference(q, k, v, k_buf, v_buf, seqs, d ** -0.5)).abs().max() <= 2e-2
    specs = [(0, 300), (70, 1), (129, 40), (0, 1), (5, 0), (1, 33)]
    q, k, v, k_buf, v_buf, seqs, refs, locs = causal_case(hq, hkv, d, specs, torch.bfloat16, seed=d)
    out = run_extend(q, k, v, k_buf, v_buf, pack(seqs, locs, q.shape[0], causal=True), 0.3, lib)
    assert (out.double() - bipartite_reference(q, k, v, k_buf, v_buf, refs, 0.3)).abs().max() <= 2e-2


@needs_kernels
@every_isa
def test_extend_attention_bfloat16_when_the_max_jumps_between_tiles(march):
    """Keys that grow along the sequence, so a row's max jumps by far more than the bf16 kernels' lazy
    threshold (8, base 2) from one 32-column tile to the next (and less than it within some): the output
    rescale runs and is skipped, both within 2e-2 of float64 attention; a cached prefix and new tokens."""
    specs = [(70, 60), (0, 129)]
    q, k, v, k_buf, v_buf, seqs, refs, locs = causal_case(6, 2, 64, specs, torch.bfloat16, seed=4)
    grow = lambda n: (1 + torch.arange(n, dtype=torch.float32) / 4).view(-1, 1, 1)  # noqa: E731
    q = (q.float().abs() + 0.5).bfloat16()  # positive scores, rising with the key's scale
    k = (k.float().abs() * grow(k.shape[0])).bfloat16()
    k_buf = (k_buf.float().abs() * grow(k_buf.shape[0])).bfloat16()
    out = run_extend(q, k, v, k_buf, v_buf, pack(seqs, locs, q.shape[0], causal=True), 0.125, native.library(march))
    want = bipartite_reference(q, k, v, k_buf, v_buf, refs, 0.125)
    assert (out.double() - want).abs().max() <= 2e-2


@needs_kernels
def test_bf16_extend_runs_on_amx_where_the_cpu_and_linux_allow_it():
    """auto's build takes AMX tiles where the CPU reports amx_tile and amx_bf16 and Linux (5.16 on) grants the
    tile data: on such a machine the AMX cases above ran the AMX path, not the dot products."""
    flags = cpu_flags()
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags):
        pytest.skip("this CPU reports no AMX bf16: the AMX build is not run here")
    release = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    assert "-mamx-bf16" in native.march_flags(flags)
    assert native.bf16_amx() == (release >= (5, 16))


@needs_kernels
def test_extend_attention_bfloat16_and_a_wrong_mask_is_caught():
    q, k, v, k_buf, v_buf, seqs, locs = rank_case(6, 2, 16, big_rank_layouts(), torch.bfloat16, seed=11)
    meta = pack(seqs, locs, q.shape[0])
    want = bipartite_reference(q, k, v, k_buf, v_buf, seqs, 0.25)
    out = run_extend(q, k, v, k_buf, v_buf, meta, 0.25)
    assert out.dtype == torch.bfloat16 and (out.double() - want).abs().max() <= 2e-2
    meta.q_block.fill_(-1)  # causal only: an item's tokens see the candidates before it
    meta.c_block.fill_(-1)
    wrong = run_extend(q.float(), k.float(), v.float(), k_buf.float(), v_buf.float(), meta, 0.25)
    assert (wrong.double() - want).abs().max() > 1e-1


@needs_kernels
def test_extend_attention_rejects_what_it_cannot_run():
    q, k, v, k_buf, v_buf, seqs, locs = rank_case(6, 2, 16, rank_layouts(), torch.float32, seed=1)
    meta = pack(seqs, locs, q.shape[0])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        run_extend(q.double(), k, v, k_buf, v_buf, meta, 0.25)
    with pytest.raises(ValueError, match="shapes"):
        run_extend(q[:, :5], k, v, k_buf, v_buf, meta, 0.25)  # 5 query heads over 2 KV heads


@needs_kernels
def test_native_backend_extend_equals_torch_backend():
    """The backend's extend batches: a rank batch and a causal batch through the kernel (new K/V
    written to the pool, cached K/V read by slot), a batch with a sequence that has only a dense mask,
    and a bfloat16 pool under a float32-only backend (auto's), through torch; each equals TorchBackend
    within 1e-5."""
    hq, hkv, d = 6, 2, 16
    q, k, v, k_buf, v_buf, seqs, locs = rank_case(hq, hkv, d, big_rank_layouts(), torch.float32, seed=3)
    dense = SeqLayout(seqs[0].q_start, seqs[0].q_len, seqs[0].kv_indices, seqs[0].mask)
    cq, ck, cv, ck_buf, cv_buf, cseqs, _, clocs = causal_case(hq, hkv, d, [(0, 70), (30, 5)], torch.float32, seed=4)
    cases = [(q, k, v, k_buf, v_buf, seqs, locs, True), (q, k, v, k_buf, v_buf, [dense, *seqs[1:]], locs, False),
             (cq, ck, cv, ck_buf, cv_buf, cseqs, clocs, True)]
    for q, k, v, k_buf, v_buf, batch_seqs, locs, kernel in cases:
        outs, took = run_backends((TorchBackend(), NativeBackend()), q, k, v, k_buf, v_buf, batch_seqs, locs, d ** -0.5)
        assert took == [False, kernel]
        assert (outs[0] - outs[1]).abs().max() <= 1e-5
    pool = KVPool(8, 1, hkv, d, torch.bfloat16)
    batch = ForwardBatch(torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64),
                         torch.arange(1, 6), [SeqLayout(0, 5, torch.arange(1, 6))], pool)
    NativeBackend(extend_dtypes=(torch.float32,)).prepare(batch)
    assert not isinstance(batch.attn_meta, ColumnMeta) and NativeBackend().takes_decode(batch) is False


@needs_kernels
def test_runner_with_the_native_backend_prefills_like_torch(tiny_model_dir):
    """Prefills of prompts of different lengths (77 tokens: several of the kernel's tiles) and greedy
    decode steps: the runner on the native backend == on torch within 5e-5 (two implementations summing
    in other orders, as against HF; logits up to about 7 here, measured 1.0e-5) and the same greedy
    tokens."""
    runners = [ModelRunner(ServerArgs(model_path=tiny_model_dir("llama"), max_total_tokens=256, dtype="float32",
                                      attention_backend=name)) for name in ("torch", "native")]
    logits = [decode_logits(r, prompts=([5, 9, 33, 2, 8, 41, 7] * 11, [17, 3], list(range(3, 40)))) for r in runners]
    assert (logits[0] - logits[1]).abs().max() <= 5e-5
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_march_by_cpu_flags():
    v3 = ["avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"]
    v4 = v3 + ["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"]
    assert native.march_flags(v4) == ["-march=x86-64-v4"]
    assert native.march_flags(v4 + ["avx512_bf16"]) == ["-march=x86-64-v4", "-mavx512bf16"]
    amx = ["-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]
    assert native.march_flags(v4 + ["avx512_bf16", "amx_tile", "amx_bf16"]) == amx
    assert native.march_flags(v4 + ["avx512_bf16", "amx_tile"]) == amx[:2]  # tiles without the bf16 product
    assert native.march_flags(v4 + ["amx_tile", "amx_bf16"]) == ["-march=x86-64-v4"]  # AMX path sits in the bf16 one
    assert native.march_flags(v3 + ["avx512_bf16"]) == ["-march=x86-64-v3"]  # bf16 dots need the AVX-512 build
    assert native.march_flags(v3 + ["avx512f"]) == ["-march=x86-64-v3"]  # AVX-512 without BW/DQ/VL
    assert native.march_flags(v3) == ["-march=x86-64-v3"]
    assert native.march_flags(["sse2", "avx"]) == []
    assert native.march_flags(["fp", "asimd"]) == []  # ARM


@needs_kernels
def test_auto_picks_the_native_kernels_only_with_avx512(monkeypatch):
    """auto on CPU: the native backend where the CPU reports AVX-512 (flags injected both ways), torch
    without it: decode in float32 and bfloat16, extend in float32, and in bfloat16 too where the kernels
    were built on the CPU's bf16 dot products (avx512_bf16); on CUDA triton where it imports (it does
    here: torch ships it) and its decode kernel runs there (triton_decodes), else torch."""
    import sgrec.model.cpu_caps as caps

    v3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"}
    monkeypatch.setattr(caps, "cpu_flags", lambda: frozenset(v3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq",
                                                                    "avx512vl"}))
    monkeypatch.setattr(native, "load", lambda: object())  # built (whatever this CPU is)
    monkeypatch.setattr(native, "bf16_dot", lambda lib=None: False)  # without avx512_bf16
    auto = make_backend("auto", "cpu")
    assert type(auto) is NativeBackend and auto.extend_dtypes == (torch.float32,)  # bf16 prefill: torch's SDPA
    assert auto.decode_dtypes == (torch.float32, torch.bfloat16)
    monkeypatch.setattr(native, "bf16_dot", lambda lib=None: True)  # built with -mavx512bf16
    assert make_backend("auto", "cpu").extend_dtypes == (torch.float32, torch.bfloat16)
    import importlib.util

    import sgrec.model.backends as backends

    monkeypatch.setattr(backends, "triton_decodes", lambda device: True)  # (no CUDA device here to check on)
    assert type(make_backend("auto", "cuda")) is TritonBackend
    monkeypatch.setattr(backends, "triton_decodes", lambda device: False)  # Triton does not run there
    assert type(make_backend("auto", "cuda")) is TorchBackend
    monkeypatch.setattr(backends, "triton_decodes", lambda device: True)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find(name, *a))
    assert type(make_backend("auto", "cuda")) is TorchBackend
    monkeypatch.setattr(caps, "cpu_flags", lambda: frozenset(v3))
    assert type(make_backend("auto", "cpu")) is TorchBackend


# ---- fused glue (RMSNorm, RoPE, SiLU * up) --------------------------------------------------------
@needs_kernels
@every_isa
@pytest.mark.parametrize("n", [576, 40, 7])
def test_fused_rmsnorm_equals_torch(march, n):
    """Rows of a strided view (every other row of a buffer), dims that are and are not multiples of the
    vector width, values over several magnitudes; with a residual, x += residual in place first. Equal
    to the float64 reference within 1e-5 (relative to the output's scale), and a row's bits do not
    depend on how many rows come with it."""
    from sgrec.model.llama import RMSNorm

    lib = native.library(march)
    g = torch.Generator().manual_seed(n)
    buf = torch.randn(2 * 33, n, generator=g) * torch.logspace(-2, 2, 2 * 33)[:, None]
    x = buf[::2]  # row stride 2n
    w = torch.randn(n, generator=g)
    norm = RMSNorm(n, 1e-6)
    norm.weight.data.copy_(w)

    def ref(t):
        t = t.double()
        return (w.double() * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)).float()

    out = native.rmsnorm(x, w, 1e-6, lib=lib)
    want = ref(x)
    assert ((out - want).abs() / want.abs().amax(-1, keepdim=True)).max() <= 1e-5
    assert ((norm(x) - want).abs() / want.abs().amax(-1, keepdim=True)).max() <= 1e-5  # torch's own, as sanity
    assert torch.equal(native.rmsnorm(x[5:6], w, 1e-6, lib=lib), out[5:6])
    res = torch.randn(33, n, generator=g)
    x2, before = x.clone(), x.clone()
    out2 = native.rmsnorm(x2, w, 1e-6, residual=res, lib=lib)
    assert torch.equal(x2, before + res) and ((out2 - ref(before + res)).abs().max() <= 1e-5 * ref(before + res).abs().max())
    # bfloat16 (the normalised row rounded before the weight): bit for bit sgrec's torch path in bfloat16
    xb, wb, rb = x.bfloat16(), w.bfloat16(), res.bfloat16()
    norm.weight.data = wb.clone()
    assert torch.equal(native.rmsnorm(xb, wb, 1e-6, lib=lib), norm(xb))
    xb2 = xb.clone()
    outb = native.rmsnorm(xb2, wb, 1e-6, residual=rb, lib=lib)
    assert torch.equal(xb2, xb + rb) and torch.equal(outb, norm(xb + rb))
    assert native.rmsnorm(xb.half(), wb, 1e-6, lib=lib) is None  # a dtype the kernels do not take: torch's then


@needs_kernels
@every_isa
@pytest.mark.parametrize("n", [1024, 256, 40, 7])
def test_the_zero_centred_norm_equals_its_torch_path(march, n):
    """Qwen3.5's norm (scale 1 + weight in float32, one rounding at the end): a float32 weight on
    bfloat16 rows, with and without the residual's add, within one bfloat16 step of the family's torch
    path and equal to it in all but a few elements (the sum of squares adds in another order, so the
    float32 scale may differ in its last bit); on float32 rows within float32 rounding; a row's bits do
    not depend on the rows beside it."""
    from sgrec.model.qwen3_5 import ZeroCenteredRMSNorm

    lib = native.library(march)
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(2 * 33, n, generator=g) * torch.logspace(-2, 2, 2 * 33)[:, None])[::2]
    res = torch.randn(33, n, generator=g)
    norm = ZeroCenteredRMSNorm(n, 1e-6)  # no glue: the torch path
    norm.weight.data.copy_(torch.randn(n, generator=g) * 0.5)
    scale = 1.0 + norm.weight.float()
    for dtype in (torch.bfloat16, torch.float32):
        xd, rd = x.to(dtype), res.to(dtype)
        out = native.rmsnorm(xd, scale, 1e-6, lib=lib)
        close_to_torch(out, norm(xd))
        assert torch.equal(native.rmsnorm(xd[5:6], scale, 1e-6, lib=lib), out[5:6])
        summed = xd.clone()
        out2 = native.rmsnorm(summed, scale, 1e-6, residual=rd, lib=lib)
        assert torch.equal(summed, xd + rd)
        close_to_torch(out2, norm(xd + rd))


def close_to_torch(out: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16: within one bfloat16 step of torch's, and equal in all but 0.1% of the elements (a
    float32 intermediate that differs in its last bit moves a rounding); float32: within float32
    rounding of the row's scale."""
    assert out.shape == want.shape and out.dtype == want.dtype
    diff = (out.float() - want.float()).abs()
    if out.dtype == torch.bfloat16:
        assert (diff <= want.float().abs() * 2**-7).all() and (diff > 0).float().mean() <= 1e-3
    else:
        assert (diff <= 1e-5 * want.abs().amax(-1, keepdim=True)).all()


@needs_kernels
@every_isa
@pytest.mark.parametrize("groups,n", [(16, 128), (3, 40), (2, 7)])
def test_the_gated_norm_equals_its_torch_path(march, groups, n):
    """The Gated DeltaNet's output norm over groups of n channels, the gate a strided slice of a wider
    projection (as the layer's z is): in bfloat16 within one bfloat16 step of the family's torch path
    and equal to it in all but a few elements (the gate's SiLU rounds in float32 before the product's
    rounding); in float32 within float32 rounding; a row's bits do not depend on the rows beside it."""
    from sgrec.model.qwen3_5 import GatedRMSNorm

    lib = native.library(march)
    g = torch.Generator().manual_seed(groups * n)
    T = 37
    x = torch.randn(T, groups * n, generator=g) * torch.logspace(-2, 1, T)[:, None]
    wide = torch.randn(T, 3 * groups * n + 5, generator=g) * 3
    gate = wide[:, groups * n : 2 * groups * n]
    norm = GatedRMSNorm(n, 1e-6)  # no glue: the torch path
    norm.weight.data.copy_(torch.randn(n, generator=g))
    for dtype in (torch.bfloat16, torch.float32):
        norm.to(dtype)
        xd, gd = x.to(dtype), wide.to(dtype)[:, groups * n : 2 * groups * n]
        out, want = native.gated_rmsnorm(xd, gd, norm.weight.data, 1e-6, lib=lib), norm(xd, gd)
        assert want.shape == (T, groups * n)
        close_to_torch(out, want)
        assert torch.equal(native.gated_rmsnorm(xd[5:6], gd[5:6], norm.weight.data, 1e-6, lib=lib), out[5:6])
    assert native.gated_rmsnorm(x.half(), gate.half(), norm.weight.data.half(), 1e-6, lib=lib) is None


@needs_kernels
@every_isa
@pytest.mark.parametrize("D", [64, 24, 6])
def test_fused_rope_equals_apply_rope(march, D):
    """q and k as views of one fused qkv output (token stride q + 2 kv), rotated in place == apply_rope
    within 1e-6; positions beyond the table's start; the v columns untouched."""
    from sgrec.model.rope import RotaryEmbedding, apply_rope

    lib = native.library(march)
    T, hq, hk = 21, 6, 2
    g = torch.Generator().manual_seed(D)
    qkv = torch.randn(T, (hq + 2 * hk) * D, generator=g) * 3
    q, k, v = qkv.split([hq * D, hk * D, hk * D], dim=-1)
    q, k = q.view(T, hq, D), k.view(T, hk, D)
    cos, sin = RotaryEmbedding(D, 10000.0, None, 64, torch.device("cpu")).cos_sin(torch.arange(40, 40 + T),
                                                                                 torch.float32)
    want_q, want_k, v_before = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.clone()
    assert native.rope_(q, k, cos, sin, lib=lib)
    assert (q - want_q).abs().max() <= 1e-6 * 3 and (k - want_k).abs().max() <= 1e-6 * 3
    assert torch.equal(v, v_before)
    assert not native.rope_(q.bfloat16(), k.bfloat16(), cos, sin, lib=lib)  # mixed dtypes: torch's then
    # bfloat16 (each product rounded, then the sum): bit for bit torch's apply_rope in bfloat16
    qb, kb = qkv.bfloat16().split([hq * D, hk * D, hk * D], dim=-1)[:2]
    qb, kb = qb.view(T, hq, D), kb.view(T, hk, D)
    cb, sb = cos.bfloat16(), sin.bfloat16()
    want_q, want_k = apply_rope(qb, cb, sb), apply_rope(kb, cb, sb)
    assert native.rope_(qb, kb, cb, sb, lib=lib) and torch.equal(qb, want_q) and torch.equal(kb, want_k)


@needs_kernels
@every_isa
@pytest.mark.parametrize("inter", [1536, 40, 5])
def test_fused_silu_mul_equals_torch(march, inter):
    """silu(gate) * up over gates from -200 to 200 (e^-g overflowing float32 at the low end) == torch
    within 1e-6 relative; a row's bits do not depend on the batch."""
    import torch.nn.functional as F

    lib = native.library(march)
    g = torch.Generator().manual_seed(inter)
    gu = torch.randn(17, 2 * inter, generator=g) * 4
    gu[0, :inter] = torch.linspace(-200, 200, inter)
    out = native.silu_mul(gu, inter, lib=lib)
    want = (F.silu(gu[:, :inter].double()) * gu[:, inter:].double()).float()
    assert ((out - want).abs() <= 1e-6 * (1 + want.abs())).all()
    assert torch.equal(native.silu_mul(gu[3:4], inter, lib=lib), out[3:4])
    # bfloat16 (silu rounded before the product): bit for bit torch's F.silu(gate) * up in bfloat16,
    # except where e^-g underflows float32 (|value| < 1e-30: exp implementations differ in denormals)
    gb = gu.bfloat16()
    outb, wantb = native.silu_mul(gb, inter, lib=lib).float(), (F.silu(gb[:, :inter]) * gb[:, inter:]).float()
    tiny = wantb.abs() < 1e-30
    assert torch.equal(outb[~tiny], wantb[~tiny]) and (outb[tiny].abs() < 1e-30).all()
    assert native.silu_mul(gu.half(), inter, lib=lib) is None  # float16: torch's then


@needs_kernels
def test_the_native_backend_turns_the_glue_on_for_float32(tiny_model_dir):
    """A runner on the native backend routes RMSNorm, RoPE and the MLP's activation through the fused
    kernels (float32 here; bfloat16 in the tests above), one on torch does not; their prefill logits agree within 5e-5 (other summation
    orders) with the same greedy tokens (the runner test above covers decode)."""
    from sgrec.model.llama import MLP, RMSNorm

    runners = [ModelRunner(ServerArgs(model_path=tiny_model_dir("qwen3"), max_total_tokens=128, dtype="float32",
                                      attention_backend=name)) for name in ("torch", "native")]
    mods = [[m for m in r.model.modules() if isinstance(m, (RMSNorm, MLP))] for r in runners]
    assert all(m.glue is None for m in mods[0]) and all(m.glue is native for m in mods[1])
    logits = [decode_logits(r, prompts=(list(range(3, 60)), [9, 8, 7]), steps=2) for r in runners]
    assert (logits[0] - logits[1]).abs().max() <= 5e-5
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


# ---- beam steps through the extend kernel (sgrec.beam.attention.beams_as_blocks) ------------------
@needs_kernels
@every_isa
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (6, 1)])
@pytest.mark.parametrize("groups", [[(37, 9, 1)], [(300, 40, 3)], [(12, 3, 2), (0, 5, 2), (129, 64, 3)],
                                    [(1, 1, 1), (50, 17, 4)]])
def test_beam_step_through_the_extend_kernel_equals_staged(march, hq, hkv, groups):
    """Every beam of a request as one block of a bipartite layout (prompt in no block, beam i's own
    tokens in block i) through the extend kernel == the staged attention (shared prompt stage, own
    tokens stage, log-sum-exp merge) per request, float32, within 1e-5. groups: (prompt length P,
    beams n, own tokens s, the current one included) per request of the step."""
    from sgrec.beam.attention import BeamBatchMeta, BeamStepMeta, beams_as_blocks, staged_attention

    lib = native.library(march)
    D, slots = 16, 4000
    g = torch.Generator().manual_seed(sum(p * 7 + n * 3 + s for p, n, s in groups))
    k_buf, v_buf = torch.randn(slots, hkv, D, generator=g) * 2, torch.randn(slots, hkv, D, generator=g)
    perm, used, metas = torch.randperm(slots - 1, generator=g) + 1, 0, []
    for P, n, s in groups:
        metas.append(BeamStepMeta(perm[used:used + P], perm[used + P:used + P + n * s].view(n, s)))
        used += P + n * s
    T = sum(n for _, n, _ in groups)
    q = torch.randn(T, hq, D, generator=g) * 2
    cur = torch.cat([m.unshared_idx[:, -1] for m in metas])  # the current tokens: in the pool and in k/v
    k, v = k_buf[cur].clone(), v_buf[cur].clone()
    meta = metas[0] if len(metas) == 1 else BeamBatchMeta(metas)
    rows = [(0, T)] if len(metas) == 1 else meta.rows()
    want = torch.cat([staged_attention(q[a:b], k_buf, v_buf, m.shared_idx, m.unshared_idx, D ** -0.5)
                      for m, (a, b) in zip(metas, rows)])
    c = beams_as_blocks(meta)
    got = native.extend_attention(q, k, v, k_buf, v_buf, c.q_start, c.q_end - c.q_start, c.q_order, c.q_block,
                                  c.c_idx, c.c_order, c.c_block, c.c_ptr, D ** -0.5, lib=lib)
    assert (got - want).abs().max() <= 1e-5


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_retrieve_with_kernel_beam_steps_equals_staged(tiny_model_dir, arch):
    """Retrieve (a batched round of three requests, then one request alone) with the runner's backend
    NativeBackend (beam steps through the extend kernel) == with TorchBackend (staged attention):
    the same items, scores (the sum of ND = 3 levels' logprobs) within ND x 1e-5."""
    import random

    from sgrec.beam import RetrieveExecutor
    from sgrec.radix.tree import RadixCache
    from tests.test_beam import random_catalog

    runner = ModelRunner(ServerArgs.from_kwargs(model_path=tiny_model_dir(arch), device="cpu", dtype="float32",
                                                max_total_tokens=40000, attention_backend="native"))
    V, rng = runner.config.vocab_size, random.Random(5)
    cat = random_catalog(rng, 1500, 3, V, codes=40)
    reqs = [dict(input_ids=[rng.randrange(V) for _ in range(rng.randint(5, 60))], beam_width=bw, top_k=bw,
                 num_items=8) for bw in (8, 64, 32)]
    out = {}
    for name, backend in (("native", runner.backend), ("torch", TorchBackend())):
        runner.backend = backend
        ex = RetrieveExecutor(runner, RadixCache(runner.kv_pool.allocator), cat)
        out[name] = ex.run_batch(reqs) + [ex.run(**reqs[1])]
        assert (ex.backend.native is not None) == (name == "native")
        ex.tree.reset()
    for a, b in zip(out["native"], out["torch"]):
        assert [i["item"] for i in a.items] == [i["item"] for i in b.items]
        assert max(abs(x["score"] - y["score"]) for x, y in zip(a.items, b.items)) <= 3 * 1e-5


def test_a_bipartite_mask_alone_is_what_the_dense_mask_was():
    """Rank layouts given only as their BipartiteMask (no dense mask built: 130M entries for an
    8K-token user and 200 items) attend as with the dense mask through the torch backend, which
    makes it when it needs it; a one-token sequence with such a mask is not a decode."""
    import dataclasses

    q, k, v, k_buf, v_buf, seqs, locs = rank_case(6, 2, 16, rank_layouts(), torch.float32, seed=4)
    compact = [dataclasses.replace(s, mask=None) for s in seqs]
    assert all(torch.equal(c.dense_mask(), s.mask) for c, s in zip(compact, seqs))
    (dense,), _ = run_backends([TorchBackend()], q, k, v, k_buf, v_buf, seqs, locs, 0.25)
    (alone,), _ = run_backends([TorchBackend()], q, k, v, k_buf, v_buf, compact, locs, 0.25)
    assert torch.equal(alone, dense)
    one = SeqLayout(0, 1, torch.arange(1, 4), bipartite=L.item_as_prefix([5], [[6]], [], [7]).bipartite())
    batch = ForwardBatch(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.ones(1), [one],
                         None)
    assert one.masked and not batch.is_decode


@needs_kernels
@every_isa
def test_the_fma_limit_counts_the_operations_it_ran(march):
    """sgrec_fma_peak (the benchmarks' float32 compute limit) reports 2 operations a lane for each of
    16 FMAs a round on every thread of torch's team, at this build's vector width."""
    lib = native.library(march)
    width = 16 if "-march=x86-64-v4" in march else 8 if "-march=x86-64-v3" in march else 4  # vec.h's VW
    assert lib.sgrec_fma_peak(1000) == 2 * 16 * width * 1000 * torch.get_num_threads()
    assert native.fma_peak_gflops(0.01, lib) > 0
