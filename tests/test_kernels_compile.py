"""The Triton kernels compiled for a Hopper GPU (sm_90: H100, H200) on this CPU machine: Triton's
compiler and the ptxas it ships need no GPU, so CI catches what the interpreter (which runs the
kernels' Python, not their compilation) lets through -- a type the compiler rejects, a shape it
cannot lower -- before a lent GPU's few minutes are spent on it.

Each wrapper (decode attention, the glue, the staged beam attention, the bipartite attention, the
trie step) is called on small CPU tensors with its kernels swapped
for recorders; every recorded launch (its arguments' types, its constexprs and num_warps) is then
compiled to a cubin for sm_90 from the real, uninterpreted kernel."""

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
           torch.int32: "*i32", torch.int8: "*i8", torch.uint8: "*u8", torch.bool: "*i1"}


class Recorder:
    """Stands for a jitted kernel: kernel[grid](*args, **kw) records the launch and runs nothing."""

    def __init__(self):
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((args, kw))


def arg_type(a) -> str:
    if isinstance(a, torch.Tensor):
        return POINTER[a.dtype]
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i64" if abs(a) >= 2**31 else "i32"
    if isinstance(a, float):
        return "fp32"
    raise TypeError(f"no Triton type for {a!r}")


def compile_launch(fn, args: tuple, kw: dict):
    kw = dict(kw)
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    signature = {name: arg_type(a) for name, a in zip(fn.arg_names, args)}
    signature.update({name: "constexpr" for name in kw})
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=kw), target=TARGET, options=options)


def recorded(module, run, monkeypatch) -> list[tuple[object, tuple, dict]]:
    """(real kernel, args, kwargs) of every launch `run()` makes through module's kernels."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    real = module._build()  # jitted, not interpreted
    fakes = tuple(Recorder() for _ in (real if isinstance(real, tuple) else (real,)))
    monkeypatch.setitem(module._KERNELS, False, fakes if isinstance(real, tuple) else fakes[0])
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the wrappers take CPU tensors only then...
    monkeypatch.setitem(module._KERNELS, True, fakes if isinstance(real, tuple) else fakes[0])  # ...and record
    run()
    reals = real if isinstance(real, tuple) else (real,)
    return [(fn, a, k) for fn, fake in zip(reals, fakes) for a, k in fake.launches]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (9, 3, 64), (32, 8, 128)])
def test_decode_attention_compiles_for_sm90(monkeypatch, dtype, hq, hkv, d):
    """In one run (splits 1) and in splits (the partials and their merge)."""
    from sgrec.model.kernels import decode_attention as da

    q = torch.zeros(3, hq, d, dtype=dtype)
    kv = torch.zeros(50, hkv, d, dtype=dtype)
    idx, ptr = torch.arange(1, 31), torch.tensor([0, 10, 11, 30])

    def run():
        for splits in (1, 4):
            da.decode_attention(q, kv, kv, idx, ptr, 0.1, splits=splits)

    launches = recorded(da, run, monkeypatch)
    assert [k["PARTIAL"] for _, _, k in launches] == [False, True]
    for fn, a, k in launches:
        assert compile_launch(fn, a, k).asm["cubin"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_glue_compiles_for_sm90(monkeypatch, dtype):
    """RMSNorm at qwen3-1.7b's width (2048) and a wide one (8192), RoPE on q/k views of a fused
    projection (head dim 128), SiLU * up at qwen3-1.7b's intermediate size (6144)."""
    from sgrec.model.kernels import glue

    def run():
        for n in (2048, 8192):
            glue.rmsnorm(torch.zeros(4, n, dtype=dtype), torch.zeros(n, dtype=dtype), 1e-6)
        qkv = torch.zeros(5, (16 + 2 * 8) * 128, dtype=dtype)
        q, k, _ = qkv.split([16 * 128, 8 * 128, 8 * 128], dim=-1)
        cs = torch.zeros(5, 128, dtype=dtype)
        assert glue.rope_(q.view(5, 16, 128), k.view(5, 8, 128), cs, cs)
        glue.silu_mul(torch.zeros(4, 2 * 6144, dtype=dtype), 6144)

    launches = recorded(glue, run, monkeypatch)
    assert len(launches) == 2 + 2 + 1  # two norms, RoPE on q and on k, one SiLU * up
    for fn, a, k in launches:
        assert compile_launch(fn, a, k).asm["cubin"]


@pytest.mark.parametrize("dtype,low", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_staged_attention_compiles_for_sm90(monkeypatch, dtype, low):
    """A beam step of a qwen3-1.7b-shaped model (16 query heads over 8 KV heads, head dim 128); and
    bench_staged_kernel.py's variant on bf16 tiles."""
    from sgrec.model.kernels import staged_attention as sa

    kv = torch.zeros(600, 8, 128, dtype=dtype)

    def run():
        sa.staged_attention_batched(torch.zeros(64, 16, 128, dtype=dtype), kv, kv, torch.arange(1, 401),
                                    torch.tensor([0, 400]), torch.arange(401, 529).view(64, 2),
                                    sa.beam_blocks([64], sa.BLOCK_B), 0.1, low_precision=low)

    launches = recorded(sa, run, monkeypatch)
    assert len(launches) == 1
    for fn, a, k in launches:
        assert compile_launch(fn, a, k).asm["cubin"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bipartite_attention_compiles_for_sm90(monkeypatch, dtype):
    """Its mask from two integers per KV column: here a beam step's layout (beams_as_blocks), as a
    rank layout would give it (16 query heads over 8 KV heads, head dim 128)."""
    from sgrec.beam.attention import BeamStepMeta, beams_as_blocks
    from sgrec.model.kernels import bipartite_attention as ba

    c = beams_as_blocks(BeamStepMeta(torch.arange(1, 401), torch.arange(401, 529).view(64, 2)))
    kv = torch.zeros(600, 8, 128, dtype=dtype)
    new = torch.zeros(64, 8, 128, dtype=dtype)

    def run():
        ba.bipartite_attention(torch.zeros(64, 16, 128, dtype=dtype), new, new, kv, kv, c.q_start, c.q_end, c.q_order,
                               c.q_block, c.c_idx, c.c_ptr, c.c_order, c.c_block, 0.1)

    launches = recorded(ba, run, monkeypatch)
    assert len(launches) == 1
    for fn, a, k in launches:
        assert compile_launch(fn, a, k).asm["cubin"]


@pytest.mark.parametrize("layered", [False, True], ids=["dense", "layered"])
@pytest.mark.parametrize("restricted", [False, True])
def test_trie_step_compiles_for_sm90(monkeypatch, restricted, layered):
    """A level's selection for two requests (children, selection, emission): over the whole
    vocabulary's logits and over the level's columns only, with an exclusion filter on one; the
    leaf level of a SemanticIdTrie (CSR) and of a LayeredTrie (runs over a base and a tail)."""
    from sgrec.beam.filters import FilterCache, build_filter
    from sgrec.beam.kernel_step import level
    from sgrec.beam.layered import LayeredTrie
    from sgrec.beam.trie import SemanticIdTrie
    from sgrec.catalog import Catalog, Item
    from sgrec.model.kernels import trie_step as ts

    paths = [(a, b) for a in range(30, 36) for b in range(20, 30)]
    cat = Catalog([Item(f"i{i}", (1,), 1, p) for i, p in enumerate(paths)])
    trie, rows = LayeredTrie.from_catalog(cat, 40, "cpu") if layered else SemanticIdTrie.from_catalog(cat, 40)
    filt = build_filter(trie, rows, cat, FilterCache(), exclude=["i3", "i17"])
    logits = torch.zeros(6, trie.level_tokens[1].numel() if restricted else 40)

    def run():
        ts.trie_step(logits, level(trie, 1), torch.arange(6), torch.zeros(6), [0, 3, 6], [2, 3], [4, 5], restricted,
                     [None, (filt.dense[2], filt.allowed[2], filt.blocked[2])])

    launches = recorded(ts, run, monkeypatch)
    assert [k.get("RESTRICTED") for _, _, k in launches][:1] == [restricted] and len(launches) == 3
    assert launches[0][2]["RUNS"] == layered
    for fn, a, k in launches:
        assert compile_launch(fn, a, k).asm["cubin"]


@pytest.mark.parametrize("dtype", ["*bf16", "*fp16", "*fp32"])
def test_fp8_quantize_compiles_for_sm90(monkeypatch, dtype):
    """--quantization fp8's activation kernel: it compiles, its divisions are IEEE (div.rn, as the
    reference's: an approximate one would move scales by an ulp) and its casts round to nearest."""
    from sgrec.model import fp8

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sig = {"x_ptr": dtype, "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "stride_x": "i32", "stride_q": "i32",
           "BLOCK": "constexpr"}
    out = triton.compile(ASTSource(fn=fp8._kernel(), signature=sig, constexprs={"BLOCK": 2048}), target=TARGET,
                         options={"num_warps": 8})
    ptx = out.asm["ptx"]
    assert out.asm["cubin"] and "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


def test_a_kernel_the_compiler_rejects_fails_here(monkeypatch):
    """The check can fail: a kernel the interpreter would run but the compiler rejects (tl.dot of 1-D
    blocks) does not compile here."""
    import triton.language as tl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    @triton.jit
    def bad(X, N: tl.constexpr):
        a = tl.load(X + tl.arange(0, N))
        tl.store(X, tl.dot(a, a))

    with pytest.raises(Exception, match="(?i)dot|dim|rank|shape"):
        compile_launch(bad, (torch.zeros(16),), {"N": 16})
