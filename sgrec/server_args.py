"""ServerArgs: every knob of the engine and server, with SGLang's names where the meaning matches."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ServerArgs:
    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    context_length: int | None = None
    # KV pool size in tokens; by default a fraction of free memory (mem_fraction_static).
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    chunked_prefill_size: int = 2048  # tokens of one prompt per prefill step; -1 disables chunking
    max_prefill_tokens: int = 16384  # tokens in one prefill batch
    max_running_requests: int = 256
    schedule_policy: str = "fcfs"  # fcfs | lpm
    radix_eviction_policy: str = "lru"
    disable_radix_cache: bool = False
    attention_backend: str = "torch"
    random_seed: int = 0

    def __post_init__(self) -> None:
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ValueError("chunked_prefill_size must be positive or -1")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError("max_total_tokens must be at least 2")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be at least 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"Unknown schedule_policy {self.schedule_policy!r} (fcfs, lpm)")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"Unknown server argument(s) {unknown}; known: {sorted(names)}")
        return cls(**kwargs)
