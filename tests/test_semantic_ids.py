"""Semantic IDs from trained codebooks and written as codes: residual k-means codebooks (faiss),
the assignment of new items (equal to a brute-force float64 reference, whatever the batch, ties to
the lower code), `python -m sgrec.catalog sid-train / sid-assign`, catalogs whose semantic IDs are
codes (JSON Lines, Parquet, convert, compact), and a server that assigns on upsert
(--semantic-id-codebooks) and reads codes (--semantic-id-tokens)."""

import json
import subprocess
import sys

import httpx
import numpy as np
import pytest

from sgrec.catalog import CatalogError, load_catalog
from sgrec.catalog import codebooks as cb
from sgrec.catalog.sid import SidTokens, token_table
from sgrec.tokenizer import Tokenizer

TEMPLATE = "<s_a_{}>,<s_b_{}>,<s_c_{}>"
CODES = 16  # per level, in the tiny model's vocabulary
DIM = 8


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", sid_tokens=TEMPLATE, sid_codes=CODES)


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer(model)


def reference_assign(books: np.ndarray, emb: np.ndarray) -> np.ndarray:
    """Level by level, the first minimum of float64 squared distances from the float32 residual."""
    res = emb.astype(np.float32).copy()
    out = np.empty((len(emb), books.shape[0]), np.int64)
    for lv in range(books.shape[0]):
        d = ((res[:, None, :].astype(np.float64) - books[lv][None].astype(np.float64)) ** 2).sum(-1)
        out[:, lv] = d.argmin(1)
        res -= books[lv][out[:, lv]]
    return out


def embeddings(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(12, DIM)) * 3
    return (centers[rng.integers(0, 12, n)] + rng.normal(size=(n, DIM))).astype(np.float32)


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sgrec.catalog", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


# ---- codebooks ---------------------------------------------------------------------------------
def test_assignment_equals_the_float64_reference_in_any_batch():
    emb = embeddings(3000)
    books = cb.train(emb, 3, CODES, niter=10)
    assert books.shape == (3, CODES, DIM) and books.dtype == np.float32
    codes = cb.assign(books, emb)
    assert np.array_equal(codes, reference_assign(books, emb))
    alone = np.concatenate([cb.assign(books, emb[i : i + 1]) for i in range(0, 3000, 97)])
    assert np.array_equal(alone, codes[::97])
    blocks = np.concatenate([cb.assign(books, emb[a : a + 7]) for a in range(0, 700, 7)])
    assert np.array_equal(blocks, codes[:700])
    assert np.array_equal(cb.train(emb, 3, CODES, niter=10), books)  # seeded: the same codebooks again


def test_ties_go_to_the_lower_code_at_every_level():
    books = np.zeros((2, 4, 2), np.float32)
    books[0] = [[1, 0], [0, 1], [1, 0], [-1, 0]]  # codes 0 and 2 are the same codeword
    books[1] = [[0, 0], [0.5, 0], [-0.5, 0], [0.5, 0]]  # residual (0.25, 0): codes 0, 1 and 3 tie
    x = np.array([[1, 0], [1.25, 0], [0.5, 0.5]], np.float32)  # the last: codes 0 and 1 of level 0 tie
    want = [[0, 0], [0, 0], [0, 2]]
    assert cb.assign(books, x).tolist() == want == reference_assign(books, x).tolist()
    assert cb.assign(books, x[::-1]).tolist() == want[::-1]


def test_dedup_codes_number_the_items_of_a_path_in_order():
    paths = np.array([[1, 2], [1, 2], [0, 1], [1, 2], [0, 1], [3, 3]])
    assert cb.dedup_codes(paths).tolist() == [0, 1, 0, 2, 1, 0]


def test_bad_codebook_files_are_errors_naming_the_array(tmp_path):
    good = cb.Codebooks(np.zeros((3, 4, 2), np.float32), np.arange(12).reshape(3, 4))
    good.save(tmp_path / "c.npz")
    assert cb.Codebooks.load(str(tmp_path / "c.npz"), 12).levels == 3
    with pytest.raises(CatalogError, match=r"c.npz': token_ids\[2\]\[3\] is 11, not a token id in \[0, 11\)"):
        cb.Codebooks.load(str(tmp_path / "c.npz"), 11)
    np.savez(tmp_path / "bad.npz", codebooks=np.zeros((3, 4), np.float32), token_ids=np.zeros((3, 4), np.int64))
    with pytest.raises(CatalogError, match="codebooks must be float"):
        cb.Codebooks.load(str(tmp_path / "bad.npz"))
    np.savez(tmp_path / "none.npz", codebooks=np.zeros((3, 4, 2), np.float32))
    with pytest.raises(CatalogError, match="no 'token_ids' array"):
        cb.Codebooks.load(str(tmp_path / "none.npz"))


# ---- the command line --------------------------------------------------------------------------
def write_jsonl(path, items):
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    return path


def test_sid_train_and_assign_on_the_command_line(tmp_path, model, tok):
    emb = embeddings(400, seed=1)
    np.save(tmp_path / "e.npy", emb)
    out = run_cli("sid-train", "--embeddings", tmp_path / "e.npy", "--levels", 3, "--codebook-size", CODES,
                  "--out", tmp_path / "c.npz", "--token-template", TEMPLATE, "--tokenizer", model, "--niter", 10)
    assert out.returncode == 0, out.stderr
    books = cb.Codebooks.load(str(tmp_path / "c.npz"), tok.vocab_size)
    assert np.array_equal(books.token_ids, token_table(TEMPLATE, tok, CODES))
    assert np.array_equal(books.token_ids[1, :3], tok.hf.convert_tokens_to_ids(["<s_b_0>", "<s_b_1>", "<s_b_2>"]))
    items = [{"id": f"n{k}", "token_ids": [5 + k % 7], "attrs": {"k": k}} for k in range(400)]
    write_jsonl(tmp_path / "items.jsonl", items)
    out = run_cli("sid-assign", tmp_path / "items.jsonl", tmp_path / "assigned.parquet", "--codebooks",
                  tmp_path / "c.npz", "--embeddings", tmp_path / "e.npy")
    assert out.returncode == 0, out.stderr
    cat = load_catalog(str(tmp_path / "assigned.parquet"))
    want = books.tokens(reference_assign(books.codebooks, emb))
    assert np.array_equal(cat.semantic_ids, want) and list(cat.ids) == [it["id"] for it in items]
    assert cat.attrs.row(7) == {"k": 7}
    # a disambiguating fourth level: every item on a path of its own
    out = run_cli("sid-assign", tmp_path / "items.jsonl", tmp_path / "dedup.jsonl", "--codebooks", tmp_path / "c.npz",
                  "--embeddings", tmp_path / "e.npy", "--dedup-level", "<s_a_{}>", "--tokenizer", model)
    repeats = np.unique(want, axis=0, return_counts=True)[1]
    assert 1 < repeats.max() <= CODES  # paths shared, and no more items on one than the level has codes
    assert out.returncode == 0, out.stderr
    sem = load_catalog(str(tmp_path / "dedup.jsonl")).semantic_ids
    assert np.array_equal(sem[:, :3], want) and len(np.unique(sem, axis=0)) == len(sem)
    assert np.array_equal(sem[:, 3], token_table("<s_a_{}>", tok, CODES)[0][cb.dedup_codes(want)])
    np.save(tmp_path / "same.npy", np.repeat(emb[:1], 400, axis=0))  # 400 items on one path: 16 codes fall short
    out = run_cli("sid-assign", tmp_path / "items.jsonl", tmp_path / "dedup.jsonl", "--codebooks", tmp_path / "c.npz",
                  "--embeddings", tmp_path / "same.npy", "--dedup-level", "<s_a_{}>", "--tokenizer", model)
    assert out.returncode == 2 and f"item 'n{CODES}'" in out.stderr and f"<s_a_{CODES}>" in out.stderr, out.stderr
    # the code form: the same catalog written as codes, read back as tokens
    out = run_cli("sid-assign", tmp_path / "items.jsonl", tmp_path / "codes.jsonl", "--codebooks", tmp_path / "c.npz",
                  "--embeddings", tmp_path / "e.npy", "--semantic-id-tokens", TEMPLATE, "--tokenizer", model)
    assert out.returncode == 0, out.stderr
    first = json.loads((tmp_path / "codes.jsonl").read_text().splitlines()[0])
    assert first["semantic_id"] == reference_assign(books.codebooks, emb[:1])[0].tolist()
    sid = SidTokens(TEMPLATE, tok)
    assert np.array_equal(load_catalog(str(tmp_path / "codes.jsonl"), tok, sid_tokens=sid).semantic_ids, want)


@pytest.mark.parametrize("args, message", [
    (["--levels", 2, "--codebook-size", CODES, "--token-template", TEMPLATE], "--token-template has 3 levels, --levels 2"),
    (["--levels", 3, "--codebook-size", 32, "--token-template", TEMPLATE],
     "semantic_id code 16 at level 0 has no token '<s_a_16>' in the vocabulary (--token-template)"),
    (["--levels", 3, "--codebook-size", 500, "--token-offset", 0, "--vocab-size", 2000],
     "--codebook-size must be in [1, 400]"),
    (["--levels", 3, "--codebook-size", 100, "--token-offset", 300], "--token-offset: token_ids[2][12] is 512, not a token id in [0, 512)"),
    (["--levels", 3, "--codebook-size", 4], "give one of --token-template (with --tokenizer) and --token-offset"),
])
def test_sid_train_refuses_what_does_not_fit(tmp_path, model, args, message):
    np.save(tmp_path / "e.npy", embeddings(400))
    out = run_cli("sid-train", "--embeddings", tmp_path / "e.npy", "--out", tmp_path / "c.npz", "--tokenizer", model,
                  "--niter", 2, *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_sid_assign_needs_one_embedding_per_item(tmp_path):
    cb.Codebooks(np.zeros((3, 4, 2), np.float32), np.arange(12).reshape(3, 4)).save(tmp_path / "c.npz")
    np.save(tmp_path / "e.npy", np.zeros((3, 2), np.float32))
    write_jsonl(tmp_path / "items.jsonl", [{"id": "a", "token_ids": [5]}, {"id": "b", "token_ids": [6]}])
    out = run_cli("sid-assign", tmp_path / "items.jsonl", tmp_path / "o.jsonl", "--codebooks", tmp_path / "c.npz",
                  "--embeddings", tmp_path / "e.npy")
    assert out.returncode == 2 and "one row per item" in out.stderr


# ---- catalogs of codes ---------------------------------------------------------------------------
def code_items(n: int = 60) -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"id": f"c{k}", "token_ids": [5 + k % 9, 6], "semantic_id": rng.integers(0, CODES, 3).tolist(),
             "attrs": {"year": 1990 + k % 5}} for k in range(n)]


def test_code_form_catalogs_equal_token_form_ones_in_every_format(tmp_path, model, tok):
    items = code_items()
    table = token_table(TEMPLATE, tok, CODES)
    as_tokens = [{**it, "semantic_id": [int(table[lv, c]) for lv, c in enumerate(it["semantic_id"])]} for it in items]
    ref = load_catalog(str(write_jsonl(tmp_path / "tokens.jsonl", as_tokens)), tok, tok.vocab_size)
    sid = SidTokens(TEMPLATE, tok)
    got = load_catalog(str(write_jsonl(tmp_path / "codes.jsonl", items)), tok, tok.vocab_size, sid_tokens=sid)
    assert np.array_equal(got.semantic_ids, ref.semantic_ids)
    for out in ("codes.parquet", "codes2.jsonl", "tokens.npz"):
        r = run_cli("convert", tmp_path / "codes.jsonl", tmp_path / out, "--semantic-id-tokens", TEMPLATE,
                    "--tokenizer", model)
        assert r.returncode == 0, r.stderr
        again = load_catalog(str(tmp_path / out), tok, tok.vocab_size, sid_tokens=sid)  # the bundle: token ids
        assert np.array_equal(again.semantic_ids, ref.semantic_ids) and list(again.ids) == list(ref.ids), out
    assert json.loads((tmp_path / "codes2.jsonl").read_text().splitlines()[0])["semantic_id"] == items[0]["semantic_id"]


@pytest.mark.parametrize("form", ["jsonl", "parquet"])
def test_a_code_the_vocabulary_lacks_is_an_error_naming_it(tmp_path, tok, form):
    items = code_items(5)
    items[3]["semantic_id"] = [1, CODES, 2]
    path = write_jsonl(tmp_path / "codes.jsonl", items)
    if form == "parquet":
        from sgrec.catalog import parquet

        parquet.write(load_catalog(str(path)), str(tmp_path / "c.parquet"))
        path = tmp_path / "c.parquet"
    with pytest.raises(CatalogError) as e:
        load_catalog(str(path), tok, sid_tokens=SidTokens(TEMPLATE, tok))
    where = f"{path}:4: item 'c3'" if form == "jsonl" else f"{path}: row 3 (item 'c3')"
    assert str(e.value).startswith(where), e.value
    assert f"semantic_id code {CODES} at level 1 has no token '<s_b_{CODES}>' in the vocabulary" in str(e.value)


# ---- the server ----------------------------------------------------------------------------------
def post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=120)


def test_a_server_assigns_on_upsert_and_reads_codes(start_server, model, tok, tmp_path):
    """--semantic-id-codebooks assigns what sid-assign would; --semantic-id-tokens reads codes in the
    catalog and in updates; the journal keeps tokens, and compaction writes codes back."""
    emb = embeddings(300, seed=5)
    books = cb.Codebooks(cb.train(emb, 3, CODES, niter=10), token_table(TEMPLATE, tok, CODES))
    books.save(tmp_path / "c.npz")
    codes = books.assign(emb[:60])
    write_jsonl(tmp_path / "catalog.jsonl", [{"id": f"c{k}", "token_ids": [5 + k % 9, 6], "semantic_id": codes[k].tolist()}
                                             for k in range(60)])
    srv = start_server(model, "--max-total-tokens", "4096", "--max-beam-width", "16", "--item-catalog",
                       str(tmp_path / "catalog.jsonl"), "--semantic-id-tokens", TEMPLATE,
                       "--semantic-id-codebooks", str(tmp_path / "c.npz"))
    doc = httpx.get(srv.url + "/openapi.json", timeout=60).json()
    item = doc["components"]["schemas"]["CatalogItemsRequest"]["properties"]["items"]["items"]["properties"]
    assert item["embedding"]["anyOf"][0]["maxItems"] == DIM and "maximum" not in item["semantic_id"]["anyOf"][0]["items"]
    version = httpx.get(srv.url + "/v1/catalog", timeout=60).json()["version"]
    # bad input: nothing applied
    for body, message in [
        ({"items": [{"id": "x0", "token_ids": [5], "embedding": emb[100].tolist()},
                    {"id": "x1", "token_ids": [5], "embedding": [1.0] * (DIM - 1)}]},
         f"items[1] ('x1'): items[1].embedding must be a list of {DIM} finite numbers (the codebooks' dimension), "
         f"got {DIM - 1} values"),
        ({"items": [{"id": "x2", "token_ids": [5], "embedding": [1.0] * (DIM - 1) + ["a"]}]},
         "items[0] ('x2'): items[0].embedding must be a list of"),
        ({"items": [{"id": "x3", "token_ids": [5], "semantic_id": [CODES, 0, 0]}]},
         f"items[0] ('x3'): items[0].semantic_id code {CODES} at level 0 has no token '<s_a_{CODES}>' in the vocabulary"),
    ]:
        r = post(srv, "/v1/catalog/items", body)
        assert r.status_code == 400 and message in r.json()["message"], r.text
    assert httpx.get(srv.url + "/v1/catalog", timeout=60).json()["version"] == version
    # an item by embedding, one by codes, one with both (its codes kept)
    r = post(srv, "/v1/catalog/items", {"items": [
        {"id": "new-e", "token_ids": [7, 8], "embedding": emb[100].tolist(), "title": "by embedding"},
        {"id": "new-c", "token_ids": [9], "semantic_id": [1, 2, 3]},
        {"id": "new-b", "token_ids": [9, 9], "semantic_id": [3, 2, 1], "embedding": emb[101].tolist()}]})
    assert r.status_code == 200, r.text
    want = books.tokens(reference_assign(books.codebooks, emb[100:101]))[0].tolist()
    assert r.json()["assigned"] == {"new-e": want} and r.json()["inserted"] == 3
    table = token_table(TEMPLATE, tok, CODES)
    for item_id, path in [("new-e", want), ("new-c", [int(table[lv, c]) for lv, c in enumerate([1, 2, 3])]),
                          ("new-b", [int(table[lv, c]) for lv, c in enumerate([3, 2, 1])])]:
        r = post(srv, "/v1/retrieve", {"user": {"token_ids": [5, 6]}, "beam_width": 4, "num_items": 1,
                                        "include_items": [item_id]})
        assert r.status_code == 200 and r.json()["items"][0]["semantic_id"] == path, (item_id, r.text)
    srv.stop()
    # the journal holds tokens; compaction writes the file back in codes
    out = run_cli("compact", tmp_path / "catalog.jsonl", "--semantic-id-tokens", TEMPLATE, "--tokenizer", model)
    assert out.returncode == 0, out.stderr
    lines = {o["id"]: o for o in map(json.loads, (tmp_path / "catalog.jsonl").read_text().splitlines())}
    assert lines["new-e"]["semantic_id"] == reference_assign(books.codebooks, emb[100:101])[0].tolist()
    assert lines["new-e"]["title"] == "by embedding" and "embedding" not in lines["new-e"]
    assert lines["new-c"]["semantic_id"] == [1, 2, 3] and lines["c7"]["semantic_id"] == codes[7].tolist()


@pytest.mark.parametrize("case", ["levels", "tokens", "template"])
def test_codebooks_or_templates_that_do_not_fit_are_startup_errors(model, tok, tmp_path, case):
    write_jsonl(tmp_path / "catalog.jsonl", code_items(5))
    flags = ["--semantic-id-tokens", TEMPLATE]
    if case == "levels":
        cb.Codebooks(np.zeros((2, 4, DIM), np.float32), token_table(TEMPLATE, tok, 4)[:2]).save(tmp_path / "c.npz")
        flags += ["--semantic-id-codebooks", str(tmp_path / "c.npz")]
        message = f"--semantic-id-codebooks '{tmp_path / 'c.npz'}' has 2 levels, the catalog's semantic IDs 3 tokens"
    elif case == "tokens":
        cb.Codebooks(np.zeros((3, 4, DIM), np.float32), np.full((3, 4), 600)).save(tmp_path / "c.npz")
        flags += ["--semantic-id-codebooks", str(tmp_path / "c.npz")]
        message = "token_ids[0][0] is 600, not a token id in [0, 512) of the model's vocabulary"
    else:
        flags = ["--semantic-id-tokens", "<s_a_{}>,<s_b_{}>,<s_d_{}>"]
        message = f"{tmp_path / 'catalog.jsonl'}:1: item 'c0': semantic_id code"
    proc = subprocess.run([sys.executable, "-m", "sgrec.launch_server", "--model-path", model, "--device", "cpu",
                           "--dtype", "float32", "--max-total-tokens", "1024", "--item-catalog",
                           str(tmp_path / "catalog.jsonl"), "--port", "0", *flags],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"start-up failed: " in out and message in out, out[-3000:]
    assert "Traceback" not in out
