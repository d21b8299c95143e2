"""What a model family is: the architectures it reads, how it builds its model, what it can do.

A family builds its model and says what it can do. The paths around the runner ask for these
capabilities, never for the architecture, and a capability a family lacks is refused at start-up
or with a 400 naming the option. `sgrec.model.families` maps architecture names to the families
(the dense decoder `sgrec.model.llama`, the hybrid `sgrec.model.qwen3_5`, the
encoder-decoder `sgrec.model.t5`); a new family is a module that defines its
`Family`, listed there.

Capabilities:
- `layer_kinds`: one entry a layer, "attention" (per-token KV in the pool) or "recurrent" (a
  fixed-size state a request, `mem.memory.StatePool`); the memory object is sized from it.
- `state_shapes`: for each recurrent layer, its state's parts and their shapes (empty for a family
  without recurrent layers): every running request holds one state slot, admitted through the same
  budget as its tokens. `state_float32`: the parts kept in float32 whatever the model's dtype.
- `prefix_reuse`: how a cached prefix may be reused: "any" (cut at any token: a radix match),
  "snapshot" (only where a state was kept), "exact" (only the whole sequence).
- `layouts`: the rank layouts (`sgrec.layout.KINDS`) whose attention masks it runs. `rank_forks`:
  user-as-prefix runs as one state fork per candidate instead (`sgrec.rank.forked`: each
  candidate continues the user on its own), for a family whose recurrent layers read in order.
- `encoder`: whether requests carry encoder inputs (cross-attention slots in ForwardBatch).
- `staged_beams`: whether a beam step may read the prompt's KV in place, every beam's own tokens
  apart (xBeam's staged attention), and the recurrent layers (where there are any) one token of
  each beam from the beam's own state; retrieve and recommend are refused with a 400 without it.
- `chunked_prefill` (`hybrid_prefill`): forward parts the family's layers support; the runner
  turns on only those it has. `fused_decode` and `decode_graphs`: the CPU fused decode step and
  the CUDA decode graphs, both written for the dense decoder's layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ATTENTION, RECURRENT = "attention", "recurrent"
PREFIX_REUSE = {"any": "cut at any token", "snapshot": "only where a state was kept",
                "exact": "only as the whole sequence"}


@dataclass(frozen=True)
class Capabilities:
    layer_kinds: tuple[str, ...]
    state_shapes: dict[int, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    state_float32: frozenset[str] = frozenset()
    prefix_reuse: str = "any"
    layouts: frozenset[str] = frozenset()
    rank_forks: bool = False
    encoder: bool = False
    staged_beams: bool = False
    hybrid_prefill: bool = False
    fused_decode: bool = False
    decode_graphs: bool = False

    def __post_init__(self):
        if self.prefix_reuse not in PREFIX_REUSE:
            raise ValueError(f"prefix_reuse must be one of {list(PREFIX_REUSE)}, got {self.prefix_reuse!r}")
        unknown = set(self.layer_kinds) - {ATTENTION, RECURRENT}
        if unknown:
            raise ValueError(f"unknown layer kinds {sorted(unknown)}")
        recurrent = {i for i, kind in enumerate(self.layer_kinds) if kind == RECURRENT}
        if set(self.state_shapes) != recurrent:
            raise ValueError(f"state_shapes must name the recurrent layers {sorted(recurrent)}, "
                             f"got {sorted(self.state_shapes)}")

    @property
    def attention_layers(self) -> list[int]:
        """The layers whose KV lives in the token pool, in layer order."""
        return [i for i, kind in enumerate(self.layer_kinds) if kind == ATTENTION]

    def refuse_layout(self, layout: str, family: str) -> None:
        """A 400's ValueError naming the field when this family cannot run a rank layout."""
        if layout not in self.layouts:
            raise ValueError(f"layout {layout!r} is not served for {family} models "
                             f"(supported: {sorted(self.layouts) or 'none'})")


@dataclass(frozen=True)
class Family:
    """A model family: its name, the checkpoint architectures it reads (architecture -> variant
    name), how its variants' flags come from config.json, and how its model is built."""

    name: str
    architectures: dict[str, str]
    config_flags: Callable[[str, dict], dict]  # (variant, config.json) -> ModelConfig flag fields
    build: Callable[..., torch.nn.Module]  # (ModelConfig, device) -> the model, on the meta device
    capabilities: Callable[..., Capabilities]  # (ModelConfig) -> what it can do
    # config.json -> the fields ModelConfig reads, under its names, for a family whose checkpoints
    # name them otherwise (T5's d_model, num_heads, ...); None: config.json names them so
    common_fields: Callable[[dict], dict] | None = None
