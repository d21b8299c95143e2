"""The hybrid family: Qwen3.5 text models (Gated DeltaNet and gated attention), matching transformers.

config.json's `layer_types` gives each layer's kind (by default three "linear_attention" layers
before every "full_attention" one):
- a **linear-attention layer** is a Gated DeltaNet: one projection gives q, k, v (through a causal
  depthwise convolution of `linear_conv_kernel_dim` taps and SiLU), the output gate z, the rate
  beta and the decay; the gated delta rule (`sgrec.model.delta_rule`) runs over the sequence; a
  gated RMSNorm and an output projection follow. Its context is a fixed-size state a request: the
  convolution's last K - 1 inputs ("conv", in the model's dtype) and the rule's [heads, dk, dv]
  matrix ("ssm", float32), kept in the memory's state slots (`ForwardBatch.state_slots`).
- a **full-attention layer** is attention over the token pool with an output gate (sigmoid of a
  second half of q_proj), per-head zero-centred q/k norms and rotary embeddings on the first
  `partial_rotary_factor` of each head.
Norms are zero-centred (scale 1 + weight). With text positions only, Qwen3.5's multi-axis rotary
embedding is the plain one. The text part of a multimodal checkpoint (`Qwen3_5ForConditionalGeneration`,
weights under `model.language_model`) loads too; its vision tower and multi-token-prediction
weights are not read.

Capabilities: a cached prefix is reusable only where a state was kept ("snapshot"); staged beams
(the prompt's KV read in place by every beam of the attention layers, each beam's state its own,
forked from the prompt's: sgrec.beam.attention.BeamStates); rank user-as-prefix only, one state
fork per candidate (sgrec.rank.forked; item-as-prefix is a 400 naming `prefix`); hybrid prefilling
with each sequence's state carried across the chunks (HybridLM.hybrid_forward); no fused decode or
decode graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sgrec.model import delta_rule
from sgrec.model.attention import AttentionBackend, ForwardBatch, SeqLayout
from sgrec.model.llama import MLP, LMBase
from sgrec.model.registry import ATTENTION, RECURRENT, Capabilities, Family
from sgrec.model.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from sgrec.model.config import ModelConfig

KINDS = {"full_attention": ATTENTION, "linear_attention": RECURRENT}
STEPWISE_MAX = 16  # sequences of at most this many tokens run the rule's step form, token by token


@dataclass(frozen=True)
class HybridShape:
    """The hybrid fields of config.json (or of its text_config)."""

    layer_types: tuple[str, ...]
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    rotary_dim: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> "HybridShape":
        hf = cfg.hf_config.get("text_config") or cfg.hf_config
        every = hf.get("full_attention_interval", 4)
        types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                          for i in range(cfg.num_layers)]
        rope = hf.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        return cls(tuple(types), hf.get("linear_num_key_heads", 16), hf.get("linear_num_value_heads", 32),
                   hf.get("linear_key_head_dim", 128), hf.get("linear_value_head_dim", 128),
                   hf.get("linear_conv_kernel_dim", 4), int(cfg.head_dim * factor))

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by 1 + weight, in float32 (transformers' Qwen3_5RMSNorm); through the glue's
    rmsnorm with that float32 scale where it takes the rows (sgrec.model.native: one pass, one rounding)."""

    glue = None  # as llama.RMSNorm.glue (HybridLM.use_glue)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.glue is not None:
            out = self.glue.rmsnorm(x, 1.0 + self.weight.float(), self.eps)
            if out is not None:
                return out
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), as llama.RMSNorm.add_forward: in one pass where the glue
        takes them (x receives the sum in place), else torch's add then forward; the same bits either way."""
        if self.glue is not None:
            out = self.glue.rmsnorm(x, 1.0 + self.weight.float(), self.eps, residual)
            if out is not None:
                return out, x
        x = x + residual
        return self(x), x


class GatedRMSNorm(nn.Module):
    """RMSNorm of each group of dim channels of x, times SiLU of the gate's (the DeltaNet output's
    norm); in one pass through the glue's gated_rmsnorm where it has one and takes the rows."""

    glue = None  # as ZeroCenteredRMSNorm.glue

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [T, groups * dim] -> [T, groups * dim]."""
        fused = getattr(self.glue, "gated_rmsnorm", None)
        if fused is not None:
            out = fused(x, gate, self.weight, self.eps)
            if out is not None:
                return out
        dtype, n = x.dtype, self.weight.numel()
        xf = x.reshape(-1, n).float()
        normed = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (normed * F.silu(gate.reshape(-1, n).float())).to(dtype).view(x.shape)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_layer: int, rotary_dim: int):
        super().__init__()
        self.kv_layer = kv_layer  # its buffer in the KV pool (attention layers only are there)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = 2 * cfg.num_heads * cfg.head_dim  # each head's query, then its gate
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.rotary_dim = rotary_dim
        self.scale = cfg.head_dim**-0.5
        bias = bool(cfg.hf_config.get("attention_bias", False))
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ([T, heads, D], normed and rotated) and the output gate [T, Hq * D] of rows x."""
        T, D = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(T, self.num_heads, 2 * D)
        q, gate = self.q_norm(qg[..., :D]), qg[..., D:].reshape(T, self.num_heads * D)
        k = self.k_norm(k.view(T, self.num_kv_heads, D))
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v.reshape(T, self.num_kv_heads, D), gate

    def output(self, attended: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attended * torch.sigmoid(gate))

    def forward(self, x, cos, sin, batch: ForwardBatch, backend: AttentionBackend,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output of every row, or of `rows` only (every row's K and V still enter the pool)."""
        q, k, v, gate = self.project(x, cos, sin)
        attended = backend.forward(q, k, v, self.kv_layer, batch, self.scale)
        return self.output(attended, gate) if rows is None else self.output(attended[rows], gate[rows])


class GatedDeltaNet(nn.Module):
    glue = None  # the runner's kernels once HybridLM.use_glue ran (HybridLM.use_glue: the rule's)

    def __init__(self, cfg: ModelConfig, layer: int, shape: HybridShape):
        super().__init__()
        self.layer = layer  # its parts in the state pool
        s = shape
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = s.k_heads, s.v_heads, s.k_dim, s.v_dim
        self.key_size, self.value_size, self.conv_dim = s.k_heads * s.k_dim, s.v_heads * s.v_dim, s.conv_dim
        self.kernel = s.conv_kernel
        # q, k, v (convolved), the output gate z, beta's and the decay's inputs: one matmul
        self.in_proj = nn.Linear(cfg.hidden_size, s.conv_dim + self.value_size + 2 * s.v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, s.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(s.v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.v_heads))
        self.norm = GatedRMSNorm(s.v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_size, cfg.hidden_size, bias=False)

    def _convolve(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal depthwise convolution and SiLU of x [B, C, L] after the previous K - 1
        inputs `window` [B, C, K - 1]; returns (out [B, C, L], the new window)."""
        ext = torch.cat([window.to(x.dtype), x], dim=-1)
        out = F.silu(F.conv1d(ext, self.conv_weight.unsqueeze(1), groups=self.conv_dim))
        return out, ext[..., ext.shape[-1] - (self.kernel - 1):]

    def _heads(self, mixed: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normalised, per value head, float32) and v [rows, H, d] of the convolved q, k, v."""
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = q.reshape(rows, self.k_heads, self.k_dim).float()
        k = k.reshape(rows, self.k_heads, self.k_dim).float()
        groups = self.v_heads // self.k_heads
        if groups > 1:
            q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
        q = delta_rule.l2norm(q) * self.k_dim**-0.5
        return q, delta_rule.l2norm(k), v.reshape(rows, self.v_heads, self.v_dim).float()

    def _heads_first(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """_heads of a sequence's convolved channels conv [C, L] (the convolution's own layout), as
        contiguous [H, L, d] float32: normalised along each head's channels, then transposed once."""
        L = conv.shape[1]
        c = conv.float()
        q = c[: self.key_size].view(self.k_heads, self.k_dim, L)
        k = c[self.key_size : 2 * self.key_size].view(self.k_heads, self.k_dim, L)
        v = c[2 * self.key_size :].view(self.v_heads, self.v_dim, L)
        q = q * (torch.rsqrt((q * q).sum(1, keepdim=True) + 1e-6) * self.k_dim**-0.5)  # delta_rule.l2norm's eps
        k = k * torch.rsqrt((k * k).sum(1, keepdim=True) + 1e-6)
        groups = self.v_heads // self.k_heads
        if groups > 1:
            q, k = q.repeat_interleave(groups, dim=0), k.repeat_interleave(groups, dim=0)
        return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output of every row, or of `rows` only (the states still read every row)."""
        T = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_size, self.v_heads, self.v_heads], dim=-1)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        parts = None if batch.state_slots is None else batch.state_pool.buffers[self.layer]
        out = torch.empty(T, self.v_heads, self.v_dim, dtype=x.dtype, device=x.device)
        if not batch.seqs:  # a beam step (sgrec.beam): row i is beam i's token, its state at state_slots[i]
            self._tokens(mixed, g, beta, parts, torch.arange(T, device=x.device), batch.state_slots, out,
                         batch.state_sources)
        parents = batch.state_parents
        if parents is None or all(p < 0 for p in parents):
            self._sequences(mixed, g, beta, batch, parts, range(len(batch.seqs)), out)
        else:  # the parents first; each child then starts from a copy of its parent's final state
            self._sequences(mixed, g, beta, batch, parts, [i for i, p in enumerate(parents) if p < 0], out)
            children = [i for i, p in enumerate(parents) if p >= 0]
            slot = batch.state_slots.tolist()
            batch.state_pool.copy_pairs_([(slot[i], slot[parents[i]]) for i in children], [self.layer])
            self._sequences(mixed, g, beta, batch, parts, children, out)
        out = out.view(T, self.value_size)
        return self.out_proj(self.norm(out, z) if rows is None else self.norm(out[rows], z[rows]))

    def _sequences(self, mixed, g, beta, batch, parts, which, out: torch.Tensor) -> None:
        """The rule over sequences `which` of the batch: one token of each at a time, all at once,
        for decode (one token each) and for sequences of up to STEPWISE_MAX tokens that keep a state
        (rank's forks: the chunked form would pad each to a chunk); longer ones (and stateless ones)
        through the chunked form, one by one."""
        kept = batch.state_slots is not None
        seqs = batch.seqs
        stepwise = [i for i in which if seqs[i].q_len == 1 or (kept and seqs[i].q_len <= STEPWISE_MAX)]
        for t in range(max((seqs[i].q_len for i in stepwise), default=0)):
            live = [i for i in stepwise if seqs[i].q_len > t]
            rows = torch.tensor([seqs[i].q_start + t for i in live], dtype=torch.int64, device=mixed.device)
            self._tokens(mixed, g, beta, parts, rows, batch.state_slots[live] if kept else None, out)
        for i in which:
            if i not in stepwise:
                self._sequence(mixed, g, beta, batch, parts, i, out)

    def _state(self, parts, slots: torch.Tensor | None, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (window, matrix) states at `slots`, or zero ones."""
        if slots is None:
            return (torch.zeros(n, self.conv_dim, self.kernel - 1, device=device),
                    torch.zeros(n, self.v_heads, self.k_dim, self.v_dim, device=device))
        return parts["conv"].index_select(0, slots), parts["ssm"].index_select(0, slots)

    def _keep(self, parts, slots: torch.Tensor | None, window: torch.Tensor, matrix: torch.Tensor) -> None:
        if slots is not None:
            parts["conv"].index_copy_(0, slots, window.to(parts["conv"].dtype))
            parts["ssm"].index_copy_(0, slots, matrix)

    def _tokens(self, mixed, g, beta, parts, rows: torch.Tensor, slots: torch.Tensor | None, out: torch.Tensor,
                sources: torch.Tensor | None = None) -> None:
        """One token of each of len(rows) sequences (flat rows `rows`, states at `slots`, read from
        `sources` where given: a beam step's forks, ForwardBatch.state_sources), at once: the rule's
        step in the glue's kernel on the pool's states in place where it takes them (gdr_step:
        native's C on CPU, kernels.delta_rule's Triton on CUDA), else delta_rule.step on copies."""
        n = rows.numel()
        read = slots if sources is None else sources
        window = (torch.zeros(n, self.conv_dim, self.kernel - 1, device=mixed.device) if slots is None
                  else parts["conv"].index_select(0, read))
        conv, window = self._convolve(mixed.index_select(0, rows)[..., None], window)
        q, k, v = self._heads(conv[..., 0], n)
        g, beta = g.index_select(0, rows), beta.index_select(0, rows)
        fast = getattr(self.glue, "gdr_step", None)
        if fast is not None and slots is not None and parts["ssm"].device.type == self.glue.DEVICE:
            o = fast(q, k, v, g, beta, parts["ssm"], slots, sources)
            parts["conv"].index_copy_(0, slots, window.to(parts["conv"].dtype))
        else:
            matrix = (torch.zeros(n, self.v_heads, self.k_dim, self.v_dim, device=mixed.device) if slots is None
                      else parts["ssm"].index_select(0, read))
            o, matrix = delta_rule.step(q, k, v, g, beta, matrix)
            self._keep(parts, slots, window, matrix)
        out.index_copy_(0, rows, o.to(out.dtype))

    def _sequence(self, mixed, g, beta, batch, parts, i: int, out: torch.Tensor) -> None:
        seq = batch.seqs[i]
        a, n = seq.q_start, seq.q_len
        slots = None if batch.state_slots is None else batch.state_slots[i : i + 1]
        window, matrix = self._state(parts, slots, 1, mixed.device)
        x = mixed[a : a + n]
        keep = self.kernel - 1  # the new window: the last K - 1 inputs
        ext = torch.cat([window.to(x.dtype), x[max(0, n - keep):].T[None]], dim=-1)
        on_glue = self.glue is not None and matrix.device.type == self.glue.DEVICE
        if on_glue and hasattr(self.glue, "gdr_prefill"):  # the convolution, the heads and the rule in one kernel
            _, state = self.glue.gdr_prefill(x, window[0], self.conv_weight, self.k_heads, self.v_heads, self.k_dim,
                                             self.v_dim, g[a : a + n].T, beta[a : a + n].T, matrix[0],
                                             out=out[a : a + n])
        else:
            conv, _ = self._convolve(x.T[None], window)
            q, k, v = self._heads_first(conv[0])
            if on_glue and hasattr(self.glue, "gdr_sequence"):  # o written into out, token-major, in its dtype
                _, state = self.glue.gdr_sequence(q, k, v, g[a : a + n].T, beta[a : a + n].T, matrix[0],
                                                  out=out[a : a + n])
            else:
                o, state = delta_rule.chunked(q, k, v, g[a : a + n].T, beta[a : a + n].T, matrix[0])
                out[a : a + n] = o.transpose(0, 1).to(out.dtype)
        window = ext[..., ext.shape[-1] - keep:]
        self._keep(parts, slots, window, state[None])


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, kv_layer: int | None, shape: HybridShape):
        super().__init__()
        if kv_layer is None:
            self.linear_attn, self.self_attn = GatedDeltaNet(cfg, layer, shape), None
        else:
            self.linear_attn, self.self_attn = None, GatedAttention(cfg, kv_layer, shape.rotary_dim)
        self.mlp = MLP(cfg)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, batch, backend, rows: torch.Tensor | None = None):
        """(this layer's MLP output, the residual stream before it), as llama.DecoderLayer: the
        stream's adds are fused into the norms that follow them. residual None: x is the first
        layer's input. rows (the last layer's): both of those rows only; the mixer still reads every
        row (the K/V and the states the next forward needs), its output projection and the MLP run on
        these rows."""
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm.add_forward(x, residual)
        if self.self_attn is None:
            h = self.linear_attn(h, batch, rows)
        else:
            h = self.self_attn(h, cos, sin, batch, backend, rows)
        h, residual = self.post_attention_layernorm.add_forward(h, residual if rows is None else residual[rows])
        return self.mlp(h), residual


class HybridLM(LMBase):
    def __init__(self, cfg: ModelConfig, device: torch.device):
        super().__init__()
        self.cfg = cfg
        shape = HybridShape.of(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        kv_layers = [sum(KINDS[t] == ATTENTION for t in shape.layer_types[:i]) if KINDS[t] == ATTENTION else None
                     for i, t in enumerate(shape.layer_types)]  # as mem.memory.Memory maps them
        self.layers = nn.ModuleList(HybridLayer(cfg, i, kv, shape) for i, kv in enumerate(kv_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(shape.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings,
                                    device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (after the last norm): [T, hidden], or of `rows` only (int64 indices),
        whose last layer then projects the output and runs the MLP of those rows alone (a prefill
        that samples one token skips them for all its other tokens)."""
        if any(s.masked for s in batch.seqs):
            raise ValueError("a hybrid model's recurrent layers read tokens in order: no attention mask")
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rope.cos_sin(batch.positions, x.dtype)
        backend.prepare(batch)
        residual, last = None, len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, batch, backend, rows if i == last else None)
        return self.norm.add_forward(x, residual)[0]

    @torch.inference_mode()
    def hybrid_forward(self, batch: ForwardBatch, backend: AttentionBackend, chunk_size: int,
                       rows: torch.Tensor) -> torch.Tensor:
        """Hybrid prefilling (PrefillOnly §4) for this family: the final hidden states of `rows` only.
        A gated attention layer projects q, k, v and its gate chunk by chunk of `chunk_size` tokens,
        attends over the whole batch at once, and projects its output chunk by chunk; a Gated DeltaNet
        layer runs chunk after chunk, each sequence's state carried from one chunk to the next in its
        state slot; the MLPs run chunk by chunk. Every chunk's intermediates exist one at a time. A last
        layer of attention projects the output and runs the MLP of `rows` alone."""
        if batch.state_slots is None:  # a batch that keeps no state (a profile run): zero states, freed after
            pool = batch.state_pool
            slots = pool.take(len(batch.seqs))
            if slots is None:
                raise RuntimeError(f"hybrid prefilling needs a state slot a sequence ({len(batch.seqs)}); "
                                   f"{pool.available_size()} are free")
            pool.zero_(slots)
            try:
                return self.hybrid_forward(replace(batch, state_slots=slots), backend, chunk_size, rows)
            finally:
                pool.free(slots)
        x = self.embed_tokens(batch.input_ids)  # the residual stream, updated in place
        T = x.shape[0]
        cos, sin = self.rope.cos_sin(batch.positions, x.dtype)
        backend.prepare(batch)
        parts = [slice(a, min(a + chunk_size, T)) for a in range(0, T, chunk_size)]
        pieces = [_rows_of(batch, c) for c in parts]  # each chunk as its own batch, for the recurrent layers
        for layer in self.layers:
            attn = layer.self_attn
            if attn is None:
                for c, piece in zip(parts, pieces):
                    x[c] += layer.linear_attn(layer.input_layernorm(x[c]), piece)
                    x[c] += layer.mlp(layer.post_attention_layernorm(x[c]))
                continue
            q = k = v = gate = None
            for c in parts:
                qc, kc, vc, gc = attn.project(layer.input_layernorm(x[c]), cos[c], sin[c])
                if q is None:
                    q, k, v, gate = (t.new_empty((T, *t.shape[1:])) for t in (qc, kc, vc, gc))
                q[c], k[c], v[c], gate[c] = qc, kc, vc, gc
            o = backend.forward(q, k, v, attn.kv_layer, batch, attn.scale)
            if layer is self.layers[-1]:  # the asked rows alone need its output and MLP (as forward's rows)
                h = x[rows] + attn.output(o[rows], gate[rows])
                return self.norm(h + layer.mlp(layer.post_attention_layernorm(h)))
            for c in parts:
                x[c] += attn.output(o[c], gate[c])
                x[c] += layer.mlp(layer.post_attention_layernorm(x[c]))
            del o
        return self.norm(x[rows])

    def use_glue(self, glue) -> None:
        """LMBase.use_glue, and the delta rule's kernels where `glue` has them: gdr_step (decode and beam
        steps, states in place), gdr_prefill (a sequence's prefill from its projection: convolution, heads
        and rule; native) or gdr_sequence (the rule of a sequence's prefill; Triton), on tensors of the
        glue's DEVICE; the torch forms elsewhere."""
        super().use_glue(glue)
        for m in self.modules():
            if isinstance(m, (GatedDeltaNet, ZeroCenteredRMSNorm, GatedRMSNorm)):
                m.glue = glue

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(("mtp.", "model.visual.")) or "rotary_emb" in name:
            return None
        name = name.removeprefix("model.language_model.").removeprefix("model.")
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the checkpoint may still carry a copy
        return name.replace("linear_attn.conv1d.weight", "linear_attn.conv_weight")

    def fused_projections(self) -> dict[str, tuple[str, int, int]]:
        cfg, shape = self.cfg, HybridShape.of(self.cfg)
        q, kv = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        c, z = shape.conv_dim, shape.v_heads * shape.v_dim
        return {
            "q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
            "in_proj_qkv": ("in_proj", 0, c), "in_proj_z": ("in_proj", c, z),
            "in_proj_b": ("in_proj", c + z, shape.v_heads), "in_proj_a": ("in_proj", c + z + shape.v_heads, shape.v_heads),
        }


def _rows_of(batch: ForwardBatch, c: slice) -> ForwardBatch:
    """The batch's rows c as a batch of their own, for the recurrent layers: the part of every
    sequence that falls in them, with its state slot (the attention layers' fields are not read)."""
    seqs, slots = [], []
    for i, s in enumerate(batch.seqs):
        a, b = max(s.q_start, c.start), min(s.q_start + s.q_len, c.stop)
        if a < b:
            seqs.append(SeqLayout(a - c.start, b - a, s.kv_indices))
            slots.append(i)
    return ForwardBatch(input_ids=batch.input_ids[c], positions=batch.positions[c], out_cache_loc=batch.out_cache_loc[c],
                        seqs=seqs, kv_pool=batch.kv_pool, state_slots=batch.state_slots[slots],
                        state_pool=batch.state_pool)


def config_flags(variant: str, cfg: dict) -> dict:
    """No ModelConfig flags of its own (the model reads HybridShape); a ValueError naming the
    config field for what it cannot serve."""
    text = cfg.get("text_config") or cfg
    if text.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Unsupported hidden_act {text['hidden_act']!r} (only silu)")
    unknown = sorted(set(text.get("layer_types") or []) - set(KINDS))
    if unknown:
        raise ValueError(f"Unsupported layer_types {unknown} (supported: {sorted(KINDS)})")
    if text.get("linear_num_value_heads", 32) % text.get("linear_num_key_heads", 16):
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    return {}


def capabilities(cfg: ModelConfig) -> Capabilities:
    shape = HybridShape.of(cfg)
    kinds = tuple(KINDS[t] for t in shape.layer_types)
    states = {i: {"conv": (shape.conv_dim, shape.conv_kernel - 1), "ssm": (shape.v_heads, shape.k_dim, shape.v_dim)}
              for i, kind in enumerate(kinds) if kind == RECURRENT}
    return Capabilities(layer_kinds=kinds, state_shapes=states, state_float32=frozenset({"ssm"}),
                        prefix_reuse="snapshot", staged_beams=True, layouts=frozenset({"user"}), rank_forks=True,
                        hybrid_prefill=True)


FAMILY = Family(  # listed in sgrec.model.families
    name="hybrid",
    architectures={"Qwen3_5ForCausalLM": "qwen3_5", "Qwen3_5ForConditionalGeneration": "qwen3_5"},
    config_flags=config_flags, build=HybridLM, capabilities=capabilities,
)
