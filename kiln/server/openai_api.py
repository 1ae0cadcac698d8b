"""OpenAI-compatible `/v1/models`, `/v1/chat/completions`, `/v1/completions` and `/v1/embeddings`
over the native engines.

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
from contextlib import contextmanager
from typing import Iterator

from flask import Blueprint, Response, jsonify, request

from kiln.completions import collected
from kiln.errors import KilnError

from .api_request import ApiError, ApiRequest, body_object, read_request, required, text
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
    """Interrupt the generation `engine` runs now when the client closes `connection` while the block runs.

    The request body is read by now, so end-of-file means the client is gone (an HTTP/1.1 client
    does not half-close while it waits for its reply; Go's net/http cancels a request on the same
    sign). The watcher interrupts only that generation (`Engine.interrupter`): a stream's generation
    ends, and frees the engine, before its watcher stops, and another request's may start in between.
    Only werkzeug's server exposes the connection (`werkzeug.socket`), and only a plain TCP socket can
    be peeked at.
    """
    if type(connection) is not socket.socket:
        yield
        return
    done = threading.Event()
    watcher = threading.Thread(
        target=watch_connection, args=(connection, done, engine.interrupter()), name="kiln-client-watch", daemon=True
    )
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def log_if_abandoned(finish_reason: str | None, engine) -> None:
    # The server interrupts a generation only when its client has gone.
    if finish_reason in (None, "abort"):
        log.info("the client went away: generation stopped after %d tokens", engine.tokens_generated)


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def event_stream(chunks: Iterator[dict], include_usage: bool, watch, engine) -> Iterator[str]:
    """Server-sent events of the engine's chunks (the usage chunk when the client asked for it);
    `watch` interrupts the engine if the client leaves.

    Closing this generator (a write failed: the client went away) closes the engine's chunks,
    which stops the generation and releases the model.
    """
    finish_reason = None
    try:
        with watch:
            for chunk in chunks:
                if chunk["choices"]:
                    finish_reason = chunk["choices"][0]["finish_reason"] or finish_reason
                    yield sse(chunk)
                elif include_usage:
                    yield sse(chunk)
        yield sse("[DONE]")
    except KilnError as e:
        finish_reason = "error"
        log.error("a generation failed: %s", e)
        # The problem, not the path: clients learn nothing of the server's folders.
        yield sse({"error": {"message": e.problem, "type": "server_error", "param": None, "code": None}})
    finally:
        log_if_abandoned(finish_reason, engine)
        chunks.close()


# The native engine's refusals (EngineError codes) as OpenAI errors: the parameter at fault, the code
# and what the API offers instead.
REFUSALS = {
    "no-chat-template": ("model", "model_cannot_chat", " Raw text is completed at /v1/completions."),
    "no-tool-support": ("tools", "model_cannot_call_tools", ""),
    "context-window-exceeded": (None, "context_length_exceeded", ""),
}


def started(start, format_param: str = "response_format"):
    """Start a completion (waiting for the model); engine errors about the request become 400s
    (naming `format_param` when the format holding the reply does not compile)."""
    from kiln.engine import EngineBusy, EngineError
    from kiln.structured import ResponseFormatError

    try:
        return start()
    except EngineBusy as e:
        raise ModelBusy(f"{e.problem}; retry later.") from None
    except ResponseFormatError as e:
        raise ApiError(400, e.problem, format_param) from None
    except EngineError as e:
        param, code, instead = REFUSALS.get(e.code, (None, None, ""))
        raise ApiError(400, e.problem + instead, param, code=code) from None
    except KilnError as e:
        raise ApiError(400, e.problem) from None


def respond(asked: ApiRequest, engine, start, format_param: str = "response_format") -> Response:
    """The reply of the completion `start()` begins: its chunks as an event stream, or the whole
    completion as one JSON object. The client is watched once the generation has started (an engine
    clears an earlier interrupt when it starts)."""
    chunks = started(start, format_param)
    watch = interrupted_if_client_leaves(request.environ.get("werkzeug.socket"), engine)
    if asked.stream:
        return Response(
            event_stream(chunks, asked.include_usage, watch, engine),
            mimetype="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    with watch:
        completion = collected(chunks)
    log_if_abandoned(completion["choices"][0]["finish_reason"], engine)
    return jsonify(completion)


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


def check_kind(engine, model: str, embedding: bool) -> None:
    """A chat request to an embedding model, or an embeddings request to a chat model, is a 400."""
    from kiln.embeddings import EmbeddingEngine

    if isinstance(engine, EmbeddingEngine) != embedding:
        kind, instead = ("a chat", "/v1/chat/completions") if embedding else ("an embedding", "/v1/embeddings")
        raise ApiError(400, f"The model {model!r} is {kind} model: use {instead}.", "model", code="wrong_model_kind")


def embeddings_reply(body: dict, model: str, engine) -> Response:
    check_kind(engine, model, embedding=True)
    return jsonify(started(lambda: engine.create(body)))


def chat_reply(asked: ApiRequest, engine) -> Response:
    from kiln.completions import ChatCompletionRequest

    check_kind(engine, asked.model, embedding=False)
    completion = ChatCompletionRequest(
        asked.messages, asked.generation_config(engine.chat_config), asked.model, asked.tools
    )
    format_param = "tools" if asked.tools and asked.tools.choice != "none" else "response_format"
    return respond(asked, engine, lambda: engine.chat_completion_chunks(completion), format_param)


def completion_reply(asked: ApiRequest, engine) -> Response:
    from kiln.completions import CompletionRequest

    check_kind(engine, asked.model, embedding=False)
    completion = CompletionRequest(asked.prompt, asked.generation_config(engine.chat_config), asked.model)
    return respond(asked, engine, lambda: engine.completion_chunks(completion))


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

    @api.post("/embeddings")
    def embeddings():
        body = body_object()
        model = text("model", required(body, "model"))
        return answer(engines.lease(model), lambda engine: embeddings_reply(body, model, engine))

    return api
