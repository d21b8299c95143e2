"""ModelRunner: owns the model, the KV pool and the attention backend; runs one forward batch."""

from __future__ import annotations

import logging
import os

import torch

from sgrec.mem.kv_pool import KVPool
from sgrec.model.attention import ForwardBatch, SeqLayout, make_backend
from sgrec.model.config import ModelConfig, resolve_dtype
from sgrec.model.cpu_linear import packing_available
from sgrec.model.loader import load_model
from sgrec.server_args import ServerArgs

logger = logging.getLogger(__name__)

CPU_MEM_FRACTION = 0.1  # of available RAM, when neither max_total_tokens nor mem_fraction_static is set
CPU_MAX_TOKENS = 1 << 17
CUDA_MEM_FRACTION = 0.85


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"Unknown device {device!r} (auto, cpu, cuda)")
    return torch.device(device)


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


class ModelRunner:
    def __init__(self, args: ServerArgs, show_progress: bool = False):
        if not args.model_path or not os.path.isdir(args.model_path):
            raise ValueError(f"model_path {args.model_path!r} is not a directory")
        self.args = args
        self.device = resolve_device(args.device)
        self.config = ModelConfig.from_dir(args.model_path)
        self.dtype = resolve_dtype(args.dtype, self.config, self.device)
        self.context_len = args.context_length or self.config.max_position_embeddings
        torch.manual_seed(args.random_seed)
        self.packed = args.enable_weight_packing and packing_available(self.device, self.dtype)
        self.model = load_model(args.model_path, self.config, self.device, self.dtype, show_progress, self.packed)
        self.backend = make_backend(args.attention_backend)
        cfg = self.config
        self.kv_pool = KVPool(
            self._pool_size(), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device
        )
        logger.info("KV pool: %d tokens, dtype %s, device %s", self.kv_pool.size, self.dtype, self.device)

    def _pool_size(self) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        cfg = self.config
        per_token = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        on_cpu = self.device.type == "cpu"
        fraction = self.args.mem_fraction_static or (CPU_MEM_FRACTION if on_cpu else CUDA_MEM_FRACTION)
        size = int(_available_memory(self.device) * fraction) // per_token
        if on_cpu:
            size = min(size, CPU_MAX_TOKENS)
        if size < 2:
            raise ValueError("Not enough memory for the KV pool; set --max-total-tokens")
        return size

    def make_batch(
        self, input_ids: list[int], positions: list[int], out_cache_loc: torch.Tensor, seqs: list[SeqLayout]
    ) -> ForwardBatch:
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_cache_loc=out_cache_loc.to(dev),
            seqs=seqs,
            kv_pool=self.kv_pool,
        )

    def forward(self, batch: ForwardBatch, logit_rows: torch.Tensor | list[int]) -> torch.Tensor:
        """float32 logits [len(logit_rows), vocab] for the asked rows of the flat batch."""
        hidden = self.model(batch, self.backend)
        rows = torch.as_tensor(logit_rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden[rows])
