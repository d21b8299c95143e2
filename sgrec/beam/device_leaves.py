"""A LayeredTrie version's leaf level on a device: what the Triton trie step (and the torch beam
step on a GPU) reads of the runs, kept from version to version at the cost of what changed.

A version's leaf level is its run pointers (start, count per parent at depth ND - 1), the base's
tokens (a base position is its slot) and the tails written since the base, (token, slot) per
position (sgrec.beam.layered). Here:

- the base's tokens are uploaded once per base (the base a version was built or compacted on;
  compaction runs on its background thread, so the upload does too), and shared by every
  version on it;
- the tails are `DeviceBuf`s, the device form of sgrec.catalog.grow.Buf: a version made from
  this one writes its new entries after this one's (a host-to-device copy of what the update
  wrote) and keeps viewing the same memory; a branch (a version made from an older one) copies;
- the run pointers are the previous version's, copied on the device, with the parents whose
  runs changed written over them; where the upper levels renumbered the parents (a node
  emptied or made above the leaves), they are uploaded whole (O(parents), as the host's arrays).

So a version costs the device what the update wrote plus a device-side copy of the run pointers,
never the leaf level (about 0.5 GiB at 10^7 items, what SemanticIdTrie's update rewrites).
"""

from __future__ import annotations

import numpy as np
import torch

from sgrec.catalog.grow import GROWTH, MIN_CAPACITY
from sgrec.model.kernels.trie_step import TrieLevel


def _to(a: np.ndarray, device) -> torch.Tensor:
    """A host array as int64 on `device` (one host-to-device copy)."""
    return torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(device)


class DeviceBuf:
    """Append-only device storage shared by versions, as sgrec.catalog.grow.Buf: version v views
    data[:n_v]; entries below `used` are never written again."""

    __slots__ = ("data", "used")

    def __init__(self, data: torch.Tensor, used: int):
        self.data, self.used = data, used

    @classmethod
    def of(cls, arr: np.ndarray, device) -> "DeviceBuf":
        data = torch.empty(max(int(len(arr) * GROWTH), MIN_CAPACITY), dtype=torch.int64, device=device)
        data[: len(arr)] = _to(arr, device)
        return cls(data, len(arr))

    def view(self, n: int) -> torch.Tensor:
        return self.data[:n]

    def append(self, n: int, more: np.ndarray) -> "DeviceBuf":
        """The buffer holding this one's first n entries and then `more`: this one when n is its end
        and `more` fits, else a new one."""
        k = len(more)
        if k == 0:
            return self
        src = _to(more, self.data.device)
        if self.used == n and n + k <= self.data.numel():
            self.data[n : n + k] = src
            self.used = n + k
            return self
        data = torch.empty(max(n + k, int((n + k) * GROWTH), MIN_CAPACITY), dtype=torch.int64, device=self.data.device)
        data[:n] = self.data[:n]
        data[n : n + k] = src
        return DeviceBuf(data, n + k)


class DeviceLeaves:
    """The leaf level of one LayeredTrie version on `device` (module doc)."""

    def __init__(self, start: torch.Tensor, count: torch.Tensor, base_tok: torch.Tensor, tail_tok: DeviceBuf,
                 tail_slot: DeviceBuf, n_tail: int):
        self.start, self.count, self.base_tok = start, count, base_tok
        self.tails, self.n_tail = (tail_tok, tail_slot), n_tail
        self.base = base_tok.numel()
        self.tail_tok, self.tail_slot = tail_tok.view(n_tail), tail_slot.view(n_tail)

    @classmethod
    def of(cls, trie, device) -> "DeviceLeaves":
        """A version's leaf level uploaded whole (a new base: from_catalog, compacted)."""
        dev = torch.device(device)
        return cls(_to(trie.run_start, dev), _to(trie.run_len, dev), _to(trie.base_tok, dev),
                   DeviceBuf.of(trie.tail_tok, dev), DeviceBuf.of(trie.tail_slot, dev), trie.tail_tok.size)

    def extended(self, trie, tok: np.ndarray, slot: np.ndarray, parents: np.ndarray | None) -> "DeviceLeaves":
        """The leaf level of `trie`, a version made from this one's (on the same base) by appending
        the entries (tok, slot) to the tails and pointing `parents` at new runs (None: the parents
        were renumbered, every pointer is uploaded)."""
        dev = self.start.device
        if parents is None:
            start, count = _to(trie.run_start, dev), _to(trie.run_len, dev)
        else:
            idx = _to(parents, dev)
            start, count = self.start.clone(), self.count.clone()
            start[idx] = _to(trie.run_start[parents], dev)
            count[idx] = _to(trie.run_len[parents], dev)
        return DeviceLeaves(start, count, self.base_tok, self.tails[0].append(self.n_tail, tok),
                            self.tails[1].append(self.n_tail, slot), self.n_tail + len(tok))

    # ---- readers -----------------------------------------------------------------------------
    def runs(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(first position, number) of the children of parents `nodes`."""
        return self.start[nodes], self.count[nodes]

    def child_at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, slot) of the children at arena positions `pos`."""
        if not self.n_tail:
            return self.base_tok[pos], pos
        tail = pos >= self.base
        t = (pos - self.base).clamp_(0, self.n_tail - 1)
        return (torch.where(tail, self.tail_tok[t], self.base_tok[pos.clamp(max=self.base - 1)]),
                torch.where(tail, self.tail_slot[t], pos))

    def level(self, max_children: int, level_col: torch.Tensor | None) -> TrieLevel:
        """The level as the Triton trie step reads it."""
        return TrieLevel(self.start, self.base_tok, max_children, level_col, self.count, self.tail_tok,
                         self.tail_slot, self.base)

    def arrays(self) -> dict[str, np.ndarray]:
        """The level's arrays on the host, named as LayeredTrie's (the tests' array-for-array check)."""
        host = lambda t: t.cpu().numpy()  # noqa: E731
        return {"run_start": host(self.start), "run_len": host(self.count), "base_tok": host(self.base_tok),
                "tail_tok": host(self.tail_tok), "tail_slot": host(self.tail_slot)}
