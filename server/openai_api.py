"""OpenAI-compatible `/v1/models`, `/v1/chat/completions` and `/v1/completions` over the native engine.

One engine per model (see `engines.py`), leased by each request until its reply ends; a model runs
one generation at a time and later requests wait for it (a bounded number of them, each up to the
queue timeout; then 503 with `Retry-After`). Streams are server-sent events. A generation ends
when its client goes away: a watcher sees the connection close (a streamed reply also notices
its next write failing) and interrupts the engine, which frees the model for the next request.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

from flask import Blueprint, Response, jsonify, request

from kiln.errors import KilnError
from kiln.tools import ContentBeforeCalls

from .api_request import ApiError, ApiRequest, read_request
from .engines import Lease, ModelBusy, NativeEngines

log = logging.getLogger(__name__)
WATCH_INTERVAL_MS = 50


def peer_closed(connection: socket.socket) -> bool:
    """Whether a readable connection was closed by its client (rather than holding a pipelined request)."""
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset by the peer
        return True


def watch_connection(connection: socket.socket, done: threading.Event, on_close) -> None:
    poller = select.poll()
    poller.register(connection, select.POLLIN)  # a closed connection reads as end-of-file (POLLRDHUP is Linux's only)
    while not done.is_set():
        if poller.poll(WATCH_INTERVAL_MS):
            if peer_closed(connection):
                on_close()
            return  # closed, or data we must not read: nothing more to learn either way


@contextmanager
def interrupted_if_client_leaves(connection: socket.socket | None, engine) -> Iterator[None]:
    """Interrupt `engine` when the client closes `connection` while the block runs.

    The request body is read by now, so end-of-file means the client is gone (an HTTP/1.1 client
    does not half-close while it waits for its reply; Go's net/http cancels a request on the same
    sign). The watcher is joined before the block ends, so it can never interrupt the next
    request's generation. Only werkzeug's server exposes the connection (`werkzeug.socket`), and
    only a plain TCP socket can be peeked at.
    """
    if type(connection) is not socket.socket:
        yield
        return
    done = threading.Event()
    watcher = threading.Thread(
        target=watch_connection, args=(connection, done, engine.interrupt), name="kiln-client-watch", daemon=True
    )
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def log_if_abandoned(finish_reason: str | None, generated: int) -> None:
    # The server interrupts a generation only when its client has gone.
    if finish_reason in (None, "abort"):
        log.info("the client went away: generation stopped after %d tokens", generated)


def usage_json(usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def event_stream(
    deltas: Iterator, chunk, opening: dict | None, include_usage: bool, watch, calls: ContentBeforeCalls | None
) -> Iterator[str]:
    """Server-sent events for an engine stream; `chunk(...)` shapes one event, `opening` is the
    first (chat streams announce the assistant's role), `watch` interrupts the engine if the client
    leaves, `calls` (when the model may call tools) holds back the text of calls and reads them at the end.

    Closing this generator (a write failed: the client went away) closes the engine stream,
    which stops the generation and releases the model.
    """
    generated = 0
    finish_reason = None
    try:
        with watch:
            if opening is not None:
                yield sse(opening)
            for delta in deltas:
                generated += len(delta.token_ids)
                text, tool_calls = delta.text, []
                if calls:
                    text = calls.feed(text)
                    if delta.finish_reason:
                        rest, tool_calls = calls.finish()
                        text += rest
                if text:
                    yield sse(chunk(text, None))
                if delta.finish_reason:
                    yield sse(chunk(None, "tool_calls" if tool_calls else delta.finish_reason, tool_calls=tool_calls))
                if delta.usage is not None and include_usage:
                    yield sse(chunk(None, None, usage=usage_json(delta.usage)))
                if delta.finish_reason:
                    finish_reason = delta.finish_reason
                    break
        yield sse("[DONE]")
    except KilnError as e:
        finish_reason = "error"
        log.error("a generation failed: %s", e)
        # The problem, not the path: clients learn nothing of the server's folders.
        yield sse({"error": {"message": e.problem, "type": "server_error", "param": None, "code": None}})
    finally:
        log_if_abandoned(finish_reason, generated)
        deltas.close()


def collect_reply(deltas: Iterator, watch) -> tuple[str, object]:
    """The whole reply's text and its last delta (finish reason and usage)."""
    texts = []
    try:
        with watch:
            for delta in deltas:
                texts.append(delta.text)
                if delta.finish_reason:
                    break
    finally:
        deltas.close()
    log_if_abandoned(delta.finish_reason, delta.usage.completion_tokens)
    return "".join(texts), delta


def start_stream(start, format_param: str = "response_format") -> Iterator:
    """Start a generation (waiting for the model); engine errors about the request become 400s
    (naming `format_param` when the format holding the reply does not compile)."""
    from kiln.engine import EngineBusy
    from kiln.structured import ResponseFormatError

    try:
        return start()
    except EngineBusy as e:
        raise ModelBusy(f"{e.problem}; retry later.") from None
    except ResponseFormatError as e:
        raise ApiError(400, e.problem, format_param) from None
    except KilnError as e:
        raise ApiError(400, e.problem) from None


def chat_choice(text: str | None, finish_reason: str | None, tool_calls=()) -> dict:
    delta = {} if text is None else {"content": text}
    if tool_calls:
        delta["tool_calls"] = [{"index": i, **call.to_openai()} for i, call in enumerate(tool_calls)]
    return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


def completion_choice(text: str | None, finish_reason: str | None, tool_calls=()) -> dict:
    return {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}


def chat_message(text: str, calls: ContentBeforeCalls | None) -> tuple[dict, bool]:
    """The reply as an assistant message, and whether it calls tools."""
    if calls is None:
        return {"role": "assistant", "content": text}, False
    content = calls.feed(text)
    rest, tool_calls = calls.finish()
    content += rest
    if not tool_calls:
        return {"role": "assistant", "content": content}, False
    return {"role": "assistant", "content": content or None, "tool_calls": [c.to_openai() for c in tool_calls]}, True


def respond(asked: ApiRequest, engine, deltas: Iterator, calls: ContentBeforeCalls | None = None) -> Response:
    """The reply to a started generation: an event stream or one JSON object."""
    chat = asked.messages is not None
    completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    object_name = "chat.completion" if chat else "text_completion"
    created = int(time.time())
    watch = interrupted_if_client_leaves(request.environ.get("werkzeug.socket"), engine)
    if asked.stream:

        def chunk(text, finish_reason, usage=None, choice=None, tool_calls=()):
            choices = (
                []
                if usage
                else [choice or (chat_choice if chat else completion_choice)(text, finish_reason, tool_calls)]
            )
            out = {
                "id": completion_id,
                "object": f"{object_name}.chunk" if chat else object_name,
                "created": created,
                "model": asked.model,
                "choices": choices,
            }
            if usage:
                out["usage"] = usage
            return out

        opening = None
        if chat:
            opening = chunk(
                None,
                None,
                choice={
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None,
                    "logprobs": None,
                },
            )
        return Response(
            event_stream(deltas, chunk, opening, asked.include_usage, watch, calls),
            mimetype="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    text, last = collect_reply(deltas, watch)
    if chat:
        message, called = chat_message(text, calls)
        choice = {"index": 0, "message": message}
    else:
        choice, called = {"index": 0, "text": text}, False
    choice.update(finish_reason="tool_calls" if called else last.finish_reason, logprobs=None)
    return jsonify(
        {
            "id": completion_id,
            "object": object_name,
            "created": created,
            "model": asked.model,
            "choices": [choice],
            "usage": usage_json(last.usage),
        }
    )


def answer(lease: Lease, reply) -> Response:
    """`reply(engine)`, holding the lease until the reply is over: a whole reply's generation is
    over when `reply` returns; a stream's when its events end or the server closes it unread."""
    try:
        response = reply(lease.engine)
    except BaseException:
        lease.release()
        raise
    if not response.is_streamed:
        lease.release()
        return response
    response.response = released_at_end(response.response, lease)
    response.call_on_close(lease.release)
    return response


def released_at_end(events: Iterator[str], lease: Lease) -> Iterator[str]:
    try:
        yield from events
    finally:
        lease.release()


def chat_reply(asked: ApiRequest, engine) -> Response:
    if engine.chat_template is None:
        raise ApiError(
            400,
            f"The model {asked.model!r} has no chat template (it is a base model): it completes "
            "raw text at /v1/completions, it does not chat.",
            "model",
            code="model_cannot_chat",
        )
    config = asked.generation_config(engine.chat_config)
    tools = asked.tools if asked.tools and asked.tools.choice != "none" else None
    if tools is None:
        return respond(asked, engine, start_stream(lambda: engine.stream_chat(asked.messages, config)))
    call_format = engine.tool_call_format
    if call_format is None:
        raise ApiError(
            400,
            f"The model {asked.model!r} cannot call tools: its chat template does not render "
            "them (or writes calls in a way Kiln does not read).",
            "tools",
            code="model_cannot_call_tools",
        )
    config.response_format = tools.response_format(call_format)
    opening = tools.reply_opening(call_format)
    deltas = start_stream(lambda: engine.stream_chat(asked.messages, config, tools.tools, opening), "tools")
    return respond(asked, engine, deltas, ContentBeforeCalls(call_format, tools.functions, opening))


def completion_reply(asked: ApiRequest, engine) -> Response:
    config = asked.generation_config(engine.chat_config)
    return respond(asked, engine, start_stream(lambda: engine.stream(asked.prompt, config)))


def make_openai_blueprint(engines: NativeEngines) -> Blueprint:
    api = Blueprint("openai_api", __name__, url_prefix="/v1")

    @api.errorhandler(ApiError)
    def api_error(error: ApiError):
        return error.response()

    @api.get("/models")
    def list_models():
        return jsonify(
            {
                "object": "list",
                "data": [
                    {"id": model_id, "object": "model", "created": 0, "owned_by": "kiln"}
                    for model_id in engines.model_ids()
                ],
            }
        )

    @api.post("/chat/completions")
    def chat_completions():
        asked = read_request(chat=True)
        return answer(engines.lease(asked.model), lambda engine: chat_reply(asked, engine))

    @api.post("/completions")
    def completions():
        asked = read_request(chat=False)
        return answer(engines.lease(asked.model), lambda engine: completion_reply(asked, engine))

    return api
