"""xBeam generative retrieval (xGR): semantic-ID trie and masks, beam selection, staged attention,
and the executor that runs a retrieve request on a ModelRunner."""

from sgrec.beam.executor import KVCacheFullError, RetrieveExecutor, RetrieveResult, naive_retrieve
from sgrec.beam.trie import SemanticIdTrie

__all__ = ["KVCacheFullError", "RetrieveExecutor", "RetrieveResult", "SemanticIdTrie", "naive_retrieve"]
