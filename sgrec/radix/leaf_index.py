"""Recency-ordered index of evictable leaves with a max-prediction query (O(log n) per operation).

Every tracked item (a tree node) owns a position; positions grow with each touch, so position order
is recency order (least recent first). A segment tree over positions keeps, per subtree, how many
items are active (evictable) and which active item has the largest prediction. That answers, in
O(log n): the least-recent active item, the position of the l-th least recent, and the item with the
largest prediction among the l least recent (ties go to the less recent one).

When positions run out the index renumbers the tracked items densely and doubles its capacity:
O(n) work every ~n touches, so O(1) amortized.
"""

from __future__ import annotations

from collections.abc import Hashable

NEG_INF = float("-inf")


class RecencyIndex:
    def __init__(self, capacity: int = 1024) -> None:
        self._reset(capacity)

    def _reset(self, capacity: int) -> None:
        size = 1
        while size < capacity:
            size *= 2
        self.size = size
        self.pos: dict[Hashable, int] = {}
        self.item: list[Hashable | None] = [None] * size
        self.pred: list[float] = [NEG_INF] * size
        self.active: list[bool] = [False] * size
        self.cnt = [0] * (2 * size)
        self.best = [-1] * (2 * size)  # position of the max-prediction active item in the subtree
        self.next = 0

    # ---- updates ---------------------------------------------------------------------------
    def clear(self) -> None:
        self._reset(1024)

    def __len__(self) -> int:
        return self.cnt[1]

    def __contains__(self, x: Hashable) -> bool:
        return x in self.pos

    def add(self, x: Hashable, pred: float = NEG_INF) -> None:
        """Track x as the most recent item (inactive)."""
        if self.next == self.size:
            self._compact()
        p = self.next
        self.next += 1
        self.pos[x], self.item[p], self.pred[p] = p, x, pred

    def touch(self, x: Hashable) -> None:
        """Move x to the most recent position, keeping its prediction and active flag."""
        p = self.pos[x]
        active, pred = self.active[p], self.pred[p]
        self._clear(p)
        self.add(x, pred)
        if active:
            self.set_active(x, True)

    def remove(self, x: Hashable) -> None:
        self._clear(self.pos.pop(x))

    def set_active(self, x: Hashable, on: bool) -> None:
        p = self.pos[x]
        if self.active[p] != on:
            self.active[p] = on
            self._update(p)

    def is_active(self, x: Hashable) -> bool:
        return self.active[self.pos[x]]

    def set_pred(self, x: Hashable, pred: float) -> None:
        p = self.pos[x]
        self.pred[p] = pred
        if self.active[p]:
            self._update(p)

    def get_pred(self, x: Hashable) -> float:
        return self.pred[self.pos[x]]

    # ---- queries ---------------------------------------------------------------------------
    def first(self) -> Hashable | None:
        """The least recent active item."""
        return None if self.cnt[1] == 0 else self.item[self._kth(1)]

    def argmax_oldest(self, l: int) -> Hashable | None:
        """Among the l least recent active items, the one with the largest prediction."""
        n = self.cnt[1]
        if n == 0:
            return None
        if l >= n:
            return self.item[self.best[1]]
        return self.item[self._argmax_prefix(self._kth(l))]

    def oldest(self, l: int) -> list[Hashable]:
        """The l least recent active items, least recent first (O(l log n); for tests)."""
        return [self.item[self._kth(i)] for i in range(1, min(l, self.cnt[1]) + 1)]

    def active_items(self) -> list[Hashable]:
        return [self.item[p] for p in range(self.next) if self.active[p]]

    # ---- internals -------------------------------------------------------------------------
    def _clear(self, p: int) -> None:
        was = self.active[p]
        self.item[p], self.pred[p], self.active[p] = None, NEG_INF, False
        if was:
            self._update(p)

    def _update(self, p: int) -> None:
        """Position p's active flag or prediction changed: fix the counts and maxima above it. The
        maxima stop changing at the first ancestor whose maximum is neither new nor p itself (its
        parent's inputs are then as before); the counts go on to the root only if they changed."""
        cnt, best, pred = self.cnt, self.best, self.pred
        i = p + self.size
        on = self.active[p]
        d = (1 if on else 0) - cnt[i]
        cnt[i], best[i] = (1, p) if on else (0, -1)
        i >>= 1
        while i:
            if d:
                cnt[i] += d
            a, b = best[2 * i], best[2 * i + 1]
            nb = b if a < 0 or (b >= 0 and pred[b] > pred[a]) else a
            if nb == best[i] and nb != p:
                break
            best[i] = nb
            i >>= 1
        else:
            return
        if d:
            i >>= 1
            while i:
                cnt[i] += d
                i >>= 1

    def _kth(self, k: int) -> int:
        """Position of the k-th (1-based) active item in position order."""
        cnt, i = self.cnt, 1
        while i < self.size:
            i *= 2
            if cnt[i] < k:
                k -= cnt[i]
                i += 1
        return i - self.size

    def _argmax_prefix(self, hi: int) -> int:
        """Position of the max-prediction active item in [0, hi] (leftmost on ties)."""
        best, pred = self.best, self.pred
        lo, hi = self.size, hi + self.size + 1
        left: list[int] = []
        right: list[int] = []
        while lo < hi:
            if lo & 1:
                left.append(best[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                right.append(best[hi])
            lo >>= 1
            hi >>= 1
        out = -1
        for b in left + right[::-1]:  # left to right, so ties keep the leftmost
            if b >= 0 and (out < 0 or pred[b] > pred[out]):
                out = b
        return out

    def _compact(self) -> None:
        live = sorted(self.pos.items(), key=lambda kv: kv[1])
        state = [(x, self.pred[p], self.active[p]) for x, p in live]
        self._reset(max(1024, 2 * len(state)))
        for x, pred, on in state:
            self.add(x, pred)
            if on:
                self.active[self.pos[x]] = True
        self._rebuild()

    def _rebuild(self) -> None:
        size, cnt, best, pred = self.size, self.cnt, self.best, self.pred
        for p in range(size):
            cnt[size + p], best[size + p] = (1, p) if self.active[p] else (0, -1)
        for i in range(size - 1, 0, -1):
            l, r = 2 * i, 2 * i + 1
            cnt[i] = cnt[l] + cnt[r]
            a, b = best[l], best[r]
            best[i] = b if a < 0 or (b >= 0 and pred[b] > pred[a]) else a
