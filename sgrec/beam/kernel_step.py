"""A beam level's selection for every request of a round at once, through the Triton trie-step
kernel (sgrec.model.kernels.trie_step, used under --attention-backend triton): the same kept
(parent, token, score, child node) per request as the torch path (sgrec.beam.search.select_level:
children_logp, select_step, child_nodes), ties included; this module turns the trie level and the
requests' TrieFilters into the kernel's plain tensors: a SemanticIdTrie's level as CSR, a
LayeredTrie's upper levels the same way and its leaf level as runs (sgrec.beam.device_leaves)."""

from __future__ import annotations

import torch

from sgrec.beam.filters import TrieFilter
from sgrec.beam.trie import SemanticIdTrie
from sgrec.model.kernels.trie_step import TrieLevel, trie_step

MAX_CHILDREN = 4096  # a wider level (one program holds and sorts a beam's children) takes the torch path


def fits(trie: SemanticIdTrie, depth: int) -> bool:
    """Can the kernel run level `depth` of this trie."""
    return trie.max_children[depth] <= MAX_CHILDREN


def level(trie: SemanticIdTrie, depth: int) -> TrieLevel:
    """Level `depth` of the trie (the children of its nodes at `depth`) as the kernel reads it, on
    the trie's device."""
    if trie.layered and depth == trie.depth - 1:
        if trie.leaves is None:
            raise ValueError("the Triton trie step reads a LayeredTrie's leaves on the device: "
                             "LayeredTrie.from_catalog(..., device)")
        return trie.leaves.level(trie.max_children[depth], trie.level_col[depth])
    return TrieLevel(trie.child_ptr[depth], trie.child_tok[depth], trie.max_children[depth], trie.level_col[depth])


def level_filter(filt: TrieFilter | None, depth: int):
    """A request's filter on the nodes at trie `depth`, as (dense, allowed, blocked) or None."""
    if filt is None or all(x[depth] is None for x in (filt.dense, filt.allowed, filt.blocked)):
        return None
    return filt.dense[depth], filt.allowed[depth], filt.blocked[depth]


def select_levels(trie: SemanticIdTrie, depth: int, logits: torch.Tensor, nodes: list[torch.Tensor],
                  scores: list[torch.Tensor], filters: list[TrieFilter | None], top_k: list[int], m: list[int],
                  restricted: bool, global_min_k: int) -> list[tuple[torch.Tensor, ...]]:
    """Level `depth` of several requests: request r's beams are nodes[r] (their scores scores[r]),
    their logits the next len(nodes[r]) rows of `logits` (restricted: only the columns
    trie.logit_columns(depth)). Returns per request (parents, tokens, scores, child nodes)."""
    row_ptr = [0]
    for x in nodes:
        row_ptr.append(row_ptr[-1] + x.numel())
    return trie_step(logits, level(trie, depth), torch.cat(nodes), torch.cat(scores), row_ptr, top_k, m, restricted,
                     [level_filter(f, depth + 1) for f in filters], global_min_k)
