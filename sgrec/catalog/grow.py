"""Append-only storage that catalog versions share: a version built from the newest one
appends its rows in place and keeps viewing the same memory, so an update of k items writes k
rows, never a copy of the catalog.

`Buf` is one array with spare capacity. Version v sees `data[:n_v]`; rows below `used` are never
written again. Appending at the end (`n == used`) writes into the spare capacity, growing it by
half when it is full (amortised O(k), and the untouched capacity is address space, not resident
memory). Appending from an older length (a branch: the version after a rollback, or after a
prepared version that was never committed) copies the first n rows into a new buffer, so no
version ever sees another's rows.
"""

from __future__ import annotations

import numpy as np

GROWTH = 1.5
MIN_CAPACITY = 1024


class Buf:
    __slots__ = ("data", "used")

    def __init__(self, data: np.ndarray, used: int):
        self.data = data
        self.used = used

    @classmethod
    def of(cls, arr: np.ndarray) -> "Buf":
        """A full buffer over an existing array (read-only arrays included: the first append copies)."""
        return cls(arr, len(arr))

    @classmethod
    def roomy(cls, arr: np.ndarray, spare: float) -> "Buf":
        """A buffer holding a copy of arr with room for spare * len(arr) more rows."""
        data = np.empty((max(int(len(arr) * (1 + spare)), MIN_CAPACITY), *arr.shape[1:]), dtype=arr.dtype)
        data[: len(arr)] = arr
        return cls(data, len(arr))

    def view(self, n: int) -> np.ndarray:
        return self.data[:n]

    def append(self, n: int, more: np.ndarray) -> "Buf":
        """The buffer holding this buffer's first n rows and then `more`: this one when n is its
        end and `more` fits, else a new one."""
        k = len(more)
        if k == 0:  # nothing to write: rows below n are never written again, whoever views them
            return self
        if self.used == n and n + k <= len(self.data) and self.data.flags.writeable:
            self.data[n : n + k] = more
            self.used = n + k
            return self
        cap = max(n + k, int((n + k) * GROWTH), MIN_CAPACITY)
        data = np.empty((cap, *self.data.shape[1:]), dtype=self.data.dtype)
        data[:n] = self.data[:n]
        data[n : n + k] = more
        return Buf(data, n + k)


def set_bits(bits: np.ndarray | None, n_old: int, n_new: int, rows) -> np.ndarray:
    """Packed little-endian row bits over n_new rows: `bits` (over n_old rows; None: none set),
    then rows [n_old, n_new) clear, with `rows` set. A copy: `bits` is left as it is."""
    out = np.zeros((n_new + 7) // 8, dtype=np.uint8)
    if bits is not None:
        out[: len(bits)] = bits
        if n_old % 8:  # bits past n_old in its last byte belong to no row: keep them clear
            out[n_old // 8] &= (1 << (n_old % 8)) - 1
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size:
        np.bitwise_or.at(out, rows >> 3, (1 << (rows & 7)).astype(np.uint8))
    return out


def unpack(bits: np.ndarray | None, n: int) -> np.ndarray:
    """bool [n] of packed little-endian row bits (all False for None)."""
    if bits is None:
        return np.zeros(n, dtype=bool)
    return np.unpackbits(bits, count=n, bitorder="little").view(bool)
