"""Model configuration read from an HF-format directory's config.json."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

from sgrec.model import cpu_caps, families
from sgrec.model.cpu_caps import NativeSupport

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class ModelConfig:
    """The fields every family reads; a family's own flags (`registry.Family.config_flags`) fill the
    rest, and `hf_config` keeps config.json whole for what only one family reads."""

    arch: str  # the family's variant: llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    config_dtype: torch.dtype | None
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: dict = field(default_factory=dict, repr=False)
    family: str = "decoder"  # registry.Family.name
    # the dense decoder's flags (sgrec.model.llama.config_flags)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # an encoder-decoder's (sgrec.model.t5.config_flags): the token its decoder starts from
    decoder_start_token_id: int | None = None

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        family, _, variant = families.family_for(cfg.get("architectures") or [], path)
        flags = family.config_flags(variant, cfg)  # the family refuses what it cannot serve
        hf, cfg = cfg, cfg.get("text_config") or cfg  # a multimodal checkpoint: its text model's fields
        if family.common_fields is not None:
            cfg = {**cfg, **family.common_fields(cfg)}
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # transformers >= 5 folds rope_theta/rope_scaling into rope_parameters.
        rope = cfg.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or rope
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        rope_scaling = None if rope_type in (None, "default") else {**scaling, "rope_type": rope_type}
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
        eos = cfg.get("eos_token_id")
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id", eos)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            arch=variant,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            config_dtype=_DTYPES.get(str(dtype_name)) if dtype_name else None,
            eos_token_ids=eos_ids,
            hf_config=hf,
            family=family.name,
            **flags,
        )


def resolve_dtype(
    dtype: str | torch.dtype, config: ModelConfig, device: torch.device,
    bf16: NativeSupport | None = None, fp16: NativeSupport | None = None,
) -> torch.dtype:
    """SGLang's --dtype: 'auto' is the checkpoint's dtype on CUDA (bfloat16 for float32 checkpoints);
    on CPU, bfloat16 where the CPU multiplies it natively (AVX-512-BF16 or AMX), else float32.
    The CPU choice and its reason are logged; an explicit bfloat16/float16 on a CPU without native
    matmuls for it logs a warning. `bf16`/`fp16`: the CPU's support (default: detected, cpu_caps)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    if device.type != "cpu":
        if dtype == "auto":
            cd = config.config_dtype or torch.float32
            return torch.bfloat16 if cd == torch.float32 else cd
        return _DTYPES[dtype]
    if dtype == "auto":
        bf16 = bf16 or cpu_caps.cpu_bf16_support()
        chosen = torch.bfloat16 if bf16.native else torch.float32
        logger.info("--dtype auto on CPU: %s (%s: %s)", _name(chosen),
                    "native bf16 matmul" if bf16.native else "no native bf16 matmul", bf16.reason)
        return chosen
    chosen = _DTYPES[dtype]
    if chosen == torch.bfloat16:
        support = bf16 or cpu_caps.cpu_bf16_support()
    elif chosen == torch.float16:
        support = fp16 or cpu_caps.cpu_fp16_support()
    else:
        return chosen
    if not support.native:
        logger.warning("--dtype %s on a CPU without native %s matmul (%s): risk of %s (--dtype auto "
                       "or float32 avoids it)", dtype, _name(chosen), support.reason, cpu_caps.SLOW_RISK[chosen])
    return chosen


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
