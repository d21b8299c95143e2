"""Rotary position embedding with HF's default, linear and llama3 frequency rules.

cos/sin are looked up by explicit position ids, so callers may place tokens at any
position (bipartite item blocks, beams), not only 0..n-1.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"Unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding:
    """Holds a cos/sin table for positions [0, size) and grows it on demand."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, size: int, device: torch.device):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        self.device = device
        self.reserved = False
        self._build(size)

    def _build(self, size: int) -> None:
        pos = torch.arange(size, dtype=torch.float32, device=self.device)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def reserve(self, size: int) -> None:
        """The table covers positions [0, size) from now on, and cos_sin no longer checks positions
        against it (the check reads them on the host, which a CUDA graph's step cannot and a device
        round's step should not): the caller keeps every position below size (the context length)."""
        if size > self.cos.shape[0]:
            self._build(size)
        self.reserved = True

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, head_dim] cos and sin for the given positions, in dtype (the table grows to cover them
        until reserve() fixes it)."""
        if positions.numel() and not self.reserved and int(positions.max()) >= self.cos.shape[0]:
            self._build(max(int(positions.max()) + 1, 2 * self.cos.shape[0]))
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        cos, sin = self._cast[dtype]
        return cos[positions], sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
