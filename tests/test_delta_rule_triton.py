"""The gated delta rule's Triton kernels (sgrec.model.kernels.delta_rule) against sgrec.model.delta_rule,
on CPU under Triton's interpreter.

TRITON_INTERPRET=1 must be set before triton is imported (the interpreter cannot take over
triton.language's own jitted helpers, tl.sum among them, in a process that imported triton without
it), so a plain run of this file runs its interpreted cases in a fresh process
(test_the_cases_pass_under_the_interpreter) and reports them there as skipped; with
TRITON_INTERPRET=1 set they run here. The input checks need no kernel and run either way.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from sgrec.model import delta_rule  # noqa: E402
from sgrec.model.kernels.delta_rule import gdr_sequence, gdr_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DRIVER = "test_the_cases_pass_under_the_interpreter"
interpreted = pytest.mark.skipif(not INTERPRETED, reason=f"run under TRITON_INTERPRET=1 in a fresh process by {DRIVER}")
TOL = 2e-6  # |o| < 0.4 and |S| < 2 here: a few float32 ulps of |S| (worst seen: 5e-7, the chunked reference's own)


def tokens(lead: tuple, dk: int, dv: int, seed: int, strided: bool = False):
    """q, k [*lead, dk], v [*lead, dv], g, beta [*lead] as the model makes them: q and k L2-normalised,
    q scaled by dk^-1/2, g = -softplus(.) <= 0, beta = sigmoid(.). strided: [H, L, ...] views of
    token-major [L, H, ...] tensors (the projections' layout), as the model passes them."""
    gen = torch.Generator().manual_seed(seed)
    shape = (lead[1], lead[0], *lead[2:]) if strided else lead

    def rand(*tail):
        t = torch.randn(*shape, *tail, generator=gen)
        return t.transpose(0, 1) if strided else t

    q = delta_rule.l2norm(rand(dk)) * dk ** -0.5
    k = delta_rule.l2norm(rand(dk))
    v = rand(dv)
    g = -F.softplus(rand())
    beta = torch.sigmoid(rand())
    return q, k, v, g, beta


def states(n: int, dk: int, dv: int, seed: int) -> torch.Tensor:
    return torch.randn(n, dk, dv, generator=torch.Generator().manual_seed(seed)) * 0.5


def worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item() if got.numel() else 0.0


# ---- gdr_step: one token of B sequences, states rows of a pool updated in place ------------------------

@interpreted
@pytest.mark.parametrize("H,dk,dv,block_v", [(2, 16, 16, None), (3, 32, 48, None), (2, 24, 40, 16), (3, 20, 24, None),
                                             (2, 32, 16, 4)])
def test_step_equals_reference_and_touches_only_its_rows(H, dk, dv, block_v):
    """Three steps of B = 3 sequences at scattered pool rows: o and the named rows as delta_rule.step's
    (dv = 48 and 40 leave a partial last block of columns, dk = 24 and 20 are not powers of two, dv = 24
    is below its one block of 32), every other row of the pool the same bits."""
    pool = states(7 * H, dk, dv, seed=H + dk).view(7, H, dk, dv)
    slots = torch.tensor([5, 0, 3])
    ref = pool[slots].clone()
    for i in range(3):
        q, k, v, g, beta = tokens((3, H), dk, dv, seed=10 * i + dv)
        before = pool.clone()
        o = gdr_step(q, k, v, g, beta, pool, slots, block_v=block_v)
        want_o, ref = delta_rule.step(q, k, v, g, beta, ref)
        assert o.shape == (3, H, dv) and o.dtype == torch.float32
        assert worst(o, want_o) <= TOL and worst(pool[slots], ref) <= TOL
        others = torch.ones(7, dtype=torch.bool)
        others[slots] = False
        assert torch.equal(pool[others], before[others])


@interpreted
def test_step_gives_a_sequence_its_bits_whatever_the_batch():
    """A sequence stepped alone (B = 1) and in the middle of B = 3: the same o and state, bit for bit."""
    H, dk, dv = 2, 24, 40
    pool = states(6 * H, dk, dv, seed=1).view(6, H, dk, dv)
    alone, batched = pool.clone(), pool.clone()
    q, k, v, g, beta = tokens((3, H), dk, dv, seed=2)
    o1 = gdr_step(q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], alone, torch.tensor([4]))
    o3 = gdr_step(q, k, v, g, beta, batched, torch.tensor([0, 4, 2]))
    assert torch.equal(o3[1:2], o1) and torch.equal(batched[4], alone[4])


@interpreted
def test_step_reads_a_forks_parent_before_the_parent_updates():
    """A beam step's forks: children read their parent's slot and write their own in the launch
    before the parent steps in place."""
    from tests.kernel_refs import gdr_fork_case

    gdr_fork_case(gdr_step)
    gdr_fork_case(gdr_step, H=3, dk=20, dv=48, seed=1)


# ---- gdr_sequence: one sequence of L tokens, the state in registers -----------------------------------

@interpreted
@pytest.mark.parametrize("L", [1, 5, 70, 130])
@pytest.mark.parametrize("H,dk,dv,strided", [(2, 16, 16, False), (3, 32, 48, True), (2, 24, 40, True)])
def test_sequence_equals_chunked_and_steps(L, H, dk, dv, strided):
    """o and the final state as delta_rule.chunked's (L across its chunks of 64) and as L calls of
    delta_rule.step in float64, from strided [H, L, d] views and a transposed state; the given state
    unchanged."""
    q, k, v, g, beta = tokens((H, L), dk, dv, seed=L + dv, strided=strided)
    state = states(H, dv, dk, seed=L).transpose(1, 2) if strided else states(H, dk, dv, seed=L)
    kept = state.clone()
    o, new = gdr_sequence(q, k, v, g, beta, state)
    assert o.shape == (H, L, dv) and new.shape == (H, dk, dv) and o.dtype == new.dtype == torch.float32
    assert torch.equal(state, kept)
    want_o, want_s = delta_rule.chunked(q, k, v, g, beta, state)
    assert worst(o, want_o) <= TOL and worst(new, want_s) <= TOL
    s, outs = state.double(), []
    for t in range(L):
        o_t, s = delta_rule.step(*(x[:, t].double() for x in (q, k, v, g, beta)), s)
        outs.append(o_t)
    assert worst(o, torch.stack(outs, 1)) <= TOL and worst(new, s) <= TOL


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sequence_writes_o_token_major_into_a_home(dtype):
    """out=: o stored token-major [L, H, dv] into a strided view in its dtype, rounded once from the
    float32 values the kernel returns without it; nothing else of the home written."""
    H, L, dk, dv = 2, 37, 16, 24
    q, k, v, g, beta = tokens((H, L), dk, dv, seed=5)
    s0 = states(H, dk, dv, seed=6)
    want, want_state = gdr_sequence(q, k, v, g, beta, s0)
    home = torch.zeros(L, H + 1, dv, dtype=dtype)
    got, state = gdr_sequence(q, k, v, g, beta, s0, out=home[:, 1:])
    assert got.data_ptr() == home[:, 1:].data_ptr() and torch.equal(state, want_state)
    assert torch.equal(home[:, 0], torch.zeros(L, dv, dtype=dtype))
    assert worst(home[:, 1:], want.transpose(0, 1).to(dtype)) <= (TOL if dtype == torch.float32 else 1e-2)


@interpreted
def test_sequence_then_steps_equals_one_longer_sequence():
    """A prefill by gdr_sequence, its state put in a pool, then gdr_step token by token: the outputs and
    state of gdr_sequence over the whole sequence (the two kernels agree with each other, not only with
    the references)."""
    H, dk, dv, L, n = 2, 24, 40, 9, 4
    q, k, v, g, beta = tokens((H, L + n), dk, dv, seed=3)
    state = states(H, dk, dv, seed=4)
    o_all, s_all = gdr_sequence(q, k, v, g, beta, state)
    o_pre, s_pre = gdr_sequence(q[:, :L], k[:, :L], v[:, :L], g[:, :L], beta[:, :L], state)
    pool = torch.zeros(3, H, dk, dv)
    pool[2] = s_pre
    outs = [gdr_step(q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t], beta[None, :, t], pool,
                     torch.tensor([2]))[0] for t in range(L, L + n)]
    assert worst(o_pre, o_all[:, :L]) <= 1e-6 and worst(torch.stack(outs, 1), o_all[:, L:]) <= 1e-6
    assert worst(pool[2], s_all) <= 1e-6


@interpreted
def test_the_comparison_can_fail():
    """A kernel that skipped the decay of one token (g = 0 at t = 3) is caught by the bound."""
    H, dk, dv, L = 2, 16, 16, 8
    q, k, v, g, beta = tokens((H, L), dk, dv, seed=5)
    state = states(H, dk, dv, seed=6)
    g_off = g.clone()
    g_off[:, 3] = 0.0
    o, new = gdr_sequence(q, k, v, g_off, beta, state)
    want_o, want_s = delta_rule.chunked(q, k, v, g, beta, state)
    assert worst(o, want_o) > 100 * TOL and worst(new, want_s) > 100 * TOL


# ---- input checks (no kernel runs: either mode) ---------------------------------------------------------

def test_bad_inputs_raise_naming_the_problem():
    H, dk, dv = 2, 16, 24
    q, k, v, g, beta = tokens((2, H), dk, dv, seed=7)
    slots = torch.tensor([0, 1])
    pool = torch.zeros(3, H, dk, dv)
    with pytest.raises(ValueError, match=r"states must be a contiguous float32 \[slots, 2, 16, 24\].*float16"):
        gdr_step(q, k, v, g, beta, pool.half(), slots)
    with pytest.raises(ValueError, match=r"states must be .*\(3, 2, 16, 20\)"):
        gdr_step(q, k, v, g, beta, torch.zeros(3, H, dk, 20), slots)
    with pytest.raises(ValueError, match="states must be a contiguous"):
        gdr_step(q, k, v, g, beta, torch.zeros(3, H, dv, dk).transpose(2, 3), slots)
    with pytest.raises(ValueError, match=r"k must be \[2, 2, 16\]"):
        gdr_step(q, k[..., :8], v, g, beta, pool, slots)
    with pytest.raises(ValueError, match=r"slots must be \[2\]"):
        gdr_step(q, k, v, g, beta, pool, slots[:1])
    with pytest.raises(ValueError, match=r"q and v must be \[B, H, d\]"):
        gdr_step(q[0], k, v, g, beta, pool, slots)
    qs, ks, vs, gs, bs = (t.transpose(0, 1) for t in (q, k, v, g, beta))  # [H, L = 2, ...]
    with pytest.raises(ValueError, match=r"state must be \[2, 16, 24\]"):
        gdr_sequence(qs, ks, vs, gs, bs, torch.zeros(H, dk, dv + 1))
    with pytest.raises(ValueError, match="state must be float32, got torch.float16"):
        gdr_sequence(qs, ks, vs, gs, bs, torch.zeros(H, dk, dv, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"beta must be \[2, 2\]"):
        gdr_sequence(qs, ks, vs, gs, bs[:, :1], torch.zeros(H, dk, dv))


def test_cpu_tensors_are_refused_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, g, beta = tokens((1, 2), 16, 16, seed=8)
    with pytest.raises(ValueError, match="CUDA tensors.*TRITON_INTERPRET=1"):
        gdr_step(q, k, v, g, beta, torch.zeros(1, 2, 16, 16), torch.tensor([0]))
    with pytest.raises(ValueError, match="CUDA tensors.*TRITON_INTERPRET=1"):
        gdr_sequence(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(), torch.zeros(2, 16, 16))


# ---- the interpreted cases, from a plain run -----------------------------------------------------------

@pytest.mark.skipif(INTERPRETED, reason="this run is the interpreted one")
def test_the_cases_pass_under_the_interpreter():
    """This file again with TRITON_INTERPRET=1 in a fresh process: every case passes, none skipped."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", me,
                          "--deselect", f"{me}::{DRIVER}"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, tail
    assert re.fullmatch(r"=*\s*\d+ passed, 1 deselected(, \d+ warnings?)? in .*", summary), tail
