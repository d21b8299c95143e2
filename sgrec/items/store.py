"""The item KV store of bipartite-attention ranking (BAT §4.3, §5.2).

Each item's KV is computed once, with the item-as-prefix positions of `sgrec.layout` (its
tokens at len(H) .. len(H)+len-1, attending to the shared header H and causally to itself), and is
shared by every user. The header's own KV is held here too. Slots come from the runner's allocator
and stay owned by the store until evicted or reset; `total_size()` counts them (header included)
so KV accounting (free + tree + store == pool) can be checked.

Budget: at most `budget_tokens` slots (header included). When the catalog fits, `precompute`
fills it at start-up; otherwise items enter lazily on a miss (the request computes them anyway and
hands their slots over), a cold entry giving way to a hotter one. Hotness is the per-item access
count of the cache meta service, the last access breaking ties. Entries in use by a request are
pinned and never evicted. With HRCS placement (`owns`), items this rank does not own are never
kept: a miss on one is recomputed for the request and dropped.

Reads from other threads (`read_kv`, what the item-KV server thread of `sgrec.items.fetch`
calls to answer peers without waiting for the scheduler): the scheduler thread is the only one that
mutates the store, and every change to `entries` and every free of a stored slot (admit, evict,
drop_unowned, reset, precompute) happens under `self.lock`. `read_kv` holds the same lock while it
looks the items up and copies their KV out of the pool, so a slot it reads cannot be freed, handed
to another request and overwritten until the copy is done; an item evicted before the read is a
miss. An entry is published (put in `entries`) only after its KV is written and the write has
finished on the device: admitted KV comes from a forward whose scores were already read back to the
host, and precompute synchronises the device before publishing (CUDA). Stored KV is never written
again, so a reader needs nothing else.
"""

from __future__ import annotations

import itertools
import logging
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sgrec.catalog import Catalog, Item
from sgrec.model.attention import SeqLayout
from sgrec import layout as L

logger = logging.getLogger(__name__)

PRECOMPUTE_BATCH_TOKENS = 4096


def fingerprint(token_ids) -> int:
    """An item's tokens as one number (CRC-32 of their int32 bytes): item KV is asked for and served
    by id and fingerprint, so KV of another catalog version's tokens is never used."""
    return zlib.crc32(np.asarray(token_ids, dtype=np.int32).tobytes())


@dataclass
class _Entry:
    slots: torch.Tensor
    pins: int = 0
    tick: int = 0
    fp: int = 0  # fingerprint() of the tokens the KV was computed from


class ItemStore:
    def __init__(self, runner, catalog: Catalog, budget_tokens: int, header_ids: Sequence[int] = (),
                 hotness: Callable[[str], float] | None = None, owns: Callable[[str], bool] | None = None,
                 hot_ids: Callable[[], Iterable[str]] | None = None):
        """hot_ids: the ids whose hotness may be nonzero (so the default precompute order needs no
        pass over a huge catalog); None: every catalog id."""
        self.runner = runner
        self.allocator = runner.memory.allocator
        self.catalog = catalog
        self.budget = int(budget_tokens)
        self.header_ids = [int(t) for t in header_ids]
        self.hotness = hotness or (lambda item_id: 0.0)
        self.owns = owns or (lambda item_id: True)
        self.hot_ids = hot_ids
        self.entries: dict[str, _Entry] = {}
        self.header_slots: torch.Tensor | None = None
        self.item_tokens = 0
        self.hits = self.misses = 0
        self._ticks = itertools.count(1)
        self.lock = threading.RLock()  # held by every change of `entries` / free of a stored slot, and by read_kv

    # ---- accounting -----------------------------------------------------------------------
    def total_size(self) -> int:
        """KV slots held by the store (items and header)."""
        header = 0 if self.header_slots is None else len(self.header_slots)
        return self.item_tokens + header

    def __contains__(self, item_id: str) -> bool:
        return item_id in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def all_values(self) -> torch.Tensor:
        vals = [e.slots for e in self.entries.values()]
        if self.header_slots is not None:
            vals.append(self.header_slots)
        return torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)

    def reset(self) -> None:
        """Frees every slot (items and header). Pinned entries are a caller error."""
        if any(e.pins for e in self.entries.values()):
            raise RuntimeError("ItemStore.reset while items are in use")
        with self.lock:
            for e in self.entries.values():
                self.allocator.free(e.slots)
            if self.header_slots is not None:
                self.allocator.free(self.header_slots)
            self.entries, self.header_slots, self.item_tokens = {}, None, 0

    # ---- requests -------------------------------------------------------------------------
    def ensure_header(self) -> torch.Tensor:
        """The header's KV slots (computed on first use; causal at positions 0..h-1)."""
        if self.header_slots is None:
            h = len(self.header_ids)
            slots = self._alloc(h)
            if h:
                lay = L.item_as_prefix(self.header_ids, [], [], [])
                seq = SeqLayout(0, h, slots, bipartite=lay.bipartite())
                self.runner.forward(self.runner.make_batch(lay.token_ids, lay.positions, slots, [seq]), [h - 1])
            self.header_slots = slots
        return self.header_slots

    def acquire(self, item_ids: Sequence[str]) -> list[torch.Tensor | None]:
        """Pins and returns the cached slots of each item (None on a miss); counts hits and misses."""
        out: list[torch.Tensor | None] = []
        for item_id in item_ids:
            e = self.entries.get(item_id)
            if e is None:
                self.misses += 1
                out.append(None)
                continue
            self.hits += 1
            e.pins += 1
            e.tick = next(self._ticks)
            out.append(e.slots)
        return out

    def release(self, item_ids: Sequence[str]) -> None:
        """Undoes acquire for the items that were hits."""
        for item_id in item_ids:
            e = self.entries.get(item_id)
            if e is not None and e.pins > 0:
                e.pins -= 1

    def admit(self, item_id: str, slots: torch.Tensor) -> bool:
        """Offers a freshly computed item's KV. True: the store owns `slots` now; False: the caller
        keeps them (not owned by this rank, over budget with nothing colder to evict, or present)."""
        n = len(slots)
        if item_id in self.entries or not self.owns(item_id):
            return False
        with self.lock:
            short = self.total_size() + n - self.budget
            if short > 0:  # over budget: only unpinned entries colder than this item may make room
                mine = self._rank(item_id, next(self._ticks))
                if self._colder_room(mine) < short:
                    return False
                self._evict(short, colder_than=mine)
            cat = self.catalog
            self.entries[item_id] = _Entry(slots.to(torch.int64).clone(), 0, next(self._ticks),
                                           fingerprint(cat.token_ids(cat.index[item_id])))
            self.item_tokens += n
        return True

    def evict(self, num_tokens: int) -> int:
        """Frees unpinned items, coldest first, until num_tokens are freed; returns tokens freed."""
        return self._evict(num_tokens, colder_than=None)

    def drop_unowned(self) -> int:
        """Frees the unpinned entries this rank no longer owns (the HRCS placement changed: a server
        joined or left); returns the tokens freed."""
        freed = 0
        with self.lock:
            for k in [k for k, e in self.entries.items() if not e.pins and not self.owns(k)]:
                e = self.entries.pop(k)
                self.allocator.free(e.slots)
                self.item_tokens -= len(e.slots)
                freed += len(e.slots)
        return freed

    def use_catalog(self, catalog: Catalog, changed: Iterable[str]) -> int:
        """Serves a new catalog version: the entries of the items whose tokens it changed (replaced
        with other tokens, deleted, or different after a rollback) are freed, so they are recomputed from their new tokens on
        their next use; returns the tokens freed. Between scheduler steps only: no entry is pinned."""
        with self.lock:
            self.catalog = catalog
            gone = [self.entries.pop(k) for k in changed if k in self.entries]
            if any(e.pins for e in gone):
                raise RuntimeError("an item in use while the catalog changes")
            if gone:  # one free for all
                slots = torch.cat([e.slots for e in gone])
                self.allocator.free(slots)
                self.item_tokens -= len(slots)
        return sum(len(e.slots) for e in gone)

    def read_kv(self, item_ids: Sequence[str], fps: dict[str, int] | None = None
                ) -> tuple[list[tuple[str, int]], torch.Tensor | None, torch.Tensor | None]:
        """Safe from any thread (see the module docstring): the stored items among `item_ids` (with
        `fps`: only those whose KV is of the tokens with that fingerprint), as (item id, tokens) in
        request order, and their K and V for every layer, concatenated in that order: two CPU
        tensors [layers, tokens, kv_heads, head_dim] (None when no item is stored)."""
        with self.lock:
            entries = self.entries
            found = [(i, entries[i].slots) for i in dict.fromkeys(item_ids)
                     if i in entries and (fps is None or fps.get(i) == entries[i].fp)]
            if not found:
                return [], None, None
            k, v = self.runner.memory.read_rows(torch.cat([s for _, s in found]))
        return [(i, len(s)) for i, s in found], k, v

    # ---- start-up -------------------------------------------------------------------------
    def precompute(self, progress: bool = False, items: Sequence[Item] | None = None) -> int:
        """Computes and stores the KV of `items` in their order (default: every owned catalog item,
        the hottest first by the store's hotness, catalog order among equals) until the budget is
        full, in batches of several items per forward. Returns how many items were added."""
        from tqdm import tqdm

        self.ensure_header()
        if items is None:
            items = self._default_order()
        added = 0
        cat = self.catalog  # the bar's total: about how many average items the budget holds
        fit = (self.budget - self.total_size()) * len(cat) // max(1, cat.total_tokens)
        bar = tqdm(total=max(0, min(len(cat) - len(self.entries), fit)), desc="item KV", unit="item",
                   disable=not progress)
        try:
            batch: list[Item] = []
            size = 0
            for it in items:
                if it.id in self.entries or not self.owns(it.id):
                    continue
                n = len(it.token_ids)
                if self.total_size() + size + n > self.budget:
                    break
                batch.append(it)
                size += n
                if size >= PRECOMPUTE_BATCH_TOKENS:
                    added += self._compute_and_keep(batch)
                    bar.update(len(batch))
                    batch, size = [], 0
            if batch:
                added += self._compute_and_keep(batch)
                bar.update(len(batch))
        finally:
            bar.close()
        if len(self.entries) < len(self.catalog):
            logger.info("item store: %d of %d catalog items held (budget %d tokens); the rest load lazily",
                        len(self.entries), len(self.catalog), self.budget)
        return added

    def _default_order(self) -> Iterator[Item]:
        """The hottest items first (by hotness, catalog order among equals), then the rest in catalog
        order; made one at a time, so filling a small budget never walks a huge catalog."""
        cat = self.catalog
        ids = cat.index if self.hot_ids is None else self.hot_ids()
        hot = sorted((cat.index[i] for i in ids if i in cat and self.hotness(i) > 0),
                     key=lambda r: (-self.hotness(cat.ids[r]), r))
        yield from (cat.item(r) for r in hot)
        seen = set(hot)
        yield from (cat.item(r) for r in cat.live_rows().tolist() if r not in seen)

    def _compute_and_keep(self, items: list[Item]) -> int:
        header = self.ensure_header()
        slots = self._alloc(sum(len(it.token_ids) for it in items))
        ids, pos, seqs = [], [], []
        off = 0
        for it in items:
            lay = L.item_as_prefix(self.header_ids, [it.token_ids], [], [])
            seg = lay.items()[0]
            mine = slots[off : off + seg.length]
            seqs.append(SeqLayout(len(ids), seg.length, torch.cat([header, mine]), bipartite=lay.bipartite()))
            ids += lay.token_ids[seg.start : seg.stop]
            pos += lay.positions[seg.start : seg.stop]
            off += seg.length
        self.runner.forward(self.runner.make_batch(ids, pos, slots, seqs), [])
        if self.runner.memory.device.type == "cuda":
            torch.cuda.synchronize(self.runner.memory.device)  # written before readers can see it
        off = 0
        with self.lock:
            for it in items:
                n = len(it.token_ids)
                self.entries[it.id] = _Entry(slots[off : off + n].clone(), 0, next(self._ticks),
                                             fingerprint(it.token_ids))
                self.item_tokens += n
                off += n
        return len(items)

    # ---- internals ------------------------------------------------------------------------
    def _rank(self, item_id: str, tick: int) -> tuple[float, int]:
        return (self.hotness(item_id), tick)

    def _colder_room(self, mine: tuple[float, int]) -> int:
        """Tokens of unpinned entries colder than rank `mine` (what admitting an item may evict)."""
        return sum(len(e.slots) for k, e in self.entries.items() if not e.pins and self._rank(k, e.tick) < mine)

    def _evict(self, num_tokens: int, colder_than: tuple | None) -> int:
        with self.lock:
            return self._evict_locked(num_tokens, colder_than)

    def _evict_locked(self, num_tokens: int, colder_than: tuple | None) -> int:
        victims = sorted((self._rank(k, e.tick), k) for k, e in self.entries.items() if not e.pins)
        freed = 0
        for rank, k in victims:
            if freed >= num_tokens or (colder_than is not None and rank >= colder_than):
                break
            e = self.entries.pop(k)
            self.allocator.free(e.slots)
            self.item_tokens -= len(e.slots)
            freed += len(e.slots)
        return freed

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.allocator.alloc(n)
        if slots is None:
            raise RuntimeError(f"item store: no room for {n} KV slots ({self.allocator.available_size()} free)")
        return slots
