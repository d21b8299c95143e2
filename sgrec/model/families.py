"""The model families sgrec serves, by architecture name (config.json's `architectures`).

Each family is a module defining a `registry.Family`; `BUILTIN` lists them. `register` adds one
more (a family living outside the package, or a test's).
"""

from __future__ import annotations

from sgrec.model import llama, qwen3_5, t5
from sgrec.model.registry import Family

BUILTIN = (llama.FAMILY, qwen3_5.FAMILY, t5.FAMILY)

_FAMILIES: dict[str, Family] = {}  # architecture name -> family
_BY_NAME: dict[str, Family] = {}


def register(family: Family) -> Family:
    for arch in family.architectures:
        if arch in _FAMILIES and _FAMILIES[arch] is not family:
            raise ValueError(f"architecture {arch} is already served by the {_FAMILIES[arch].name} family")
        _FAMILIES[arch] = family
    _BY_NAME[family.name] = family
    return family


for _family in BUILTIN:
    register(_family)


def family_named(name: str) -> Family:
    return _BY_NAME[name]


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def family_for(architectures: list[str], where: str = "config.json") -> tuple[Family, str, str]:
    """(family, the architecture it matched, its variant) for a checkpoint's `architectures`;
    a ValueError naming the supported ones otherwise."""
    for arch in architectures:
        if arch in _FAMILIES:
            family = _FAMILIES[arch]
            return family, arch, family.architectures[arch]
    raise ValueError(f"Unsupported architecture {architectures} in {where}; sgrec supports {supported_architectures()}")
