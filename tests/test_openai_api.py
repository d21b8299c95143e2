"""OpenAI-compatible routes (/v1/completions, /v1/chat/completions) against a real server, driven
with the real `openai` client (docs/reference/sglang-api.md §5). Greedy outputs are checked against the
native /generate route for the same prompt."""

import json
import time

import httpx
import openai
import pytest

from sgrec.tools.probe import HANG_S, Departing, kv_state, paused_in_place, running_per_rank, wait_for
from transformers import AutoTokenizer

PROMPTS = ["The user likes red shoes", "What is the cheap phone?"]
GREEDY = {"temperature": 0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(start_server, model_path):
    return start_server(model_path, "--max-total-tokens", "4096")


@pytest.fixture(scope="module")
def small_server(start_server, model_path):
    """A server whose queue fills at once (for 503s)."""
    return start_server(model_path, "--max-total-tokens", "4096", "--max-queued-requests", "1",
                        "--max-running-requests", "1")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def native(server, **body):
    r = server.client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def chat_ids(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


# ---- completions ---------------------------------------------------------------------------------
def test_completion_matches_native_generate(server, client, model_path):
    resp = client.completions.create(model="anything", prompt=PROMPTS[0], max_tokens=8, **GREEDY,
                                     extra_body=NO_EOS)
    ref = native(server, text=PROMPTS[0], sampling_params={"max_new_tokens": 8, **GREEDY, **NO_EOS})
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.model == model_path  # the served name, whatever the request said
    assert isinstance(resp.created, int)
    [choice] = resp.choices
    assert choice.index == 0 and choice.text == ref["text"]
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert choice.model_extra["matched_stop"] is None
    meta = ref["meta_info"]
    assert resp.usage.prompt_tokens == meta["prompt_tokens"]
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == meta["prompt_tokens"] + 8


def test_completion_default_max_tokens_is_16(client):
    resp = client.completions.create(model="m", prompt=PROMPTS[1], **GREEDY, extra_body=NO_EOS)
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_completion_prompt_list_and_token_ids(server, client, tok):
    resp = client.completions.create(model="m", prompt=PROMPTS, max_tokens=6, **GREEDY, extra_body=NO_EOS)
    refs = native(server, text=PROMPTS, sampling_params={"max_new_tokens": 6, **GREEDY, **NO_EOS})
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [r["text"] for r in refs]
    assert resp.usage.prompt_tokens == sum(r["meta_info"]["prompt_tokens"] for r in refs)
    assert resp.usage.completion_tokens == 12

    ids = [tok.encode(p) for p in PROMPTS]
    one = client.completions.create(model="m", prompt=ids[0], max_tokens=6, **GREEDY, extra_body=NO_EOS)
    assert one.choices[0].text == refs[0]["text"]
    assert one.usage.prompt_tokens == len(ids[0])
    many = client.completions.create(model="m", prompt=ids, max_tokens=6, **GREEDY, extra_body=NO_EOS)
    assert [c.text for c in many.choices] == [r["text"] for r in refs]


def test_n_choices_are_ordered_by_prompt_then_sample(server, client):
    n = 3
    resp = client.completions.create(model="m", prompt=PROMPTS, n=n, max_tokens=5, **GREEDY, extra_body=NO_EOS)
    refs = native(server, text=PROMPTS, sampling_params={"max_new_tokens": 5, **GREEDY, **NO_EOS})
    assert refs[0]["text"] != refs[1]["text"]  # otherwise the order check proves nothing
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS) * n))
    for c in resp.choices:  # index = prompt_index * n + sample
        assert c.text == refs[c.index // n]["text"]
    # usage counts each prompt once (OpenAI semantics), completions for every choice
    assert resp.usage.prompt_tokens == sum(r["meta_info"]["prompt_tokens"] for r in refs)
    assert resp.usage.completion_tokens == 5 * n * len(PROMPTS)


def test_stop_string_and_length(server, client):
    base = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, **GREEDY, extra_body=NO_EOS)
    text = base.choices[0].text
    assert base.choices[0].finish_reason == "length"
    # a two-character stop string whose first occurrence is inside the greedy output
    k = next(i for i in range(2, len(text) - 1)
             if text[i:i + 2].isascii() and text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    stop = text[k:k + 2]
    resp = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, stop=[stop, "zzzq"], **GREEDY,
                                     extra_body=NO_EOS)
    c = resp.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["matched_stop"] == stop
    assert c.text == text[:k]
    # streamed deltas add up to the same trimmed text (a partial stop string is never streamed)
    chunks = list(client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, stop=stop, stream=True,
                                            **GREEDY, extra_body=NO_EOS))
    assert "".join(ch.choices[0].text for ch in chunks) == text[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # no_stop_trim keeps the output up to the end of the token that completed the stop string
    kept = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, stop=stop, **GREEDY,
                                     extra_body={**NO_EOS, "no_stop_trim": True}).choices[0].text
    assert kept.startswith(text[:k + 2]) and text.startswith(kept)


def test_completion_streaming_matches_non_streaming(client):
    kw = dict(model="m", prompt=PROMPTS, n=2, max_tokens=10, **GREEDY, extra_body=NO_EOS)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, finish = {}, {}
    for ch in chunks[:-1]:
        assert ch.object == "text_completion" and ch.id == chunks[0].id and ch.usage is None
        [c] = ch.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason:
            assert c.index not in finish
            finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {i: "length" for i in range(4)}
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.model_dump() == full.usage.model_dump()


def test_completion_logprobs_match_native(server, client):
    resp = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=6, logprobs=3, **GREEDY,
                                     extra_body=NO_EOS)
    ref = native(server, text=PROMPTS[1], return_logprob=True, top_logprobs_num=3, return_text_in_logprobs=True,
                 sampling_params={"max_new_tokens": 6, **GREEDY, **NO_EOS})["meta_info"]
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e[0] for e in ref["output_token_logprobs"]], abs=1e-4)
    assert len(lp.tokens) == len(lp.text_offset) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for top, ref_row in zip(lp.top_logprobs, ref["output_top_logprobs"], strict=True):
        assert 1 <= len(top) <= 3  # keyed by token text: tokens with the same text collapse
        for value in top.values():
            assert any(value == pytest.approx(t[0], abs=1e-4) for t in ref_row)
        assert max(top.values()) == pytest.approx(ref_row[0][0], abs=1e-4)
    # greedy: the chosen token is the most likely one
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value == pytest.approx(max(top.values()), abs=1e-5)
    # streamed logprobs are the same entries, chunk by chunk
    chunks = list(client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=6, logprobs=3, stream=True,
                                            **GREEDY, extra_body=NO_EOS))
    streamed = [v for ch in chunks for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_echo(server, client):
    resp = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=4, echo=True, **GREEDY,
                                     extra_body=NO_EOS)
    plain = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=4, **GREEDY, extra_body=NO_EOS)
    assert resp.choices[0].text == PROMPTS[0] + plain.choices[0].text

    lp_resp = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=4, echo=True, logprobs=1,
                                        **GREEDY, extra_body=NO_EOS)
    ref = native(server, text=PROMPTS[0], return_logprob=True, logprob_start_len=0, top_logprobs_num=1,
                 sampling_params={"max_new_tokens": 4, **GREEDY, **NO_EOS})["meta_info"]
    lp = lp_resp.choices[0].logprobs
    n_prompt = ref["prompt_tokens"]
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
    expected = [e[0] for e in ref["input_token_logprobs"] + ref["output_token_logprobs"]]
    assert lp.token_logprobs[1:] == pytest.approx(expected[1:], abs=1e-4)
    assert lp_resp.choices[0].text == resp.choices[0].text

    chunks = list(client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=4, echo=True, stream=True,
                                            **GREEDY, extra_body=NO_EOS))
    assert "".join(ch.choices[0].text for ch in chunks) == resp.choices[0].text


def test_seed_reproducibility(client):
    def sample(seed):
        r = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=8, temperature=1.5, seed=seed,
                                      extra_body=NO_EOS)
        return r.choices[0].text

    first = sample(42)
    assert sample(42) == first
    assert len({first, *(sample(s) for s in (1, 2, 3, 4))}) > 1


# ---- chat ----------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "You recommend products."},
            {"role": "user", "content": "The user likes red shoes. Next?"}]


def test_chat_matches_native_generate(server, client, tok, model_path):
    ids = chat_ids(tok, MESSAGES)
    resp = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, **GREEDY, extra_body=NO_EOS)
    ref = native(server, input_ids=ids, sampling_params={"max_new_tokens": 8, **GREEDY, **NO_EOS})
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == model_path
    [c] = resp.choices
    assert c.index == 0 and c.finish_reason == "length" and c.logprobs is None
    assert c.message.role == "assistant" and c.message.content == ref["text"]
    assert c.message.tool_calls is None and c.message.model_extra["reasoning_content"] is None
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 8

    # text parts are flattened into the same prompt; max_completion_tokens wins over max_tokens
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": MESSAGES[1]["content"]}]}]
    again = client.chat.completions.create(model="m", messages=parts, max_tokens=3, max_completion_tokens=8,
                                           **GREEDY, extra_body=NO_EOS)
    assert again.choices[0].message.content == ref["text"]


def test_chat_without_max_tokens_runs_until_a_stop(server, client, tok):
    first = native(server, input_ids=chat_ids(tok, MESSAGES),
                   sampling_params={"max_new_tokens": 1, **GREEDY})["output_ids"][0]
    resp = client.chat.completions.create(model="m", messages=MESSAGES, **GREEDY,
                                          extra_body={"stop_token_ids": [first]})
    c = resp.choices[0]
    assert c.finish_reason == "stop" and c.model_extra["matched_stop"] == first
    assert resp.usage.completion_tokens == 1


def test_logit_bias(client, tok):
    resp = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=3, logit_bias={"7": 100}, **GREEDY,
                                      extra_body=NO_EOS)
    assert resp.choices[0].text == tok.decode([7, 7, 7])


def test_chat_streaming_matches_non_streaming(client):
    kw = dict(model="m", messages=MESSAGES, max_tokens=10, n=2, **GREEDY, extra_body=NO_EOS)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    seen, texts, finish = set(), {}, {}
    for ch in chunks[:-1]:
        [c] = ch.choices
        if c.index not in seen:  # the first delta of each choice carries the role
            seen.add(c.index)
            assert c.delta.role == "assistant" and c.delta.content == ""
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_logprobs_match_native(server, client, tok):
    ids = chat_ids(tok, MESSAGES)
    resp = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=2,
                                          **GREEDY, extra_body=NO_EOS)
    ref = native(server, input_ids=ids, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True,
                 sampling_params={"max_new_tokens": 5, **GREEDY, **NO_EOS})["meta_info"]
    content = resp.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([e[0] for e in ref["output_token_logprobs"]], abs=1e-4)
    for entry, ref_entry, ref_row in zip(content, ref["output_token_logprobs"], ref["output_top_logprobs"],
                                         strict=True):
        assert entry.token == ref_entry[2] and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 2
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([t[0] for t in ref_row], abs=1e-4)
    streamed = [e.logprob for ch in client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=5, logprobs=True, stream=True, **GREEDY, extra_body=NO_EOS)
        if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-5)


# ---- errors --------------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    dict(temperature=-1),
    dict(top_p=1.5),
    dict(n=0),
    dict(max_tokens=-5),
    dict(prompt=""),
    dict(prompt=None),
    dict(frequency_penalty=3),
    dict(logit_bias={"99999": 1}),
    dict(stop=[f"s{i}" for i in range(33)]),
    dict(suffix="tail"),
    dict(best_of=3),
    dict(logprobs=-1),
    dict(prompt=[5] * 3000),  # longer than the context
    dict(extra_body={"regex": "a+"}),
    dict(extra_body={"stop_regex": "a+"}),
    dict(extra_body={"temperature": "hot"}),
    dict(extra_body={"top_k": 0}),
]

BAD_CHATS = [
    dict(messages=[]),
    dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]),
    dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
    dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    dict(response_format={"type": "json_object"}),
    dict(top_logprobs=30, logprobs=True),
    dict(presence_penalty=-3),
    dict(extra_body={"ebnf": "root ::= 'a'"}),
]


def check_error_body(body, status=400):
    assert body["object"] == "error" and body["code"] == status
    assert isinstance(body["message"], str) and body["message"]
    assert isinstance(body["type"], str) and "param" in body


@pytest.mark.parametrize("bad", BAD_COMPLETIONS, ids=lambda b: ",".join(b.get("extra_body", b)))
def test_bad_completion_requests_are_400(client, bad):
    kw = {"model": "m", "prompt": "hello", "max_tokens": 2, **bad}
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(**kw)
    assert exc.value.status_code == 400
    check_error_body(exc.value.body)
    check_error_body(exc.value.response.json())


@pytest.mark.parametrize("bad", BAD_CHATS, ids=lambda b: ",".join(b.get("extra_body", b)))
def test_bad_chat_requests_are_400(client, bad):
    kw = {"model": "m", "messages": MESSAGES, "max_tokens": 2, **bad}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**kw)
    assert exc.value.status_code == 400
    check_error_body(exc.value.body)


def test_bad_streaming_request_is_a_plain_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="m", messages=MESSAGES, temperature=-1, stream=True)
    check_error_body(exc.value.body)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'{"prompt": 1, "messages": 1}'])
def test_malformed_bodies_are_400(server, route, body):
    r = server.client.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    check_error_body(r.json())


def test_error_messages_name_the_problem(server):
    r = server.client.post("/v1/completions", json={"prompt": "hi", "temperature": -1})
    assert "temperature" in r.json()["message"]
    r = server.client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": [{"type": "function"}]})
    assert "not supported" in r.json()["message"]


def test_server_still_serves_after_errors(client):
    resp = client.completions.create(model="m", prompt="hello", max_tokens=2, **GREEDY, extra_body=NO_EOS)
    assert resp.usage.completion_tokens == 2


# ---- client disconnects ----------------------------------------------------------------------------
def wait_idle(server, timeout=HANG_S) -> float:
    """Seconds until the scheduler has no running or queued request (flush_cache succeeds only then)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if server.client.post("/flush_cache").status_code == 200:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError("requests still running after the client left")


@pytest.fixture(scope="module")
def long_server(start_server, tiny_model_dir):
    """Requests of 60,000 new tokens (a 65,536-token context): one observed running is still running
    when the test pauses the rank in place a moment later, on any machine."""
    return start_server(tiny_model_dir("llama", max_position_embeddings=65536), "--max-total-tokens", "61000")


def aborted_while_paused(srv, what: str) -> None:
    """With the rank paused in place no request can end by itself: the one observed running leaves the
    rank only by the abort its client's disconnect sent. Then its KV is freed (the cache flushed)."""
    wait_for(lambda: running_per_rank(srv.client) == [(0, 0)], f"the {what} request aborted")
    wait_for(lambda: srv.client.post("/flush_cache").status_code == 200 and kv_state(srv.client).kv_used == 0,
             f"the {what} request's KV freed")


def test_disconnect_aborts_streaming_and_non_streaming(long_server):
    srv = long_server
    body = {"prompt": PROMPTS[0], "max_tokens": 60000, "ignore_eos": True, "temperature": 0}
    running = lambda: running_per_rank(srv.client) == [(1, 0)]  # noqa: E731
    # streaming: the client leaves after the first chunk, while the request is held running
    with httpx.Client(base_url=srv.url, timeout=HANG_S) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator closes the response (the client leaves)
            line = next(line for line in lines if line.startswith("data: "))
            assert json.loads(line[6:])["choices"][0]["index"] == 0
            with paused_in_place(srv.client):
                wait_for(running, "the streamed request running")
                r.close()
                aborted_while_paused(srv, "streamed")
    # non-streaming: nothing comes before the end; the client leaves while the request is held running
    leaving = Departing(srv.url, "/v1/chat/completions", {**body, "messages": MESSAGES})
    wait_for(running, "the chat request running")
    with paused_in_place(srv.client):
        leaving.leave()
        aborted_while_paused(srv, "chat")
    done = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=HANG_S)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4


# ---- queue full ----------------------------------------------------------------------------------
def test_queue_full_is_503(small_server):
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="m", prompt=PROMPTS[0], n=4, max_tokens=50, extra_body=NO_EOS)
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(**kw)
    assert exc.value.status_code == 503
    check_error_body(exc.value.body, 503)
    assert "queue is full" in exc.value.body["message"]
    # streaming: a 503 before the first token, or an error event then [DONE] once streaming started
    r = small_server.client.post("/v1/chat/completions", json={"messages": MESSAGES, "n": 4, "max_tokens": 50,
                                                              "ignore_eos": True, "stream": True})
    if r.status_code == 503:
        check_error_body(r.json(), 503)
    else:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        check_error_body(json.loads(events[-2])["error"], 503)
    wait_idle(small_server)
    ok = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=2, extra_body=NO_EOS)
    assert ok.usage.completion_tokens == 2
