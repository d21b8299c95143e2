"""Rank for an encoder-decoder family: each candidate's semantic-ID path scored by the decoder against
the request's encoder K/V.

The encoder reads the request's input (the user's profile, then the instruction) once, or finds it
whole in the radix tree (sgrec.beam.encdec.InputCache); a candidate's score is its path's
teacher-forced log-likelihood under the decoder, log p(s1 | x) + log p(s2 | x, s1) + ...
(full-vocabulary log_softmax, as sgrec.rank.semantic scores a decoder-only path). The candidates'
paths share prefixes: the decoder runs one row per distinct prefix (the start token for the empty
one), each row's self-attention over its own prefix's rows and its cross-attention over the
request's encoder K/V in place, every request of a batch in one forward. The candidates never read
one another, so their order and number change no score.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sgrec.beam.encdec import Encoded, InputCache
from sgrec.model.attention import SeqLayout

Path = tuple[int, ...]


def check_options(score_by: str | None, prefix: str | None, family: str) -> None:
    """A ValueError (a 400) naming what an encoder-decoder cannot mean: scoring by id token (an
    item's tokens in the prompt, a decoder-only model's), and the item-as-prefix layout."""
    if score_by == "id_token":
        raise ValueError(f"score_by 'id_token' reads each candidate's tokens in a decoder-only prompt; the {family} "
                         f"family scores candidates by their semantic-ID path (score_by 'semantic_id' or 'auto')")
    if prefix == "item":
        raise ValueError(f"prefix 'item' puts item tokens before the user in a decoder-only prompt; the {family} "
                         f"family's input is the user's profile and instruction, and it reads no item tokens")


@dataclass
class EncodedForward:
    """One rank request's forward: its encoder input, its candidates' paths (in the request's
    canonical order), whether the input may come from and go to the tree; `cached` is set to the
    input tokens the tree held."""

    ids: list[int]
    extra_key: str | None
    paths: list[Path]
    cache: bool = True
    cached: int = field(default=0, init=False)


def prefixes(paths: list[Path]) -> list[Path]:
    """The distinct proper prefixes of the paths (the empty one first), shortest first: the rows
    the decoder runs."""
    out = {p[:d] for p in paths for d in range(len(p))}
    return sorted(out, key=lambda q: (len(q), q))


def forward_many(runner, inputs: InputCache, specs: list[EncodedForward], make_room) -> tuple[list, float, int]:
    """Every request's scores (one a path) in one decoder forward, the inputs the tree lacks
    encoded first; (scores, seconds, computed tokens). make_room(n) raises when n slots cannot be
    freed; every slot taken here is free again or the tree's when it returns."""
    t0 = time.perf_counter()
    entries: list[Encoded] = []
    rows_slots = None
    try:
        for sp in specs:
            entries.append(inputs.match(sp.ids, sp.extra_key, sp.cache))
        rows = [prefixes(sp.paths) for sp in specs]
        make_room(sum(e.fresh for e in entries) + sum(len(r) for r in rows))
        for e in entries:
            inputs.alloc(e)
        rows_slots = runner.memory.allocator.alloc(sum(len(r) for r in rows))
        inputs.encode(entries)
        start = runner.config.decoder_start_token_id or 0
        tokens, pos, seqs, enc, where = [], [], [], [], []
        a = 0
        for sp, e, rs in zip(specs, entries, rows):
            slot = dict(zip(rs, rows_slots[a:a + len(rs)].tolist()))
            index = {q: a + i for i, q in enumerate(rs)}
            for q in rs:  # a row sees its own prefix's rows, the empty one's first
                chain = torch.tensor([slot[q[:d]] for d in range(len(q) + 1)], dtype=torch.int64)
                seqs.append(SeqLayout(q_start=len(tokens), q_len=1, kv_indices=chain))
                tokens.append(q[-1] if q else start)
                pos.append(len(q))
                enc.append(e.slots)
            where.append(index)
            a += len(rs)
            sp.cached = len(sp.ids) if e.hit else 0
        batch = runner.make_batch(tokens, pos, rows_slots, seqs, encoder_slots=enc)
        logp = torch.log_softmax(runner.forward(batch, list(range(len(tokens)))), dim=-1)
        out = []
        for sp, index in zip(specs, where):  # level d of a path: its prefix's row at the path's token
            at = torch.tensor([[index[p[:d]] for d in range(len(p))] for p in sp.paths], dtype=torch.int64)
            tok = torch.tensor([list(p) for p in sp.paths], dtype=torch.int64)
            out.append(logp[at, tok].sum(dim=1))
        computed = sum(e.fresh for e in entries) + len(tokens)
        return out, time.perf_counter() - t0, computed
    finally:
        if rows_slots is not None:
            runner.memory.allocator.free(rows_slots)
        for e in entries:
            inputs.release(e)
