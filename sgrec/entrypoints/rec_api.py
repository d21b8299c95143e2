"""Recommendation routes: /v1/score (SGLang 0.5.23's ScoringRequest / ScoringResponse), /v1/rank, /v1/retrieve."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sgrec.entrypoints.http_server import (
    HTTPError, abort_of, await_or_disconnect, native_error, openai_error_body, read_json, wait_or_disconnect,
)
from sgrec.managers.rec import beam_generate_response, task_response
from sgrec.managers.score import score_response
from sgrec.managers.tokenizer_manager import TokenizerManager


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(openai_error_body(status, message), status_code=status)


def error(request: Request, status: int, message: str) -> JSONResponse:
    """OpenAI-style errors on /v1 routes, SGLang's native ones on /generate."""
    return _error(status, message) if request.url.path.startswith("/v1/") else native_error(status, message)


def add_rec_routes(app: FastAPI, tm: TokenizerManager, model_name: str) -> None:
    @app.post("/v1/score")
    async def score(request: Request):
        try:
            body = await read_json(request)
            sub, plan = tm.submit_score(body)
        except HTTPError as e:
            return _error(e.status, e.message)
        except ValueError as e:
            return _error(400, str(e))
        except RuntimeError as e:  # shutting down, or a scheduler died
            return _error(503, str(e))
        outs = await wait_or_disconnect(tm, sub, request)
        if outs is None:
            return Response(status_code=499)
        if (err := abort_of(outs)) is not None:
            return _error(*err)
        result = plan.result([s.lp["output_token_ids_logprobs"][0] for s in sub.states])
        return JSONResponse(score_response(result, body.get("model") or "default"))  # echoed, as SGLang

    async def run_task(request: Request, submit, respond=task_response, body=None):
        try:
            if body is None:
                body = await read_json(request)
            sub = submit(body)
        except HTTPError as e:
            return error(request, e.status, e.message)
        except ValueError as e:
            return error(request, 400, str(e))
        except RuntimeError as e:
            return error(request, 503, str(e))
        states = await await_or_disconnect(tm.wait_states(sub), tm, sub, request)
        if states is None:
            return Response(status_code=499)
        fr = states[0].finish_reason or {}
        if fr.get("type") == "abort":
            return error(request, fr.get("status_code") or 500, fr.get("message") or "aborted")
        return JSONResponse(respond(states[0]))

    @app.post("/v1/rank")
    async def rank(request: Request):
        return await run_task(request, tm.submit_rank)

    @app.post("/v1/retrieve")
    async def retrieve(request: Request):
        return await run_task(request, tm.submit_retrieve)

    async def beam_generate(request: Request, body: dict):
        """Native /generate with sampling_params.beam_width (routed here by the /generate handler)."""
        return await run_task(request, lambda b: tm.submit_retrieve(b, native_beam=True),
                              lambda state: beam_generate_response(state, tm.tokenizer), body)

    app.state.beam_generate = beam_generate
