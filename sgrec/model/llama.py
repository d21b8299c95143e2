"""The dense decoder family (Llama / Qwen2 / Qwen3), numerically matching HF transformers.

Differences between the three are flags on ModelConfig (`config_flags`): Qwen2's q/k/v bias,
Qwen3's per-head q/k RMSNorm (and explicit head_dim), tied or untied embeddings.
q/k/v and gate/up projections are fused into one matmul each. The "decoder" family
(sgrec.model.families): every layer attention over the token pool, any prefix reusable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from sgrec.model.attention import AttentionBackend, ForwardBatch
from sgrec.model.cpu_linear import MIN_PACKED_NUMEL, pack_linears
from sgrec.model.registry import ATTENTION, Capabilities, Family
from sgrec.model.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:  # the config reads sgrec.model.families, which lists this family: a type only here
    from sgrec.model.config import ModelConfig


class RMSNorm(nn.Module):
    glue = None  # fused element-wise kernels once use_glue() ran: sgrec.model.native (CPU) or kernels.glue (CUDA)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.glue is not None:
            out = self.glue.rmsnorm(x, self.weight, self.eps)
            if out is not None:
                return out
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and the next norm in one pass
        where the glue takes them (x, a layer's fresh output, receives the sum in place), else torch's
        add then forward; the same bits either way."""
        if self.glue is not None:
            out = self.glue.rmsnorm(x, self.weight, self.eps, residual)
            if out is not None:
                return out, x
        x = x + residual
        return self(x), x


class Attention(nn.Module):
    glue = None  # as RMSNorm.glue

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k/v [T, Hkv, D], rotated and normed."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.glue is not None and self.glue.rope_(q, k, cos, sin):  # in place (q, k: views of a fresh tensor)
            return q, k, v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        return self.o_proj(backend.forward(q, k, v, self.layer, batch, self.scale))


class MLP(nn.Module):
    glue = None  # as RMSNorm.glue

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = None if self.glue is None else self.glue.silu_mul(gate_up, self.inter)
        if act is None:
            gate, up = gate_up.split([self.inter, self.inter], dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, batch, backend):
        """(this layer's MLP output, the residual stream before it): the stream's adds are fused into
        the norms that follow them (the next layer's, or the final norm, adds the MLP output).
        residual None: x is the first layer's input."""
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, cos, sin, batch, backend), residual)
        return self.mlp(h), residual


class LMBase(nn.Module):
    """What every family's causal LM shares: the output layer over `embed_tokens` / `lm_head`
    (tied or not), and the whole-model transforms the loader and the runner apply (weight packing,
    batch invariance, fused element-wise glue). A subclass sets cfg, embed_tokens, lm_head (None
    when tied) and rope, and defines forward(batch, backend) and load_weights."""

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits for the given rows of hidden states only. `columns` (vocabulary ids):
        only those, [rows, len(columns)], through the output layer's rows gathered first: the
        values of compute_logits(hidden)[:, columns] up to the float32 rounding of a smaller matmul,
        at len(columns) / vocab of its cost. Made batch-invariant (make_batch_invariant), one row per
        matmul: that gathered weight's shape changes with the trie level, so no start-up check covers it,
        and a float32 sgemm may sum in another order at another row count (MKL on Intel does)."""
        if columns is not None:
            weight = self.out_weight.index_select(0, columns)
            if self.__dict__.get("_batch_invariant"):
                from sgrec.model.batch_invariant import rowwise

                return rowwise(lambda row: F.linear(row, weight), hidden).float()
            return F.linear(hidden, weight).float()
        if self.lm_head is None:  # tied embeddings
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    @property
    def out_weight(self) -> torch.Tensor:
        """The output layer's plain [vocab, hidden] weight (kept aside when the layer is packed)."""
        plain = self.__dict__.get("_plain_out_weight")
        if plain is not None:
            return plain
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def use_glue(self, glue) -> None:
        """RMSNorm, RoPE and SiLU-times-up through fused kernels wherever `glue` takes the tensors,
        the torch ops elsewhere: sgrec.model.native (C, float32 on CPU) or sgrec.model.kernels.glue
        (Triton, CUDA). A glue module has rmsnorm(x, weight, eps), rope_(q, k, cos, sin) and
        silu_mul(gate_up, inter), each returning None (False) where it does not take its tensors."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.glue = glue

    def pack_for_cpu(self, min_numel: int = MIN_PACKED_NUMEL, keep_plain: bool = False) -> None:
        """Prepacks every projection (and the output layer) of at least min_numel weights for oneDNN;
        see cpu_linear.py. keep_plain: the plain weights stay too (sgrec.model.fused_decode reads them)."""
        self.__dict__["_plain_out_weight"] = self.out_weight.detach()  # for compute_logits(columns=...)
        self.untie_output(min_numel)
        pack_linears(self, min_numel, keep_plain)

    def make_batch_invariant(self) -> list[str]:
        """--enable-deterministic-inference: every linear layer, the output layer untied from the
        embedding included, gives a row the same bits whatever else is in the batch
        (sgrec.model.batch_invariant); returns the layers that had to compute one row per matmul."""
        from sgrec.model.batch_invariant import make_batch_invariant

        self.__dict__.setdefault("_plain_out_weight", self.out_weight.detach())
        self.__dict__["_batch_invariant"] = True  # compute_logits(columns=...) one row per matmul
        self.untie_output(0)
        return make_batch_invariant(self, self.embed_tokens.weight.dtype, self.embed_tokens.weight.device)

    def untie_output(self, min_numel: int = MIN_PACKED_NUMEL) -> None:
        """With tied embeddings, an output layer of its own over the shared weight (the embedding's
        lookups cannot use a packed or wrapped copy): where it is packed, or made batch-invariant."""
        if self.lm_head is None and self.embed_tokens.weight.numel() >= min_numel:
            self.lm_head = nn.Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.embed_tokens.weight  # shared

    def checkpoint_name(self, name: str) -> str | None:
        """This model's parameter name for a checkpoint tensor's, or None to skip it."""
        raise NotImplementedError

    def fused_projections(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint projections stored as rows of one fused matrix: module name -> (the fused
        module, its first row, its rows)."""
        return {}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors (`checkpoint_name`), fusing the projections `fused_projections`
        names. Every parameter must be set."""
        fused = self.fused_projections()
        params = dict(self.named_parameters())
        expected = {name: params[name].shape[0] for name in params}
        loaded: dict[str, int] = {}
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name is None:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, start, size = fused[parts[-2]]
                name = ".".join(parts[:-2] + [target, parts[-1]])
                if name not in params:
                    raise ValueError(f"Unexpected weight {name} in checkpoint")
                params[name][start : start + size].copy_(tensor)
                loaded[name] = loaded.get(name, 0) + size
                continue
            if name not in params:
                raise ValueError(f"Unexpected weight {name} in checkpoint")
            params[name].copy_(tensor.reshape(params[name].shape))
            loaded[name] = params[name].shape[0]
        missing = [n for n, rows in expected.items() if loaded.get(n, 0) != rows]
        if missing:
            raise ValueError(f"Checkpoint is missing weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")


class CausalLM(LMBase):
    def __init__(self, cfg: ModelConfig, device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (after the last norm): [T, hidden], or of `rows` only (int64 indices)."""
        x = self.embed_tokens(batch.input_ids)
        cos, sin = self.rope.cos_sin(batch.positions, x.dtype)
        backend.prepare(batch)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, batch, backend)
        if rows is not None:
            x, residual = x[rows], None if residual is None else residual[rows]
        return self.norm.add_forward(x, residual)[0] if residual is not None else self.norm(x)

    def hybrid_forward(self, batch: ForwardBatch, backend: AttentionBackend, chunk_size: int,
                       rows: torch.Tensor) -> torch.Tensor:
        """Hybrid prefilling (sgrec.model.hybrid_prefill): the final hidden states of `rows` only."""
        from sgrec.model.hybrid_prefill import hybrid_forward

        return hybrid_forward(self, batch, backend, chunk_size, rows)

    def checkpoint_name(self, name: str) -> str | None:
        """This model's parameter name for a checkpoint tensor's, or None to skip it."""
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None  # tied: the checkpoint may still carry a copy
        return name

    def fused_projections(self) -> dict[str, tuple[str, int, int]]:
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }


def config_flags(variant: str, cfg: dict) -> dict:
    """ModelConfig's decoder flags for a variant's config.json; a ValueError for what it cannot serve."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
    if variant == "qwen2" and cfg.get("use_sliding_window"):
        raise ValueError("Qwen2 sliding-window attention is not supported")
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": variant == "qwen2" or bias, "o_bias": variant != "qwen2" and bias,
            "mlp_bias": bool(cfg.get("mlp_bias", False)), "qk_norm": variant == "qwen3"}


def capabilities(cfg: ModelConfig) -> Capabilities:
    # layouts: both of sgrec.layout.KINDS (user-as-prefix, item-as-prefix), masks through the backends
    return Capabilities(layer_kinds=(ATTENTION,) * cfg.num_layers, prefix_reuse="any",
                        layouts=frozenset({"user", "item"}), encoder=False, staged_beams=True, hybrid_prefill=True,
                        fused_decode=True, decode_graphs=True)


FAMILY = Family(  # listed in sgrec.model.families
    name="decoder",
    architectures={"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"},
    config_flags=config_flags, build=CausalLM, capabilities=capabilities,
)
