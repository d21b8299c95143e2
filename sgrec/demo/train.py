"""`python -m sgrec.demo.train`: builds the demo recommender from MovieLens-100K.

Steps (all deterministic in --seed, CPU only):
1. leave-last-out split (sgrec.demo.data), semantic IDs (sgrec.demo.semantic_ids) from the
   training part, the tokenizer (sgrec.demo.tokenizer) and the item catalog;
2. a small Llama (HF LlamaForCausalLM weights, tied embeddings) trained on two tasks at once:
   - rank: user + candidates + RANK_INSTRUCTION in the layouts of sgrec.layout (tokens,
     positions and masks built by that module), loss = cross-entropy of the next item over the
     vocabulary and over the candidates' id_tokens at the last position; all prompts use the
     user-as-prefix layout unless --ip-fraction gives a share to item-as-prefix;
   - retrieve: user + RETRIEVE_INSTRUCTION -> the next item's semantic-ID path, then EOS (TIGER),
     a loss term of its own (--sid-weight); the semantic-ID tokens of the k-means levels after the
     first name trie nodes (sgrec.demo.semantic_ids.node_codes) and start from their movies' mean
     features;
   in both, every user-history token also predicts the next item of the history (SASRec-style).
3. the artifacts (config.json, model.safetensors, tokenizer, catalog.jsonl, train_meta.json) are
   written to --out (default: the packaged sgrec/demo/ml100k).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from sgrec.demo import ARTIFACT_DIR, CATALOG_NAME, HISTORY_LEN, RANK_INSTRUCTION, RETRIEVE_INSTRUCTION, item_id, item_token
from sgrec.demo.data import CANDIDATE_SCHEMES, Split, Vocab, load_split, sample_candidates
from sgrec.demo.semantic_ids import hierarchical_codes, item_features, node_codes
from sgrec.demo.tokenizer import build_tokenizer, semantic_token
from sgrec.model.rope import rope_inv_freq
from sgrec import layout as L

MODEL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=True, initializer_range=0.02)


# ---- artifacts before training ----------------------------------------------------------
def text_corpus(split: Split) -> list[str]:
    out = []
    for m in split.movie_ids:
        mv = split.data.movies[m]
        out.append(f"{mv.title} ({mv.year}) {' '.join(mv.genres)}")
    out += [RANK_INSTRUCTION, RETRIEVE_INSTRUCTION, "User history:", "Candidates:", "Recommended:"] * 50
    return out


def build_catalog(split: Split, tok, codes: np.ndarray) -> list[dict]:
    rows = []
    for i, m in enumerate(split.movie_ids):
        mv = split.data.movies[m]
        idt = tok.convert_tokens_to_ids(item_token(m))
        sid = [tok.convert_tokens_to_ids(semantic_token(lv, int(c))) for lv, c in enumerate(codes[i])]
        rows.append({"id": item_id(m), "token_ids": [idt], "id_token": idt, "semantic_id": sid,
                     "attrs": {"genres": list(mv.genres), **({"year": mv.year} if mv.year is not None else {})},
                     "movie_id": m, "title": mv.title, "popularity": split.train_pop.get(m, 0)})
    return rows


def write_catalog(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


# ---- the training forward (same math as HF Llama / sgrec.model.llama, arbitrary masks) ----
def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    f = positions.float()[..., None] * rope_inv_freq(head_dim, theta, None)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def _rot(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def forward_hidden(model, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ids, pos int64 [B, T]; mask bool [B, T, T] (row may attend to column) -> hidden [B, T, H]."""
    cfg, m = model.config, model.model
    B, T = ids.shape
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // nh
    cos, sin = rope(pos, hd, cfg.rope_theta if hasattr(cfg, "rope_theta") else MODEL["rope_theta"])
    cos, sin = cos[:, None], sin[:, None]
    x = m.embed_tokens(ids)
    am = mask[:, None]
    for layer in m.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h).view(B, T, nh, hd).transpose(1, 2)
        k = a.k_proj(h).view(B, T, nkv, hd).transpose(1, 2)
        v = a.v_proj(h).view(B, T, nkv, hd).transpose(1, 2)
        q, k = q * cos + _rot(q) * sin, k * cos + _rot(k) * sin
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=am)
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, T, nh * hd))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return m.norm(x)


# ---- examples -----------------------------------------------------------------------------
class Example:
    __slots__ = ("ids", "pos", "mask", "lm", "cand", "sid")

    def __init__(self, ids, pos, mask, lm, cand=None, sid=()):
        self.ids, self.pos, self.mask = ids, pos, mask
        self.lm = lm  # [(row, target token)], full-vocabulary cross-entropy
        self.cand = cand  # (row, candidate tokens, index of the target) or None
        self.sid = sid  # [(row, target token)]: the semantic-ID path and EOS (own loss term)


def _user_lm(user_start: int, history: list[int], target: int, vocab: Vocab) -> list[tuple[int, int]]:
    """Row j of the user segment (BOS, h_1..h_k) predicts h_{j+1}; the last predicts the target."""
    nxt = history + [target]
    return [(user_start + j, vocab.item[nxt[j]]) for j in range(len(history) + 1)]


def rank_example(vocab: Vocab, history: list[int], target: int, cands: list[int], kind: str) -> Example:
    user = vocab.user_ids(history)
    hist = history[-HISTORY_LEN:]
    lay = L.build(kind, (), user, [[vocab.item[c]] for c in cands], list(vocab.rank_instr))
    useg = lay.segment("user")
    lm = _user_lm(useg.start, hist, target, vocab)
    last = len(lay) - 1
    lm.append((last, vocab.item[target]))
    cand = (last, [vocab.item[c] for c in cands], cands.index(target))
    return Example(lay.token_ids, lay.positions, lay.mask(), lm, cand)


def retrieve_example(vocab: Vocab, history: list[int], target: int) -> Example:
    hist = history[-HISTORY_LEN:]
    prompt = vocab.retrieve_ids(hist)
    sid = list(vocab.semantic_id[target])
    ids = prompt + sid
    T = len(ids)
    lm = _user_lm(0, hist, target, vocab)
    outs = sid + [vocab.eos]
    sid_rows = [(len(prompt) - 1 + j, outs[j]) for j in range(len(outs))]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return Example(ids, list(range(T)), mask, lm, sid=sid_rows)


def collate(exs: list[Example]):
    T = max(len(e.ids) for e in exs)
    B = len(exs)
    ids = torch.zeros(B, T, dtype=torch.int64)
    pos = torch.zeros(B, T, dtype=torch.int64)
    mask = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)  # padding rows see themselves only
    lm_b, lm_r, lm_t = [], [], []
    sid_b, sid_r, sid_t = [], [], []
    cand_b, cand_r, cand_tok, cand_y = [], [], [], []
    for b, e in enumerate(exs):
        n = len(e.ids)
        ids[b, :n] = torch.tensor(e.ids)
        pos[b, :n] = torch.tensor(e.pos)
        mask[b, :n, :n] = e.mask
        for r, t in e.lm:
            lm_b.append(b), lm_r.append(r), lm_t.append(t)
        for r, t in e.sid:
            sid_b.append(b), sid_r.append(r), sid_t.append(t)
        if e.cand is not None:
            r, toks, y = e.cand
            cand_b.append(b), cand_r.append(r), cand_tok.append(toks), cand_y.append(y)
    lm = (torch.tensor(lm_b), torch.tensor(lm_r), torch.tensor(lm_t))
    sid = (torch.tensor(sid_b), torch.tensor(sid_r), torch.tensor(sid_t)) if sid_b else None
    cand = (torch.tensor(cand_b), torch.tensor(cand_r), torch.tensor(cand_tok), torch.tensor(cand_y)) if cand_b else None
    return ids, pos, mask, lm, cand, sid


def batch_loss(model, batch, lm_weight: float, sid_weight: float = 1.0) -> tuple[torch.Tensor, dict]:
    ids, pos, mask, (lb, lr, lt), cand, sid = batch
    hid = forward_hidden(model, ids, pos, mask)
    W = model.model.embed_tokens.weight  # tied output embedding
    logits = hid[lb, lr] @ W.T
    ce = F.cross_entropy(logits, lt, reduction="none")
    stats = {}
    loss = ce.mean() * lm_weight
    stats["lm"] = float(ce.detach().mean())
    if sid is not None:
        sb, sr, st = sid
        sce = F.cross_entropy(hid[sb, sr] @ W.T, st)
        loss = loss + sid_weight * sce
        stats["sid"] = float(sce.detach())
    if cand is not None:
        cb, cr, ctok, cy = cand
        h = hid[cb, cr]  # [n, H]
        full = F.cross_entropy(h @ W.T, ctok[torch.arange(len(cy)), cy])
        cl = torch.einsum("nh,nch->nc", h, W[ctok])
        cc = F.cross_entropy(cl, cy)
        loss = loss + full + cc
        stats["rank_full"], stats["rank_cand"] = float(full.detach()), float(cc.detach())
    return loss, stats


class ExampleStream:
    """Deterministic stream of training examples (targets drawn uniformly over all training
    targets, so active users weigh more, like every interaction does)."""

    def __init__(self, split: Split, vocab: Vocab, seed: int, num_candidates: int, ip_fraction: float):
        self.split, self.vocab = split, vocab
        self.rng = np.random.default_rng(seed)
        self.pairs = [(u, t) for u in split.users for t in split.train_targets(u)]
        self.num_candidates = num_candidates
        self.ip_fraction = ip_fraction

    def _draw(self):
        u, t = self.pairs[int(self.rng.integers(len(self.pairs)))]
        seq = self.split.sequences[u]
        return u, seq[:t], seq[t], seq

    def rank(self) -> Example:
        u, hist, target, seq = self._draw()
        scheme = CANDIDATE_SCHEMES[int(self.rng.integers(len(CANDIDATE_SCHEMES)))]
        t = len(hist)
        cands = sample_candidates(self.split, u, target, self.num_candidates, scheme, self.rng, exclude=set(seq[: t + 1]))
        kind = L.ITEM_PREFIX if self.rng.random() < self.ip_fraction else L.USER_PREFIX
        return rank_example(self.vocab, hist, target, cands, kind)

    def retrieve(self) -> Example:
        _, hist, target, _ = self._draw()
        return retrieve_example(self.vocab, hist, target)


# ---- main -------------------------------------------------------------------------------
def build_artifacts(out: str, seed: int, sid_tokens: str = "node"):
    """Split, semantic IDs, tokenizer and catalog (written to `out`); returns what training needs."""
    from sgrec.catalog import load_catalog

    split = load_split()
    train_seqs = {u: s[:-1] for u, s in split.sequences.items()}
    feats = item_features(split.movie_ids, split.data.movies, train_seqs)
    codes = hierarchical_codes(feats, seed=seed)
    if sid_tokens == "node":
        codes = node_codes(codes)
    level_sizes = [int(codes[:, lv].max()) + 1 for lv in range(codes.shape[1])]
    tok = build_tokenizer(text_corpus(split), [item_token(m) for m in split.movie_ids], level_sizes)
    tok.save_pretrained(out)
    write_catalog(build_catalog(split, tok, codes), os.path.join(out, CATALOG_NAME))
    catalog = load_catalog(os.path.join(out, CATALOG_NAME), vocab_size=len(tok))
    return split, tok, Vocab.from_tokenizer(tok, catalog), level_sizes, feats


def init_sid_embeddings(model, split: Split, vocab: Vocab, item_vectors: np.ndarray) -> None:
    """Each semantic-ID token of a k-means level (not the disambiguation level) starts at the mean
    of `item_vectors` (rows in split.movie_ids order, first columns of the embedding) over the
    movies whose path holds it."""
    paths = np.array([vocab.semantic_id[m] for m in split.movie_ids])
    with torch.no_grad():
        E = model.model.embed_tokens.weight
        for level in range(paths.shape[1] - 1):
            for t in np.unique(paths[:, level]):
                mean = item_vectors[paths[:, level] == t].mean(0)
                E[int(t), : item_vectors.shape[1]] = torch.tensor(mean, dtype=E.dtype)


def init_item_embeddings(model, split: Split, vocab: Vocab, feats: np.ndarray, scale: float,
                         sid_init: bool = False) -> None:
    """Starts each movie's (tied) embedding from its features (co-occurrence SVD, genres, year)
    and a log-popularity coordinate, the other coordinates staying random: the model does not
    have to discover the catalog's structure from scratch in a short CPU run. With `sid_init`,
    each semantic-ID token of a k-means level (not the disambiguation level) starts from the mean
    of the features of the movies whose path holds it."""
    pop = np.log1p(np.array([split.train_pop.get(m, 0) for m in split.movie_ids], dtype=np.float64))
    pop = (pop - pop.mean()) / (pop.std() + 1e-9)
    f = np.concatenate([feats, pop[:, None]], axis=1) * scale
    with torch.no_grad():
        E = model.model.embed_tokens.weight
        rows = torch.tensor([vocab.item[m] for m in split.movie_ids])
        E[rows, : f.shape[1]] = torch.tensor(f, dtype=E.dtype)
    if sid_init:
        init_sid_embeddings(model, split, vocab, f)


def make_model(vocab_size: int, tok, seed: int):
    import transformers

    padded = int(math.ceil(vocab_size / 64) * 64)
    cfg = transformers.LlamaConfig(vocab_size=padded, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   **MODEL)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).float()


def check_forward(model) -> float:
    """Max |logit diff| of forward_hidden vs HF's own forward on a causal prompt (sanity)."""
    ids = torch.arange(3, 40)[None]
    T = ids.shape[1]
    with torch.no_grad():
        ref = model(ids).logits
        hid = forward_hidden(model, ids, torch.arange(T)[None], torch.ones(1, T, T, dtype=torch.bool).tril())
        mine = hid @ model.model.embed_tokens.weight.T
    return float((ref - mine).abs().max())


def train(args) -> dict:
    torch.manual_seed(args.seed)
    # Same seed and same --threads: bit-identical weights (CPU float32). Another thread count
    # changes the order of float reductions in the matmuls, so the weights differ in the last bits.
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    out = os.path.abspath(args.out)
    tmp = tempfile.mkdtemp(prefix=".demo-train-", dir=os.path.dirname(out))
    t0 = time.time()
    try:
        split, tok, vocab, level_sizes, feats = build_artifacts(tmp, args.seed, args.sid_tokens)
        model = make_model(len(tok), tok, args.seed)
        if args.item_init_scale > 0:
            init_item_embeddings(model, split, vocab, feats, args.item_init_scale, args.sid_init)
        diff = check_forward(model)
        assert diff < 1e-4, f"training forward disagrees with HF Llama by {diff}"
        print(f"vocab {len(tok)} (model {model.config.vocab_size}), "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
              f"semantic-ID levels {level_sizes}, forward check {diff:.1e}", flush=True)
        stream = ExampleStream(split, vocab, args.seed, args.num_candidates, args.ip_fraction)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
        warm = max(1, args.steps // 20)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
        model.train()
        hist = []
        t_train = time.time()
        for step in range(args.steps):
            rb = collate([stream.rank() for _ in range(args.rank_batch)])
            qb = collate([stream.retrieve() for _ in range(args.retrieve_batch)])
            l1, s1 = batch_loss(model, rb, args.lm_weight)
            l2, s2 = batch_loss(model, qb, args.lm_weight, args.sid_weight)
            loss = l1 + l2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            hist.append([s1["lm"], s1["rank_full"], s1["rank_cand"], s2["lm"], s2["sid"]])
            if (step + 1) % args.log_every == 0 or step == args.steps - 1:
                m = np.mean(hist[-args.log_every:], axis=0)
                print(f"step {step + 1}/{args.steps}  lm {m[0]:.3f}  rank(full) {m[1]:.3f}  rank(cand) {m[2]:.3f}  "
                      f"retrieve lm {m[3]:.3f}  sid {m[4]:.3f}  lr {sched.get_last_lr()[0]:.2e}  {time.time() - t_train:.0f}s",
                      flush=True)
        model.eval()
        model.save_pretrained(tmp, safe_serialization=True)
        from transformers import GenerationConfig

        GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(tmp)
        meta = {"seed": args.seed, "steps": args.steps, "rank_batch": args.rank_batch,
                "retrieve_batch": args.retrieve_batch, "num_candidates": args.num_candidates,
                "ip_fraction": args.ip_fraction, "item_init_scale": args.item_init_scale, "lr": args.lr,
                "lm_weight": args.lm_weight, "sid_weight": args.sid_weight, "sid_tokens": args.sid_tokens,
                "sid_init": args.sid_init, "threads": args.threads,
                "history_len": HISTORY_LEN, "model": MODEL, "vocab": len(tok),
                "parameters": sum(p.numel() for p in model.parameters()),
                "semantic_id_levels": level_sizes, "train_seconds": round(time.time() - t_train, 1),
                "total_seconds": round(time.time() - t0, 1),
                "final_losses": dict(zip(["lm", "rank_full", "rank_cand", "retrieve_lm", "sid"],
                                         np.mean(hist[-args.log_every:], axis=0).round(4).tolist())),
                "torch": torch.__version__}
        with open(os.path.join(tmp, "train_meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
        tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out} in {meta['total_seconds']:.0f}s", flush=True)
    return meta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=ARTIFACT_DIR)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--rank-batch", type=int, default=8)
    ap.add_argument("--retrieve-batch", type=int, default=24)
    ap.add_argument("--num-candidates", type=int, default=100)
    ap.add_argument("--ip-fraction", type=float, default=0.0,
                    help="share of rank prompts in the item-as-prefix layout (default 0: all user-as-prefix)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--lm-weight", type=float, default=0.5, help="weight of the next-item loss of history tokens")
    ap.add_argument("--sid-weight", type=float, default=1.0,
                    help="weight of the retrieval loss (semantic-ID path and EOS, mean over its tokens)")
    ap.add_argument("--sid-tokens", choices=["node", "sibling"], default="node",
                    help="semantic-ID tokens of the k-means levels after the first: one per trie node (node) or "
                         "the index among siblings, shared by all parents (sibling)")
    ap.add_argument("--sid-init", type=int, default=1, choices=[0, 1],
                    help="start semantic-ID token embeddings from their movies' mean features")
    ap.add_argument("--item-init-scale", type=float, default=0.4,
                    help="start item embeddings from their features times this (0: random init)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the weights depend on it in the last bits)")
    ap.add_argument("--log-every", type=int, default=250)
    train(ap.parse_args(argv))


if __name__ == "__main__":
    main()
