"""xBeam for an encoder-decoder family (TIGER's T5): the encoder's output shared by every beam.

    input ──(whole-key radix hit, or the encoder once)──► cross-attention K/V of every decoder layer
    step 0: the decoder's start token ──► logits at the root's children ──► per-beam top-K ──► top-BW
    step s: BW tokens ──(each beam's own decoder tokens + the shared cross-attention K/V)──► ...

The encoder runs once per request, whatever the beam width; its output's K/V (one slot per input
token, every decoder layer's) is cached in the radix tree under the input's whole key
(`radix.tree.whole_key`: a returning user's same history is a hit, any other input a miss, as the
encoder is bidirectional), and every beam's cross-attention reads it in place, in one matmul per
request and layer. A beam owns only its decoder tokens' self-attention K/V: the start token's
(shared by the beams) and one slot per level, reordered in place with the beams like the
decoder-only path's unshared KV. Selection, filters and results are RetrieveExecutor's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sgrec.beam.attention import UnsharedKV
from sgrec.beam.executor import RetrieveExecutor, _Request
from sgrec.model.attention import ForwardBatch, SeqLayout
from sgrec.radix.node import TreeNode
from sgrec.radix.tree import RadixCache, whole_key


@dataclass
class Encoded:
    """A request's encoder input while it is in use: the radix node it holds locked and, on a miss,
    the fresh slots (the digest's, then the input's) it owns until they go to the tree."""

    ids: list[int]
    extra_key: str | None
    lock: TreeNode
    cache: bool  # whether the input goes to the tree once encoded
    hit: bool
    fresh: int  # slots a miss needs (the whole key's)
    new: torch.Tensor | None = None  # the miss's slots, not (yet) the tree's
    slots: torch.Tensor | None = None  # the input's slots (its cross-attention K/V), the digest's left out
    ready: bool = False  # its slots hold the encoder's K/V (a hit, or encoded)


class InputCache:
    """An encoder-decoder family's inputs in the radix tree under whole keys: a match is a hit only
    for the whole input; the misses are encoded together and handed to the tree."""

    def __init__(self, runner, tree: RadixCache):
        self.runner, self.tree, self.allocator = runner, tree, runner.memory.allocator

    def match(self, ids: list[int], extra_key: str | None, cache: bool = True) -> Encoded:
        """The input's entry, its matched node locked (cache False: never a hit, never kept)."""
        key = whole_key(ids)
        res = self.tree.match_prefix(key, extra_key) if cache else None
        node = self.tree.root if res is None else res.last_node
        self.tree.inc_lock_ref(node)
        hit = res is not None and res.indices.numel() == len(key)
        e = Encoded(list(ids), extra_key, node, cache, hit, 0 if hit else len(key), ready=hit)
        if hit:
            e.slots = res.indices[1:]
        return e

    def alloc(self, e: Encoded) -> None:
        """A miss's slots (room made by the caller)."""
        if not e.hit:
            e.new = self.allocator.alloc(e.fresh)
            e.slots = e.new[1:]

    def encode(self, entries: list[Encoded]) -> None:
        """The entries not yet ready through the encoder, one per distinct input (and namespace),
        packed into forwards of at most --chunked-prefill-size tokens (an input longer than that runs
        alone), then each handed to the tree; an entry of the same input as one encoded here (a
        request's n samples, two users with one history) gives its fresh slots back and reads that
        one's, in the tree."""
        todo = [e for e in entries if not e.ready]
        first: dict[tuple, Encoded] = {}
        misses, repeats = [], []
        for e in todo:
            src = first.setdefault((tuple(e.ids), e.extra_key), e) if e.cache and not self.tree.disable else e
            (misses if src is e else repeats).append((e, src))
        chunk = self.runner.args.prefill_chunk
        group: list[Encoded] = []
        for e, _ in misses:
            if group and sum(len(g.ids) for g in group) + len(e.ids) > chunk:
                self._encode_packed(group)
                group = []
            group.append(e)
        if group:
            self._encode_packed(group)
        for e, _ in misses:
            e.ready = True
            if e.cache and not self.tree.disable:
                full = self.tree.hand_off(whole_key(e.ids), e.new, e.extra_key, 0, e.lock)
                e.new, e.lock, e.slots = None, full.last_node, full.indices[1:]
        for e, src in repeats:
            self.allocator.free(e.new)
            self.tree.inc_lock_ref(src.lock)
            self.tree.dec_lock_ref(e.lock)
            e.new, e.lock, e.slots, e.ready = None, src.lock, src.slots, True

    def _encode_packed(self, entries: list[Encoded]) -> None:
        ids, pos, seqs = [], [], []
        for e in entries:
            seqs.append(SeqLayout(q_start=len(ids), q_len=len(e.ids), kv_indices=e.slots))
            ids += e.ids
            pos += range(len(e.ids))
        self.runner.encode(self.runner.make_batch(ids, pos, torch.cat([e.slots for e in entries]), seqs))

    def release(self, e: Encoded) -> None:
        """What the entry holds: its fresh slots (a miss not handed to the tree) and its lock."""
        if e.new is not None:
            self.allocator.free(e.new)
            e.new = None
        if e.lock is not None:
            self.tree.dec_lock_ref(e.lock)
            e.lock = None


class EncoderDecoderRetrieve(RetrieveExecutor):
    """RetrieveExecutor for a family with an encoder (capabilities.encoder)."""

    def __init__(self, runner, tree, catalog, **kw):
        if not runner.capabilities.encoder:
            raise ValueError(f"the {runner.family.name} family has no encoder")
        super().__init__(runner, tree, catalog, **kw)
        self.inputs = InputCache(runner, tree)
        self.decoder_start = runner.config.decoder_start_token_id or 0

    def _check_served(self) -> None:
        """Every encoder-decoder family serves its beams."""

    def cache_key(self, payload: dict) -> tuple[list[int], str | None]:
        """The input's whole key (InputCache: a hit only as a whole)."""
        return whole_key(payload["input_ids"]), payload.get("extra_key")

    def tokens(self, payload: dict) -> int:
        """The input (and its digest slot), the start token and one token a beam and level."""
        return super().tokens(payload) + 2

    def _admit(self, r: _Request) -> bool:
        """The input's entry (a hit only when the tree holds it whole) and the request's decoder
        slots (the start token's, then rows x cols for the beams); False (holding nothing) when the
        pool cannot hold them now."""
        e = self.inputs.match(r.ids, r.extra_key)
        rows, cols = self._rows_cols(r)
        if not self.tree.make_room(e.fresh + 1 + rows * cols):
            self.inputs.release(e)
            return False
        self.inputs.alloc(e)
        r.encoded, r.cached = e, len(r.ids) if e.hit else 0
        r.unshared = self.allocator.alloc(1 + rows * cols)
        return True

    def _release(self, r: _Request) -> None:
        if r.unshared is not None:
            self.allocator.free(r.unshared)
            r.unshared = None
        if r.encoded is not None:
            self.inputs.release(r.encoded)
            r.encoded = None

    def _prefill_round(self, reqs: list[_Request]) -> None:
        """The inputs the tree lacks through the encoder (InputCache.encode); then every request's
        start token through the decoder in one forward (level 0's logits)."""
        self.inputs.encode([r.encoded for r in reqs])
        for r in reqs:
            r.prompt_kv = r.encoded.slots
        starts = [r.unshared[:1] for r in reqs]
        seqs = [SeqLayout(q_start=i, q_len=1, kv_indices=s) for i, s in enumerate(starts)]
        batch = self.runner.make_batch([self.decoder_start] * len(reqs), [0] * len(reqs), torch.cat(starts), seqs,
                                       encoder_slots=[r.prompt_kv for r in reqs])
        logits = self.runner.forward(batch, list(range(len(reqs))))
        now = time.perf_counter()
        for r, row in zip(reqs, logits):
            r.logits0, r.t1 = row[None], now
            rows, cols = self._rows_cols(r)
            r.kv = UnsharedKV(self.pool, r.unshared[1:].view(rows, cols), self.reorder_chunk)

    def _beam_step(self, reqs: list[_Request], step: int, positions: list[int]) -> torch.Tensor:
        """Every live beam's level step - 1 token at decoder position `step`: its self-attention over
        the start token and its own tokens, its cross-attention over its request's encoder K/V (one
        group a request: ForwardBatch.encoder_slots names the same tensor for all its beams)."""
        tokens, locs, seqs, enc = [], [], [], []
        for r in reqs:
            n = r.bufs.n
            own = r.kv.slots[:n, :step]
            kv = torch.cat([r.unshared[:1].expand(n, 1), own], dim=1)
            seqs += [SeqLayout(q_start=len(seqs) + b, q_len=1, kv_indices=kv[b]) for b in range(n)]
            enc += [r.prompt_kv] * n
            tokens.append(r.bufs.tokens[:n, step - 1])
            locs.append(own[:, -1])
        ids = torch.cat(tokens)
        batch = ForwardBatch(input_ids=ids, positions=torch.full_like(ids, step), out_cache_loc=torch.cat(locs),
                             seqs=seqs, kv_pool=self.pool, encoder_slots=enc)
        runner = self.runner
        return runner.compute_logits(runner.forward_with(batch, runner.backend), self.trie.logit_columns(step))


def make_retriever(runner, tree, catalog, **kw) -> RetrieveExecutor:
    """The retrieve executor for the runner's family: EncoderDecoderRetrieve where it has an
    encoder, else RetrieveExecutor."""
    cls = EncoderDecoderRetrieve if runner.capabilities.encoder else RetrieveExecutor
    return cls(runner, tree, catalog, **kw)
