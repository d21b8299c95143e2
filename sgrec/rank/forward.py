"""One forward over several rank layouts (BAT §4.2), as the rank executor batches them: which of
each layout's tokens are computed (`Forward.plan`: what is not cached), the batch of their rows
under each layout's bipartite mask, and the candidates' scores read from its output, by id token or
by semantic-ID path (`sgrec.rank.semantic`). The slots of the fresh tokens are freed here unless the
caller keeps them (for the user cache or the item store)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sgrec import layout as L
from sgrec.model.attention import SeqLayout
from sgrec.rank import semantic


@dataclass
class Forward:
    """What one rank request computes: its layout, the KV it already has, what scores its
    candidates (`targets`: their id tokens, ints, or their semantic-ID paths, tuples), and the
    segments whose fresh KV it keeps (filled in by the forward)."""

    lay: L.RankLayout
    cached: dict[int, torch.Tensor]
    targets: list[int] | list[tuple[int, ...]]
    keep: dict[str, torch.Tensor | None] | None = None

    @property
    def by_path(self) -> bool:
        return isinstance(self.targets[0], tuple)

    def plan(self) -> tuple[list[int], list[torch.Tensor], list[int], list[tuple[str, int, int]]]:
        """(cached columns, their slots, fresh rows, (segment name, first fresh index, count) per
        segment with fresh tokens)."""
        cached_cols: list[int] = []
        cached_slots: list[torch.Tensor] = []
        fresh_rows: list[int] = []
        owner: list[tuple[str, int, int]] = []
        for seg in self.lay.segments:
            s = self.cached.get(seg.start)
            n_cached = 0 if s is None else len(s)
            if n_cached:
                cached_cols += range(seg.start, seg.start + n_cached)
                cached_slots.append(s)
            if n_cached < seg.length:
                name = "user" if seg.kind == "user" else f"item{seg.item}" if seg.kind == "item" else seg.kind
                owner.append((name, len(fresh_rows), seg.length - n_cached))
                fresh_rows += range(seg.start + n_cached, seg.stop)
        assert fresh_rows and fresh_rows[-1] == len(self.lay) - 1, "the last token (instruction) is always computed"
        return cached_cols, cached_slots, fresh_rows, owner


def forward_many(runner, specs: list[Forward], make_room) -> tuple[list[torch.Tensor], float, int]:
    """One forward over several layouts (one sequence each): every token of a layout not in its
    `cached` (segment start -> slots of that segment's first len(slots) tokens) is computed
    against the KV of all its layout's tokens, under the layout's mask; returns per layout the
    softmax over its candidates' id-token `targets` logits at its last token (only those columns
    of the output layer are computed), or, for path
    targets, their path log-likelihoods: the layout's sequence then also holds one row per
    distinct path prefix (`semantic.path_rows`: it sees the whole layout and its own prefixes),
    so every level of every candidate is in this same forward; their slots are freed here.
    A spec's `keep` names segments ("user", "item<j>") whose fresh slots are handed to the
    caller (as the values of those keys) instead of being freed; a name with nothing fresh keeps None."""
    plans = [spec.plan() for spec in specs]
    tries = [semantic.PathTrie(spec.targets) if spec.by_path else None for spec in specs]
    sizes = [len(fresh_rows) + (0 if t is None else t.num_rows()) for (_, _, fresh_rows, _), t in zip(plans, tries)]
    total = sum(sizes)
    make_room(total)
    allocator = runner.memory.allocator
    slots = allocator.alloc(total)  # per spec: its fresh layout tokens, then its path rows
    kept: list[set[str]] = [set() for _ in specs]
    try:
        ids, pos, seqs, rows, off = [], [], [], [], 0
        for spec, (cached_cols, cached_slots, fresh_rows, _), trie, size in zip(specs, plans, tries, sizes):
            n, lay = len(fresh_rows), spec.lay
            kv = torch.cat([*cached_slots, slots[off : off + size]])
            mask = bipartite = None
            ids += [lay.token_ids[r] for r in fresh_rows]
            pos += [lay.positions[r] for r in fresh_rows]
            if trie is None:  # the mask as two integers per column (dense only where a backend needs it)
                bipartite = lay.bipartite(cached_cols + fresh_rows)
            else:  # path rows: a dense mask
                mask = lay.mask(fresh_rows, cached_cols + fresh_rows)
                p_ids, p_pos, p_mask = semantic.path_rows(trie, lay.positions[-1], mask.shape[1])
                mask = torch.cat([torch.cat([mask, torch.zeros(n, len(p_ids), dtype=torch.bool)], 1), p_mask])
                ids += p_ids
                pos += p_pos
            # path rows: the deterministic kernel sums the layout's columns in layout order, then the rows
            paths = range(len(lay), len(lay) + size - n)
            order = None if trie is None else torch.tensor([*cached_cols, *fresh_rows, *paths])
            seqs.append(SeqLayout(off, size, kv, mask, bipartite, order))
            rows += range(off + n - 1, off + size)  # the layout's last token, then the path rows
            off += size
        t0 = time.perf_counter()
        hidden = runner.hidden(runner.make_batch(ids, pos, slots, seqs), rows)
        seconds = time.perf_counter() - t0
        out, off, a = [], 0, 0
        for b, (spec, (_, _, fresh_rows, owner)) in enumerate(zip(specs, plans)):
            m = sizes[b] - len(fresh_rows)
            if tries[b] is None:  # only the candidates' id-token columns of the output layer
                ids_t = torch.tensor(spec.targets, device=hidden.device)
                out.append(torch.softmax(runner.compute_logits(hidden[a : a + 1], ids_t)[0], dim=0).cpu())
            else:  # full-vocabulary log-probabilities at the last token and every path row
                logits = runner.compute_logits(hidden[a : a + 1 + m])
                out.append(semantic.path_logliks(tries[b], logits[0], logits[1:]).cpu())
            a += 1 + m
            if spec.keep is not None:
                for name, start, count in owner:
                    if name in spec.keep:
                        spec.keep[name] = slots[off + start : off + start + count]
                        kept[b].add(name)
            off += sizes[b]
    finally:
        free, off = [], 0
        for b, (_, _, fresh_rows, owner) in enumerate(plans):
            free += [slots[off + start : off + start + count] for name, start, count in owner
                     if name not in kept[b]]
            free.append(slots[off + len(fresh_rows) : off + sizes[b]])  # path rows (maybe empty)
            off += sizes[b]
        allocator.free(torch.cat(free))
    return out, seconds, total
