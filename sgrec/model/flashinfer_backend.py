"""Attention through FlashInfer on CUDA (the `gpu` extra): decode and causal
prefill / extend batches over a bfloat16 or float16 KV pool, reading the pool by slot with FlashInfer's
paged kernels at page size 1 (a page is a pool slot, so a sequence's page list is its slot list and
every last page holds one token). Rank forwards (bipartite masks), beam steps and CUDA-graph decode
steps keep the Triton kernels (the backend is a TritonBackend), other batches torch.

FlashInfer plans a batch on the host once (its work partition), then runs each layer: the plan is
made at the batch's first layer, when the head counts and the scale are known.

auto picks it on CUDA when flashinfer imports and `flashinfer_runs` (a small decode and a causal
extend against torch at start-up) passes; the GPU machines lent to this project have no FlashInfer
(its wheel, 62 MB with dependencies well past that, does not fit the 64 MiB that travels with the
repository), so this path has not run on a GPU here: the start-up check is what keeps a mismatch
with the installed FlashInfer from serving wrong numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from sgrec.model.attention import ForwardBatch, SeqLayout, TritonBackend

logger = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16)  # FlashInfer's KV dtypes (no float32)
WORKSPACE_BYTES = 128 << 20


def paged_layout(seqs: list[SeqLayout], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page tables for sequences at page size 1: (qo_indptr [B + 1], kv_indptr [B + 1],
    kv_indices (every sequence's slots, concatenated), last_page_len [B], all ones), int32 on device.
    A sequence's new tokens are the last q_len of its kv_indices (written before attention)."""
    q_len = torch.tensor([0] + [s.q_len for s in seqs], dtype=torch.int32)
    kv_len = torch.tensor([0] + [s.kv_len for s in seqs], dtype=torch.int32)
    idx = torch.cat([s.kv_indices.cpu() for s in seqs]).to(torch.int32)
    on = lambda t: t.to(device)  # noqa: E731
    return (on(torch.cumsum(q_len, 0, dtype=torch.int32)), on(torch.cumsum(kv_len, 0, dtype=torch.int32)), on(idx),
            on(torch.ones(len(seqs), dtype=torch.int32)))


@dataclass
class _PagedMeta:
    decode: bool
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    planned: bool = False


class FlashInferBackend(TritonBackend):
    """See the module doc."""

    def __init__(self):
        super().__init__()
        self._wrappers: dict[str, object] = {}

    def wrapper(self, kind: str, device: torch.device):
        if kind not in self._wrappers:
            import flashinfer

            if "workspace" not in self._wrappers:
                self._wrappers["workspace"] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            ws = self._wrappers["workspace"]
            cls = (flashinfer.BatchDecodeWithPagedKVCacheWrapper if kind == "decode"
                   else flashinfer.BatchPrefillWithPagedKVCacheWrapper)
            self._wrappers[kind] = cls(ws, "NHD")
        return self._wrappers[kind]

    def takes(self, batch: ForwardBatch) -> bool:
        """Decode, or an extend batch whose sequences are all plainly causal, over a FlashInfer dtype's pool."""
        return (batch.kv_pool.dtype in DTYPES and batch.kv_pool.device.type == "cuda" and bool(batch.seqs)
                and (batch.is_decode or not any(s.masked for s in batch.seqs)))

    def prepare(self, batch: ForwardBatch) -> None:
        if not self.takes(batch):
            return super().prepare(batch)
        batch.attn_meta = _PagedMeta(batch.is_decode, *paged_layout(batch.seqs, batch.out_cache_loc.device))

    def forward(self, q, k, v, layer, batch, scale):
        meta = batch.attn_meta
        if not isinstance(meta, _PagedMeta):
            return super().forward(q, k, v, layer, batch, scale)
        pool = batch.kv_pool
        pool.set_kv(layer, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer)
        T, hq, d = q.shape
        w = self.wrapper("decode" if meta.decode else "prefill", q.device)
        if not meta.planned:
            common = dict(sm_scale=float(scale), q_data_type=q.dtype, kv_data_type=k_buf.dtype)
            if meta.decode:
                w.plan(meta.kv_indptr, meta.kv_indices, meta.last_page_len, hq, k_buf.shape[1], d, 1,
                       pos_encoding_mode="NONE", **common)
            else:
                w.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.last_page_len, hq, k_buf.shape[1], d, 1,
                       causal=True, **common)
            meta.planned = True
        out = w.run(q.contiguous(), (k_buf.unsqueeze(1), v_buf.unsqueeze(1)))  # [slots, page 1, Hkv, D]
        return out.reshape(T, hq * d)


def check_cases(device) -> list[tuple]:
    """flashinfer_runs' batches on one bfloat16 pool: a decode batch of two sequences (9 and 20
    slots) and an extend batch of a fresh 5-token prefill and 7 new tokens over 23 cached. Each
    (seqs, q, k, v, out_cache_loc, pool), slots scattered over the pool."""
    from sgrec.mem.kv_pool import KVPool

    g = torch.Generator().manual_seed(0)
    hq, hkv, d = 8, 2, 64
    pool = KVPool(80, 1, hkv, d, torch.bfloat16, device)  # slots 1 .. 80 (0 pads)
    for buf in (pool.k_buffer[0], pool.v_buffer[0]):
        buf.copy_(torch.randn(buf.shape, generator=g))
    perm = (torch.randperm(80, generator=g) + 1).tolist()
    cases = []
    for group in (((1, 9), (1, 20)), ((5, 5), (7, 30))):  # (q_len, kv_len)
        seqs, start = [], 0
        for ql, kv in group:
            seqs.append(SeqLayout(start, ql, torch.tensor(perm[:kv], device=device)))
            del perm[:kv]
            start += ql
        q, k, v = (torch.randn(start, h, d, generator=g).to(device, torch.bfloat16) for h in (hq, hkv, hkv))
        loc = torch.cat([s.kv_indices[s.kv_len - s.q_len:] for s in seqs])
        cases.append((seqs, q, k, v, loc, pool))
    return cases


def flashinfer_runs(device: torch.device) -> bool:
    """Whether FlashInfer imports, runs on this device and equals torch (bfloat16, within 2e-2) on
    check_cases' decode and extend batches: auto's check before it picks FlashInferBackend."""
    from sgrec.model.attention import TorchBackend

    try:
        for seqs, q, k, v, loc, pool in check_cases(device):
            T, outs = q.shape[0], []
            for backend in (FlashInferBackend(), TorchBackend()):
                batch = ForwardBatch(torch.zeros(T, dtype=torch.int64, device=device),
                                     torch.zeros(T, dtype=torch.int64, device=device), loc, seqs, pool)
                backend.prepare(batch)
                if isinstance(backend, FlashInferBackend) and not isinstance(batch.attn_meta, _PagedMeta):
                    raise RuntimeError("the check's batch did not take the FlashInfer path")
                outs.append(backend.forward(q, k, v, 0, batch, q.shape[-1] ** -0.5).float().cpu())
            if not (outs[0] - outs[1]).abs().max() <= 2e-2:
                logger.warning("FlashInfer disagrees with torch on %s; attention uses the Triton kernels", device)
                return False
    except Exception as e:  # noqa: BLE001 - whatever FlashInfer raises (import, JIT build, launch), Triton still runs
        logger.warning("FlashInfer does not run on %s (%s: %s); attention uses the Triton kernels", device,
                       type(e).__name__, e)
        return False
    return True
