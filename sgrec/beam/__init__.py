"""xBeam generative retrieval (xGR): semantic-ID trie and masks, beam selection, staged attention,
and the executor that runs a retrieve request on a ModelRunner.

The executor (model code) is imported on first use, so that `sgrec.beam.trie` / `sgrec.beam.filters`
stay light for the SGLang plugin, which uses the trie without sgrec's runtime."""

from sgrec.beam.trie import SemanticIdTrie

__all__ = ["KVCacheFullError", "RetrieveExecutor", "RetrieveResult", "SemanticIdTrie", "naive_retrieve"]


def __getattr__(name):
    if name in ("KVCacheFullError", "RetrieveExecutor", "RetrieveResult"):
        from sgrec.beam import executor

        return getattr(executor, name)
    if name == "naive_retrieve":
        from sgrec.beam.reference import naive_retrieve

        return naive_retrieve
    raise AttributeError(name)
