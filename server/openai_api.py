"""OpenAI-compatible `/v1/models`, `/v1/chat/completions` and `/v1/completions` over the native engine.

One engine per model, loaded on first use; a model runs one generation at a time and later
requests wait for it (up to the queue timeout, then 503). Streams are server-sent events; when
the client goes away the next write fails, the response is closed and so is the engine's
stream, which ends the generation and frees the model.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

from flask import Blueprint, Response, jsonify, request

from kiln.app_config import compiled_models
from kiln.errors import KilnError

log = logging.getLogger(__name__)
ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 4


class ApiError(Exception):
    """An error answered as OpenAI's JSON error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.error_type, self.code = status, message, param, error_type, code

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}
        response = jsonify(body)
        response.status_code = self.status
        return response


class NativeEngines:
    """The native engines of the models under `dist` that have a library for `target`."""

    def __init__(self, dist: Path, target: str, queue_timeout_s: float):
        self.dist = dist
        self.target = target
        self.queue_timeout_s = queue_timeout_s
        self.engines: dict = {}
        self.lock = threading.Lock()

    def model_ids(self) -> list[str]:
        return [m.model_id for m in compiled_models(self.dist) if self.target in m.libraries]

    def get(self, model_id: str):
        from kiln.engine import Engine

        with self.lock:
            if model_id not in self.engines:
                if model_id not in self.model_ids():
                    raise ApiError(404, f"The model {model_id!r} does not exist here (models with a {self.target} "
                                        f"library: {', '.join(self.model_ids()) or 'none'})", "model", code="model_not_found")
                self.engines[model_id] = Engine(self.dist / model_id, self.target, busy_timeout_s=self.queue_timeout_s)
            return self.engines[model_id]

    def loaded(self) -> list[str]:
        return sorted(self.engines)


# Request validation: each function takes the request body and returns a checked value.

def body_object() -> dict:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object (Content-Type: application/json).")
    return body


def field(body: dict, name: str, kinds: tuple[type, ...], default=None, required: bool = False):
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, f"Missing required parameter: {name!r}.", name)
        return default
    value = body[name]
    # bool is an int in Python; JSON true is never a number here.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__.replace("str", "string").replace("float", "number").replace("int", "integer")
                               for k in kinds)
        raise ApiError(400, f"Invalid type for {name!r}: expected {expected}.", name)
    return value


def number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = field(body, name, (int, float), default)
    if not (low < value <= high if low_open else low <= value <= high):
        raise ApiError(400, f"{name!r} must be in {'(' if low_open else '['}{low}, {high}], got {value}.", name)
    return float(value)


def message_content(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts.",
                   f"messages[{index}].content")


def chat_messages(body: dict) -> list[dict]:
    messages = field(body, "messages", (list,), required=True)
    if not messages:
        raise ApiError(400, "'messages' must not be empty.", "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}.", f"messages[{i}].role")
        checked.append({"role": message["role"], "content": message_content(message.get("content"), i)})
    return checked


def generation_config(body: dict, chat_config: dict, context_window: int):
    from kiln.engine import GenerationConfig

    if field(body, "n", (int,), 1) != 1:
        raise ApiError(400, "Only n=1 is supported.", "n")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = field(body, name, (int,), context_window)
    if max_tokens < 1:
        raise ApiError(400, f"{name!r} must be at least 1, got {max_tokens}.", name)
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings.", "stop")
    top_k = field(body, "top_k", (int,), 0)
    if top_k < 0:
        raise ApiError(400, f"'top_k' must be 0 (off) or positive, got {top_k}.", "top_k")
    return GenerationConfig(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", chat_config.get("temperature", 1.0), 0, 2),
        top_p=number(body, "top_p", chat_config.get("top_p", 1.0), 0, 1, low_open=True),
        top_k=top_k,
        repetition_penalty=number(body, "repetition_penalty", chat_config.get("repetition_penalty", 1.0), 0, 10,
                                  low_open=True),
        presence_penalty=number(body, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2, 2),
        seed=field(body, "seed", (int,)),
        stop=stop,
        ignore_eos=field(body, "ignore_eos", (bool,), False),
    )


def completion_prompt(body: dict) -> str | list[int]:
    prompt = field(body, "prompt", (str, list), required=True)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids.", "prompt")
    return prompt


def usage_json(usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def event_stream(deltas: Iterator, chunk, opening: dict | None, include_usage: bool) -> Iterator[str]:
    """Server-sent events for an engine stream; `chunk(...)` shapes one event, `opening` is the
    first (chat streams announce the assistant's role).

    Closing this generator (the client went away) closes the engine stream, which stops the
    generation and releases the model.
    """
    generated = 0
    finished = False
    try:
        if opening is not None:
            yield sse(opening)
        for delta in deltas:
            generated += len(delta.token_ids)
            if delta.text or delta.finish_reason:
                yield sse(chunk(delta.text, delta.finish_reason))
            if delta.usage is not None and include_usage:
                yield sse(chunk(None, None, usage=usage_json(delta.usage)))
        yield sse("[DONE]")
        finished = True
    except KilnError as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
    finally:
        if not finished:
            log.info("the client went away: generation stopped after %d tokens", generated)
        deltas.close()


def start_stream(engine, start):
    """Start a generation (waiting for the model); engine errors about the request become 400s."""
    from kiln.engine import EngineBusy

    try:
        return start()
    except EngineBusy as e:
        raise ApiError(503, f"{e}; retry later.", error_type="server_error", code="model_busy") from None
    except KilnError as e:
        raise ApiError(400, e.problem) from None


def make_openai_blueprint(engines: NativeEngines) -> Blueprint:
    api = Blueprint("openai_api", __name__, url_prefix="/v1")

    @api.errorhandler(ApiError)
    def api_error(error: ApiError):
        return error.response()

    @api.get("/models")
    def list_models():
        return jsonify({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": 0, "owned_by": "kiln"} for model_id in engines.model_ids()]})

    def request_engine(body: dict):
        model_id = field(body, "model", (str,), required=True)
        engine = engines.get(model_id)
        return model_id, engine, generation_config(body, engine.chat_config, engine.model.context_window_size)

    def respond(body: dict, deltas: Iterator, shape_choice, object_name: str, chat: bool):
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        model_id = body["model"]
        if field(body, "stream", (bool,), False):
            options = field(body, "stream_options", (dict,), {})

            def chunk(text, finish_reason, usage=None, choice=None):
                choices = [] if usage else [choice or shape_choice(text, finish_reason)]
                out = {"id": completion_id, "object": f"{object_name}.chunk" if chat else object_name,
                       "created": created, "model": model_id, "choices": choices}
                if usage:
                    out["usage"] = usage
                return out

            opening = None
            if chat:
                opening = chunk(None, None, choice={"index": 0, "delta": {"role": "assistant", "content": ""},
                                                    "finish_reason": None, "logprobs": None})
            return Response(event_stream(deltas, chunk, opening, bool(options.get("include_usage"))),
                            mimetype="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts = []
        try:
            for delta in deltas:
                texts.append(delta.text)
                last = delta
        finally:
            deltas.close()
        text = "".join(texts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text})
        choice.update(finish_reason=last.finish_reason, logprobs=None)
        return jsonify({"id": completion_id, "object": object_name, "created": created, "model": model_id,
                        "choices": [choice], "usage": usage_json(last.usage)})

    @api.post("/chat/completions")
    def chat_completions():
        body = body_object()
        messages = chat_messages(body)
        model_id, engine, config = request_engine(body)
        if engine.chat_template is None:
            raise ApiError(400, f"The model {model_id!r} has no chat template (it is a base model): it completes raw "
                                "text at /v1/completions, it does not chat.", "model", code="model_cannot_chat")
        deltas = start_stream(engine, lambda: engine.stream_chat(messages, config))

        def choice(text, finish_reason):
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}

        return respond(body, deltas, choice, "chat.completion", chat=True)

    @api.post("/completions")
    def completions():
        body = body_object()
        prompt = completion_prompt(body)
        _, engine, config = request_engine(body)
        deltas = start_stream(engine, lambda: engine.stream(prompt, config))

        def choice(text, finish_reason):
            return {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}

        return respond(body, deltas, choice, "text_completion", chat=False)

    return api
