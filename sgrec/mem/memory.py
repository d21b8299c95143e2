"""A model's memory in one object: the attention layers' per-token KV and the per-request states.

`Memory` is what the runner hands every path: the token slots' allocator, the KV pool of the
attention layers (with the layer map: model layer -> KV buffer, None for a layer without KV), and
a `StatePool` of fixed-size per-request state slots for families whose layers keep one (a
recurrent layer's state; none for the dense decoder). Bytes per token and per state are computed
here once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sgrec.mem.kv_pool import KVPool, TokenAllocator


class StatePool:
    """`size` state slots (slot 0 is padding, as the KV pool's): for each stateful layer, one
    [size + 1, *shape] tensor per named part, in `dtype` (the parts named in `float32`: float32).
    alloc / free hand out slots (take: without zeroing them); fork copies a slot's state into
    fresh ones, copy_ into taken ones (a beam taking its parent's state), broadcast_ one state into
    many (rank's candidates taking the user's); gather reads some slots' states."""

    def __init__(self, size: int, shapes: dict[int, dict[str, tuple[int, ...]]], dtype: torch.dtype,
                 device: str | torch.device = "cpu", float32: frozenset[str] = frozenset()):
        self.size, self.dtype, self.device = size, dtype, torch.device(device)
        part_dtype = {name: torch.float32 if name in float32 else dtype for parts in shapes.values() for name in parts}
        self.buffers = {layer: {name: torch.zeros((size + 1, *shape), dtype=part_dtype[name], device=self.device)
                                for name, shape in parts.items()} for layer, parts in shapes.items()}
        self.allocator = TokenAllocator(size, self.device) if size else None
        self.bytes_per_state = sum(part_dtype[name].itemsize * int(torch.Size(shape).numel())
                                   for parts in shapes.values() for name, shape in parts.items())

    def available_size(self) -> int:
        return self.allocator.available_size() if self.allocator is not None else 0

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots with zeroed states, or None when fewer are free."""
        slots = self.take(n)
        if slots is not None:
            self.zero_(slots)
        return slots

    def take(self, n: int) -> torch.Tensor | None:
        """n free slots whose states are whatever their last owner left (for a caller that writes
        them before any read: beams forked from a parent), or None when fewer are free."""
        return None if self.allocator is None else self.allocator.alloc(n)

    def zero_(self, slots: torch.Tensor) -> None:
        for parts in self.buffers.values():
            for buf in parts.values():
                buf.index_fill_(0, slots, 0)

    def copy_pairs_(self, pairs: list[tuple[int, int]], layers=None) -> None:
        """State dst becomes a copy of state src for each (dst, src) of `pairs`, one after the other
        (a later pair reads what an earlier one wrote), in every part of `layers` (default: every
        stateful layer): one contiguous copy a pair and part, several times faster than gathering
        MiB-sized states."""
        for layer in self.buffers if layers is None else layers:
            for buf in self.buffers[layer].values():
                for d, s in pairs:
                    buf[d].copy_(buf[s])

    def broadcast_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Every state at dst becomes a copy of the one state at src (a slot not in dst)."""
        one = int(src.reshape(-1)[0])
        self.copy_pairs_([(d, one) for d in dst.tolist()])

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The states at dst become copies of those at src (read in full first: the two may overlap)."""
        for parts in self.buffers.values():
            for buf in parts.values():
                buf.index_copy_(0, dst, buf.index_select(0, src))

    def read(self, slot: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
        """One slot's state, copied to host memory (layer -> part -> tensor, bit for bit)."""
        one = int(slot.reshape(-1)[0])
        return {layer: {name: buf[one].cpu().clone() for name, buf in parts.items()}
                for layer, parts in self.buffers.items()}

    def write_(self, slot: torch.Tensor, state: dict[int, dict[str, torch.Tensor]]) -> None:
        """The state at `slot` becomes `state` (read's form)."""
        one = int(slot.reshape(-1)[0])
        for layer, parts in self.buffers.items():
            for name, buf in parts.items():
                buf[one].copy_(state[layer][name])

    def free(self, slots: torch.Tensor) -> None:
        if self.allocator is not None:
            self.allocator.free(slots)

    def fork(self, src: torch.Tensor) -> torch.Tensor | None:
        """Fresh slots holding copies of the states at `src` (one a source slot), or None when the
        pool cannot hold them."""
        dst = self.take(src.numel())
        if dst is not None:
            self.copy_(dst, src)
        return dst

    def gather(self, slots: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
        """Copies of the states at `slots`: layer -> part -> [len(slots), *shape]."""
        return {layer: {name: buf.index_select(0, slots) for name, buf in parts.items()}
                for layer, parts in self.buffers.items()}


class Memory:
    """The token pool's KV for the attention layers and, where a family has them, the state slots.

    layer_kinds: one entry a model layer ("attention" has KV; any other kind none); kv_layers[i]
    is the KV buffer of model layer i (None without). states/state_shapes: the StatePool's size
    and, per stateful layer, its parts' shapes (`state_float32`: the parts kept in float32)."""

    def __init__(self, tokens: int, layer_kinds: Sequence[str], num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu", attn_dtype: torch.dtype | None = None,
                 states: int = 0, state_shapes: dict[int, dict[str, tuple[int, ...]]] | None = None,
                 state_dtype: torch.dtype | None = None, state_float32: frozenset[str] = frozenset()):
        self.kv_layers: list[int | None] = []
        n_kv = 0
        for kind in layer_kinds:
            self.kv_layers.append(n_kv if kind == "attention" else None)
            n_kv += kind == "attention"
        self.kv = KVPool(tokens, n_kv, num_kv_heads, head_dim, dtype, device, attn_dtype)
        self.allocator = self.kv.allocator  # the token slots
        self.bytes_per_token = KVPool.bytes_per_token(n_kv, num_kv_heads, head_dim, dtype)
        self.states = StatePool(states, state_shapes or {}, state_dtype or self.kv.attn_dtype, device, state_float32)
        self.bytes_per_state = self.states.bytes_per_state

    @property
    def size(self) -> int:
        """Token slots."""
        return self.kv.size

    @property
    def states_per_request(self) -> int:
        """State slots a running request holds: one where some layer keeps a state, else none."""
        return 1 if self.states.buffers else 0

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def read_rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KVPool.read_rows: the attention layers' K and V at `slots`, on the host, bit for bit."""
        return self.kv.read_rows(slots)

    def write_rows(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """KVPool.write_rows."""
        self.kv.write_rows(slots, k, v)
