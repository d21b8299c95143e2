"""KV below the pool (--enable-hierarchical-cache): page keys, the host tier and the storage backends.

A page is the K and V of `page_size` consecutive tokens of one prefix, for every layer. Its key names
the whole prefix up to the page's end (a chained hash over the namespace, the extra key and every
token from the first), so equal keys mean equal KV wherever they were computed: the namespace holds
the model's fingerprint and the KV dtype. Pages are stored as the pool's bytes, so a page loaded
back is the KV it replaces bit for bit. Encoded pages (the storage tier) carry a digest: a corrupt or
truncated object reads as missing, and the caller recomputes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sgrec.mem.kv_pool import KVPool

_MAGIC = b"SGRKV1".ljust(16, b"\0")  # with the 16-byte shape: rows start 32-byte aligned
_DIGEST = 16


def page_keys(namespace: str, extra_key: str | None, tokens: list[int], page_size: int) -> list[str]:
    """One key per full page of `tokens`: key k names tokens[: (k + 1) * page_size] in the namespace."""
    n = len(tokens) // page_size
    if n == 0:
        return []
    h = hashlib.blake2b(f"{namespace}\0{extra_key!r}\0{page_size}".encode(), digest_size=_DIGEST)
    arr = np.asarray(tokens[: n * page_size], dtype=np.int64).reshape(n, page_size)
    keys = []
    for row in arr:
        h.update(row.tobytes())
        keys.append(h.copy().hexdigest())
    return keys


def item_key(namespace: str, header_ids: list[int], token_ids: list[int]) -> str:
    """The key of one item's KV (BAT's item-as-prefix block: its tokens after the shared header, at
    the same positions in every request): the model, the header and the item's own tokens, so a
    catalog update that changes an item's tokens never finds the old KV."""
    h = hashlib.blake2b(f"{namespace}\0item".encode(), digest_size=_DIGEST)
    h.update(struct.pack("<q", len(header_ids)))
    h.update(np.asarray(header_ids, dtype=np.int64).tobytes())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.hexdigest()


def snapshot_key(namespace: str, extra_key: str | None, tokens: list[int]) -> str:
    """The key of a state snapshot after `tokens` (the whole prefix) in the namespace."""
    h = hashlib.blake2b(f"{namespace}\0{extra_key!r}\0state".encode(), digest_size=_DIGEST)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()


@dataclass
class StateSnapshot:
    """A recurrent family's state after a prefix, in the host tier: the state's parts per layer (as
    the StatePool keeps them), and the K and V of the prefix's tokens past its last full page
    (`tail`, [layers, n, heads, dim]), which no page holds. `anchor` names where the tail starts: the
    key of the page before it, or the namespace's root."""

    state: dict[int, dict[str, torch.Tensor]]
    k: torch.Tensor
    v: torch.Tensor
    tail: tuple[int, ...]
    anchor: str

    @property
    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for parts in self.state.values() for t in parts.values())
                + 2 * self.k.numel() * self.k.element_size())


@dataclass
class Page:
    """One page's rows as the pool stores them (float8 pools as bytes): k and v are [layers, page, heads, dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def read_pages(pool: KVPool, slots: torch.Tensor, page_size: int) -> list[Page]:
    """The pool's rows at `slots` (a multiple of page_size), copied to host memory, one Page per page."""
    k, v = pool.read_rows(slots)
    return [Page(k[:, i : i + page_size].clone(), v[:, i : i + page_size].clone())
            for i in range(0, len(slots), page_size)]


def encode(page: Page) -> bytes:
    """A page as bytes for a storage backend: magic, shape, K and V, and a digest of all of it (one
    copy of the rows, hashed in place)."""
    head = _MAGIC + struct.pack("<4I", *page.k.shape)
    n = page.k.numel() * page.k.element_size()
    out = bytearray(len(head) + 2 * n + _DIGEST)
    out[: len(head)] = head
    view = memoryview(out)
    for i, t in enumerate((page.k, page.v)):
        view[len(head) + i * n : len(head) + (i + 1) * n] = t.contiguous().view(torch.uint8).numpy().reshape(-1)
    view[-_DIGEST:] = hashlib.blake2b(view[:-_DIGEST], digest_size=_DIGEST).digest()
    return out  # a bytearray: every backend takes a buffer


def decode(data: bytes | bytearray, like: Page) -> Page | None:
    """The page in `data` if it is whole and has `like`'s shape and dtype; None if corrupt or foreign.
    The page's tensors share `data`'s memory when it is writable (no copy)."""
    head_len = len(_MAGIC) + 16
    half = like.k.numel() * like.k.element_size()
    if len(data) != head_len + 2 * half + _DIGEST or not data.startswith(_MAGIC):
        return None
    if struct.unpack("<4I", data[len(_MAGIC) : head_len]) != tuple(like.k.shape):
        return None
    view = memoryview(data)
    if hashlib.blake2b(view[:-_DIGEST], digest_size=_DIGEST).digest() != bytes(view[-_DIGEST:]):
        return None
    buf = data if isinstance(data, bytearray) else bytearray(data)
    flat = torch.frombuffer(buf, dtype=torch.uint8, offset=head_len, count=2 * half).view(like.k.dtype)
    n = like.k.numel()
    return Page(flat[:n].view(like.k.shape), flat[n:].view(like.k.shape))


@dataclass
class TierStats:
    """What one tier did: pages hit / missed on lookup, pages and bytes written and read, failures."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    failures: int = 0
    evictions: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "extra"} | self.extra


class HostTier:
    """Pages in host memory, up to `capacity` pages, least recently used out first. An entry may
    weigh more than a page (a state snapshot: its bytes in pages, `put`'s weight). Thread-safe: the
    storage prefetcher adds pages while the scheduler reads them."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"the host tier must hold at least one page, got {capacity}")
        self.capacity = capacity
        self.pages: OrderedDict[str, Page] = OrderedDict()
        self.weights: dict[str, int] = {}  # entries heavier than one page
        self.used = 0  # pages' worth held
        self.lock = threading.Lock()
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self.pages)

    def __contains__(self, key: str) -> bool:
        return key in self.pages

    def get(self, key: str) -> Page | None:
        with self.lock:
            page = self.pages.get(key)
            if page is None:
                self.stats.misses += 1
                return None
            self.pages.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_read += page.nbytes
            return page

    def put(self, key: str, page, weight: int = 1) -> list[tuple[str, object]]:
        """Keeps the entry (most recent), counted as `weight` pages; returns the entries it pushed
        out (an entry heavier than the whole tier is not kept)."""
        with self.lock:
            if key in self.pages:
                self.pages.move_to_end(key)
                return []
            if weight > self.capacity:
                self.stats.extra["too_large"] = self.stats.extra.get("too_large", 0) + 1
                return []
            self.pages[key] = page
            if weight != 1:
                self.weights[key] = weight
            self.used += weight
            self.stats.writes += 1
            self.stats.bytes_written += page.nbytes
            out = []
            while self.used > self.capacity:
                k, p = self.pages.popitem(last=False)
                self.used -= self.weights.pop(k, 1)
                out.append((k, p))
            self.stats.evictions += len(out)
            return out

    def clear(self) -> None:
        with self.lock:
            self.pages.clear()
            self.weights.clear()
            self.used = 0


def each(call, args: list) -> list:
    """call(a) for every a, each result or the exception it raised (a storage backend's batch calls
    where it has none of its own: one bad object is not the others' failure)."""
    out = []
    for a in args:
        try:
            out.append(call(*a) if isinstance(a, tuple) else call(a))
        except Exception as e:  # noqa: BLE001 - handed to the caller, which counts it
            out.append(e)
    return out


class FileStorage:
    """--hicache-storage-backend file: one file per page under a directory that servers may share.
    A write goes to a temporary name and is renamed into place, so a reader sees a whole page or none.
    `exists_many` / `get_many` / `put_many` are the batch calls every backend has (here one file
    after another; the tier runs READERS of them in parallel: `parallel_reads`)."""

    name = "file"
    parallel_reads = True

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        if not os.access(self.path, os.W_OK):
            raise OSError(f"the file storage directory {self.path} is not writable")

    def _file(self, key: str) -> Path:
        return self.path / f"{key}.kv"

    def exists(self, key: str) -> bool:
        return self._file(key).exists()

    def get(self, key: str) -> bytearray | None:
        try:
            with open(self._file(key), "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                return buf if f.readinto(buf) == len(buf) else None
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        target = self._file(key)
        tmp = target.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)

    def remove(self, key: str) -> None:
        self._file(key).unlink(missing_ok=True)

    def get_many(self, keys: list[str]) -> list:
        """Each object's bytes, None when missing, or the exception its read raised."""
        return each(self.get, keys)

    def exists_many(self, keys: list[str]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def put_many(self, items: list[tuple[str, bytes]]) -> list:
        """Writes the objects; per object None, or the exception its write raised."""
        return each(self.put, items)

    def close(self) -> None:
        pass
