"""Loads an HF-format model directory (config.json + *.safetensors) into a CausalLM."""

from __future__ import annotations

import glob
import os
from typing import Iterator

import torch
from safetensors import safe_open

from sgrec.model.config import ModelConfig
from sgrec.model.llama import CausalLM


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(path: str, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config, device)
    model.to_empty(device=device)
    model.to(dtype)
    model.load_weights(iter_safetensors(path))
    return model.eval()
