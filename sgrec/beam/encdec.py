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

import torch

from sgrec.beam.attention import UnsharedKV
from sgrec.beam.executor import RetrieveExecutor, _Request
from sgrec.model.attention import ForwardBatch, SeqLayout
from sgrec.radix.tree import whole_key


class EncoderDecoderRetrieve(RetrieveExecutor):
    """RetrieveExecutor for a family with an encoder (capabilities.encoder)."""

    def __init__(self, runner, tree, catalog, **kw):
        if not runner.capabilities.encoder:
            raise ValueError(f"the {runner.family.name} family has no encoder")
        super().__init__(runner, tree, catalog, **kw)
        self.decoder_start = runner.config.decoder_start_token_id or 0

    def _check_served(self) -> None:
        """Every encoder-decoder family serves its beams."""

    def tokens(self, payload: dict) -> int:
        """The input (and its digest slot), the start token and one token a beam and level."""
        return super().tokens(payload) + 2

    def _admit(self, r: _Request) -> bool:
        """A hit only when the tree holds the whole input; the request's slots: its input's (on a
        miss: the digest's and the input's) and its decoder tokens' (the start token, then rows x
        cols for the beams); False (holding nothing) when the pool cannot hold them now."""
        tree, alloc = self.tree, self.allocator
        key = whole_key(r.ids)
        res = tree.match_prefix(key, r.extra_key)
        tree.inc_lock_ref(res.last_node)
        hit = res.indices.numel() == len(key)
        rows, cols = self._rows_cols(r)
        fresh = 0 if hit else len(key)
        if not tree.make_room(fresh + 1 + rows * cols):
            tree.dec_lock_ref(res.last_node)
            return False
        r.lock, r.cached = res.last_node, len(r.ids) if hit else 0
        r.new_slots = None if hit else alloc.alloc(fresh)
        r.unshared = alloc.alloc(1 + rows * cols)  # the start token's slot, then the beams'
        r.prompt_kv = res.indices[1:] if hit else r.new_slots[1:]  # the input's (not the digest's)
        return True

    def _prefill_round(self, reqs: list[_Request]) -> None:
        """The inputs the tree lacks through the encoder (_encode), each handed to the tree; then
        every request's start token through the decoder in one forward (level 0's logits)."""
        misses = [r for r in reqs if r.new_slots is not None]
        if misses:
            self._encode(misses)
        for r in misses:
            if self.tree.disable:
                continue
            key = whole_key(r.ids)
            full = self.tree.hand_off(key, r.new_slots, r.extra_key, 0, r.lock)
            r.new_slots = None
            r.lock, r.prompt_kv = full.last_node, full.indices[1:]
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

    def _encode(self, reqs: list[_Request]) -> None:
        """The requests' inputs through the encoder, packed into forwards of at most
        --chunked-prefill-size tokens (an input longer than that runs alone)."""
        chunk = self.runner.args.prefill_chunk
        group: list[_Request] = []
        for r in reqs:
            if group and sum(len(g.ids) for g in group) + len(r.ids) > chunk:
                self._encode_packed(group)
                group = []
            group.append(r)
        self._encode_packed(group)

    def _encode_packed(self, reqs: list[_Request]) -> None:
        ids, pos, seqs = [], [], []
        for r in reqs:
            seqs.append(SeqLayout(q_start=len(ids), q_len=len(r.ids), kv_indices=r.new_slots[1:]))
            ids += r.ids
            pos += range(len(r.ids))
        self.runner.encode(self.runner.make_batch(ids, pos, torch.cat([r.new_slots[1:] for r in reqs]), seqs))

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
