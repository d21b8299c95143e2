"""The TIGER-style demo: a small T5 trained on MovieLens-100K to emit the next movie's semantic ID.

    python -m sgrec.demo.tiger train [--steps N] [--out DIR]     # writes sgrec/demo/tiger_ml100k
    python -m sgrec.demo.tiger evaluate [--users N]              # Recall/NDCG@5/10, both demos

TIGER (Rajput et al., 2023) reads a user's history as semantic-ID tokens with a T5 encoder and decodes
the next item's semantic ID by beam search. Here, on the decoder-only demo's leave-last-out split
(sgrec.demo.data) and its semantic IDs (sgrec.demo.semantic_ids: three k-means levels of 16 over the
training part's item features, then a disambiguation index; each level's codes are tokens of their
own, `<a_3>`, `<b_7>`, ...):
- input: the last HISTORY items' semantic IDs (4 tokens each), oldest first;
- output: the next item's 4 tokens, after the decoder's start token (pad, id 0);
- every training target of every user is an example (history: the items before it).
The artifacts (an HF T5ForConditionalGeneration directory, a word-level tokenizer over the code
tokens, catalog.jsonl) are written to --out; `python -m sgrec.launch_server --model-path DIR
--item-catalog DIR/catalog.jsonl` serves them (`--model-path demo-tiger`: the packaged ones, with
their catalog).

`evaluate` retrieves for every user through sgrec.Engine (xBeam over the catalog's trie, 10 items)
and reports Recall@5/10 and NDCG@5/10 of this demo, of the decoder-only demo (its retrieval prompt)
and of the 10 most popular movies, on the same held-out items.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from sgrec.demo import CATALOG_NAME, TIGER_DIR, item_id
from sgrec.demo.data import Split, load_split
from sgrec.demo.semantic_ids import hierarchical_codes, item_features
from sgrec.demo.tokenizer import semantic_token

HISTORY = 20  # TIGER's longest history, in items
SPECIALS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2: T5's pad (the decoder's start), EOS, unknown
MODEL = dict(d_model=128, d_kv=32, num_heads=4, d_ff=512, num_layers=3, num_decoder_layers=3,
             feed_forward_proj="relu", dropout_rate=0.1, tie_word_embeddings=True, decoder_start_token_id=0,
             pad_token_id=0, eos_token_id=1, relative_attention_num_buckets=32, relative_attention_max_distance=128)


def code_tokens(level_sizes: list[int]) -> list[str]:
    return [semantic_token(lv, c) for lv, n in enumerate(level_sizes) for c in range(n)]


def build_tokenizer(level_sizes: list[int]):
    """A word-level tokenizer whose words are the code tokens (text `<a_3><b_7><c_1><d_0>` is one
    item's semantic ID), the specials first."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + code_tokens(level_sizes))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<[^<>]+>"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def semantic_ids(split: Split, seed: int) -> tuple[dict[int, list[int]], list[int]]:
    """Each movie's semantic-ID token ids and the level sizes (the decoder-only demo's k-means over
    the training part, each level numbered among its siblings)."""
    train_seqs = {u: s[:-1] for u, s in split.sequences.items()}
    codes = hierarchical_codes(item_features(split.movie_ids, split.data.movies, train_seqs), seed=seed)
    sizes = [int(codes[:, lv].max()) + 1 for lv in range(codes.shape[1])]
    offsets = np.cumsum([len(SPECIALS)] + sizes[:-1])
    return {m: [int(offsets[lv] + c) for lv, c in enumerate(row)] for m, row in zip(split.movie_ids, codes)}, sizes


def encoder_input(sids: dict[int, list[int]], history: list[int]) -> list[int]:
    return [t for m in history[-HISTORY:] for t in sids[m]]


def examples(split: Split, sids: dict[int, list[int]]) -> list[tuple[list[int], list[int]]]:
    """(input, target path) of every training target of every user."""
    out = []
    for u in split.users:
        seq = split.sequences[u]
        for t in split.train_targets(u):
            out.append((encoder_input(sids, seq[:t]), sids[seq[t]]))
    return out


def catalog_rows(split: Split, sids: dict[int, list[int]]) -> list[dict]:
    rows = []
    for m in split.movie_ids:
        mv = split.data.movies[m]
        rows.append({"id": item_id(m), "token_ids": sids[m], "semantic_id": sids[m], "movie_id": m, "title": mv.title,
                     "attrs": {"genres": list(mv.genres), **({"year": mv.year} if mv.year is not None else {})},
                     "popularity": split.train_pop.get(m, 0)})
    return rows


def train(args) -> dict:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    split = load_split()
    sids, sizes = semantic_ids(split, args.seed)
    data = examples(split, sids)
    tok = build_tokenizer(sizes)
    config = T5Config(vocab_size=len(tok), **MODEL)
    model = T5ForConditionalGeneration(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 200) * max(0.05, 1 - s / args.steps))
    t0, losses = time.perf_counter(), []
    for step in range(args.steps):
        batch = [data[i] for i in rng.integers(0, len(data), args.batch_size)]
        width = max(len(x) for x, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # right-padded with pad (0)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, (x, _) in enumerate(batch):
            ids[r, :len(x)], mask[r, :len(x)] = torch.tensor(x), 1
        labels = torch.tensor([y for _, y in batch])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {np.mean(losses[-100:]):.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    model.eval().save_pretrained(args.out, safe_serialization=True)
    from transformers import GenerationConfig

    GenerationConfig(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1).save_pretrained(args.out)
    tok.save_pretrained(args.out)
    with open(os.path.join(args.out, CATALOG_NAME), "w") as f:
        for row in catalog_rows(split, sids):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    meta = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
            "examples": len(data), "final_loss": float(np.mean(losses[-100:])), "seconds": time.perf_counter() - t0,
            "level_sizes": sizes, "history_items": HISTORY, "model": MODEL}
    with open(os.path.join(args.out, "train_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def evaluate(args) -> dict:
    from sgrec.demo import evaluate as ev

    split = load_split()
    users = split.users[: args.users] if args.users else split.users
    targets = {u: item_id(split.test_case(u)[1]) for u in users}
    pop = [item_id(m) for m in split.popularity_order()]
    res = {"popularity (10 most popular)": ev.metrics([ev.hit_rank(pop[:10], targets[u]) for u in users])}
    tiger = ev.open_engine(args.model_path, dtype=args.dtype)
    catalog = tiger.scheduler.catalog
    sids = {int(it.meta["movie_id"]): list(it.semantic_id) for it in catalog.items}
    for bw in args.beam_widths:
        ranks, invalid = [], 0
        for u in users:
            out = tiger.retrieve(user={"token_ids": encoder_input(sids, split.test_case(u, HISTORY)[0])},
                                 beam_width=bw, top_k=bw, num_items=10)
            items = [r["item"] for r in out["items"]]
            invalid += sum(i not in catalog for i in items)
            ranks.append(ev.hit_rank(items, targets[u]))
        res[f"TIGER demo (T5), beam width {bw}"] = {**ev.metrics(ranks), "invalid_items": invalid}
    del tiger
    dense = ev.open_engine(dtype=args.dtype)
    vocab = ev.engine_vocab(dense)
    for bw in args.beam_widths:
        ranks = [ev.hit_rank(ev.retrieve_user(dense, vocab, split, u, bw), targets[u]) for u in users]
        res[f"decoder-only demo (Llama), beam width {bw}"] = ev.metrics(ranks)
    cols = ["Recall@5", "Recall@10", "NDCG@5", "NDCG@10"]
    ev.print_table(f"Retrieval, {len(users)} users, 10 items, leave-last-out", res, cols)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the TIGER demo and write its artifacts")
    t.add_argument("--out", default=TIGER_DIR)
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--batch-size", type=int, default=128)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("evaluate", help="Recall/NDCG@5/10 of both demos and popularity")
    e.add_argument("--model-path", default=TIGER_DIR)
    e.add_argument("--users", type=int, default=0, help="the first N users (0: all 943)")
    e.add_argument("--beam-widths", type=lambda s: [int(x) for x in s.split(",")], default=[20, 50])
    e.add_argument("--dtype", default="float32")
    a = ap.parse_args(argv)
    if a.cmd == "train":
        print(json.dumps(train(a), indent=2))
    else:
        print(json.dumps(evaluate(a), indent=2))


if __name__ == "__main__":
    main()
