"""HTTP routes with SGLang 0.5.23's shapes: native /generate and friends; OpenAI routes in openai_api."""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any, AsyncIterator

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from sgrec import __version__
from sgrec.managers.io_struct import QUEUE_FULL
from sgrec.managers.rec import is_beam_generate
from sgrec.managers.tokenizer_manager import QueueFull, Submission, TokenizerManager
from sgrec.sampling import SchemaError
from sgrec.server_args import ServerArgs

OPEN_PATHS = ("/health", "/health_generate", "/ready", "/metrics")
HEALTH_TIMEOUT_S = 20.0
DISCONNECT_POLL_S = 0.1


class HTTPError(Exception):
    def __init__(self, status: int, message: str, plain: bool = False):
        self.status, self.message, self.plain = status, message, plain


def native_error(status: int, message: str, plain: bool = False) -> JSONResponse:
    """SGLang's native error bodies: a plain string for schema errors, else {"message": ...};
    non-400 aborts use the OpenAI-style object."""
    if status != 400 and status >= 400 and not plain:
        return JSONResponse(openai_error_body(status, message, str(status)), status_code=status)
    return JSONResponse({"error": message if plain else {"message": message}}, status_code=status)


def openai_error_body(status: int, message: str, err_type: str | None = None) -> dict:
    return {"object": "error", "message": message, "type": err_type or "BadRequestError", "param": None,
            "code": status}


async def read_json(request: Request) -> Any:
    body = await request.body()
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise HTTPError(400, f"Malformed JSON body: {e}") from None


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def abort_of(outputs: list[dict]) -> tuple[int, str] | None:
    """(status, message) of the first request that ended in an abort, if any."""
    for out in outputs:
        fr = out["meta_info"]["finish_reason"]
        if fr and fr.get("type") == "abort":
            return fr.get("status_code") or 500, fr.get("message") or "aborted"
    return None


async def await_or_disconnect(aw, tm: TokenizerManager, sub: Submission, request: Request):
    """Awaits `aw`; if the client disconnects first, aborts the submission (freeing its KV) and
    returns None."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                tm.abort(sub)
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let whatever it was awaiting unwind first


async def wait_or_disconnect(tm: TokenizerManager, sub: Submission, request: Request) -> list[dict] | None:
    """A submission's results, or None if the client left first."""
    return await await_or_disconnect(tm.wait(sub), tm, sub, request)


class BodyLimitMiddleware:
    """Pure ASGI: a request body over `limit` bytes gets a 413 before it is read whole (by its
    Content-Length, or by counting the chunks of a streamed body)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, receive, send)
        seen = 0

        async def counting_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge()
            return msg

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await self._reject(scope, receive, send)

    async def _reject(self, scope, receive, send):
        message = f"Request body larger than --max-request-bytes ({self.limit} bytes)"
        await JSONResponse(openai_error_body(413, message, "RequestTooLarge"), status_code=413)(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def redact(text: str | None, secret: str | None) -> str | None:
    """`text` with every occurrence of the API key replaced (the launch command carries it)."""
    if text is None or not secret:
        return text
    return text.replace(secret, "<redacted>")


SUBMIT_PATHS = frozenset(("/generate", "/v1/completions", "/v1/chat/completions", "/v1/score", "/v1/rank",
                          "/v1/retrieve"))


class AdmissionMiddleware:
    """Pure ASGI: a request to a route that submits work gets its 503 `The request queue is full.`
    here, before the body is read or the route runs, when every rank already holds
    --max-running-requests + --max-queued-requests requests (TokenizerManager.admit), so a burst
    over capacity costs the server as little as possible. Requests that pass are checked again in
    their route (with the routing key of the body) and by the scheduler."""

    def __init__(self, app, tm: TokenizerManager):
        self.app, self.tm = app, tm

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT") and scope["path"] in SUBMIT_PATHS:
            try:
                self.tm.admit(None)
            except QueueFull as e:
                await native_error(503, str(e))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    """Pure ASGI (BaseHTTPMiddleware would hide client disconnects from the handlers)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(tm: TokenizerManager, args: ServerArgs, launch: dict) -> FastAPI:
    app = FastAPI(title="sgrec", version=__version__)
    model_name = args.served_model_name or args.model_path
    app.state.tm, app.state.args, app.state.model_name = tm, args, model_name

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        if request.url.path.startswith("/v1/"):
            return JSONResponse(openai_error_body(exc.status, exc.message), status_code=exc.status)
        return native_error(exc.status, exc.message, exc.plain)

    if args.max_queued_requests is not None:
        app.add_middleware(AdmissionMiddleware, tm=tm)  # inside the key check: 401 before 503
    if args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key)
    app.add_middleware(BodyLimitMiddleware, limit=args.max_request_bytes)

    # ---- /generate ---------------------------------------------------------------------
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

    # ---- health and info ---------------------------------------------------------------
    async def health():
        """A one-token generation. With the queue full the server is busy, not broken: healthy when
        the schedulers keep sending outputs (an orchestrator must not restart an overloaded server)."""
        if tm.dead:
            return Response(status_code=503)
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
                 "num_running_reqs": s.num_running_reqs if s else 0, "num_queue_reqs": s.num_queue_reqs if s else 0}
                for r, s in enumerate(stats)
            ],
        }

    app.add_api_route("/get_server_info", server_info, methods=["GET"])
    app.add_api_route("/server_info", server_info, methods=["GET"])

    async def flush_cache():
        ok = await tm.flush_cache()
        if ok:
            return PlainTextResponse(
                "Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)

    app.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])

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

    @app.get("/metrics")
    async def metrics():
        if tm.metrics is None:
            return PlainTextResponse("Metrics are off; start the server with --enable-metrics.\n", status_code=404)
        return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    from sgrec.entrypoints.openai_api import add_openai_routes

    add_openai_routes(app, tm, model_name)
    from sgrec.entrypoints.rec_api import add_rec_routes

    add_rec_routes(app, tm)
    from sgrec.entrypoints.openapi import SchemaLimits, install_openapi

    lim = tm.builder.limits
    install_openapi(app, SchemaLimits(lim.vocab_size, lim.max_n, lim.max_batch_size, args.max_rank_candidates,
                                      args.max_beam_width), OPEN_PATHS if args.api_key else None)
    return app
