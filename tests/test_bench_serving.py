"""sgrec.bench_serving: the metrics on hand-made records, and one short run against a real server."""

import asyncio
import json
import math

import httpx
import pytest

from sgrec.bench_serving import (Record, Request, arrival_times, compute_metrics, main, random_requests, send,
                                 summarize, token_counts)


def rec(ttft, e2e, itl, out, prompt=10, ok=True, error=""):
    return Record(success=ok, error=error, prompt_len=prompt, output_len=out, output_tokens=out if ok else 0,
                  ttft=ttft, e2e=e2e, itl=itl)


def test_summarize_exact_percentiles():
    s = summarize([0.1, 0.2, 0.3, 0.4])  # seconds -> ms, numpy linear interpolation
    assert s == pytest.approx({"mean": 250.0, "p50": 250.0, "p90": 370.0, "p99": 397.0})
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert summarize([2.0], scale=1) == {"mean": 2.0, "p50": 2.0, "p90": 2.0, "p99": 2.0}


def test_compute_metrics_exact():
    records = [
        rec(0.1, 0.5, [0.1, 0.1, 0.2], 4, prompt=10),
        rec(0.3, 1.1, [0.4, 0.4], 3, prompt=20),
        rec(0.2, 0.2, [], 1, prompt=30),
        rec(0, 0, [], 5, prompt=40, ok=False, error="HTTP 503: full"),
        rec(0, 0, [], 5, prompt=50, ok=False, error="HTTP 503: full"),
    ]
    m = compute_metrics(records, duration=2.0)
    assert (m["completed"], m["failed"]) == (3, 2)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 8)  # completed requests only
    assert m["request_throughput"] == 1.5 and m["input_throughput"] == 30.0 and m["output_throughput"] == 4.0
    assert m["errors"] == {"HTTP 503: full": 2}
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0) and m["p99_ttft_ms"] == pytest.approx(298.0)
    # ITL pools every gap: [100, 100, 200, 400, 400] ms
    assert m["mean_itl_ms"] == pytest.approx(240.0) and m["p50_itl_ms"] == pytest.approx(200.0)
    assert m["p99_itl_ms"] == pytest.approx(400.0)
    # TPOT = (e2e - ttft) / (out - 1) for requests with > 1 token: 400/3 and 400 ms
    assert m["mean_tpot_ms"] == pytest.approx((400 / 3 + 400) / 2)
    assert m["mean_e2e_ms"] == pytest.approx(600.0) and m["p50_e2e_ms"] == pytest.approx(500.0)
    assert m["p90_e2e_ms"] == pytest.approx(980.0) and m["p99_e2e_ms"] == pytest.approx(1088.0)


def test_compute_metrics_all_failed_and_zero_duration():
    m = compute_metrics([rec(0, 0, [], 4, ok=False, error="boom")], duration=0.0)
    assert (m["completed"], m["failed"], m["request_throughput"]) == (1 - 1, 1, 0.0)
    assert m["mean_ttft_ms"] is None and m["p99_e2e_ms"] is None


def test_token_counts_and_arrivals_and_dataset():
    native = {"text": "ab", "output_ids": [5, 6], "meta_info": {"prompt_tokens": 7, "completion_tokens": 2}}
    assert token_counts("sgrec", native, 0) == (7, 2)
    assert token_counts("sgrec", {"output_ids": [1, 2, 3], "meta_info": {}}, 0) == (0, 3)
    usage = {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
    assert token_counts("openai", usage, 0) == (4, 3)
    assert token_counts("openai", {"choices": [{"text": "x"}], "usage": None}, 2) == (0, 3)
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    at = arrival_times(2000, 10.0, 0)
    assert at[0] == 0.0 and all(b >= a for a, b in zip(at, at[1:])) and 180 < at[-1] < 220
    reqs = random_requests(50, 16, 8, 0.5, [3, 4, 5], seed=0)
    assert all(8 <= r.prompt_len <= 16 and len(r.prompt) == r.prompt_len and 4 <= r.output_len <= 8 for r in reqs)
    assert {t for r in reqs for t in r.prompt} == {3, 4, 5}
    assert [r.prompt for r in random_requests(3, 4, 2, 1.0, [3, 4, 5], 7)] == \
        [r.prompt for r in random_requests(3, 4, 2, 1.0, [3, 4, 5], 7)]


def sse_client(*chunks, status=200):
    body = b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)
    return httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(status, content=body)))


def native(ids, prompt=5):
    return {"text": "", "output_ids": ids, "meta_info": {"prompt_tokens": prompt, "completion_tokens": len(ids)}}


def run_send(client, output_len=3):
    async def go():
        async with client:
            return await send(client, "sgrec", "http://test/generate", Request([1] * 5, 5, output_len), "m", True)

    return asyncio.run(go())


def test_send_parses_streams_and_errors():
    r = run_send(sse_client(native([]), native([7]), native([7, 8, 9]), b"[DONE]"))
    assert (r.success, r.output_tokens, r.prompt_len, len(r.itl), r.error) == (True, 3, 5, 2, "")
    assert r.itl[0] == r.itl[1] and 0 < r.ttft <= r.e2e  # a 2-token chunk counts as two gaps of half
    r = run_send(sse_client(native([7]), {"error": {"message": "aborted", "code": 500}}, b"[DONE]"))
    assert not r.success and r.error.startswith("error chunk:") and "aborted" in r.error
    r = run_send(sse_client(native([7])))
    assert not r.success and r.error == "stream ended without [DONE]"
    r = run_send(sse_client(b"[DONE]"))
    assert not r.success and r.error == "no output tokens"
    r = run_send(sse_client({"error": "full"}, status=503))
    assert not r.success and r.error.startswith("HTTP 503")
    r = run_send(sse_client(b"not json", b"[DONE]"))
    assert not r.success and r.error.startswith("JSONDecodeError")


@pytest.fixture(scope="module")
def server(tiny_model_dir, start_server):
    return start_server(tiny_model_dir("llama"), "--max-total-tokens", "4096")


@pytest.mark.parametrize("backend", ["sgrec", "openai"])
def test_end_to_end_against_server(backend, server, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "out.json", tmp_path / "plot.png"
    main(["--base-url", server.url, "--backend", backend, "--num-prompts", "8", "--random-input-len", "24",
          "--random-output-len", "12", "--random-range-ratio", "0.5", "--request-rate", "inf,20",
          "--output-file", str(out), "--plot", str(png), "--disable-tqdm", "--timeout", "120"])
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "rerun: python -m sgrec.bench_serving" in printed
    data = json.loads(out.read_text())
    assert {"date", "backend", "base_url", "model", "args", "rerun", "results"} <= data.keys()
    assert [r["request_rate"] for r in data["results"]] == ["inf", 20.0]
    for res in data["results"]:
        assert (res["completed"], res["failed"], res["errors"]) == (8, 0, {})
        for key in ("duration_s", "request_throughput", "input_throughput", "output_throughput", "mean_ttft_ms",
                    "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_e2e_ms", "p50_e2e_ms", "p90_e2e_ms",
                    "p99_e2e_ms"):
            assert res[key] > 0, key
        reqs = res["requests"]
        assert len(reqs) == 8 and all(r["success"] for r in reqs)
        assert [r["output_tokens"] for r in reqs] == [r["output_len"] for r in reqs]  # ignore_eos
        assert all(12 <= r["prompt_len"] <= 24 and len(r["itl"]) <= r["output_tokens"] - 1 for r in reqs)
        # A busy client may read several tokens in one chunk, even all of them: then a request has no gap.
        # The gaps a request has lie between its first and last chunk, so they sum to at most e2e - TTFT.
        assert all(sum(r["itl"]) <= r["e2e"] - r["ttft"] + 1e-9 for r in reqs)
        gaps = [x for r in reqs for x in r["itl"]]
        for key in ("mean_itl_ms", "p50_itl_ms", "p99_itl_ms"):
            assert (res[key] is None) if not gaps else res[key] > 0, key
        assert res["total_output_tokens"] == sum(r["output_len"] for r in reqs)
    assert png.stat().st_size > 1000


def test_failed_requests_are_counted_not_raised(server, tmp_path):
    """A JSONL prompt the server rejects (400) is reported as failed; the others still complete."""
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello", "output_len": 4}\n{"prompt": "world", "output_len": -1}\n'
                    '{"prompt": "again", "output_len": 3}\n')
    out = main(["--base-url", server.url, "--dataset-path", str(path), "--num-prompts", "3",
                "--output-file", str(tmp_path / "o.json"), "--disable-tqdm"])
    (res,) = out["results"]
    assert (res["completed"], res["failed"]) == (2, 1)
    assert [r["output_tokens"] for r in res["requests"]] == [4, 0, 3]
    assert list(res["errors"]) == ['HTTP 400: {"error":{"message":"sampling_params.max_new_tokens must be at least 0, got -1"}}']
