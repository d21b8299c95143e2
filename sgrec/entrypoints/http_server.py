"""The HTTP app with SGLang 0.5.23's routes and shapes: create_app adds the middleware (body limit, API
key, admission) and then each route group, every group a function of its own module: native
(native_api.py), OpenAI (openai_api.py), recommendation (rec_api.py); then /openapi.json (openapi.py).
What the route modules share is in helpers.py."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sgrec import __version__
from sgrec.entrypoints.helpers import HTTPError, native_error, openai_error_body
from sgrec.entrypoints.native_api import add_admin_routes, add_generate_routes, add_health_routes, add_info_routes
from sgrec.entrypoints.openai_api import add_openai_routes
from sgrec.entrypoints.openapi import SchemaLimits, install_openapi
from sgrec.entrypoints.rec_api import add_rec_routes
from sgrec.managers.tokenizer_manager import QueueFull, TokenizerManager
from sgrec.server_args import ServerArgs

OPEN_PATHS = ("/health", "/health_generate", "/ready", "/metrics")
ADMIN_PATHS = ("/v1/catalog/items", "/v1/catalog/delete", "/v1/catalog/rollback")  # --admin-api-key


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

    def __init__(self, app, api_key: str | None, admin_api_key: str | None = None):
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        admin = admin_api_key or api_key  # the catalog updates: the admin key when given
        self.admin = None if admin is None else f"Bearer {admin}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path")
        if scope["type"] == "http" and path not in OPEN_PATHS:
            expected = self.admin if path in ADMIN_PATHS and scope.get("method") == "POST" else self.expected
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if expected is not None and not hmac.compare_digest(given, expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def http_error(request: Request, exc: HTTPError) -> JSONResponse:
    """An HTTPError raised by a route: OpenAI's error body on /v1 routes, SGLang's native one elsewhere."""
    if request.url.path.startswith("/v1/"):
        return JSONResponse(openai_error_body(exc.status, exc.message), status_code=exc.status)
    return native_error(exc.status, exc.message, exc.plain)


def add_middleware(app: FastAPI, tm: TokenizerManager, args: ServerArgs) -> None:
    """Outermost first: the body limit (413), the API key (401), admission (503)."""
    if args.max_queued_requests is not None:
        app.add_middleware(AdmissionMiddleware, tm=tm)  # inside the key check: 401 before 503
    if args.api_key or args.admin_api_key:
        app.add_middleware(APIKeyMiddleware, api_key=args.api_key, admin_api_key=args.admin_api_key)
    app.add_middleware(BodyLimitMiddleware, limit=args.max_request_bytes)


def secured_routes(args: ServerArgs):
    """(path, method) -> whether APIKeyMiddleware asks for a key there; None when it is not installed."""
    if not (args.api_key or args.admin_api_key):
        return None

    def secured(path: str, method: str) -> bool:
        if path in OPEN_PATHS:
            return False
        return bool(args.admin_api_key or args.api_key) if path in ADMIN_PATHS and method == "post" else bool(args.api_key)

    return secured


def create_app(tm: TokenizerManager, args: ServerArgs, launch: dict) -> FastAPI:
    app = FastAPI(title="sgrec", version=__version__)
    model_name = args.served_model_name or args.model_path
    app.state.tm, app.state.args, app.state.model_name = tm, args, model_name
    app.add_exception_handler(HTTPError, http_error)
    add_middleware(app, tm, args)

    add_generate_routes(app, tm)
    add_health_routes(app, tm)
    add_info_routes(app, tm, args, launch, model_name)
    add_admin_routes(app, tm)
    add_openai_routes(app, tm, model_name)
    add_rec_routes(app, tm)

    lim = tm.builder.limits
    admin = tm.catalog  # None before the ranks are ready (a schema-only app)
    books = None if admin is None else admin.codebooks
    install_openapi(app, SchemaLimits(lim.vocab_size, lim.max_n, lim.max_batch_size, args.max_rank_candidates,
                                      args.max_beam_width, args.max_filter_items,
                                      admin is not None and admin.sid is not None,
                                      None if books is None else books.dim, lim.context_len), secured_routes(args))
    return app
