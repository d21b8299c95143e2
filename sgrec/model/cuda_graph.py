"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches a few hundred small kernels (projections, norms, RoPE, attention, per layer)
whose launch cost, not their work, bounds a small batch on a GPU. DecodeGraphs captures the whole
step -- embedding, every layer, the final norm and the output layer -- once per bucket of batch sizes
into a CUDA graph over static buffers, and each step copies its inputs into those buffers and
replays the bucket's graph.

What a graph may not do is decide anything on the host, so the step's shape-dependent parts become
data in static buffers the kernels read:

* input ids, positions and the slots receiving the new K/V: [bucket] each;
* the attention metadata of the kernel backend's decode (`_SlotMeta`): every sequence's slots
  concatenated (`idx`, sized for `max_kv_tokens` in all) and the offsets `ptr` [bucket + 1]; the
  Triton decode kernel reads its loop bounds from `ptr` on the device.

A batch of n < bucket sequences is padded to the bucket by sequences of one token at position 0
that attend to and write slot 0, the pool's padding slot (whose contents nothing reads), so the
padded rows' logits are garbage and dropped, and the real rows equal an unpadded step's (each row's
attention reads only its own slots; projections are row by row). `capture=False` runs the very same
padded static-buffer step eagerly: how the CPU tests check the padding and the metadata, and the
fallback where capture fails.
"""

from __future__ import annotations

import logging

import torch

from sgrec.mem.kv_pool import KVPool
from sgrec.model.attention import AttentionBackend, ForwardBatch, _KernelBackend, _SlotMeta

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


def buckets_up_to(max_bs: int) -> list[int]:
    """The batch-size buckets a graph is captured for: BUCKETS below max_bs, then every multiple of
    256 below it, and max_bs."""
    if max_bs < 1:
        raise ValueError("cuda_graph_max_bs must be at least 1")
    return [b for b in BUCKETS if b < max_bs] + list(range(BUCKETS[-1] + 256, max_bs, 256)) + [max_bs]


def capture(step, device: torch.device, mem=None) -> tuple["torch.cuda.CUDAGraph", object]:
    """A CUDA graph of step() (its static buffers already loaded), in memory pool `mem` (None: a new
    one; share it between graphs that never run at once): run twice on a side stream first (Triton
    compiles, cuBLAS sets up), then captured. Returns (graph, step's output: the graph's static output)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mem, stream=stream, capture_error_mode="thread_local"):
        out = step()
    return graph, out


def try_capture(make, fallback: str):
    """make() (a capture), or None where it ran out of device memory: the one known, recoverable way a
    capture fails (the graph's memory pool did not fit). That is logged with `fallback` (what runs
    instead) and the allocator's cached blocks are freed. Anything else it raises is raised: a CUDA
    error can leave the context unusable (a sticky error every later call would hit), and any other
    exception is a bug in the captured step, which an eager run would hide."""
    try:
        return make()
    except torch.cuda.OutOfMemoryError as e:
        logger.warning("CUDA graph capture ran out of device memory, %s: %s", fallback, e)
        torch.cuda.empty_cache()
        return None


class _Preset(AttentionBackend):
    """The kernel backend, with the step's metadata already in the batch (prepare does nothing)."""

    def __init__(self, inner: _KernelBackend):
        self.inner = inner

    def forward(self, q, k, v, layer, batch, scale):
        return self.inner.forward(q, k, v, layer, batch, scale)


class DecodeGraphs:
    """Decode steps of up to max_bs sequences (and max_kv_tokens KV slots in all) through static
    buffers; captured as CUDA graphs with capture=True (CUDA), else run eagerly the same way."""

    def __init__(self, model, backend: _KernelBackend, pool: KVPool, max_bs: int, max_kv_tokens: int,
                 context_len: int, capture: bool):
        if not isinstance(backend, _KernelBackend):
            raise TypeError("DecodeGraphs needs a kernel backend that decodes by slot (triton or native)")
        self.model, self.pool, self.backend = model, pool, _Preset(backend)
        self.buckets = buckets_up_to(max_bs)
        self.max_bs, self.max_kv_tokens = self.buckets[-1], max_kv_tokens + self.buckets[-1]
        dev = pool.device
        self.device = dev
        self.ids, self.pos, self.loc = (torch.zeros(self.max_bs, dtype=torch.int64, device=dev) for _ in range(3))
        self.idx = torch.zeros(self.max_kv_tokens, dtype=torch.int64, device=dev)
        self.ptr = torch.arange(self.max_bs + 1, dtype=torch.int64, device=dev)
        model.rope.reserve(context_len)  # no table growth (a host decision) inside a step
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def takes(self, batch: ForwardBatch) -> bool:
        """A decode batch that fits a bucket and the slot buffer."""
        return (bool(batch.seqs) and batch.is_decode and len(batch.seqs) <= self.max_bs
                and sum(s.kv_len for s in batch.seqs) + self.max_bs <= self.max_kv_tokens)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [n, vocab] of the batch's n sequences (a view of the bucket's static output
        when replayed: valid until the next run)."""
        n = len(batch.seqs)
        bs = self.bucket(n)
        self._load(batch, bs)
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        return self._step(bs)[:n]

    # ---- inside ---------------------------------------------------------------------------------
    def _load(self, batch: ForwardBatch, bs: int) -> None:
        """The batch into the static buffers, padded to bs by one-token sequences on slot 0."""
        n, pad = len(batch.seqs), bs - len(batch.seqs)
        lens = torch.tensor([0] + [s.kv_len for s in batch.seqs] + [1] * pad, dtype=torch.int64)
        idx = torch.cat([s.kv_indices for s in batch.seqs])  # where the allocator keeps them; one copy
        total = idx.numel()
        self.idx[:total].copy_(idx)
        self.idx[total:total + pad].zero_()  # the padding sequences' slot 0
        self.ptr[: bs + 1].copy_(torch.cumsum(lens, 0))
        for buf, src in ((self.ids, batch.input_ids), (self.pos, batch.positions), (self.loc, batch.out_cache_loc)):
            buf[:n].copy_(src.to(self.device, torch.int64))
            buf[n:bs].zero_()

    def _step(self, bs: int) -> torch.Tensor:
        batch = ForwardBatch(input_ids=self.ids[:bs], positions=self.pos[:bs], out_cache_loc=self.loc[:bs], seqs=[],
                             kv_pool=self.pool, attn_meta=_SlotMeta(self.idx, self.ptr[: bs + 1]))
        return self.model.compute_logits(self.model(batch, self.backend))

    def _capture(self) -> None:
        """One graph per bucket, the largest first, all in one memory pool (a step's activations are
        dead once its logits are read, and only one step runs at a time)."""
        mem = None
        for bs in reversed(self.buckets):
            self.ptr[: bs + 1].copy_(torch.arange(bs + 1, device=self.device))  # bs padding sequences
            for buf in (self.ids, self.pos, self.loc, self.idx):
                buf.zero_()
            self.graphs[bs], self.outputs[bs] = capture(lambda bs=bs: self._step(bs), self.device, mem)
            mem = self.graphs[bs].pool()
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs captured for decode batch sizes %s", self.buckets)
