"""The gated delta rule (Gated DeltaNet's recurrence) in Triton (CUDA): sgrec.model.delta_rule's
step and sequence forms, the state kept on the GPU. Per head the state S is a [dk, dv] matrix and a
token (q, k, v, log-decay g <= 0, rate beta) does

    S' = e^g S;   u = beta (v - S'^T k);   S = S' + k u^T;   o = S^T q

in float32, in the reference's order (decay, then the prediction S'^T k, then the rank-1 write, then
the read); the sums over dk are tl.sum's tree where torch sums in its own order, so the values agree
to float32 rounding, not to the bit.

`gdr_step`: one token of each of B sequences, their states rows of the pool updated in place, a beam
fork's read from its parent's row (the interface of sgrec.model.native.gdr_step, the C kernel for
CPU). One program per (sequence, head,
BLOCK_V columns of dv) loads its [dk, BLOCK_V] tile of S (BLOCK_K = pow2(dk) rows, masked), steps it
and stores it back; the columns of S are independent, so the tiles need no communication, and a
sequence's bits do not depend on what else is in the batch.

`gdr_sequence`: one sequence of L tokens (the contract of delta_rule.chunked). One program per (head,
BLOCK_V columns of dv) keeps its tile of S in registers and runs the tokens in order (the fused
recurrent form: L dependent steps, each reading a token's q, k, v, g, beta once per program, no
chunked solve), writing o token by token and the final state once. Inputs may be strided.

Under TRITON_INTERPRET=1 (read when a kernel is first built) the kernels run on CPU tensors (the
tests: tests/test_delta_rule_triton.py); otherwise they take CUDA tensors only.
"""

from __future__ import annotations

import os

import torch

from sgrec.model.kernels import built, pow2

_KERNELS: dict[bool, object] = {}  # interpreted or compiled -> (step kernel, sequence kernel)
BLOCK_V = 32  # dv columns a program at most: a [dk, 32] float32 tile (dk = 128: 32 registers a thread at 4 warps)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def step_kernel(Q, K, V, G, BETA, S, SLOTS, SOURCES, ROWS, OUT, H, dk, dv, BLOCK_K: tl.constexpr,
                    BLOCK_V: tl.constexpr):
        b = tl.load(ROWS + tl.program_id(0))
        h = tl.program_id(1)
        kk = tl.arange(0, BLOCK_K)
        vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        mk = kk < dk
        mv = vv < dv
        row = b * H + h  # (b, h) of q, k, v, g, beta and o, all contiguous
        slot = tl.load(SLOTS + b).to(tl.int64)
        source = tl.load(SOURCES + b).to(tl.int64)  # slot itself, or a beam fork's parent's
        tile = S + ((slot * H + h) * dk + kk[:, None]) * dv + vv[None, :]
        m2 = mk[:, None] & mv[None, :]
        s = tl.load(S + ((source * H + h) * dk + kk[:, None]) * dv + vv[None, :], mask=m2, other=0.0)
        q = tl.load(Q + row * dk + kk, mask=mk, other=0.0)
        k = tl.load(K + row * dk + kk, mask=mk, other=0.0)
        v = tl.load(V + row * dv + vv, mask=mv, other=0.0)
        g = tl.load(G + row)
        beta = tl.load(BETA + row)
        s = s * tl.exp(g)  # S' = e^g S
        u = (v - tl.sum(s * k[:, None], axis=0)) * beta  # beta (v - S'^T k); masked rows of k are 0
        s = s + k[:, None] * u[None, :]
        tl.store(tile, s, mask=m2)
        tl.store(OUT + row * dv + vv, tl.sum(s * q[:, None], axis=0), mask=mv)

    @triton.jit
    def sequence_kernel(Q, K, V, G, BETA, S0, OUT, S1, L, dk, dv,
                        sq_h, sq_l, sq_d, sk_h, sk_l, sk_d, sv_h, sv_l, sv_d, sg_h, sg_l, sb_h, sb_l,
                        ss_h, ss_k, ss_v, so_l, so_h, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        h = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, BLOCK_K)
        vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        mk = kk < dk
        mv = vv < dv
        m2 = mk[:, None] & mv[None, :]
        s = tl.load(S0 + h * ss_h + kk[:, None] * ss_k + vv[None, :] * ss_v, mask=m2, other=0.0)
        q_ptr = Q + h * sq_h + kk * sq_d
        k_ptr = K + h * sk_h + kk * sk_d
        v_ptr = V + h * sv_h + vv * sv_d
        g_ptr = G + h * sg_h
        b_ptr = BETA + h * sb_h
        o_ptr = OUT + h * so_h + vv  # token t of head h at t * so_l + h * so_h
        for t in range(L):
            q = tl.load(q_ptr, mask=mk, other=0.0)
            k = tl.load(k_ptr, mask=mk, other=0.0)
            v = tl.load(v_ptr, mask=mv, other=0.0)
            g = tl.load(g_ptr)
            beta = tl.load(b_ptr)
            s = s * tl.exp(g)
            u = (v - tl.sum(s * k[:, None], axis=0)) * beta
            s = s + k[:, None] * u[None, :]
            tl.store(o_ptr, tl.sum(s * q[:, None], axis=0).to(OUT.dtype.element_ty), mask=mv)
            q_ptr += sq_l
            k_ptr += sk_l
            v_ptr += sv_l
            g_ptr += sg_l
            b_ptr += sb_l
            o_ptr += so_l
        tl.store(S1 + (h * dk + kk[:, None]) * dv + vv[None, :], s, mask=m2)  # the new state, contiguous

    return step_kernel, sequence_kernel


def _on_device(name: str, *tensors: torch.Tensor) -> None:
    """Raise unless the tensors are on one CUDA device (any device under TRITON_INTERPRET=1)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{name}: the tensors are on several devices ({sorted({str(t.device) for t in tensors})})")
    if not (tensors[0].is_cuda or interpreted):
        raise ValueError(f"{name}: Triton's kernels take CUDA tensors, got {tensors[0].device} (CPU tensors only "
                         "under TRITON_INTERPRET=1, Triton's interpreter: slow, for tests)")


def _block_v(dv: int, block_v: int | None) -> int:
    """dv columns a program: block_v (rounded up to a power of two), else min(pow2(dv), BLOCK_V)."""
    return pow2(block_v or min(dv, BLOCK_V))


def gdr_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             states: torch.Tensor, slots: torch.Tensor, sources: torch.Tensor | None = None, *,
             block_v: int | None = None) -> torch.Tensor:
    """One token of each of B sequences through the gated delta rule, their states updated in place:
    q, k [B, H, dk], v [B, H, dv], g, beta [B, H] (float32, q and k normalised as the rule wants),
    states the pool's contiguous float32 [slots, H, dk, dv], slots [B] distinct rows of it. sources
    [B]: the row each state is read from (a beam fork's parent's; None: slots): the forks run in a
    launch before the others, so every parent is read before it is updated in place. -> o
    [B, H, dv] float32 (delta_rule.step's values to float32 rounding). block_v: dv columns a program
    (a power of two; default min(pow2(dv), BLOCK_V)), for tests."""
    if q.dim() != 3 or v.dim() != 3:
        raise ValueError(f"gdr_step: q and v must be [B, H, d], got {list(q.shape)} and {list(v.shape)}")
    B, H, dk = q.shape
    dv = v.shape[-1]
    if states.dtype != torch.float32 or tuple(states.shape[1:]) != (H, dk, dv) or not states.is_contiguous():
        raise ValueError(f"gdr_step: states must be a contiguous float32 [slots, {H}, {dk}, {dv}], got "
                         f"{states.dtype} {tuple(states.shape)}")
    want = {"k": (k, (B, H, dk)), "v": (v, (B, H, dv)), "g": (g, (B, H)), "beta": (beta, (B, H)),
            "slots": (slots, (B,))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"gdr_step: {name} must be {list(shape)} (q is {list(q.shape)}), got {list(t.shape)}")
    _on_device("gdr_step", q, k, v, g, beta, states, slots)
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    slots = slots.to(torch.int64).contiguous()
    if sources is not None and tuple(sources.shape) != (B,):
        raise ValueError(f"gdr_step: sources must be [{B}] as slots, got {list(sources.shape)}")
    sources = slots if sources is None else sources.to(device=slots.device, dtype=torch.int64).contiguous()
    out = torch.empty(B, H, dv, dtype=torch.float32, device=q.device)
    bv = _block_v(dv, block_v)
    if sources is slots:
        phases = (torch.arange(B, device=q.device),)
    else:
        fork = sources != slots
        phases = (torch.nonzero(fork).flatten(), torch.nonzero(~fork).flatten())
    for rows in phases:  # the forks first: they read parents' states that the others update in place
        if rows.numel() and H and dv:
            built(_KERNELS, _build)[0][(rows.numel(), H, -(-dv // bv))](
                q, k, v, g, beta, states, slots, sources, rows, out, H, dk, dv, BLOCK_K=pow2(dk), BLOCK_V=bv)
    return out


def gdr_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 state: torch.Tensor, *, out: torch.Tensor | None = None,
                 block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through the gated delta rule: q, k [H, L, dk], v [H, L, dv], g, beta [H, L],
    state [H, dk, dv] (float32, any strides; state is not modified). -> (o [H, L, dv], the state after
    the last token [H, dk, dv]), new contiguous float32 tensors (delta_rule.chunked's values to float32
    rounding). out: o's home instead, token-major [L, H, dv] in any float dtype (rounded once on the
    store; its last dimension contiguous), returned as o. block_v as gdr_step's."""
    if q.dim() != 3 or v.dim() != 3:
        raise ValueError(f"gdr_sequence: q and v must be [H, L, d], got {list(q.shape)} and {list(v.shape)}")
    H, L, dk = q.shape
    dv = v.shape[-1]
    want = {"k": (k, (H, L, dk)), "v": (v, (H, L, dv)), "g": (g, (H, L)), "beta": (beta, (H, L)),
            "state": (state, (H, dk, dv))}
    if out is not None:
        want["out"] = (out, (L, H, dv))
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"gdr_sequence: {name} must be {list(shape)} (q is {list(q.shape)}), got {list(t.shape)}")
    if state.dtype != torch.float32:
        raise ValueError(f"gdr_sequence: state must be float32, got {state.dtype}")
    if out is not None and (not out.dtype.is_floating_point or out.stride(2) != 1):
        raise ValueError(f"gdr_sequence: out must be floating point with a contiguous last dimension, got "
                         f"{out.dtype} strides {out.stride()}")
    _on_device("gdr_sequence", q, k, v, g, beta, state, *([] if out is None else [out]))
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))  # no copy where float32 already
    o = torch.empty(H, L, dv, dtype=torch.float32, device=q.device) if out is None else out
    so_l, so_h = (dv, L * dv) if out is None else (out.stride(0), out.stride(1))
    new = torch.empty(H, dk, dv, dtype=torch.float32, device=q.device)
    bv = _block_v(dv, block_v)
    if H and dk and dv:
        built(_KERNELS, _build)[1][(H, -(-dv // bv))](q, k, v, g, beta, state, o, new, L, dk, dv,
                                                       *q.stride(), *k.stride(), *v.stride(), *g.stride(),
                                                       *beta.stride(), *state.stride(), so_l, so_h,
                                                       BLOCK_K=pow2(dk), BLOCK_V=bv)
    else:
        new.copy_(state)
    return o, new
