"""The encoder-decoder family: T5 (`T5ForConditionalGeneration`, the model TIGER trains), matching
transformers.

An encoder reads a request's input (a user's history as semantic-ID tokens) with bidirectional
self-attention; a decoder emits the output (the next item's semantic ID) with causal self-attention
and cross-attention over the encoder's output. Both stacks use T5's relative position buckets (a
bias per head, made by each stack's first layer and shared by all its layers, no rotary
embedding and no 1/sqrt(d) scaling), its RMS-style norm, and a plain (`relu`) or gated
(`gated-gelu`, ...) feed-forward as `feed_forward_proj` says. With tied embeddings (config.json's
`tie_word_embeddings`, true by default) the output layer is the shared embedding, else
`lm_head.weight`; the decoder's output is scaled by d_model^-0.5 first where
`scale_decoder_outputs` says so (by default: where tied), as transformers does.

Memory: the token pool has one layer a decoder layer. An encoder token's slot holds, in layer i, the
cross-attention K/V of decoder layer i over that token (`T5LM.encode` writes them once per input);
a decoder token's slot holds its self-attention K/V. `ForwardBatch.encoder_slots` names each decoder
sequence's encoder slots; sequences of one batch that name the same tensor (the beams of one
request) read it in one matmul, in place.

Capabilities: `encoder`; a cached input is reusable only whole ("exact": the encoder is
bidirectional); no rank layouts, no staged beams of the decoder-only kind (retrieve runs
`sgrec.beam.encdec`), no hybrid prefilling, fused decode or decode graphs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from sgrec.model.attention import AttentionBackend, ForwardBatch
from sgrec.model.llama import LMBase, RMSNorm
from sgrec.model.registry import ATTENTION, Capabilities, Family

if TYPE_CHECKING:
    from sgrec.model.config import ModelConfig


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU written out in the input's dtype as transformers' NewGELUActivation does (T5
    v1.1's gated-gelu): in bfloat16 the same bits as transformers, where F.gelu's one rounding differs."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# a decode step whose inputs each feed at most this many rows (generate's requests, a few narrow beams)
# reads every row's encoder K/V in one padded batch; wider groups (a retrieve's beams) one matmul each
CROSS_PADDED_ROWS = 8

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": _gelu_new, "gelu_pytorch_tanh": _gelu_tanh,
               "silu": F.silu, "swish": F.silu}


@dataclass(frozen=True)
class T5Shape:
    """The T5 fields of config.json."""

    d_model: int
    heads: int
    d_kv: int
    d_ff: int
    encoder_layers: int
    decoder_layers: int
    buckets: int
    max_distance: int
    act: str
    gated: bool
    eps: float
    tied: bool  # the output layer is the shared embedding
    scaled: bool  # the decoder's output is scaled by d_model^-0.5 before the output layer
    decoder_start: int

    @classmethod
    def of(cls, hf: dict) -> "T5Shape":
        act, gated = feed_forward(hf.get("feed_forward_proj", "relu"))
        tied = hf.get("tie_word_embeddings") is not False
        return cls(d_model=hf["d_model"], heads=hf["num_heads"], d_kv=hf["d_kv"], d_ff=hf["d_ff"],
                   encoder_layers=hf["num_layers"], decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
                   buckets=hf.get("relative_attention_num_buckets", 32),
                   max_distance=hf.get("relative_attention_max_distance", 128), act=act, gated=gated,
                   eps=hf.get("layer_norm_epsilon", 1e-6), tied=tied,
                   scaled=bool(hf.get("scale_decoder_outputs", tied)), decoder_start=_decoder_start(hf))

    @property
    def inner(self) -> int:
        return self.heads * self.d_kv


def feed_forward(proj: str) -> tuple[str, bool]:
    """(activation, gated) of config.json's feed_forward_proj, as transformers reads it (`gated-gelu`:
    the tanh GELU); a ValueError naming the field for one sgrec does not run."""
    parts = proj.split("-")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated") or act not in ACTIVATIONS:
        raise ValueError(f"Unsupported feed_forward_proj {proj!r} (supported: an activation of "
                         f"{sorted(ACTIVATIONS)}, or gated-<activation>)")
    return act, len(parts) == 2


def _decoder_start(hf: dict) -> int:
    start = hf.get("decoder_start_token_id")
    return int(start if start is not None else hf.get("pad_token_id") or 0)


def position_buckets(relative: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position (key position - query position): exact below half the
    buckets, logarithmic up to max_distance; bidirectional splits the buckets by sign."""
    out = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        out += (relative > 0).to(torch.long) * buckets
        n = relative.abs()
    else:
        n = -torch.min(relative, torch.zeros_like(relative))
    exact = buckets // 2
    large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (buckets - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, buckets - 1))
    return out + torch.where(n < exact, n, large)


class PositionBias(nn.Module):
    """A stack's relative position bias: [heads, queries, keys] for query and key positions."""

    def __init__(self, shape: T5Shape, bidirectional: bool):
        super().__init__()
        self.bidirectional, self.buckets, self.max_distance = bidirectional, shape.buckets, shape.max_distance
        self.relative_attention_bias = nn.Embedding(shape.buckets, shape.heads)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        buckets = position_buckets(k_pos[None, :] - q_pos[:, None], self.bidirectional, self.buckets,
                                   self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1)


class FeedForward(nn.Module):
    def __init__(self, shape: T5Shape):
        super().__init__()
        self.gated, self.d_ff, self.act = shape.gated, shape.d_ff, ACTIVATIONS[shape.act]
        self.wi = nn.Linear(shape.d_model, (2 if shape.gated else 1) * shape.d_ff, bias=False)
        self.wo = nn.Linear(shape.d_ff, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wi(x)
        if self.gated:
            gate, lin = h.split([self.d_ff, self.d_ff], dim=-1)
            h = self.act(gate) * lin
        else:
            h = self.act(h)
        return self.wo(h)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, heads * d] -> [1, heads, T, d] (SDPA's layout)."""
    return x.view(x.shape[0], heads, -1).transpose(0, 1)[None]


def _rows(att: torch.Tensor) -> torch.Tensor:
    """[1, heads, T, d] (SDPA's layout) -> [T, heads * d]."""
    return att[0].transpose(0, 1).reshape(att.shape[2], -1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA without T5's absent scaling: [B, H, Tq, D] x [B, H, Tk, D] -> [B, H, Tq, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)


def _attend_few(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """_attend for a few keys a query (a decode step's self-attention over a beam's own tokens):
    two batched matmuls and a float32 softmax, about 3x faster than SDPA's kernel at these shapes on
    CPU (400 rows of 6 heads over 4 keys: 0.44 ms against 1.23 ms, bfloat16)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() + mask
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


class SelfAttention(nn.Module):
    def __init__(self, shape: T5Shape):
        super().__init__()
        self.heads, self.d_kv, self.inner = shape.heads, shape.d_kv, shape.inner
        self.qkv = nn.Linear(shape.d_model, 3 * shape.inner, bias=False)
        self.o = nn.Linear(shape.inner, shape.d_model, bias=False)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv(x).split([self.inner] * 3, dim=-1)


class CrossAttention(nn.Module):
    def __init__(self, shape: T5Shape):
        super().__init__()
        self.heads, self.inner = shape.heads, shape.inner
        self.q_proj = nn.Linear(shape.d_model, shape.inner, bias=False)
        self.kv = nn.Linear(shape.d_model, 2 * shape.inner, bias=False)  # of the encoder's output
        self.o = nn.Linear(shape.inner, shape.d_model, bias=False)


class EncoderLayer(nn.Module):
    def __init__(self, shape: T5Shape):
        super().__init__()
        self.attn_norm, self.ff_norm = RMSNorm(shape.d_model, shape.eps), RMSNorm(shape.d_model, shape.eps)
        self.self_attn, self.ff = SelfAttention(shape), FeedForward(shape)

    def forward(self, x: torch.Tensor, spans: list[slice], masks: list[torch.Tensor]) -> torch.Tensor:
        a = self.self_attn
        q, k, v = a.split(self.attn_norm(x))
        out = torch.empty_like(q)
        for sl, mask in zip(spans, masks):  # each input attends to all of itself
            att = _attend(_heads(q[sl], a.heads), _heads(k[sl], a.heads), _heads(v[sl], a.heads), mask)
            out[sl] = _rows(att)
        x = x + a.o(out)
        return x + self.ff(self.ff_norm(x))


@dataclass
class _DecoderMeta:
    """What every decoder layer of one forward reads: the self-attention's KV slots and additive
    masks (the position bias, -inf where a query may not look), and the cross-attention's groups."""

    decode: bool  # every sequence one new token: one padded batch
    kv_idx: torch.Tensor | list[torch.Tensor]  # decode: [B, L] padded with slot 0; else per sequence
    masks: torch.Tensor | list[torch.Tensor]  # decode: [B, H, 1, L] float32; else per sequence [1, H, q, kv]
    spans: list[slice]  # else: each sequence's rows
    cross: list[tuple[slice, torch.Tensor]]  # (rows, encoder slots): runs of sequences reading one input
    rows: torch.Tensor | None = None  # decode: the pool's (slot, head) rows of kv_idx, in (b, h, l) order
    # a decode step over several inputs (generate's requests): every row's encoder K/V padded into one
    # batch, as the pool's (slot, head) rows in (b, h, l) order, and its additive mask [B, 1, 1, L]
    cross_rows: torch.Tensor | None = None
    cross_mask: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    def __init__(self, shape: T5Shape, layer: int):
        super().__init__()
        self.layer = layer
        self.self_norm, self.cross_norm, self.ff_norm = (RMSNorm(shape.d_model, shape.eps) for _ in range(3))
        self.self_attn, self.cross_attn, self.ff = SelfAttention(shape), CrossAttention(shape), FeedForward(shape)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, meta: _DecoderMeta) -> torch.Tensor:
        a, pool = self.self_attn, batch.kv_pool
        q, k, v = a.split(self.self_norm(x))
        T, H = q.shape[0], a.heads
        pool.set_kv(self.layer, batch.out_cache_loc, k.view(T, H, -1), v.view(T, H, -1))
        k_buf, v_buf = pool.get_kv(self.layer)
        if meta.decode:  # the pool's rows (slot, head) in (b, h, l) order: K/V as [B, H, L, D], contiguous
            B, L = meta.kv_idx.shape
            d = k_buf.shape[-1]
            kk = k_buf.view(-1, d).index_select(0, meta.rows).view(B, H, L, d).to(q.dtype)
            vv = v_buf.view(-1, d).index_select(0, meta.rows).view(B, H, L, d).to(q.dtype)
            out = _attend_few(q.view(B, H, 1, -1), kk, vv, meta.masks).reshape(B, -1)
        else:
            out = torch.empty_like(q)
            for sl, idx, mask in zip(meta.spans, meta.kv_idx, meta.masks):
                kk, vv = (_heads(buf[idx].to(q.dtype).reshape(idx.numel(), -1), H) for buf in (k_buf, v_buf))
                att = _attend(_heads(q[sl], H), kk, vv, mask)
                out[sl] = _rows(att)
        x = x + a.o(out)
        c = self.cross_attn
        cq = c.q_proj(self.cross_norm(x))
        if meta.cross_rows is not None:  # one padded batch: [B, H, 1, d] against [B, H, L, d]
            B, L = cq.shape[0], meta.cross_mask.shape[-1]
            d = k_buf.shape[-1]
            kk = k_buf.view(-1, d).index_select(0, meta.cross_rows).view(B, H, L, d).to(cq.dtype)
            vv = v_buf.view(-1, d).index_select(0, meta.cross_rows).view(B, H, L, d).to(cq.dtype)
            x = x + c.o(_attend_few(cq.view(B, H, 1, -1), kk, vv, meta.cross_mask).reshape(B, -1))
            return x + self.ff(self.ff_norm(x))
        out = torch.empty_like(cq)
        for rows, slots in meta.cross:  # every row of a group reads the same encoder K/V, in place
            n = slots.numel()
            kk = _heads(k_buf.index_select(0, slots).to(cq.dtype).reshape(n, -1), H)
            vv = _heads(v_buf.index_select(0, slots).to(cq.dtype).reshape(n, -1), H)
            att = _attend(_heads(cq[rows], H), kk, vv, None)
            out[rows] = _rows(att)
        x = x + c.o(out)
        return x + self.ff(self.ff_norm(x))


class T5LM(LMBase):
    def __init__(self, cfg: ModelConfig, device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.shape = shape = T5Shape.of(cfg.hf_config)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, shape.d_model)
        self.encoder = nn.ModuleList(EncoderLayer(shape) for _ in range(shape.encoder_layers))
        self.encoder_bias = PositionBias(shape, bidirectional=True)
        self.encoder_norm = RMSNorm(shape.d_model, shape.eps)
        self.decoder = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.decoder_layers))
        self.decoder_bias = PositionBias(shape, bidirectional=False)
        self.decoder_norm = RMSNorm(shape.d_model, shape.eps)
        self.lm_head = None if shape.tied else nn.Linear(shape.d_model, cfg.vocab_size, bias=False)
        self.rope = None
        self.encoded_inputs = 0  # inputs the encoder has read (counted: once a request, whatever its beams)

    # ---- the encoder ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, batch: ForwardBatch) -> torch.Tensor:
        """Reads each sequence of the batch (its tokens, at positions from 0) through the encoder and
        writes every decoder layer's cross-attention K/V of each token into its slot
        (batch.out_cache_loc); returns the encoder's output [T, d_model]."""
        x = self.embed_tokens(batch.input_ids)
        spans, masks = [], []
        for s in batch.seqs:
            sl = slice(s.q_start, s.q_start + s.q_len)
            pos = batch.positions[sl]
            spans.append(sl)
            masks.append(self.encoder_bias(pos, pos).to(x.dtype)[None])
        for layer in self.encoder:
            x = layer(x, spans, masks)
        x = self.encoder_norm(x)
        T, H = x.shape[0], self.shape.heads
        for layer in self.decoder:
            k, v = layer.cross_attn.kv(x).split([self.shape.inner] * 2, dim=-1)
            batch.kv_pool.set_kv(layer.layer, batch.out_cache_loc, k.view(T, H, -1), v.view(T, H, -1))
        self.encoded_inputs += len(batch.seqs)
        return x

    # ---- the decoder ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, backend: AttentionBackend | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's final hidden states [T, d_model] (scaled as the output layer expects), or of
        `rows` only (int64 indices). Each sequence's kv_indices are its decoder tokens' slots from
        position 0 (its new tokens last), its encoder_slots the slots `encode` wrote. The attention is
        T5's own (a position bias in every score): `backend` is not read."""
        if batch.encoder_slots is None or len(batch.encoder_slots) != len(batch.seqs):
            raise ValueError("an encoder-decoder forward needs each sequence's encoder slots")
        x = self.embed_tokens(batch.input_ids)
        meta = self._meta(batch, x.dtype)
        for layer in self.decoder:
            x = layer(x, batch, meta)
        x = self.decoder_norm(x if rows is None else x[rows])
        return x * self.shape.d_model**-0.5 if self.shape.scaled else x

    def _meta(self, batch: ForwardBatch, dtype: torch.dtype) -> _DecoderMeta:
        seqs, dev = batch.seqs, batch.input_ids.device
        cross: list[tuple[slice, torch.Tensor]] = []
        for s, slots in zip(seqs, batch.encoder_slots):
            if cross and cross[-1][1] is slots and cross[-1][0].stop == s.q_start:
                cross[-1] = (slice(cross[-1][0].start, s.q_start + s.q_len), slots)
            else:
                cross.append((slice(s.q_start, s.q_start + s.q_len), slots.to(dev)))
        # one padded batch for a decode step, except under --enable-deterministic-inference, where each
        # sequence attends on its own (the padding's length would change a softmax's summation order)
        if all(s.q_len == 1 and not s.masked for s in seqs) and not self.__dict__.get("_batch_invariant"):
            lens = torch.tensor([s.kv_len for s in seqs], device=dev)
            kv_idx = torch.nn.utils.rnn.pad_sequence([s.kv_indices for s in seqs], batch_first=True).to(dev)
            k_pos = torch.arange(kv_idx.shape[1], device=dev)
            q_pos = batch.positions[[s.q_start for s in seqs]]
            bias = self.decoder_bias(q_pos, k_pos).float().permute(1, 0, 2)[:, :, None, :]  # [B, H, 1, L]
            allowed = (k_pos[None, :] < lens[:, None]) & (k_pos[None, :] <= q_pos[:, None])
            masks = bias.masked_fill(~allowed[:, None, None, :], float("-inf"))
            heads = self.shape.heads
            rows = (kv_idx[:, None, :] * heads + torch.arange(heads, device=dev)[None, :, None]).reshape(-1)
            meta = _DecoderMeta(True, kv_idx, masks, [], cross, rows)
            if len(cross) > 1 and max(r.stop - r.start for r, _ in cross) <= CROSS_PADDED_ROWS:
                meta.cross_rows, meta.cross_mask = self._padded_cross(cross, dev)
            return meta
        spans, kv_idx, masks = [], [], []
        for s in seqs:
            sl = slice(s.q_start, s.q_start + s.q_len)
            k_pos = torch.arange(s.kv_len, device=dev)
            q_pos = batch.positions[sl]
            allowed = s.dense_mask()
            allowed = k_pos[None, :] <= q_pos[:, None] if allowed is None else allowed.to(dev)
            bias = self.decoder_bias(q_pos, k_pos).to(dtype)
            spans.append(sl)
            kv_idx.append(s.kv_indices.to(dev))
            masks.append(bias.masked_fill(~allowed[None], float("-inf"))[None])
        return _DecoderMeta(False, kv_idx, masks, spans, cross)

    def _padded_cross(self, cross: list[tuple[slice, torch.Tensor]], dev) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's cross-attention as one padded batch: each row's encoder slots (padded with
        slot 0) as the pool's (slot, head) rows, and the mask that hides the padding."""
        per_row = [slots for rows, slots in cross for _ in range(rows.stop - rows.start)]
        enc = torch.nn.utils.rnn.pad_sequence(per_row, batch_first=True)
        lens = torch.tensor([t.numel() for t in per_row], device=dev)
        pad = torch.arange(enc.shape[1], device=dev)[None, :] >= lens[:, None]
        mask = torch.zeros(pad.shape, device=dev).masked_fill(pad, float("-inf"))[:, None, None, :]
        heads = self.shape.heads
        rows = (enc[:, None, :] * heads + torch.arange(heads, device=dev)[None, :, None]).reshape(-1)
        return rows, mask

    # ---- weights ---------------------------------------------------------------------------------------
    _LAYER = re.compile(r"(encoder|decoder)\.block\.(\d+)\.layer\.(\d+)\.(.+)")
    _ENCODER_PARTS = {0: {"SelfAttention": "self_attn", "layer_norm": "attn_norm"},
                      1: {"DenseReluDense": "ff", "layer_norm": "ff_norm"}}
    _DECODER_PARTS = {0: {"SelfAttention": "self_attn", "layer_norm": "self_norm"},
                      1: {"EncDecAttention": "cross_attn", "layer_norm": "cross_norm"},
                      2: {"DenseReluDense": "ff", "layer_norm": "ff_norm"}}
    _CROSS = {"q": "q_proj", "k": "ck", "v": "cv", "o": "o"}  # ck/cv: rows of cross_attn.kv

    def checkpoint_name(self, name: str) -> str | None:
        if name == "shared.weight":
            return "embed_tokens.weight"
        if name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            return None  # the shared embedding
        if name == "lm_head.weight":
            return None if self.lm_head is None else name
        if name.endswith("final_layer_norm.weight"):
            return name.split(".")[0] + "_norm.weight"
        m = self._LAYER.fullmatch(name)
        if m is None:
            return name  # an unknown tensor: load_weights names it
        stack, block, sub, rest = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        part, _, tail = rest.partition(".")
        if tail.startswith("relative_attention_bias"):  # block 0's self-attention makes the stack's bias
            return f"{stack}_bias.{tail}" if block == 0 and part == "SelfAttention" else None
        module = (self._ENCODER_PARTS if stack == "encoder" else self._DECODER_PARTS).get(sub, {}).get(part)
        if module is None:
            return name
        if module == "cross_attn":
            proj, _, leaf = tail.partition(".")
            tail = f"{self._CROSS.get(proj, proj)}.{leaf}"
        return f"{stack}.{block}.{module}.{tail}"

    def fused_projections(self) -> dict[str, tuple[str, int, int]]:
        inner, ff = self.shape.inner, self.shape.d_ff
        return {"q": ("qkv", 0, inner), "k": ("qkv", inner, inner), "v": ("qkv", 2 * inner, inner),
                "ck": ("kv", 0, inner), "cv": ("kv", inner, inner), "wi_0": ("wi", 0, ff), "wi_1": ("wi", ff, ff)}


def common_fields(hf: dict) -> dict:
    """config.json's T5 fields under the names ModelConfig reads (the token pool's layers are the
    decoder's)."""
    shape = T5Shape.of(hf)
    return {"hidden_size": shape.d_model, "num_attention_heads": shape.heads, "num_key_value_heads": shape.heads,
            "head_dim": shape.d_kv, "intermediate_size": shape.d_ff, "num_hidden_layers": shape.decoder_layers,
            "rms_norm_eps": shape.eps, "max_position_embeddings": hf.get("n_positions") or 512,
            "tie_word_embeddings": shape.tied}


def config_flags(variant: str, cfg: dict) -> dict:
    """ModelConfig's decoder_start_token_id (the model reads the rest as T5Shape); a ValueError
    naming the config field for what it cannot serve."""
    feed_forward(cfg.get("feed_forward_proj", "relu"))
    if cfg.get("is_encoder_decoder") is False:
        raise ValueError("is_encoder_decoder is false: a T5 checkpoint served here needs its decoder")
    for name in ("d_model", "num_heads", "d_kv", "d_ff", "num_layers"):
        if not isinstance(cfg.get(name), int) or cfg[name] < 1:
            raise ValueError(f"config.json's {name} must be a positive integer, got {cfg.get(name)!r}")
    return {"decoder_start_token_id": _decoder_start(cfg)}


def capabilities(cfg: ModelConfig) -> Capabilities:
    return Capabilities(layer_kinds=(ATTENTION,) * cfg.num_layers, prefix_reuse="exact", encoder=True)


FAMILY = Family(  # listed in sgrec.model.families
    name="encoder-decoder",
    architectures={"T5ForConditionalGeneration": "t5"},
    config_flags=config_flags, build=T5LM, capabilities=capabilities, common_fields=common_fields,
)
