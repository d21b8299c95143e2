"""Token-granular KV pool: per-layer K and V tensors indexed by token slot, and its allocator.

Slot 0 is reserved as a padding slot: batched kernels may write garbage there and read it
under a mask, so it is never handed out.
"""

from __future__ import annotations

import torch


class TokenAllocator:
    """Free list over KV slots 1..size (slot 0 is the padding slot)."""

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        if size < 1:
            raise ValueError(f"KV pool size must be positive, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._pending: list[torch.Tensor] = []
        self._pending_n = 0

    def available_size(self) -> int:
        return len(self._free) + self._pending_n

    def used_size(self) -> int:
        return self.size - self.available_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots (int64), or None when fewer than n are free."""
        if n > len(self._free) and self._pending:
            self._merge()
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            self._pending.append(indices.to(self.device, torch.int64))
            self._pending_n += indices.numel()

    def _merge(self) -> None:
        self._free = torch.cat([self._free, *self._pending])
        self._pending, self._pending_n = [], 0


FP8 = torch.float8_e4m3fn  # --kv-cache-dtype fp8_e4m3 (and the FP8 linear layers' dtype)
FP8_MAX = 448.0  # the largest float8_e4m3fn value


def copyable(buf: torch.Tensor) -> torch.Tensor:
    """buf, or its bytes for a float8 buffer (index_copy_ has no float8 kernel on CPU): for copying rows."""
    return buf.view(torch.uint8) if buf.dtype == FP8 else buf


class KVPool:
    """Preallocated K/V buffers, one [size + 1, num_kv_heads, head_dim] pair per layer, stored in
    `dtype`; attention computes in `attn_dtype` (the model's; default `dtype`). A float8_e4m3fn pool
    (--kv-cache-dtype fp8_e4m3) saturates what it stores to +-448 (scale 1, as SGLang's default); the
    kernels read it back in float32."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        attn_dtype: torch.dtype | None = None,
    ):
        self.size = size
        self.num_layers = num_layers
        self.dtype = dtype
        self.attn_dtype = dtype if attn_dtype is None else attn_dtype
        self.fp8 = dtype == FP8
        self.device = torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.allocator = TokenAllocator(size, self.device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dtype != self.dtype:  # an fp8 pool saturates: the cast of a larger value would give NaN
            if self.fp8:
                k, v = k.clamp(-FP8_MAX, FP8_MAX), v.clamp(-FP8_MAX, FP8_MAX)
            k, v = k.to(self.dtype), v.to(self.dtype)
        if loc.dtype != torch.int64 or loc.device != self.device:
            loc = loc.to(self.device, torch.int64)
        # index_copy_, not advanced-index assignment: 1.1-1.8x faster on CPU (an H200 prefill did not move)
        for buf, x in ((self.k_buffer[layer], k), (self.v_buffer[layer], v)):
            copyable(buf).index_copy_(0, loc, copyable(x.reshape(-1, *buf.shape[1:])))

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer], self.v_buffer[layer]

    def buffers(self) -> list[torch.Tensor]:
        """Every layer's K and V buffer: for moving rows in all layers at once."""
        return [b for layer in range(self.num_layers) for b in self.get_kv(layer)]

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """In every layer, K and V at slots src copied to slots dst (src is read first: the two may
        overlap, as when beams take their parents' rows)."""
        for buf in map(copyable, self.buffers()):
            buf.index_copy_(0, dst, buf.index_select(0, src))

    def read_rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` for every layer, copied to host memory: two [layers, n, kv_heads,
        head_dim] tensors in the pool's dtype, bit for bit (what the tiers store and peers are sent)."""
        loc = slots.to(self.device)
        k = torch.stack([copyable(b)[loc] for b in self.k_buffer]).cpu()
        v = torch.stack([copyable(b)[loc] for b in self.v_buffer]).cpu()
        return k.view(self.dtype), v.view(self.dtype)

    def write_rows(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores [layers, n, kv_heads, head_dim] rows (host or device) at `slots`: bit for bit when
        they are in the pool's dtype (read_rows' output), cast as set_kv casts otherwise."""
        loc = slots.to(self.device)
        for layer in range(self.num_layers):
            self.set_kv(layer, loc, k[layer].to(self.device), v[layer].to(self.device))
