"""The one definition of the two bipartite-attention layouts of a rank request (BAT §4.2).

user-as-prefix  [U, I1..IN, Instr]
    U at positions 0..u-1, causal. Every item starts at position u and sees U and, causally,
    itself. Instr starts at u + max item length and sees everything before it.
item-as-prefix  [H, I1..IN, U, Instr]   (H: an optional fixed header, e.g. "Candidate items:")
    H at 0..h-1, causal. Every item starts at position h and sees H and, causally, itself.
    U starts at h + max item length and sees H, all items and, causally, itself. Instr follows U
    and sees everything.

In both, the visibility rule is "causal in token order, except that an item token never sees a
token of another item". Candidates therefore never see each other and every item's tokens have the
same positions wherever it sits, so scores do not depend on candidate order, and (item-as-prefix)
an item's KV depends only on H and the item itself: it can be computed once and shared.

Every path, cached or not, builds its positions and masks here: a forward computes some rows of
the layout against the KV of all its tokens, with `RankLayout.mask(rows, cols)` (and the same mask
in O(columns), `RankLayout.bipartite(cols)`, for the triton backend's bipartite-attention kernel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from sgrec.model.attention import BipartiteMask

USER_PREFIX = "user"
ITEM_PREFIX = "item"
KINDS = (USER_PREFIX, ITEM_PREFIX)


@dataclass(frozen=True)
class Segment:
    kind: str  # "header" | "user" | "item" | "instr"
    start: int  # offset of the first token in the layout's token order
    length: int
    pos0: int  # position id of the first token
    item: int = -1  # candidate index for kind == "item"

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass
class RankLayout:
    kind: str  # USER_PREFIX or ITEM_PREFIX
    token_ids: list[int]
    positions: list[int]
    segments: list[Segment]
    item_of: torch.Tensor  # int64 [T]: candidate index of each token, -1 for non-item tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    def segment(self, kind: str) -> Segment | None:
        return next((s for s in self.segments if s.kind == kind), None)

    def items(self) -> list[Segment]:
        return [s for s in self.segments if s.kind == "item"]

    def mask(self, rows: torch.Tensor | Sequence[int] | None = None,
             cols: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """bool [len(rows), len(cols)]: may the token at layout offset rows[i] attend to cols[j]."""
        T = len(self.token_ids)
        r = torch.arange(T) if rows is None else torch.as_tensor(rows, dtype=torch.int64)
        c = torch.arange(T) if cols is None else torch.as_tensor(cols, dtype=torch.int64)
        ir, ic = self.item_of[r][:, None], self.item_of[c][None, :]
        other_item = (ir >= 0) & (ic >= 0) & (ir != ic)
        return (c[None, :] <= r[:, None]) & ~other_item

    def bipartite(self, cols: torch.Tensor | Sequence[int] | None = None) -> BipartiteMask:
        """mask(rows, cols) as two integers per column (what the triton backend's kernel reads), for
        rows that are the last columns, ascending (a forward's new tokens): each column's layout
        offset and its candidate (-1 for tokens of no item)."""
        c = torch.arange(len(self.token_ids)) if cols is None else torch.as_tensor(cols, dtype=torch.int64)
        return BipartiteMask(c, self.item_of[c])


def _build(kind: str, parts: list[tuple[str, Sequence[int], int, int]]) -> RankLayout:
    ids: list[int] = []
    pos: list[int] = []
    segs: list[Segment] = []
    item_of: list[int] = []
    for seg_kind, toks, pos0, item in parts:
        segs.append(Segment(seg_kind, len(ids), len(toks), pos0, item))
        ids += [int(t) for t in toks]
        pos += range(pos0, pos0 + len(toks))
        item_of += [item] * len(toks)
    return RankLayout(kind, ids, pos, segs, torch.tensor(item_of, dtype=torch.int64))


def user_as_prefix(user: Sequence[int], items: Sequence[Sequence[int]], instr: Sequence[int]) -> RankLayout:
    u = len(user)
    longest = max((len(it) for it in items), default=0)
    parts = [("user", user, 0, -1)]
    parts += [("item", it, u, j) for j, it in enumerate(items)]
    parts.append(("instr", instr, u + longest, -1))
    return _build(USER_PREFIX, [p for p in parts if len(p[1])])


def item_as_prefix(header: Sequence[int], items: Sequence[Sequence[int]], user: Sequence[int],
                   instr: Sequence[int]) -> RankLayout:
    h = len(header)
    longest = max((len(it) for it in items), default=0)
    parts = [("header", header, 0, -1)]
    parts += [("item", it, h, j) for j, it in enumerate(items)]
    parts.append(("user", user, h + longest, -1))
    parts.append(("instr", instr, h + longest + len(user), -1))
    return _build(ITEM_PREFIX, [p for p in parts if len(p[1])])


def build(kind: str, header: Sequence[int], user: Sequence[int], items: Sequence[Sequence[int]],
          instr: Sequence[int]) -> RankLayout:
    """The layout of `kind` (the header is used by item-as-prefix only)."""
    if kind == USER_PREFIX:
        return user_as_prefix(user, items, instr)
    if kind == ITEM_PREFIX:
        return item_as_prefix(header, items, user, instr)
    raise ValueError(f"unknown layout {kind!r}; expected one of {KINDS}")
