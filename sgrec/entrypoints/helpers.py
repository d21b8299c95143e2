"""What every route module shares: HTTP errors and their bodies (SGLang's native shapes and OpenAI's),
reading a JSON body, server-sent events, and awaiting a submission while watching for the client
leaving. Imports no route module; http_server.py and every *_api.py import it."""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from sgrec.managers.tokenizer_manager import Submission, TokenizerManager

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


SAFE_INT = 2**53  # integral floats below this are exact integers (RFC 7493's interoperable range)
_FLOAT_TOKEN = re.compile(rb"[0-9][.eE]")  # a body without one has no float to look at


def integral_floats_as_ints(v: Any) -> Any:
    """`v` with every integral float (2.0, 1e3) below SAFE_INT made an int: JSON Schema's
    "integer" is a value, not a spelling, so `"n": 2.0` is the integer 2 (as SGLang's pydantic
    models read it)."""
    if type(v) is float:
        return int(v) if v.is_integer() and abs(v) < SAFE_INT else v
    if type(v) is list:
        return [integral_floats_as_ints(x) for x in v]
    if type(v) is dict:
        return {k: integral_floats_as_ints(x) for k, x in v.items()}
    return v


async def read_json(request: Request) -> Any:
    body = await request.body()
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise HTTPError(400, f"Malformed JSON body: {e}") from None
    return integral_floats_as_ints(obj) if _FLOAT_TOKEN.search(body) else obj


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
