"""Write a tiny random-weight HF-format model directory (llama / qwen2 / qwen3 / qwen3_5 / t5) with a
small trained byte-level BPE tokenizer, for fast tests; or, with --shape, random weights of a real
model's exact shape (for timings at the sizes the field reports; no hub needed).

    python -m sgrec.tools.make_tiny_model OUT --arch qwen3 --seed 1
    python -m sgrec.tools.make_tiny_model OUT --shape qwen3-1.7b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import random

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_5", "t5")

DEFAULTS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # larger than HF's 0.02: peaked logits, non-degenerate greedy
    tie_word_embeddings=False,
)

# qwen3_5 (hybrid): three Gated DeltaNet layers, then a gated attention layer (transformers' default
# full_attention_interval), small linear-attention heads
HYBRID_DEFAULTS = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)

# t5 (encoder-decoder): T5Config's own field names; the decoder starts from id 0
T5_DEFAULTS = dict(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="relu",
                   layer_norm_epsilon=1e-6, initializer_factor=2.0, tie_word_embeddings=True, decoder_start_token_id=0)
_T5_NAMES = {"hidden_size": "d_model", "intermediate_size": "d_ff", "num_hidden_layers": "num_layers",
             "num_attention_heads": "num_heads", "head_dim": "d_kv"}  # make_tiny_model's keywords -> T5Config's

# Real models' shapes (from their config.json): (arch, config). Random weights at HF's init scale.
SHAPES = {
    "smollm2-135m": ("llama", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True)),
    "qwen3-0.6b": ("qwen3", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
    "qwen3.5-0.8b": ("qwen3_5", dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144, rope_theta=10000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen3-1.7b": ("qwen3", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
    # TIGER (Rajput et al. 2023): 4 + 4 layers, d_model 128, 6 heads of 64, MLP 1024, ReLU; 4 codebooks
    # of 256 and 2,000 hashed user ids (TIGER's own token ids, not a text tokenizer's)
    "tiger": ("t5", dict(vocab_size=3072, d_model=128, d_kv=64, num_heads=6, d_ff=1024, num_layers=4,
                         num_decoder_layers=4, feed_forward_proj="relu")),
    "t5-small": ("t5", dict(vocab_size=32128, d_model=512, d_kv=64, num_heads=8, d_ff=2048, num_layers=6,
                            num_decoder_layers=6, feed_forward_proj="relu")),
}

LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # last three ids
QWEN_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = {
    "subj": "the user|a shopper|my friend|the model|this system|a customer|the team|our store|every reader|the engine".split("|"),
    "verb": "likes|buys|recommends|reads|watches|returns|compares|rates|searches for|shares".split("|"),
    "adj": "red|cheap|new|popular|small|fast|quiet|classic|modern|warm|bright|simple".split("|"),
    "noun": "shoes|books|phones|movies|songs|jackets|laptops|games|cameras|chairs|items|products".split("|"),
    "adv": "today|often|again|quickly|rarely|online|at night|every week|last year|in the morning".split("|"),
    "q": "What is|Where is|Who likes|Why does|How many|Which one is".split("|"),
}


def _corpus(seed: int = 0, n: int = 600) -> list[str]:
    rng = random.Random(seed)
    w = lambda k: rng.choice(_WORDS[k])  # noqa: E731
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            s = f"{w('subj').capitalize()} {w('verb')} {w('adj')} {w('noun')} {w('adv')}."
        elif kind == 1:
            s = f"{w('q')} the {w('adj')} {w('noun')}? It costs {rng.randint(1, 999)} dollars, item {rng.randint(0, 99999)}."
        elif kind == 2:
            s = f"User {rng.randint(0, 9999)} viewed {w('noun')}, {w('noun')} and {w('noun')}; next: {w('adj')} {w('noun')}!"
        else:
            s = f"\"{w('subj').capitalize()}\" said: {w('adj')} {w('noun')} are ({rng.randint(1, 5)}/5) - {w('adv')}\n"
        out.append(s)
    return out


_TOKENIZER_CACHE: dict = {}


def _train_tokenizer(vocab_size: int, family: str):
    """Byte-level BPE trained on a deterministic built-in corpus (cached in-process)."""
    key = (vocab_size, family)
    if key not in _TOKENIZER_CACHE:
        from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

        specials = LLAMA_SPECIALS if family == "llama" else QWEN_SPECIALS
        tok = Tokenizer(models.BPE())
        tok.decoder = decoders.ByteLevel()
        if family == "llama":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:  # exactly the pipeline transformers' Qwen2Tokenizer rebuilds from vocab + merges
            tok.normalizer = normalizers.NFC()
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        # llama: specials first (ids 0..2); qwen: appended after the learned vocab.
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size if family == "llama" else vocab_size - len(specials),
            special_tokens=specials if family == "llama" else [],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(), trainer=trainer)
        if family == "llama":
            tok.post_processor = processors.TemplateProcessing(
                single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
            )
        else:
            tok.add_special_tokens(specials)
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        _TOKENIZER_CACHE[key] = tok.to_str()
    return _TOKENIZER_CACHE[key]


def _build_tokenizer(vocab_size: int, family: str, extra_tokens: list[str] = ()):
    """A trained byte-level BPE tokenizer of vocab_size tokens in all, the last ones `extra_tokens`
    (added tokens, as a recommender adds its semantic-ID tokens to a base vocabulary)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_train_tokenizer(vocab_size - len(extra_tokens), family))
    if family == "llama":
        kw = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=LLAMA_TEMPLATE)
    else:
        kw = dict(
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            additional_special_tokens=["<|im_start|>", "<|im_end|>"],
            chat_template=CHATML_TEMPLATE,
        )
    out = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kw)
    if extra_tokens:
        out.add_tokens(list(extra_tokens))
    return out


def sid_token_texts(template: str, codes: int) -> list[str]:
    """The vocabulary tokens of `codes` codes per level of a semantic-ID template (`<s_a_{}>,<s_b_{}>`)."""
    return [t.format(k) for t in template.split(",") for k in range(codes)]


def shape_config(shape: str) -> tuple[str, dict]:
    """(arch, HF config keys) of a named real-model shape (SHAPES), at HF's init scale."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    arch, cfg = SHAPES[shape]
    if arch == "t5":
        return arch, {**T5_DEFAULTS, "initializer_factor": 1.0, **cfg}
    return arch, {**DEFAULTS, "initializer_range": 0.02, **cfg}


def make_tiny_model(out_dir: str, arch: str = "llama", seed: int = 0, shape: str | None = None,
                    dtype: str = "float32", sid_tokens: str | None = None, sid_codes: int = 0, **overrides) -> str:
    """Write config.json, model.safetensors (`dtype`: float32 or bfloat16), generation_config.json
    and tokenizer files for a random-weight model into out_dir; returns out_dir. `shape` (a key of
    SHAPES) takes a real model's architecture and sizes (overrides still apply on top). `sid_tokens`
    (a template such as `<s_a_{}>,<s_b_{}>,<s_c_{}>`) with `sid_codes` codes per level: the
    tokenizer's last tokens are the semantic-ID tokens (decoder-only families)."""
    import torch
    import transformers
    from transformers import GenerationConfig

    out_dir = str(out_dir)
    base = DEFAULTS
    if shape is not None:
        arch, base = shape_config(shape)
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    if arch == "qwen3_5" and shape is None:
        base = {**base, **HYBRID_DEFAULTS}
    if arch == "t5":
        return _make_t5(out_dir, base if shape is not None else T5_DEFAULTS, seed, dtype, overrides)
    cfg = {**base, **{k: v for k, v in overrides.items() if v is not None}}
    if arch == "qwen3":
        cfg.setdefault("head_dim", 32)
    if arch == "qwen3_5":
        rope_theta = cfg.pop("rope_theta")
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.25}
    family = "llama" if arch == "llama" else "qwen"
    tokenizer = _build_tokenizer(cfg["vocab_size"], family, sid_token_texts(sid_tokens, sid_codes) if sid_tokens else ())
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert all(i is None or i < cfg["vocab_size"] for i in ids.values()), ids
    assert len(tokenizer) <= cfg["vocab_size"], (len(tokenizer), cfg["vocab_size"])

    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_5": "Qwen3_5"}[arch]
    config = getattr(transformers, f"{name}TextConfig" if arch == "qwen3_5" else f"{name}Config")(**cfg, **ids)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so loading bugs show up
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith(".bias"):
                p.normal_(0.0, cfg["initializer_range"])
        if not config.tie_word_embeddings:
            model.lm_head.weight.mul_(2.0)  # logit std ~3 rather than ~1.6

    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
        config.dtype = torch.bfloat16
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _make_t5(out_dir: str, base: dict, seed: int, dtype: str, overrides: dict) -> str:
    """make_tiny_model of a T5ForConditionalGeneration (the overrides' generic names mapped to
    T5Config's; num_key_value_heads, rope and position limits do not apply)."""
    import torch
    from transformers import GenerationConfig, T5Config, T5ForConditionalGeneration

    skip = {"num_key_value_heads", "rope_theta", "rope_scaling", "max_position_embeddings"}
    given = {_T5_NAMES.get(k, k): v for k, v in overrides.items() if v is not None and k not in skip}
    if "num_layers" in given:
        given.setdefault("num_decoder_layers", given["num_layers"])
    cfg = {**base, **given}
    tokenizer = _build_tokenizer(cfg["vocab_size"], "llama")
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    config = T5Config(**cfg, **ids)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # non-trivial norms, so loading bugs show up
        for pname, p in model.named_parameters():
            if "layer_norm" in pname:
                p.uniform_(0.5, 1.5)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if cfg["tie_word_embeddings"] is False:  # transformers 5 always ties T5: an output layer of its own, as T5 v1.1 has
        _untie_t5(out_dir, seed)
    GenerationConfig(decoder_start_token_id=cfg["decoder_start_token_id"], **ids).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _untie_t5(out_dir: str, seed: int) -> None:
    """A saved T5 with an lm_head.weight of its own and `tie_word_embeddings: false` (what
    transformers reads as untied, with the decoder's output unscaled)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(out_dir, "model.safetensors")
    weights = load_file(path)
    shared = weights["shared.weight"]
    g = torch.Generator().manual_seed(seed + 1)
    weights["lm_head.weight"] = (torch.randn(shared.shape, generator=g) * shared.float().std() * 0.25).to(shared.dtype)
    save_file(weights, path, metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config.update(tie_word_embeddings=False, scale_decoder_outputs=False)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a real model's architecture and sizes (random weights)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of the written weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--hidden-size", type=int)
    ap.add_argument("--intermediate-size", type=int)
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--num-heads", type=int)
    ap.add_argument("--num-kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--tie-word-embeddings", action="store_true", default=None)
    ap.add_argument("--max-position-embeddings", type=int)
    ap.add_argument("--rope-theta", type=float)
    ap.add_argument("--rope-scaling", type=json.loads, help='e.g. \'{"rope_type": "linear", "factor": 2.0}\'')
    ap.add_argument("--sid-tokens", metavar="TEMPLATE", help="add semantic-ID tokens to the tokenizer, e.g. "
                    "'<s_a_{}>,<s_b_{}>,<s_c_{}>' (with --sid-codes codes per level)")
    ap.add_argument("--sid-codes", type=int, default=0, help="codes per level of --sid-tokens")
    a = ap.parse_args(argv)
    path = make_tiny_model(
        a.out,
        arch=a.arch,
        seed=a.seed,
        shape=a.shape,
        dtype=a.dtype,
        sid_tokens=a.sid_tokens,
        sid_codes=a.sid_codes,
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        tie_word_embeddings=a.tie_word_embeddings,
        max_position_embeddings=a.max_position_embeddings,
        rope_theta=a.rope_theta,
        rope_scaling=a.rope_scaling,
    )
    print(path)


if __name__ == "__main__":
    main()
