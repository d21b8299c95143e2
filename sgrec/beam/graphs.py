"""Beam steps replayed from CUDA graphs (FlashRec's and xGR's graph-captured beam
expansion): the forward of a device round's step (sgrec.beam.device_round) -- embedding, every
layer with the batched staged attention, the final norm -- captured once per (bucket of beam rows,
step) over static buffers and replayed; the output layer (the level's logit columns) runs after it.

Beam rows from several requests share a step, as FlashRec's slot budget does: a bucket is a
number of rows, whatever the requests they belong to, because what differs between rounds --
which request owns which rows, its prompt's slots, each beam's own slots -- is data the staged
kernel reads on the device (StagedMeta: the prompts' slots and offsets, the unshared slots, the
block table). A round of n rows is padded to its bucket by rows that write their K/V to the pool's
padding slot 0 and are attended by no program (block table entries of request -1), so their
outputs are garbage and dropped, and the real rows equal an unpadded step's.

`capture=False` runs the same padded static-buffer step eagerly: how the CPU tests check the
padding (tests/triton_interpreted.py), and what runs where capture fails.
"""

from __future__ import annotations

import logging

import torch

from sgrec.beam.attention import StagedMeta
from sgrec.model.attention import ForwardBatch
from sgrec.model.cuda_graph import buckets_up_to, capture, try_capture
from sgrec.model.kernels.staged_attention import BLOCK_B

logger = logging.getLogger(__name__)


def programs(rows: int) -> int:
    """Block-table entries a bucket of `rows` needs: a block of at most BLOCK_B rows per request
    start and per BLOCK_B rows, so at most rows / BLOCK_B + rows."""
    return -(-rows // BLOCK_B) + rows


class BeamGraphs:
    """Device-round beam steps of up to max_rows beams whose prompts hold up to max_shared slots in
    all, through static buffers; each (bucket, step) captured as a CUDA graph on its first use
    (capture=True, CUDA), else run eagerly the same way."""

    def __init__(self, forward, backend, pool, max_rows: int, max_shared: int, max_steps: int, capture: bool):
        """forward(batch, backend): a step's final hidden states (ModelRunner.forward_with)."""
        self.forward, self.backend, self.pool = forward, backend, pool
        self.buckets = buckets_up_to(max_rows)
        self.max_rows, self.max_shared, self.max_steps = self.buckets[-1], max_shared, max_steps
        dev = self.device = pool.device
        n = self.max_rows
        self.ids, self.pos, self.loc = (torch.zeros(n, dtype=torch.int64, device=dev) for _ in range(3))
        self.shared = torch.zeros(max_shared, dtype=torch.int64, device=dev)
        self.sh_ptr = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        self.unshared = torch.zeros(n, max(max_steps, 1), dtype=torch.int64, device=dev)
        self.blocks = torch.zeros(programs(n), 3, dtype=torch.int64, device=dev)
        self.no_work = torch.tensor([[-1, 0, 0]], dtype=torch.int64).to(dev)  # a block table entry
        self.capture = capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._mem = None

    def takes(self, n: int, meta: StagedMeta) -> bool:
        """A step of n rows with this metadata fits the buffers."""
        return (n <= self.max_rows and meta.shared.numel() <= self.max_shared
                and 1 <= meta.unshared.shape[1] <= self.max_steps and meta.blocks.shape[0] <= programs(self.bucket(n)))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor, meta: StagedMeta
            ) -> torch.Tensor:
        """The step's hidden states [n, hidden] (a view of the graph's static output when replayed:
        valid until the next run)."""
        n, s = tokens.numel(), meta.unshared.shape[1]
        bs = self.bucket(n)
        self._load(tokens, positions, out_loc, meta, bs)
        key = (bs, s)
        if key not in self.graphs and self.capture:
            self._capture(key)
        if key in self.graphs:
            self.graphs[key].replay()
            return self.outputs[key][:n]
        return self._step(bs, s)[:n]

    # ---- inside ---------------------------------------------------------------------------------
    def _load(self, tokens, positions, out_loc, meta: StagedMeta, bs: int) -> None:
        n, s = tokens.numel(), meta.unshared.shape[1]
        for buf, src in ((self.ids, tokens), (self.pos, positions), (self.loc, out_loc)):
            buf[:n].copy_(src)
            buf[n:bs].zero_()  # padding rows: token 0 at position 0, K/V to slot 0
        self.shared[: meta.shared.numel()].copy_(meta.shared)
        self.sh_ptr[: meta.sh_ptr.numel()].copy_(meta.sh_ptr)
        self.unshared[:n, :s].copy_(meta.unshared)
        self.unshared[n:bs, :s].zero_()
        nb = meta.blocks.shape[0]
        self.blocks[:nb].copy_(meta.blocks)
        self.blocks[nb : programs(bs)].copy_(self.no_work.expand(programs(bs) - nb, 3))

    def _step(self, bs: int, s: int) -> torch.Tensor:
        meta = StagedMeta(self.shared, self.sh_ptr, self.unshared[:bs, :s], self.blocks[: programs(bs)])
        batch = ForwardBatch(input_ids=self.ids[:bs], positions=self.pos[:bs], out_cache_loc=self.loc[:bs], seqs=[],
                             kv_pool=self.pool, attn_meta=meta)
        return self.forward(batch, self.backend)

    def _capture(self, key: tuple[int, int]) -> None:
        """The (bucket, step) graph, in the memory pool all of them share (one step runs at a time and
        its hidden states are read before the next). A capture that runs out of memory turns capturing
        off: steps then run eagerly through the same buffers. Any other failure is raised (try_capture)."""
        got = try_capture(lambda: capture(lambda: self._step(*key), self.device, self._mem),
                          "beam steps run without graphs")
        if got is None:
            self.capture = False
            return
        self.graphs[key], self.outputs[key] = got
        self._mem = got[0].pool()
        logger.info("CUDA graph captured for beam steps of %d rows at step %d", *key)
