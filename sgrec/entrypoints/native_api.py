"""SGLang 0.5.23's native routes: /generate (with streaming), health and readiness, model and server
info, /v1/models, /flush_cache and /metrics. One function per route group; create_app calls them."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from sgrec import __version__
from sgrec.entrypoints.helpers import SSE_DONE, HTTPError, abort_of, native_error, read_json, sse, wait_or_disconnect
from sgrec.managers.io_struct import PAUSE_MODES, QUEUE_FULL
from sgrec.managers.rec import is_beam_generate
from sgrec.managers.tokenizer_manager import QueueFull, Submission, TokenizerManager
from sgrec.sampling import SchemaError
from sgrec.server_args import ServerArgs

HEALTH_TIMEOUT_S = 20.0


def redact(text: str | None, secret: str | None) -> str | None:
    """`text` with every occurrence of the API key replaced (the launch command carries it)."""
    if text is None or not secret:
        return text
    return text.replace(secret, "<redacted>")


def add_generate_routes(app: FastAPI, tm: TokenizerManager) -> None:
    """/generate (POST, PUT): one request or a batch, streamed or not; the beam form goes to the
    recommendation routes (`app.state.beam_generate`, set by add_rec_routes)."""

    async def generate(request: Request):
        obj = await read_json(request)
        if is_beam_generate(obj):
            return await app.state.beam_generate(request, obj)
        try:
            sub = tm.submit(obj)
        except SchemaError as e:
            raise HTTPError(400, str(e), plain=True) from None
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        except RuntimeError as e:
            raise HTTPError(503, str(e)) from None
        if obj.get("stream"):
            return StreamingResponse(_stream_native(sub), media_type="text/event-stream")
        outs = await wait_or_disconnect(tm, sub, request)
        if outs is None:
            return Response(status_code=499)
        if (err := abort_of(outs)) is not None:
            return native_error(*err)
        return JSONResponse(outs if sub.is_list else outs[0])

    async def _stream_native(sub: Submission) -> AsyncIterator[bytes]:
        async for index, out in tm.stream(sub):
            fr = out["meta_info"]["finish_reason"]
            if fr and fr.get("type") == "abort":
                err = {"message": fr.get("message"), "type": "invalid_request_error",
                       "code": fr.get("status_code") or 500, "retryable": False}
                yield sse({"error": err})
                break
            if sub.is_list:
                out["index"] = index
            yield sse(out)
        yield SSE_DONE

    app.add_api_route("/generate", generate, methods=["POST", "PUT"])


def add_health_routes(app: FastAPI, tm: TokenizerManager) -> None:
    """/health and /health_generate (a one-token generation), /ready (the schedulers are alive)."""

    async def health():
        """A one-token generation. With the queue full the server is busy, not broken: healthy when
        the schedulers keep sending outputs (an orchestrator must not restart an overloaded server)."""
        if tm.dead:
            return Response(status_code=503)
        if tm.paused:  # every rank acknowledged /pause_generation: alive, not generating on purpose
            return Response(status_code=200)
        t0 = time.monotonic()
        try:
            sub = tm.submit({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        except QueueFull:
            return Response(status_code=200 if await tm.outputs_since(t0, HEALTH_TIMEOUT_S) else 503)
        except (ValueError, RuntimeError):
            return Response(status_code=503)
        try:
            outs = await asyncio.wait_for(tm.wait(sub), HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            tm.abort(sub)
            return Response(status_code=503)
        err = abort_of(outs)  # the scheduler's own queue limit answered: it is alive
        return Response(status_code=200 if err is None or err == (503, QUEUE_FULL) else 503)

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/health_generate", health, methods=["GET"])

    @app.get("/ready")
    async def ready():
        return Response(status_code=503 if tm.dead else 200)


def add_info_routes(app: FastAPI, tm: TokenizerManager, args: ServerArgs, launch: dict, model_name: str) -> None:
    """/get_model_info, /get_server_info (and their short names), /v1/models."""

    def model_info():
        return {
            "model_path": args.model_path,
            "served_model_name": model_name,
            "tokenizer_path": args.tokenizer_path or args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": launch.get("model_type"),
            "architectures": launch.get("architectures"),
        }

    app.add_api_route("/get_model_info", model_info, methods=["GET"])
    app.add_api_route("/model_info", model_info, methods=["GET"])

    def server_info():
        stats = [tm.stats.get(r) for r in range(args.dp_size)]
        return {
            **args.to_dict(),
            **(tm.ready[0].sizes or {}),  # the sizes the scheduler picked for its device
            "api_key": None,
            "launch_command": redact(launch.get("launch_command"), args.api_key),
            "status": "dead" if tm.dead else "ready",
            "max_total_num_tokens": tm.max_total_num_tokens,
            "max_req_input_len": tm.context_len - 1,
            "max_context_length": tm.context_len,
            "kv_events": None,
            "startup_time": launch.get("startup_time"),
            "version": "0.5.23",
            "sgrec_version": __version__,
            "frontend": "python",
            "internal_states": [
                {"dp_rank": r, "last_gen_throughput": s.last_gen_throughput if s else 0.0,
                 "memory_usage": {"kv_used_tokens": s.kv_used if s else 0, "kv_total_tokens": s.kv_total if s else 0},
                 "num_running_reqs": s.num_running_reqs if s else 0, "num_queue_reqs": s.num_queue_reqs if s else 0,
                 "hicache": s.hicache if s else None, "forward_threads": s.forward_threads if s else None}
                for r, s in enumerate(stats)
            ],
        }

    app.add_api_route("/get_server_info", server_info, methods=["GET"])
    app.add_api_route("/server_info", server_info, methods=["GET"])

    def model_card():
        return {"id": model_name, "object": "model", "created": int(launch.get("startup_time", time.time())),
                "owned_by": "sglang", "root": model_name, "parent": None, "max_model_len": tm.context_len}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != model_name:
            return JSONResponse({"error": {"message": f"The model '{model_id}' does not exist",
                                           "type": "invalid_request_error", "param": "model",
                                           "code": "model_not_found"}}, status_code=404)
        return model_card()


async def _control_body(request: Request, fields: dict) -> dict:
    """An admin route's optional JSON object body: `fields` maps each allowed key to its check
    (value -> error text or None); a missing key is absent from the result."""
    if not (await request.body()).strip():
        return {}
    obj = await read_json(request)
    if not isinstance(obj, dict):
        raise HTTPError(400, "The request body must be a JSON object")
    for key, value in obj.items():
        if key not in fields:
            raise HTTPError(400, f"{key}: unknown field (allowed: {', '.join(fields)})")
        if (why := fields[key](value)) is not None:
            raise HTTPError(400, f"{key}: {why}")
    return obj


def add_admin_routes(app: FastAPI, tm: TokenizerManager) -> None:
    """/flush_cache, /pause_generation and /continue_generation, /metrics (Prometheus, with
    --enable-metrics)."""

    async def ask(call):
        """A control round with every scheduler; 503 when one died or did not answer."""
        try:
            return await call
        except RuntimeError as e:
            raise HTTPError(503, str(e)) from None

    async def flush_cache():
        if await ask(tm.flush_cache()):
            return PlainTextResponse(
                "Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)

    app.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])

    def pause_mode(v):
        return None if v in PAUSE_MODES else f"must be one of {', '.join(PAUSE_MODES)}"

    def boolean(v):
        return None if isinstance(v, bool) else "must be a boolean"

    async def control(mode: str | None, message: str) -> JSONResponse:
        await ask(tm.pause(mode))
        return JSONResponse({"message": message, "status": "ok"})

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        """SGLang's: stops running batches on every rank. mode "abort" (the default) ends every
        request (503), "retract" puts the running ones back in the queue, "in_place" keeps them
        and their KV. Requests sent while paused wait in the queue."""
        obj = await _control_body(request, {"mode": pause_mode})
        return await control(obj.get("mode", "abort"), "Generation paused successfully.")

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        """Resumes after /pause_generation (torch_empty_cache is accepted and has nothing to do here)."""
        await _control_body(request, {"torch_empty_cache": boolean})
        return await control(None, "Generation continued successfully.")

    @app.get("/metrics")
    async def metrics():
        if tm.metrics is None:
            return PlainTextResponse("Metrics are off; start the server with --enable-metrics.\n", status_code=404)
        return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
