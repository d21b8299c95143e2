"""The embedded demo recommender: a small Llama trained on MovieLens-100K.

One model serves both tasks of sgrec's recommendation API:
- rank (BAT): user history + candidate items + RANK_INSTRUCTION; the candidates are scored by
  their `id_token` logits at the last position;
- retrieve (xGR / TIGER): user history + RETRIEVE_INSTRUCTION; beam search over semantic-ID paths.

The artifacts (HF-format weights, tokenizer, item catalog) live in `ARTIFACT_DIR` and ship with the
wheel; they are produced by `python -m sgrec.demo.train` and measured by `python -m sgrec.demo.evaluate`.
"""

from __future__ import annotations

import os

ARTIFACT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ml100k")
# the TIGER-style demo beside it: a small T5 emitting semantic IDs (sgrec.demo.tiger)
TIGER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiger_ml100k")
CATALOG_NAME = "catalog.jsonl"
# `--model-path` names of the packaged demos
NAMES = {"demo": ARTIFACT_DIR, "demo-tiger": TIGER_DIR}

# The engine's default rank instruction (sgrec.managers.rec.DEFAULT_INSTRUCTION): a rank request
# without an instruction gets exactly the prompts the model was trained on.
RANK_INSTRUCTION = "\nNext item:"
RETRIEVE_INSTRUCTION = "\nSemantic ID:"
HISTORY_LEN = 30  # most recent interactions in a user prompt


def model_path() -> str:
    """The packaged model directory (config, safetensors weights, tokenizer, catalog)."""
    return ARTIFACT_DIR


def catalog_path(model_dir: str = ARTIFACT_DIR) -> str:
    return os.path.join(model_dir, CATALOG_NAME)


def resolve(model_path: str) -> str:
    """A packaged demo's directory for its name (NAMES), else model_path as given."""
    return NAMES.get(model_path, model_path)


def packaged_catalog(model_path: str) -> str | None:
    """The item catalog of a packaged demo's directory, None for any other model."""
    if os.path.realpath(model_path) in {os.path.realpath(d) for d in NAMES.values()}:
        path = catalog_path(model_path)
        return path if os.path.exists(path) else None
    return None


def available() -> bool:
    return all(os.path.exists(os.path.join(ARTIFACT_DIR, f)) for f in ("config.json", "model.safetensors", CATALOG_NAME))


def item_token(movie_id: int) -> str:
    """The vocabulary token of a movie (its catalog `id_token`)."""
    return f"<i{movie_id}>"


def item_id(movie_id: int) -> str:
    """The catalog id of a movie."""
    return f"m{movie_id}"
