"""sgrec inside stock SGLang 0.5.23: the entry point `sgrec` of the group `sglang.srt.plugins`.

SGLang calls `register()` through `sglang.srt.plugins.load_plugins()` in every process (the launcher
before it parses its command line, each scheduler before it builds its caches), then applies the
hooks registered here. It adds:

- `--radix-eviction-policy laru`: sgrec's LARU on SGLang's RadixCache (`eviction.py`);
- `--grammar-backend sgrec-sid`: the catalog's semantic-ID trie as a grammar backend (`grammar.py`),
  and valid-path beam search for those requests (`beam.py`);
- `--schedule-policy srjf`: PrefillOnly's SRJF with continuous JCT calibration (`schedule.py`).

It patches all of that or nothing: see `register()` (the supported SGLang versions: SUPPORTED_SGLANG).

Each part reuses sgrec's own algorithm (radix.eviction / radix.predictor, beam.trie / beam.filters /
catalog, policy.prefill_only); these modules only translate SGLang's objects and events. Registering
imports no model code and starts nothing: the catalog is read and the policy built when SGLang
builds its grammar backend and radix cache.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

# the SGLang releases whose classes the plugin was tested against (tests/test_sglang_plugin.py); the
# test extra of pyproject.toml pins the same
SUPPORTED_SGLANG = ">=0.5.23,<0.5.24"
# what a command line may ask of the plugin: (flag, the value only the plugin provides)
FLAGS = (("--radix-eviction-policy", "laru"), ("--grammar-backend", "sgrec-sid"), ("--schedule-policy", "srjf"))
# SGLang's symbols the plugin uses besides its hook targets: registries, base classes, and classes
# its hooks import when they run
SYMBOLS = (
    "sglang.srt.arg_groups.choices.add_grammar_backend_choices",
    "sglang.srt.arg_groups.choices.add_radix_eviction_policy_choices",
    "sglang.srt.constrained.base_grammar_backend.register_grammar_backend",
    "sglang.srt.constrained.base_grammar_backend.GRAMMAR_BACKEND_REGISTRY",
    "sglang.srt.constrained.base_grammar_backend.BaseGrammarBackend",
    "sglang.srt.constrained.base_grammar_backend.BaseGrammarObject",
    "sglang.srt.constrained.base_grammar_backend.InvalidGrammarObject",
    "sglang.srt.mem_cache.utils._EVICTION_POLICY_FACTORIES",
    "sglang.srt.mem_cache.evict_policy.EvictionStrategy",
    "sglang.srt.mem_cache.base_prefix_cache.EvictResult",
    "sglang.srt.mem_cache.radix_cache.RadixCache",
    "sglang.srt.managers.schedule_policy.CacheAwarePolicy",
    "sglang.srt.plugins.hook_registry.HookRegistry",
    "sglang.srt.plugins.hook_registry.HookType",
)

_registered = False
failure: str | None = None  # why the plugin patched nothing in this process, where it did not


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def _resolves(path: str) -> bool:
    import pkgutil

    owner, attr = path.rsplit(".", 1)
    try:
        return hasattr(pkgutil.resolve_name(owner), attr)
    except (ImportError, AttributeError, ValueError):
        return False


def problems() -> list[str]:
    """What keeps the plugin from patching this SGLang whole: a version outside SUPPORTED_SGLANG, a
    plugin module that does not import, a symbol or hook target that does not resolve. Empty: go."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    found = []
    installed = sglang_version()
    try:
        supported = Version(installed) in SpecifierSet(SUPPORTED_SGLANG)
    except InvalidVersion:
        supported = False
    if not supported:
        found.append(f"SGLang {installed} is outside the supported range {SUPPORTED_SGLANG}")
    try:
        targets = [t for t, _, _ in _hooks()]
    except ImportError as e:  # a plugin module imports a name this SGLang does not have
        return found + [f"cannot import {e.name or e}: {e}"]
    found += [f"missing symbol {path}" for path in (*SYMBOLS, *targets) if not _resolves(path)]
    return found


def _hooks() -> list[tuple[str, object, str]]:
    from sgrec.sglang_plugin import beam, eviction, schedule

    return eviction.HOOKS + schedule.HOOKS + beam.HOOKS


def requested(argv: list[str]) -> list[str]:
    """The plugin's names a command line asks for (`--flag value` or `--flag=value`)."""
    asked = []
    for flag, name in FLAGS:
        for i, arg in enumerate(argv):
            if (arg == flag and i + 1 < len(argv) and argv[i + 1] == name) or arg == f"{flag}={name}":
                asked.append(f"{flag} {name}")
    return asked


def register() -> None:
    """Add sgrec's policies to SGLang's factories, registries and CLI choices, and register the hooks
    (SGLang's load_plugins applies them). All or nothing: every symbol and hook target is resolved and
    the SGLang version checked first; on any mismatch nothing is patched, an ERROR names the version
    and what is missing, and a command line that asks for laru, sgrec-sid or srjf stops with that
    message (SystemExit, which SGLang's plugin loader does not swallow). Once per process."""
    global _registered, failure
    if _registered:
        return
    _registered = True
    found = problems()
    if found:
        failure = (f"sgrec's SGLang plugin patched nothing (SGLang {sglang_version()}, supported "
                   f"{SUPPORTED_SGLANG}): " + "; ".join(found))
        logger.error(failure)
        asked = requested(sys.argv)
        if asked:
            raise SystemExit(f"{failure}. The command line asks for {', '.join(asked)}, which only this plugin "
                             f"provides.")
        return
    from sglang.srt.arg_groups.choices import add_grammar_backend_choices, add_radix_eviction_policy_choices
    from sglang.srt.constrained.base_grammar_backend import register_grammar_backend
    from sglang.srt.mem_cache import utils as mem_cache_utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgrec.sglang_plugin import eviction, grammar

    mem_cache_utils._EVICTION_POLICY_FACTORIES[eviction.NAME] = eviction.LaruStrategy
    add_radix_eviction_policy_choices([eviction.NAME])
    register_grammar_backend(grammar.NAME, grammar.create_backend)
    add_grammar_backend_choices([grammar.NAME])
    for target, hook, kind in _hooks():
        HookRegistry.register(target, hook, HookType(kind))
