"""Loads an HF-format model directory (config.json + *.safetensors) into its family's model."""

from __future__ import annotations

import glob
import os
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from sgrec.model import families
from sgrec.model.config import ModelConfig
from sgrec.model.cpu_linear import MIN_PACKED_NUMEL


def iter_safetensors(path: str, show_progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {path}")
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
                    bar.update()


def load_model(
    path: str, config: ModelConfig, device: torch.device, dtype: torch.dtype, show_progress: bool = False,
    pack_weights: bool = False, deterministic: bool = False, quantization: str | None = None,
    keep_plain: bool = False,
) -> torch.nn.Module:
    """The model of config's family (sgrec.model.families). pack_weights: prepack for oneDNN (cpu_linear); deterministic: every layer packed (where
    pack_weights) and batch-invariant (CausalLM.make_batch_invariant); quantization "fp8": the decoder
    layers' linear layers in FP8 (sgrec.model.fp8); keep_plain: packed layers keep their plain weights
    too (for sgrec.model.fused_decode)."""
    with torch.device("meta"):
        model = families.family_named(config.family).build(config, device)
    model.to_empty(device=device)
    model.to(dtype)
    model.load_weights(iter_safetensors(path, show_progress))
    if pack_weights:
        model.pack_for_cpu(0 if deterministic else MIN_PACKED_NUMEL, keep_plain)
    if deterministic:
        model.make_batch_invariant()
    if quantization == "fp8":
        from sgrec.model.fp8 import quantize_linears

        quantize_linears(model)
    return model.eval()
