"""sgrec: a serving engine for LLM-based generative recommendation, SGLang-compatible."""

__version__ = "0.2.0"


def __getattr__(name):  # lazy, so `import sgrec` stays light for tools and the launcher
    if name == "Engine":
        from sgrec.engine import Engine

        return Engine
    raise AttributeError(name)
