"""Leave-last-out splits of MovieLens-100K and the demo's prompts.

Every user's interactions, in time order s_1..s_n (n >= 20 in ML-100K): s_n is the held-out test
item (history s_1..s_{n-1}); s_2..s_{n-1} are training targets (history: the items before each).
Only the training part feeds the model, the semantic IDs and the popularity counts.

Prompts (token ids; the catalog's `id_token` of each movie is one vocabulary token):
    user       [BOS, id(h_1), ..., id(h_k)]             the last HISTORY_LEN items
    rank       sgrec.layout over (user, candidates' token_ids, RANK_INSTRUCTION)
    retrieve   user + RETRIEVE_INSTRUCTION, continued by the semantic-ID path and EOS
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sgrec.demo import HISTORY_LEN, RANK_INSTRUCTION, RETRIEVE_INSTRUCTION, item_token
from sgrec.data.movielens import MovieLens100K, load_ml100k

CANDIDATE_SCHEMES = ("popular", "uniform")


@dataclass
class Split:
    data: MovieLens100K
    sequences: dict[int, list[int]]  # user -> all item ids, time order
    movie_ids: list[int]  # every movie id, ascending
    train_pop: dict[int, int]  # movie -> interactions in the training part

    @property
    def users(self) -> list[int]:
        return sorted(self.sequences)

    def test_case(self, user: int, history_len: int = HISTORY_LEN) -> tuple[list[int], int]:
        """(history: the last `history_len` items before the test item, test item)."""
        seq = self.sequences[user]
        return seq[:-1][-history_len:], seq[-1]

    def train_targets(self, user: int) -> range:
        """Indices t into the user's sequence whose item is a training target (history seq[:t])."""
        return range(1, len(self.sequences[user]) - 1)

    def popularity_order(self) -> list[int]:
        """Movies by training popularity, most popular first (ties: smaller id first)."""
        return sorted(self.movie_ids, key=lambda m: (-self.train_pop.get(m, 0), m))


def load_split() -> Split:
    data = load_ml100k()
    seqs = {u: [x.item for x in hist] for u, hist in data.histories().items()}
    pop: dict[int, int] = {}
    for seq in seqs.values():
        for m in seq[:-1]:
            pop[m] = pop.get(m, 0) + 1
    return Split(data, seqs, sorted(data.movies), pop)


def sample_candidates(split: Split, user: int, target: int, n: int, scheme: str, rng: np.random.Generator,
                      exclude: set[int] | None = None) -> list[int]:
    """`n` candidates: the target and n-1 negatives the user never interacted with, shuffled.
    scheme "popular": negatives drawn with probability proportional to training popularity + 1
    (a stand-in for a retrieval stage's candidates, where popularity alone does not separate the
    target); "uniform": uniformly."""
    if scheme not in CANDIDATE_SCHEMES:
        raise ValueError(f"scheme must be one of {CANDIDATE_SCHEMES}")
    seen = set(split.sequences[user]) if exclude is None else exclude
    pool = np.array([m for m in split.movie_ids if m not in seen and m != target])
    if scheme == "popular":
        w = np.array([split.train_pop.get(int(m), 0) + 1.0 for m in pool])
        neg = rng.choice(pool, size=n - 1, replace=False, p=w / w.sum())
    else:
        neg = rng.choice(pool, size=n - 1, replace=False)
    cands = [int(target)] + [int(m) for m in neg]
    order = rng.permutation(n)
    return [cands[i] for i in order]


def eval_candidates(split: Split, user: int, scheme: str, n: int = 100, seed: int = 0) -> list[int]:
    """The fixed evaluation candidates of a user's test item (deterministic in seed and user)."""
    _, target = split.test_case(user)
    rng = np.random.default_rng([seed, user, CANDIDATE_SCHEMES.index(scheme)])
    return sample_candidates(split, user, target, n, scheme, rng)


# ---- token-level prompts ------------------------------------------------------------------
@dataclass(frozen=True)
class Vocab:
    """Token ids of the demo vocabulary that prompts need."""
    bos: int
    eos: int
    item: dict[int, int]  # movie id -> id_token
    rank_instr: tuple[int, ...]
    retrieve_instr: tuple[int, ...]
    semantic_id: dict[int, tuple[int, ...]]  # movie id -> semantic-ID token path

    @classmethod
    def from_tokenizer(cls, tok, catalog) -> "Vocab":
        """`tok`: an HF tokenizer of the demo; `catalog`: sgrec.catalog.Catalog of the demo."""
        item, sid = {}, {}
        for it in catalog.items:
            m = int(it.meta["movie_id"])
            item[m] = it.id_token
            if it.semantic_id is not None:
                sid[m] = tuple(it.semantic_id)
        return cls(tok.bos_token_id, tok.eos_token_id, item,
                   tuple(tok.encode(RANK_INSTRUCTION, add_special_tokens=False)),
                   tuple(tok.encode(RETRIEVE_INSTRUCTION, add_special_tokens=False)), sid)

    def user_ids(self, history: list[int]) -> list[int]:
        return [self.bos] + [self.item[m] for m in history[-HISTORY_LEN:]]

    def retrieve_ids(self, history: list[int]) -> list[int]:
        return self.user_ids(history) + list(self.retrieve_instr)


def user_text(history: list[int]) -> str:
    """The user's text for the API (`{"user": {"text": ...}}`): the tokenizer (which adds BOS)
    turns it into exactly `Vocab.user_ids(history)`."""
    return "".join(item_token(m) for m in history[-HISTORY_LEN:])


def retrieve_text(history: list[int]) -> str:
    """The user's text for `/v1/retrieve` (whose prompt is the user's tokens alone): the history
    followed by RETRIEVE_INSTRUCTION, tokenized into exactly `Vocab.retrieve_ids(history)`."""
    return user_text(history) + RETRIEVE_INSTRUCTION
