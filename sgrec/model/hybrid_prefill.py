"""Hybrid prefilling (PrefillOnly §4) of the dense decoder (`CausalLM.hybrid_forward`; the hybrid
family has its own, `sgrec.model.qwen3_5`): attention over the whole sequence at once, everything else
(norms, projections, MLP) chunk by chunk into preallocated buffers.

The MLP's intermediates ([chunk, 2 * intermediate_size]) then exist for one chunk at a time, never
for the whole sequence; the residual stream is updated in place. Row-wise operations give the same
rows whichever chunk they run in, so the result equals the normal forward up to matmul rounding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgrec.model.attention import AttentionBackend, ForwardBatch

if TYPE_CHECKING:
    from sgrec.model.llama import CausalLM


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@torch.inference_mode()
def hybrid_forward(
    model: CausalLM, batch: ForwardBatch, backend: AttentionBackend, chunk_size: int, rows: torch.Tensor
) -> torch.Tensor:
    """Final hidden states (after the last norm) of the asked rows only: [len(rows), hidden]."""
    cfg = model.cfg
    x = model.embed_tokens(batch.input_ids)  # the residual stream, updated in place
    T = x.shape[0]
    cos, sin = model.rope.cos_sin(batch.positions, x.dtype)
    backend.prepare(batch)
    parts = _chunks(T, chunk_size)
    q = x.new_empty(T, cfg.num_heads, cfg.head_dim)
    k = x.new_empty(T, cfg.num_kv_heads, cfg.head_dim)
    v = torch.empty_like(k)
    for layer in model.layers:
        attn = layer.self_attn
        for c in parts:
            q[c], k[c], v[c] = attn.project_qkv(layer.input_layernorm(x[c]), cos[c], sin[c])
        o = backend.forward(q, k, v, attn.layer, batch, attn.scale)  # [T, Hq * D]
        for c in parts:
            x[c] += attn.o_proj(o[c])
            x[c] += layer.mlp(layer.post_attention_layernorm(x[c]))
        del o
    return model.norm(x[rows])
