"""A decode step on CPU in one C call, bfloat16 or float32 (sgrec/model/native/decode.c).

At batch 1 a decode step reads every weight once: its floor is the time the weights take to come from
memory. Through torch it made about a dozen calls per layer (oneDNN's packed bf16 matmuls streamed the
weights at about half of what the memory gives, torch's float32 M=1 linears at about a quarter,
docs/performance.md), so a SmolLM2 step took several times that floor. decode.c runs every layer, the final
norm and the output layer in one call: matrix-vector products that prefetch the next weight rows (bf16
on vdpbf16ps, float32 on fused multiply-adds), and the glue and decode attention kernels the torch
path calls (attention.c, glue.c), so every op rounds where torch's ops round; only the products sum
in another order (a step is not torch's bit for bit, as in any other implementation;
tests/test_fused_decode.py bounds it).

Taken by ModelRunner.forward for decode batches of at most MAX_BATCH[dtype] sequences, where the
runner decodes on CPU through sgrec's C kernels (NativeBackend) in a dtype the kernels' build runs
(`available`: bf16 where they are built with avx512_bf16, float32 where built for AVX2 + FMA or
AVX-512; never a default on a feature not detected), the model has no FP8 layers and
--enable-deterministic-inference is off (its one-row-per-matmul contract is the batch-invariant
path's); --disable-fused-decode turns it off. It keeps the projections' plain weights beside oneDNN's
packed copies (CausalLM.pack_for_cpu(keep_plain=True)): one more copy of the decoder's weights in
memory.
"""

from __future__ import annotations

import ctypes

import torch

from sgrec.model.attention import ForwardBatch, NativeBackend, _SlotMeta
from sgrec.model.llama import CausalLM

# larger decode batches reuse each weight across enough rows for oneDNN's GEMMs to win (bench_fused_decode)
MAX_BATCH = {torch.bfloat16: 8, torch.float32: 3}
DTYPE_BITS = {torch.float32: 1, torch.bfloat16: 2}  # sgrec_fused_decode()'s answer: the dtypes a build runs
LAYER_PTRS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down",
              "down_bias", "q_norm", "k_norm", "k_buf", "v_buf")  # decode.c's per-layer table, in its order


def plain_weight(linear) -> torch.Tensor:
    """A projection's plain [out, in] weight: an nn.Linear's, or the copy a PackedLinear kept."""
    plain = getattr(linear, "plain", None)
    return linear.weight if plain is None else plain


def available(device: torch.device, dtype: torch.dtype, lib: ctypes.CDLL | None) -> bool:
    """Whether this machine can run the fused step for a model in dtype: on CPU, bf16 with the kernels
    built on avx512_bf16, float32 with them built for AVX2 + FMA or AVX-512."""
    return device.type == "cpu" and lib is not None and bool(lib.sgrec_fused_decode() & DTYPE_BITS.get(dtype, 0))


class FusedDecode:
    def __init__(self, model: CausalLM, lib: ctypes.CDLL, max_batch: int | None = None):
        cfg = model.cfg
        self.dtype = model.embed_tokens.weight.dtype
        self.model, self.lib = model, lib
        self.max_batch = MAX_BATCH[self.dtype] if max_batch is None else max_batch
        self.dims = torch.tensor([cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                  cfg.intermediate_size, cfg.vocab_size, cfg.num_layers], dtype=torch.int32)
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim**-0.5
        self._tensors: list[torch.Tensor] = []  # everything the table points at, kept alive
        self._rows = [self._layer(layer) for layer in model.layers]
        self.final_norm = self._keep(model.norm.weight)
        self.out_weight = self._keep(model.out_weight)
        self._table: tuple[object, torch.Tensor] | None = None  # (the pool it was built for, [L, LAYER_PTRS])

    def _keep(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        t = t.detach().contiguous()
        if t.dtype != self.dtype:
            raise TypeError(f"fused decode: {self.dtype} weights (the model's dtype), got {t.dtype}")
        self._tensors.append(t)
        return t.data_ptr()

    def _layer(self, layer) -> list[int]:
        attn, mlp = layer.self_attn, layer.mlp
        qn, kn = (None, None) if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
        return [self._keep(t) for t in (
            layer.input_layernorm.weight, plain_weight(attn.qkv_proj), attn.qkv_proj.bias, plain_weight(attn.o_proj),
            attn.o_proj.bias, layer.post_attention_layernorm.weight, plain_weight(mlp.gate_up_proj),
            mlp.gate_up_proj.bias, plain_weight(mlp.down_proj), mlp.down_proj.bias, qn, kn)]

    def takes(self, batch: ForwardBatch, backend) -> bool:
        pool = batch.kv_pool
        return (type(backend) is NativeBackend and not backend.deterministic and batch.is_decode
                and 0 < len(batch.seqs) <= self.max_batch and pool.dtype == self.dtype
                and pool.device.type == "cpu")

    def _layer_table(self, pool) -> torch.Tensor:
        if self._table is None or self._table[0] is not pool:
            rows = [r + [pool.k_buffer[i].data_ptr(), pool.v_buffer[i].data_ptr()] for i, r in enumerate(self._rows)]
            for i, row in enumerate(rows):
                assert len(row) == len(LAYER_PTRS)
                assert pool.k_buffer[i].is_contiguous() and pool.v_buffer[i].is_contiguous()
            self._table = (pool, torch.tensor(rows, dtype=torch.int64))
        return self._table[1]

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [B, vocab] of a decode batch (takes() it); writes its K/V into the pool."""
        model = self.model
        B = len(batch.seqs)
        x = model.embed_tokens(batch.input_ids).contiguous()
        cos, sin = (t.contiguous() for t in model.rope.cos_sin(batch.positions, x.dtype))
        slot_meta = _SlotMeta.of(batch)  # the slots each sequence attends to, as the decode kernel reads them
        slots = batch.out_cache_loc.to(torch.int64).contiguous()
        logits = torch.empty(B, model.cfg.vocab_size, dtype=self.dtype)
        table = self._layer_table(batch.kv_pool)
        failed = self.lib.sgrec_decode_step(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                                            slot_meta.idx.data_ptr(), slot_meta.ptr.data_ptr(), table.data_ptr(),
                                            self.final_norm, self.out_weight, logits.data_ptr(), self.dims.data_ptr(),
                                            B, self.eps, self.scale, int(self.dtype == torch.bfloat16))
        if failed:
            raise MemoryError("fused decode: scratch allocation failed") if failed == 1 else \
                RuntimeError(f"fused decode: this build of the kernels does not run {self.dtype}")
        return logits.float()
