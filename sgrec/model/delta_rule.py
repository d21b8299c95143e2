"""The gated delta rule (Gated DeltaNet's recurrence), in float32: one step and a chunked form.

Per head, the state S is a [dk, dv] matrix. A token (q, k, v, decay g <= 0 in log space, rate beta)
updates and reads it:

    S' = e^g S;   u = beta (v - S'^T k);   S = S' + k u^T;   o = S^T q

with q and k L2-normalised and q scaled by dk^-1/2 by the caller. `step` applies it to one token of
many sequences at once (decode). `chunked` runs a sequence of L tokens in chunks of C: within a
chunk, with gamma_i the cumulative log-decay from the chunk's start S0, every u_i depends on the u
before it through A[i, m] = beta_i e^(gamma_i - gamma_m) (k_i . k_m) (m < i), so

    (I + A) U = beta V - diag(beta e^gamma) K S0

is one unit lower-triangular solve per chunk for the parts that do not depend on S0 (all chunks at
once), and only the S0 terms run chunk after chunk:

    U = U0 - W S0,   O = diag(e^gamma) Q S0 + (Q K^T * decay) U,   S_end = e^gamma_C S0 + (K * e^(gamma_C - gamma))^T U.

Both give the same values up to float32 rounding (tests/test_hybrid_model.py checks them against
each other and against transformers' implementation). They are the reference and the torch path;
the model runs the kernels of its glue where it has them: sgrec.model.native's C (gdr_step and
gdr_sequence, the chunked algebra with the state in each chunk's right-hand side) on CPU, and
sgrec.model.kernels.delta_rule's Triton on CUDA, each tested against these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens a chunk: transformers' and fla's default


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv], all
    float32. Returns (o [B, H, dv], the new state)."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)  # S'^T k
    u = (v - predicted) * beta[..., None]
    state = state + k[..., None] * u[..., None, :]
    return (state * q[..., None]).sum(-2), state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [H, L, dk], v [H, L, dv], g, beta [H, L], state [H, dk, dv], all float32.
    Returns (o [H, L, dv], the state after the last token)."""
    H, L, dk = k.shape
    dv = v.shape[-1]
    pad = -L % chunk
    if pad:  # padded tokens have beta = 0 and g = 0: they neither write nor decay the state
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (L + pad) // chunk
    q, k, v = (t.reshape(H, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)
    gamma = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    strict = (k_beta @ k.transpose(-1, -2)) * decay  # A below the diagonal; solved as unit lower-triangular
    u0 = torch.linalg.solve_triangular(strict, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(strict, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]
    out = torch.empty(H, n, chunk, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        u = u0[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + scores[:, i] @ u
        state = state * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(H, n * chunk, dv)[:, :L], state
