"""sgrec inside stock SGLang 0.5.23: the entry point `sgrec` of the group `sglang.srt.plugins`.

SGLang calls `register()` through `sglang.srt.plugins.load_plugins()` in every process (the launcher
before it parses its command line, each scheduler before it builds its caches), then applies the
hooks registered here. It adds:

- `--radix-eviction-policy laru`: sgrec's LARU on SGLang's RadixCache (`eviction.py`);
- `--grammar-backend sgrec-sid`: the catalog's semantic-ID trie as a grammar backend (`grammar.py`),
  and valid-path beam search for those requests (`beam.py`);
- `--schedule-policy srjf`: PrefillOnly's SRJF with continuous JCT calibration (`schedule.py`).

Each part reuses sgrec's own algorithm (radix.eviction / radix.predictor, beam.trie / beam.filters /
catalog, policy.prefill_only); these modules only translate SGLang's objects and events. Registering
imports no model code and starts nothing: the catalog is read and the policy built when SGLang
builds its grammar backend and radix cache.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Add sgrec's policies to SGLang's factories, registries and CLI choices, and register the hooks
    (SGLang's load_plugins applies them). Idempotent."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import add_grammar_backend_choices, add_radix_eviction_policy_choices
    from sglang.srt.constrained.base_grammar_backend import register_grammar_backend
    from sglang.srt.mem_cache import utils as mem_cache_utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgrec.sglang_plugin import beam, eviction, grammar, schedule

    mem_cache_utils._EVICTION_POLICY_FACTORIES[eviction.NAME] = eviction.LaruStrategy
    add_radix_eviction_policy_choices([eviction.NAME])
    register_grammar_backend(grammar.NAME, grammar.create_backend)
    add_grammar_backend_choices([grammar.NAME])
    for target, hook, kind in eviction.HOOKS + schedule.HOOKS + beam.HOOKS:
        HookRegistry.register(target, hook, HookType(kind))
    _registered = True
