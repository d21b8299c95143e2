"""Recommendation routes: /v1/score (SGLang 0.5.23's ScoringRequest / ScoringResponse), /v1/rank, /v1/retrieve,
and the native /generate beam form."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sgrec.entrypoints.helpers import HTTPError, await_or_disconnect, native_error, openai_error_body, read_json
from sgrec.managers.catalog import CatalogRequestError
from sgrec.managers.rec import beam_generate_response, task_response
from sgrec.managers.score import score_response
from sgrec.managers.tokenizer_manager import TokenizerManager


def error(request: Request, status: int, message: str) -> JSONResponse:
    """OpenAI-style errors on /v1 routes, SGLang's native ones on /generate."""
    if request.url.path.startswith("/v1/"):
        return error_json(status, message)  # type as the OpenAI routes: BadRequestError for 400s, else the status
    return native_error(status, message)


def error_json(status: int, message: str) -> JSONResponse:
    return JSONResponse(openai_error_body(status, message, None if status == 400 else str(status)), status_code=status)


def add_rec_routes(app: FastAPI, tm: TokenizerManager) -> None:
    async def run(request: Request, submit, respond, body=None):
        """Validates and submits the body (`submit(body) -> Submission`), waits (aborting when the
        client leaves) and answers `respond(states, body)`, or the first request's error."""
        try:
            if body is None:
                body = await read_json(request)
            sub = submit(body)
        except HTTPError as e:
            return error(request, e.status, e.message)
        except ValueError as e:
            return error(request, 400, str(e))
        except RuntimeError as e:  # shutting down, or a scheduler died
            return error(request, 503, str(e))
        states = await await_or_disconnect(tm.wait_states(sub), tm, sub, request)
        if states is None:
            return Response(status_code=499)
        for s in states:
            fr = s.finish_reason or {}
            if fr.get("type") == "abort":
                return error(request, fr.get("status_code") or 500, fr.get("message") or "aborted")
        return JSONResponse(respond(states, body))

    @app.post("/v1/score")
    async def score(request: Request):
        plan = None

        def submit(body):
            nonlocal plan
            sub, plan = tm.submit_score(body)
            return sub

        def respond(states, body):
            result = plan.result([s.lp["output_token_ids_logprobs"][0] for s in states])
            return score_response(result, body.get("model") or "default")  # the model is echoed, as SGLang

        return await run(request, submit, respond)

    @app.post("/v1/rank")
    async def rank(request: Request):
        return await run(request, tm.submit_rank, lambda states, _: task_response(states[0]))

    @app.post("/v1/retrieve")
    async def retrieve(request: Request):
        return await run(request, tm.submit_retrieve, lambda states, _: task_response(states[0]))

    @app.post("/v1/recommend")
    async def recommend(request: Request):
        """Candidates by retrieve, ranked by rank, in one request (one task on one catalog version)."""
        return await run(request, tm.submit_recommend, lambda states, _: task_response(states[0]))

    async def beam_generate(request: Request, body: dict):
        """Native /generate with sampling_params.beam_width (routed here by the /generate handler)."""
        return await run(request, lambda b: tm.submit_retrieve(b, native_beam=True),
                         lambda states, _: beam_generate_response(states[0], tm.tokenizer), body)

    app.state.beam_generate = beam_generate

    async def catalog_update(request: Request, op: str):
        try:
            body = await read_json(request)
            return JSONResponse(await tm.catalog.update(op, body))
        except HTTPError as e:
            return error(request, e.status, e.message)
        except CatalogRequestError as e:
            return error(request, e.status, e.message)

    @app.post("/v1/catalog/items")
    async def catalog_items(request: Request):
        """Inserts or replaces items by id (all or nothing), durably, on every rank."""
        return await catalog_update(request, "upsert")

    @app.post("/v1/catalog/delete")
    async def catalog_delete(request: Request):
        """Deletes items by id (unknown ids are ignored and counted)."""
        return await catalog_update(request, "delete")

    @app.post("/v1/catalog/rollback")
    async def catalog_rollback(request: Request):
        """Serves a kept earlier version again, as a new version."""
        return await catalog_update(request, "rollback")

    @app.get("/v1/catalog")
    async def catalog_info():
        """The served catalog version: item counts, semantic-ID length, kept versions."""
        if tm.catalog.facts is None:
            return error_json(404, "this server has no item catalog (--item-catalog)")
        return JSONResponse(tm.catalog.facts)
