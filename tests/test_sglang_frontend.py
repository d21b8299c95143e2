"""SGLang's frontend language (the real `sglang` package) against a real sgrec server."""

import pytest
import sglang as sgl

CHOICES = [" alpha", " beta", " gamma", " delta"]


@pytest.fixture(scope="module")
def srv(start_server, tiny_model_dir):
    return start_server(tiny_model_dir("qwen2"), "--max-total-tokens", "8192")


@pytest.fixture(scope="module")
def backend(srv):
    return sgl.RuntimeEndpoint(srv.url)


def direct(srv, text, max_new_tokens, stop=None):
    """What the server generates for this text, asked through native /generate."""
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0, "stop": stop or []}
    return srv.client.post("/generate", json={"text": text, "sampling_params": sp}).json()["text"]


@sgl.function
def answer(s, question):
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=12, stop=["\n", "."], temperature=0)


@sgl.function
def choose(s, prompt):
    s += prompt
    s += sgl.select("choice", choices=CHOICES)


@sgl.function
def forked(s):
    s += "Items:"
    branches = s.fork(3)
    for i, b in enumerate(branches):
        b += f" number {i} is"
        b += sgl.gen("x", max_tokens=6, temperature=0)
    s += "".join(b["x"] for b in branches)


def test_gen_with_stop_and_max_tokens(srv, backend):
    state = answer.run(question="what is good", backend=backend)
    assert state["answer"] == direct(srv, "Q: what is good\nA:", 12, ["\n", "."])
    meta = state.get_meta_info("answer")
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["completion_tokens"] <= 12


def mean_logprob(srv, prompt: str, choice: str) -> float:
    """SGLang's token_length_normalized score, computed here independently through /generate."""
    prompt_len = srv.client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 0}}).json()[
        "meta_info"]["prompt_tokens"]
    out = srv.client.post("/generate", json={
        "text": prompt + choice, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True, "logprob_start_len": max(prompt_len - 2, 0),
    }).json()
    vals = [e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0]]
    return sum(vals) / len(vals)


@pytest.mark.parametrize("prompt", ["The answer is", "Pick one of the options:", "x y z"])
def test_select_picks_highest_mean_logprob(srv, backend, prompt):
    state = choose.run(prompt=prompt, backend=backend)
    scores = {c: mean_logprob(srv, prompt, c) for c in CHOICES}
    assert state["choice"] == max(scores, key=scores.get)


def test_fork(srv, backend):
    state = forked.run(backend=backend)
    want = "".join(direct(srv, f"Items: number {i} is", 6) for i in range(3))
    assert state.text() == "Items:" + want


def test_run_batch(srv, backend):
    questions = ["one", "two two", "a much longer question that shares nothing", "four"]
    states = answer.run_batch([{"question": q} for q in questions], backend=backend)
    assert [s["answer"] for s in states] == [direct(srv, f"Q: {q}\nA:", 12, ["\n", "."]) for q in questions]


def test_streaming(srv, backend):
    state = answer.run(question="stream this", backend=backend, stream=True)
    pieces = list(state.text_iter("answer"))
    assert "".join(pieces) == state["answer"] == direct(srv, "Q: stream this\nA:", 12, ["\n", "."])
