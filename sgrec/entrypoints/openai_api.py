"""OpenAI-compatible routes with SGLang 0.5.23's shapes: /v1/completions and /v1/chat/completions.

Both translate the request into a native /generate request (TokenizerManager.submit), so the
native validation, batching, n > 1 fan-out, logprobs and aborts apply unchanged; this module maps
the native output dicts to OpenAI's response and stream-chunk shapes.

Differences from a plain translation, all as in SGLang / OpenAI:
- choice index = prompt_index * n + sample (the native layer orders a batch sample-major);
- usage.prompt_tokens counts every prompt once, whatever n;
- echo prepends the prompt text (and, with logprobs, its token logprobs: logprob_start_len=0);
- aborted requests answer with the abort's status code and the OpenAI error body;
- a streamed choice holds back a trailing partial UTF-8 character and a suffix that could begin a
  stop string until it is resolved, so the streamed deltas always add up to the final text.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sgrec.entrypoints.helpers import (
    SSE_DONE, HTTPError, abort_of, await_or_disconnect, openai_error_body, read_json, sse, wait_or_disconnect,
)
from sgrec.entrypoints.protocol import (
    ChatCompletionRequest, CompletionRequest, RequestError, ValidationError, validation_message,
)
from sgrec.managers.generate import ENCODER_LOGPROBS
from sgrec.managers.tokenizer_manager import Submission, TokenizerManager

# Chat without max_tokens: no limit but the context; the native layer caps it at context/pool room.
UNLIMITED_NEW_TOKENS = 1 << 30
_RESERVED_TEMPLATE_KWARGS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                             "return_dict", "return_tensors", "tools", "documents", "tokenizer_kwargs")


def error_response(status: int, message: str, err_type: str | None = None, param: str | None = None) -> JSONResponse:
    body = openai_error_body(status, message, err_type or ("BadRequestError" if status == 400 else str(status)))
    body["param"] = param
    return JSONResponse(body, status_code=status)


@dataclass
class Plan:
    """A translated OpenAI request: the native request, and what is needed to map outputs back."""

    native: dict
    n: int
    count: int  # number of prompts
    stops: list[str]
    logprobs: bool
    top_k: int
    echo_texts: list[str] | None = None  # completions with echo: per prompt
    echo_logprobs: bool = False
    tb: TokenBytes | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def choice_index(self, native_index: int) -> int:
        sample, prompt = divmod(native_index, self.count)
        return prompt * self.n + sample

    def prompt_of(self, choice_index: int) -> int:
        return choice_index // self.n


def _native_request(req, plan_rid: str, max_new_tokens: int, logprobs: bool, top_k: int, start: int) -> dict:
    native: dict[str, Any] = {"sampling_params": req.sampling_params(max_new_tokens), "rid": req.rid or plan_rid}
    if logprobs:
        native.update(return_logprob=True, logprob_start_len=start, top_logprobs_num=top_k,
                      return_text_in_logprobs=True)
    key = req.cache_namespace()
    if key is not None:
        native["extra_key"] = key
    if req.lora_path:
        native["lora_path"] = req.lora_path
    return native


def build_completion(req: CompletionRequest, tm: TokenizerManager) -> Plan:
    req.check_unsupported()
    prompt = req.prompt
    if isinstance(prompt, str):
        key, items, native_prompt = "text", [prompt], prompt
    elif prompt and isinstance(prompt[0], str):
        key, items, native_prompt = "text", list(prompt), list(prompt)
    elif prompt and isinstance(prompt[0], list):
        key, items = "input_ids", [list(p) for p in prompt]
        native_prompt = items
    else:  # one prompt of token ids (an empty list is rejected natively)
        key, items, native_prompt = "input_ids", [list(prompt)], list(prompt)
    logprobs = req.logprobs is not None
    top_k = req.logprobs or 0
    rid = uuid.uuid4().hex
    echo_logprobs = bool(req.echo and req.logprobs)  # as SGLang: logprobs=0 reports no prompt tokens
    if echo_logprobs and tm.builder.limits.encoder:
        raise RequestError(f"echo with logprobs reports the prompt's token logprobs: {ENCODER_LOGPROBS}", "echo")
    native = _native_request(req, rid, 16 if req.max_tokens is None else req.max_tokens, logprobs, top_k,
                             0 if echo_logprobs else -1)
    native[key] = native_prompt
    plan = Plan(native, req.n if req.n is not None else 1, len(items), native["sampling_params"].get("stop", []),
                logprobs, top_k, echo_logprobs=echo_logprobs, tb=token_bytes(tm), id=rid)
    if req.echo:
        plan.echo_texts = items if key == "text" else [_decode_prompt(tm, ids) for ids in items]
    return plan


def _decode_prompt(tm: TokenizerManager, ids: list) -> str:
    vocab = tm.tokenizer.vocab_size
    if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
        return ""  # rejected by the native validation right after
    return tm.tokenizer.decode(ids)  # skip_special_tokens, as SGLang's echo of token-id prompts


def build_chat(req: ChatCompletionRequest, tm: TokenizerManager) -> Plan:
    req.check_unsupported()
    if req.input_ids is not None:
        ids = list(req.input_ids)
    else:
        msgs = [m.template_dict(i) for i, m in enumerate(req.messages)]
        if req.chat_template_kwargs and "chat_template" in req.chat_template_kwargs:
            raise RequestError("Request-supplied chat_template is not allowed", "chat_template_kwargs")
        try:
            if req.chat_template_kwargs or req.continue_final_message:
                kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items()
                          if k not in _RESERVED_TEMPLATE_KWARGS}
                text = tm.tokenizer.hf.apply_chat_template(
                    msgs, tokenize=False, add_generation_prompt=not req.continue_final_message,
                    continue_final_message=bool(req.continue_final_message), **kwargs)
            else:
                text = tm.tokenizer.apply_chat_template(msgs)
        except Exception as e:  # jinja errors (e.g. a template's raise_exception), missing template
            raise RequestError(f"Failed to apply the chat template: {e}", "messages") from None
        # The template carries the special tokens (BOS ...): tokenize it as is, as SGLang does.
        ids = tm.tokenizer.hf.encode(text, add_special_tokens=False)
    logprobs = bool(req.logprobs)
    top_k = (req.top_logprobs or 0) if logprobs else 0
    rid = uuid.uuid4().hex
    max_new = req.max_new_tokens
    native = _native_request(req, rid, UNLIMITED_NEW_TOKENS if max_new is None else max_new, logprobs, top_k, -1)
    native["input_ids"] = ids
    return Plan(native, req.n if req.n is not None else 1, 1, native["sampling_params"].get("stop", []),
                logprobs, top_k, tb=token_bytes(tm), id=rid)


# ---- output mapping -------------------------------------------------------------------------
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: vocabulary piece character -> raw byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenBytes:
    """Raw bytes of byte-level-BPE tokens, for the logprob fields (as SGLang): a token that is a
    fragment of a multi-byte character displays as U+FFFD, which would lose its bytes."""

    _DECODER = _byte_decoder()

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.cache: dict[int, list[int] | None] = {}
        try:
            vocab = len(hf_tokenizer)
            probe = [i for i in (0, 1, 2, 3, vocab // 2, vocab - 2) if 0 <= i < vocab]
            pieces = [hf_tokenizer.convert_ids_to_tokens(i) for i in probe]
            self.byte_level = all(all(ch in self._DECODER for ch in (p or "")) for p in pieces)
        except Exception:
            self.byte_level = False

    def raw(self, token_id: int) -> list[int] | None:
        if not self.byte_level:
            return None
        if token_id not in self.cache:
            try:
                piece = self.hf.convert_ids_to_tokens(token_id)
            except Exception:
                piece = None
            out = [self._DECODER.get(ch) for ch in piece or ""]
            self.cache[token_id] = None if not out or None in out else out
        return self.cache[token_id]

    def bytes_of(self, token_id: int, text: str) -> list[int]:
        raw = self.raw(token_id)
        return raw if raw is not None else list(text.encode("utf-8"))

    def lossless_text(self, token_id: int, text: str | None) -> str:
        """The display text, or for a genuine UTF-8 fragment its bytes as latin-1 (one char a byte)."""
        text = text or ""
        if "\ufffd" not in text:
            return text
        raw = self.raw(token_id)
        if raw is None:
            return text
        try:
            bytes(raw).decode("utf-8")
            return text  # valid UTF-8: a real U+FFFD, not a fragment
        except UnicodeDecodeError:
            return bytes(raw).decode("latin-1")


_TOKEN_BYTES: dict[int, TokenBytes] = {}


def token_bytes(tm: TokenizerManager) -> TokenBytes:
    key = id(tm.tokenizer)
    if key not in _TOKEN_BYTES:
        _TOKEN_BYTES[key] = TokenBytes(tm.tokenizer.hf)
    return _TOKEN_BYTES[key]


def _finish(fr: dict | None) -> tuple[str | None, int | str | None]:
    if not fr:
        return None, None
    return fr.get("type"), fr.get("matched") if fr.get("type") == "stop" else None


def _text_offsets(tokens: list[str], text: str, pos: int) -> tuple[list[int], int]:
    """Offsets of the tokens in `text` from `pos` on; tokens missing from the text (skipped special
    tokens, partial UTF-8) get the current position."""
    offsets = []
    for tok in tokens:
        j = text.find(tok, pos, pos + len(tok) + 8) if tok else -1
        if j >= 0:
            offsets.append(j)
            pos = j + len(tok)
        else:
            offsets.append(pos)
    return offsets, pos


def completion_logprobs(entries: list, tops: list | None, text: str, pos: int, tb: TokenBytes) -> tuple[dict, int]:
    """OpenAI legacy logprobs from native [logprob, id, text] entries and top rows; text_offset is the
    position of each token in the choice's text."""
    tokens = [tb.lossless_text(e[1], e[2]) for e in entries]
    offsets, pos = _text_offsets(tokens, text, pos)
    top = [] if tops is None else [
        None if row is None else {tb.lossless_text(t[1], t[2]): t[0] for t in row} for row in tops
    ]
    return {"tokens": tokens, "token_logprobs": [e[0] for e in entries], "top_logprobs": top,
            "text_offset": offsets}, pos


def chat_logprobs(entries: list, tops: list | None, tb: TokenBytes) -> dict:
    def item(e):
        tok = e[2] or ""
        return {"token": tok, "logprob": e[0], "bytes": tb.bytes_of(e[1], tok)}

    content = []
    for i, e in enumerate(entries):
        row = tops[i] if tops is not None and i < len(tops) else None
        content.append({**item(e), "top_logprobs": [item(t) for t in row or []]})
    return {"content": content}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": None,
            "reasoning_tokens": 0, "completion_tokens_details": None}


def _hold_back(text: str, stops: list[str]) -> str:
    """The part of an unfinished choice's text that is safe to stream."""
    text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence decodes to U+FFFD until completed
    cut = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), cut, -1):
            if text.endswith(s[:k]):
                cut = k
                break
    return text[: len(text) - cut]


def _sorted_outputs(plan: Plan, outs: list[dict]) -> list[tuple[int, dict]]:
    return sorted(((plan.choice_index(k), out) for k, out in enumerate(outs)), key=lambda x: x[0])


def _total_usage(plan: Plan, outs: list[dict]) -> dict:
    prompt = sum(outs[p]["meta_info"]["prompt_tokens"] for p in range(plan.count))  # sample 0 of each prompt
    return _usage(prompt, sum(o["meta_info"]["completion_tokens"] for o in outs))


def completion_response(plan: Plan, outs: list[dict], model_name: str) -> dict:
    choices = []
    for idx, out in _sorted_outputs(plan, outs):
        meta = out["meta_info"]
        echo = plan.echo_texts[plan.prompt_of(idx)] if plan.echo_texts is not None else ""
        text = echo + out["text"]
        logprobs = None
        if plan.logprobs:
            entries = list(meta["output_token_logprobs"])
            tops = meta.get("output_top_logprobs") if plan.top_k > 0 else None
            if plan.echo_logprobs:
                entries = list(meta["input_token_logprobs"]) + entries
                if tops is not None:
                    inp = meta.get("input_top_logprobs") or []
                    tops = list(inp) + [None] * (len(meta["input_token_logprobs"]) - len(inp)) + list(tops)
            logprobs, _ = completion_logprobs(entries, tops, text, 0, plan.tb)
        reason, matched = _finish(meta["finish_reason"])
        choices.append({"index": idx, "text": text, "logprobs": logprobs, "finish_reason": reason,
                        "matched_stop": matched})
    return {"id": f"cmpl-{plan.id}", "object": "text_completion", "created": plan.created, "model": model_name,
            "choices": choices, "usage": _total_usage(plan, outs), "metadata": {"weight_version": "default"}}


def chat_response(plan: Plan, outs: list[dict], model_name: str) -> dict:
    choices = []
    for idx, out in _sorted_outputs(plan, outs):
        meta = out["meta_info"]
        logprobs = None
        if plan.logprobs:
            logprobs = chat_logprobs(meta["output_token_logprobs"],
                                     meta.get("output_top_logprobs") if plan.top_k > 0 else None, plan.tb)
        reason, matched = _finish(meta["finish_reason"])
        choices.append({
            "index": idx,
            "message": {"role": "assistant", "content": out["text"], "reasoning_content": None, "tool_calls": None},
            "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched,
        })
    return {"id": f"chatcmpl-{plan.id}", "object": "chat.completion", "created": plan.created, "model": model_name,
            "choices": choices, "usage": _total_usage(plan, outs), "metadata": {"weight_version": "default"}}


# ---- streaming --------------------------------------------------------------------------------
@dataclass
class _ChoiceStream:
    sent: str = ""  # text streamed so far (echo included)
    n_logprobs: int = 0  # output logprob entries streamed so far
    offset_pos: int = 0
    started: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def _choice_updates(tm: TokenizerManager, sub: Submission, plan: Plan) -> AsyncIterator[Any]:
    """Yields (choice index, state, delta text, native chunk, text) per progress, or an
    _Abort on an abort. Aborts the submission's unfinished requests however the stream ends
    (client gone included)."""
    states: dict[int, _ChoiceStream] = {}
    agen = tm.stream(sub)
    try:
        async for k, out in agen:
            meta = out["meta_info"]
            fr = meta["finish_reason"]
            if fr and fr.get("type") == "abort":
                yield _Abort(fr.get("status_code") or 500, fr.get("message") or "aborted")
                return
            idx = plan.choice_index(k)
            st = states.setdefault(idx, _ChoiceStream())
            st.prompt_tokens, st.completion_tokens = meta["prompt_tokens"], meta["completion_tokens"]
            text = out["text"] if fr else _hold_back(out["text"], plan.stops)
            if plan.echo_texts is not None:
                text = plan.echo_texts[plan.prompt_of(idx)] + text
            delta = text[len(st.sent):] if len(text) > len(st.sent) else ""
            yield idx, st, delta, out, text
            st.sent += delta
            st.started = True
    finally:
        tm.abort(sub)  # no-op for finished requests
        await agen.aclose()


@dataclass
class _Abort:
    status: int
    message: str

    def stream_error(self) -> dict:
        try:
            err_type = HTTPStatus(self.status).name
        except ValueError:
            err_type = str(self.status)
        return openai_error_body(self.status, self.message, err_type)


async def _first_update(updates: AsyncIterator[Any], tm: TokenizerManager, sub: Submission, request: Request):
    """The first update of a stream, awaited before the 200 goes out (so an immediate abort, such as a
    full queue, answers with its HTTP status); None if the client left or nothing came."""

    async def first():
        try:
            return await updates.__anext__()
        except StopAsyncIteration:
            return None

    return await await_or_disconnect(first(), tm, sub, request)


def _stream_usage(plan: Plan, states: dict[int, _ChoiceStream]) -> dict:
    prompt = sum(st.prompt_tokens for idx, st in states.items() if idx % plan.n == 0)  # sample 0 of each prompt
    return _usage(prompt, sum(st.completion_tokens for st in states.values()))


async def _sse_stream(updates: AsyncIterator[Any], first: Any, plan: Plan, req, base: dict,
                      render) -> AsyncIterator[bytes]:
    """The SSE body: render(idx, state, delta, native chunk, text) -> choice dicts per update; then the
    usage chunk if asked, then [DONE]. An abort ends the stream with `data: {"error": ...}`."""
    states: dict[int, _ChoiceStream] = {}

    async def all_updates():
        yield first
        async for upd in updates:
            yield upd

    async with contextlib.aclosing(updates):
        async for upd in all_updates():
            if isinstance(upd, _Abort):
                yield sse({"error": upd.stream_error()})
                yield SSE_DONE
                return
            idx, st = upd[0], upd[1]
            states[idx] = st
            for chunk in render(*upd):
                chunk = {**base, "choices": [chunk], "usage": None}
                if req.continuous_usage:
                    chunk["usage"] = _usage(st.prompt_tokens, st.completion_tokens)
                yield sse(chunk)
    if req.include_usage:
        yield sse({**base, "choices": [], "usage": _stream_usage(plan, states)})
    yield SSE_DONE


def completion_stream(updates, first, plan: Plan, req: CompletionRequest, model_name: str) -> AsyncIterator[bytes]:
    def render(idx: int, st: _ChoiceStream, delta: str, out: dict, text: str) -> list[dict]:
        meta = out["meta_info"]
        logprobs = None
        if plan.logprobs:
            entries = list(meta["output_token_logprobs"][st.n_logprobs:])
            tops = list(meta.get("output_top_logprobs", [])[st.n_logprobs:]) if plan.top_k > 0 else None
            if plan.echo_logprobs and not st.started:
                entries = list(meta["input_token_logprobs"]) + entries
                if tops is not None:
                    inp = meta.get("input_top_logprobs") or []
                    tops = list(inp) + [None] * (len(meta["input_token_logprobs"]) - len(inp)) + tops
            st.n_logprobs = len(meta["output_token_logprobs"])
            logprobs, st.offset_pos = completion_logprobs(entries, tops, text, st.offset_pos, plan.tb)
        reason, matched = _finish(meta["finish_reason"])
        if not delta and reason is None and not (logprobs and logprobs["tokens"]):
            return []
        return [{"index": idx, "text": delta, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}]

    base = {"id": f"cmpl-{plan.id}", "object": "text_completion", "created": plan.created, "model": model_name}
    return _sse_stream(updates, first, plan, req, base, render)


def _delta(role: str | None, content: str | None) -> dict:
    return {"role": role, "content": content, "reasoning_content": None}


def chat_stream(updates, first, plan: Plan, req: ChatCompletionRequest, model_name: str) -> AsyncIterator[bytes]:
    def choice(idx, delta, logprobs=None, reason=None, matched=None) -> dict:
        return {"index": idx, "delta": delta, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}

    def render(idx: int, st: _ChoiceStream, delta: str, out: dict, text: str) -> list[dict]:
        meta = out["meta_info"]
        chunks = [] if st.started else [choice(idx, _delta("assistant", ""))]
        logprobs = None
        if plan.logprobs:
            entries = meta["output_token_logprobs"][st.n_logprobs:]
            tops = meta.get("output_top_logprobs", [])[st.n_logprobs:] if plan.top_k > 0 else None
            st.n_logprobs = len(meta["output_token_logprobs"])
            logprobs = chat_logprobs(entries, tops, plan.tb) if entries else None
        if delta or logprobs:
            chunks.append(choice(idx, _delta(None, delta), logprobs))
        reason, matched = _finish(meta["finish_reason"])
        if reason is not None:
            chunks.append(choice(idx, _delta(None, None), None, reason, matched))
        return chunks

    base = {"id": f"chatcmpl-{plan.id}", "object": "chat.completion.chunk", "created": plan.created,
            "model": model_name}
    return _sse_stream(updates, first, plan, req, base, render)


# ---- routes -----------------------------------------------------------------------------------
def add_openai_routes(app: FastAPI, tm: TokenizerManager, model_name: str) -> None:
    async def handle(request: Request, model_cls, build, respond, stream):
        try:
            body = await read_json(request)
            req = model_cls.model_validate(body)
            plan = build(req, tm)
            sub = tm.submit(plan.native, sampling_where="")  # the client sent them as top-level fields
        except HTTPError as e:  # malformed JSON
            return error_response(e.status, e.message, "Bad Request" if e.status == 400 else None)
        except ValidationError as e:
            message, param = validation_message(e)
            return error_response(400, message, "Bad Request", param)
        except RequestError as e:
            return error_response(e.status, str(e), None, e.param)
        except ValueError as e:  # native validation (SchemaError included)
            return error_response(400, str(e))
        except RuntimeError as e:  # the server is shutting down or a scheduler died
            return error_response(503, str(e))
        if req.stream:
            updates = _choice_updates(tm, sub, plan)
            first = await _first_update(updates, tm, sub, request)
            if first is None or isinstance(first, _Abort):
                await updates.aclose()
                if first is None:
                    return Response(status_code=499)
                return error_response(first.status, first.message)
            return StreamingResponse(stream(updates, first, plan, req, model_name), media_type="text/event-stream")
        outs = await wait_or_disconnect(tm, sub, request)
        if outs is None:
            return Response(status_code=499)
        if (err := abort_of(outs)) is not None:
            return error_response(*err)
        return JSONResponse(respond(plan, outs, model_name))

    async def completions(request: Request):
        return await handle(request, CompletionRequest, build_completion, completion_response, completion_stream)

    async def chat_completions(request: Request):
        return await handle(request, ChatCompletionRequest, build_chat, chat_response, chat_stream)

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
