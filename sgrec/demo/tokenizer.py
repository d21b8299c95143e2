"""The demo tokenizer: byte-level BPE word pieces trained on the catalog's text (titles, years,
genres, instructions), plus added tokens: one per movie (`<i{id}>`, the catalog's id_token) and
the semantic-ID tokens of each level (`<a_3>`, `<b_7>`, `<c_0>`, `<d_1>`). Llama family:
`<unk>`, `<s>` (BOS), `</s>` (EOS) are ids 0, 1, 2.
"""

from __future__ import annotations

SPECIALS = ["<unk>", "<s>", "</s>"]
LEVEL_NAMES = "abcdefgh"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def semantic_token(level: int, code: int) -> str:
    return f"<{LEVEL_NAMES[level]}_{code}>"


def build_tokenizer(corpus: list[str], item_tokens: list[str], level_sizes: list[int], bpe_vocab: int = 1024):
    """A transformers PreTrainedTokenizerFast (deterministic for the same inputs)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.ByteLevel()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    added = list(item_tokens) + [semantic_token(lv, c) for lv, n in enumerate(level_sizes) for c in range(n)]
    tok.add_tokens([AddedToken(t, single_word=False, normalized=False, special=False) for t in added])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", chat_template=CHAT_TEMPLATE)
