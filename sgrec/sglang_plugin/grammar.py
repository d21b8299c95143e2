"""`--grammar-backend sgrec-sid` inside SGLang: the catalog's semantic-ID trie (sgrec.beam.trie) as an
SGLang grammar backend, with a request's exclude / include / attribute filters (sgrec.beam.filters),
so a generation can only spell a valid, allowed semantic-ID path, greedy or sampled.

The catalog: the file named by the environment variable SGREC_CATALOG (sgrec's JSON Lines or binary
catalog; SGLang's scheduler processes inherit the launcher's environment). It is loaded when SGLang
builds its grammar backend, at start-up: a missing, unreadable or malformed file, or one without
semantic IDs, stops the server with the loader's message. Without SGREC_CATALOG the server starts and
every request that opts in is refused as an invalid grammar (HTTP 400).

A request opts in through `sampling_params.structural_tag` (SGLang hands that string to the backend
unchanged), a JSON object:

    {"type": "sgrec-sid", "exclude_items": ["m1"], "include_items": null, "filter": {"year": {"gte": 1990}}}

Only "type" is required; the other keys are those of sgrec's /v1/retrieve. A bad spec (not JSON,
unknown keys, an include id not in the catalog, a bad attribute filter, filters that leave no item)
is an invalid grammar: SGLang aborts that request with 400 and serves the rest.

Decoding: token t of a path must be a child of the path so far that leads to an allowed leaf; after
the last semantic-ID token only the model's stop tokens (EOS) are allowed, and the grammar terminates
when one is accepted. The mask is a bool [batch, vocab] tensor, True = not allowed.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable

import torch
from sglang.srt.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    InvalidGrammarObject,
)

from sgrec.beam.filters import FilterCache, TrieFilter, build_filter
from sgrec.beam.trie import SemanticIdTrie
from sgrec.catalog import Catalog, UnknownItemError, load_catalog

logger = logging.getLogger(__name__)

NAME = "sgrec-sid"
CATALOG_ENV = "SGREC_CATALOG"
SPEC_KEYS = {"type", "exclude_items", "include_items", "filter"}
CACHE_SIZE = 256  # compiled request grammars kept (SGLang's own cache is unbounded)
_shared: SidTrie | None = None  # this process's catalog trie, once SGLang built the backend


def shared_trie() -> SidTrie | None:
    """The catalog trie of this process's sgrec-sid backend (None: not built, or no catalog)."""
    return _shared


class SidTrie:
    """What every request of a server shares: the trie over the catalog's semantic IDs, the catalog
    row of each trie row, the stop tokens that end a path, and the attribute-filter cache."""

    def __init__(self, catalog: Catalog, vocab_size: int, stop_tokens: Iterable[int]):
        self.catalog = catalog
        self.trie, self.rows = SemanticIdTrie.from_catalog(catalog, vocab_size)
        self.stop_tokens = torch.tensor(sorted({int(t) for t in stop_tokens}), dtype=torch.int64)
        if not self.stop_tokens.numel():
            raise ValueError(f"{NAME}: the model has no EOS token to end a semantic-ID path")
        if self.stop_tokens.min() < 0 or self.stop_tokens.max() >= vocab_size:
            raise ValueError(f"{NAME}: stop tokens {self.stop_tokens.tolist()} outside the vocabulary")
        self.filter_cache = FilterCache()
        self.lock = threading.Lock()  # SGLang compiles grammars on a thread pool

    def compile(self, spec: str) -> BaseGrammarObject:
        """A request's grammar from its structural_tag, or InvalidGrammarObject naming what is wrong."""
        try:
            obj = json.loads(spec)
        except ValueError as e:
            return InvalidGrammarObject(f"{NAME}: structural_tag is not JSON: {e}")
        if not isinstance(obj, dict) or obj.get("type") != NAME:
            return InvalidGrammarObject(f'{NAME}: structural_tag must be a JSON object with "type": "{NAME}"')
        unknown = set(obj) - SPEC_KEYS
        if unknown:
            return InvalidGrammarObject(f"{NAME}: unknown key(s) {sorted(unknown)}; known: {sorted(SPEC_KEYS)}")
        exclude, include, attr = obj.get("exclude_items"), obj.get("include_items"), obj.get("filter")
        for name, ids in (("exclude_items", exclude), ("include_items", include)):
            if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
                return InvalidGrammarObject(f"{NAME}: {name} must be a list of item ids (strings)")
        if attr is not None and not isinstance(attr, dict):
            return InvalidGrammarObject(f"{NAME}: filter must be a JSON object")
        try:
            with self.lock:
                filt = build_filter(self.trie, self.rows, self.catalog, self.filter_cache, exclude, include, attr)
        except UnknownItemError as e:
            return InvalidGrammarObject(f"{NAME}: include_items not in the catalog: {e}")
        except ValueError as e:
            return InvalidGrammarObject(f"{NAME}: bad filter: {e}")
        if filt is not None and filt.leaves == 0:
            return InvalidGrammarObject(f"{NAME}: the filters leave no item of the catalog")
        return SidGrammar(self, filt)


class SidGrammar(BaseGrammarObject):
    """One request's position on the trie: the nodes of its path so far (node 0 = the root)."""

    def __init__(self, shared: SidTrie, filt: TrieFilter | None):
        super().__init__()
        self.shared, self.filt = shared, filt
        self.path: list[int] = [0]  # node id at each depth reached
        self.stopped = False

    @property
    def depth(self) -> int:
        return len(self.path) - 1

    def allowed_tokens(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens, their child node ids; None at a complete path, where only stop tokens are allowed)."""
        trie, d = self.shared.trie, self.depth
        if self.stopped:
            return torch.empty(0, dtype=torch.int64), None
        if d == trie.depth:
            return self.shared.stop_tokens, None
        ptr = trie.child_ptr[d]
        nodes = torch.arange(int(ptr[self.path[-1]]), int(ptr[self.path[-1] + 1]))
        toks = trie.child_tok[d][nodes]
        if self.filt is not None:
            keep = self.filt.keep(d + 1, nodes)
            nodes, toks = nodes[keep], toks[keep]
        return toks, nodes

    def accept_token(self, token: int) -> None:
        toks, nodes = self.allowed_tokens()
        hit = (toks == int(token)).nonzero()
        if not hit.numel():
            raise ValueError(f"{NAME}: token {token} is not allowed after semantic-ID path {self.tokens()}")
        self.current_token = int(token)
        if nodes is None:
            self.stopped = True
        else:
            self.path.append(int(nodes[int(hit[0])]))

    def tokens(self) -> list[int]:
        trie = self.shared.trie
        return [int(trie.child_tok[d][n]) for d, n in enumerate(self.path[1:])]

    def rollback(self, k: int) -> None:
        if k > self.depth + self.stopped:
            raise ValueError(f"{NAME}: cannot roll back {k} tokens of {self.depth + self.stopped}")
        if k and self.stopped:
            self.stopped, k = False, k - 1
        del self.path[len(self.path) - k:]

    def is_terminated(self) -> bool:
        return self.stopped

    def item_ids(self) -> list[str]:
        """Every allowed catalog item of the path reached, in retrieve's order (Catalog.path_order;
        empty before the path is complete)."""
        if self.depth < self.shared.trie.depth:
            return []
        rows = self.shared.trie.rows_of_leaf(self.path[-1])
        ok = self.filt.row_allowed if self.filt is not None and self.filt.row_allowed is not None else None
        catalog = self.shared.catalog
        return [catalog.ids[r] for r in catalog.path_order([int(self.shared.rows[r]) for r in rows
                                                           if ok is None or ok(r)])]

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        return torch.zeros(batch_size, vocab_size, dtype=torch.bool)  # all allowed: rows left unfilled

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        row = vocab_mask[idx]
        row.fill_(True)
        row[self.allowed_tokens()[0]] = False

    @staticmethod
    def reset_vocab_mask(vocab_mask: torch.Tensor) -> None:
        vocab_mask.fill_(False)

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device) -> torch.Tensor:
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        logits.masked_fill_(vocab_mask, float("-inf"))

    def copy(self) -> SidGrammar:
        """A fresh grammar at the root with the same trie and filter (SGLang hands each request a
        copy of the compiled, cached grammar)."""
        return SidGrammar(self.shared, self.filt)

    def try_jump_forward(self, tokenizer):
        return None


class SidGrammarBackend(BaseGrammarBackend):
    def __init__(self, shared: SidTrie | None):
        super().__init__()
        self.shared = shared

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        if self.shared is None:
            return InvalidGrammarObject(f"{NAME}: the server has no item catalog; start it with "
                                        f"{CATALOG_ENV}=/path/to/catalog.jsonl")
        return self.shared.compile(key_string)

    def _only_sid(self, kind: str) -> BaseGrammarObject:
        return InvalidGrammarObject(f"{NAME} serves semantic-ID paths only (structural_tag "
                                    f'{{"type": "{NAME}", ...}}), not {kind}')

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        return self._only_sid("json_schema")

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        return self._only_sid("regex")

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        return self._only_sid("ebnf")

    def set_cache(self, key, value) -> None:
        super().set_cache(key, value)
        while len(self.cache) > CACHE_SIZE:
            self.cache.pop(next(iter(self.cache)))


def create_backend(server_args, tokenizer, vocab_size: int, eos_token_ids=None) -> SidGrammarBackend:
    """SGLang's grammar-backend factory signature (register_grammar_backend)."""
    global _shared
    path = os.environ.get(CATALOG_ENV)
    if not path:
        logger.warning("%s: %s is not set: requests that opt in will be refused", NAME, CATALOG_ENV)
        _shared = None
        return SidGrammarBackend(None)
    stop = set(eos_token_ids or ())
    if not stop and getattr(tokenizer, "eos_token_id", None) is not None:
        stop.add(tokenizer.eos_token_id)
    try:
        catalog = load_catalog(path, tokenizer, vocab_size)
        shared = SidTrie(catalog, vocab_size, stop)
    except (OSError, ValueError) as e:
        raise ValueError(f"--grammar-backend {NAME}: cannot use the catalog {CATALOG_ENV}={path}: {e}") from e
    logger.info("%s: %d items, semantic IDs of %d tokens, from %s", NAME, len(catalog), shared.trie.depth, path)
    _shared = shared
    return SidGrammarBackend(shared)
