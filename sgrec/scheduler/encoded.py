"""An encoder-decoder family's generate and score requests in the scheduler's batches.

A request's input_ids are the encoder's; its decoder reads the family's start token and then its
outputs (`Req.prompt_ids`), so continuous batching, chunked prefill, retraction and the decoder's
radix cache run as for a decoder-only prompt. What this adds:

- the input's entry (`sgrec.beam.encdec.InputCache`: the tree's whole-key cache of encoder K/V),
  matched and locked with the request's decoder prefix, its slots allocated at admission, encoded
  in the request's first prefill batch (once per distinct input in that batch) and held until the
  request ends or is retracted;
- the decoder's tokens cached in the tree in a namespace of their own input (`namespace`): a
  decoder prefix is reusable only under the same input, whose K/V every decoder layer read;
- each sequence's encoder slots in the batches (`ForwardBatch.encoder_slots`).
"""

from __future__ import annotations

from sgrec.beam.encdec import InputCache
from sgrec.radix.tree import RadixCache, whole_key
from sgrec.scheduler.req import Req


def namespace(ids: list[int], extra_key: str | None) -> str:
    """The decoder's radix namespace for an input: the caller's extra_key and the input's digest."""
    return f"{extra_key or ''}\x00encoder:{whole_key(ids)[0]:x}"


class EncoderInputs:
    def __init__(self, runner, tree: RadixCache):
        self.cache, self.tree = InputCache(runner, tree), tree
        self.start = runner.config.decoder_start_token_id or 0

    def prepare(self, req: Req) -> None:
        """A new request: its decoder starts from the start token, under its input's namespace."""
        req.decoder_start, req.encoder_key = self.start, req.extra_key
        req.extra_key = namespace(req.input_ids, req.extra_key)

    def storage_key(self, req: Req) -> tuple[list[int], str | None]:
        """The input's key in the tree (and the storage tier)."""
        return whole_key(req.input_ids), req.encoder_key

    def hold(self, req: Req) -> None:
        """Matches and locks the request's input (once per admission)."""
        if req.encoded is None:
            req.encoded = self.cache.match(req.input_ids, req.encoder_key)

    def missing_slots(self, req: Req) -> int:
        """The slots the held input still needs (a miss not yet allocated), else 0."""
        e = req.encoded
        return 0 if e.slots is not None else e.fresh

    def pending_tokens(self, req: Req) -> int:
        """Input tokens the encoder still has to read for the request (a prefill batch's cost)."""
        e = req.encoded
        return 0 if e is not None and e.ready else len(req.input_ids)

    def alloc(self, req: Req) -> None:
        """A missed input's slots (room made by the caller)."""
        if req.encoded.slots is None:
            self.cache.alloc(req.encoded)

    def admitted(self, req: Req) -> None:
        """A first admission's cached_tokens: the decoder's prefix and the input, when the tree held it whole."""
        req.cached_tokens = req.kv_len + (len(req.input_ids) if req.encoded.hit else 0)

    def encode(self, reqs: list[Req]) -> None:
        """The batch's inputs not yet encoded through the encoder (InputCache.encode)."""
        self.cache.encode([r.encoded for r in reqs])

    def slots(self, reqs: list[Req]) -> list:
        """The batch's encoder slots, one entry a request."""
        return [r.encoded.slots for r in reqs]

    def release(self, req: Req) -> None:
        if req.encoded is not None:
            self.cache.release(req.encoded)
            req.encoded = None

    def peek_cached(self, req: Req) -> int:
        """Input tokens the tree holds for the request (all or none), without touching it."""
        key = whole_key(req.input_ids)
        return len(req.input_ids) if self.tree.peek_prefix_len(key, req.encoder_key) == len(key) else 0
