"""OpenAI's completion objects, built from an engine's stream of deltas: what `Engine.chat_completion`
and `Engine.completion` return, shaped as the browser engine's `chatCompletion` shapes them
(web/src/engine.js): one choice, the reply's text outside tool calls, calls whole in the last delta,
finish reason "tool_calls" when the reply calls one, and usage after it."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from kiln.tools import ContentBeforeCalls, ToolCall, ToolRequest

if TYPE_CHECKING:
    from kiln.engine import Delta, GenerationConfig, Usage


@dataclass
class ChatCompletionRequest:
    messages: list[dict]
    config: GenerationConfig
    model: str  # the name the reply gives the model
    tools: ToolRequest | None = None


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    config: GenerationConfig
    model: str


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass
class Reply:
    """The objects of one completion: `chat` ones (chat.completion) or raw text ones (text_completion)."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def chunk(self, choices: list[dict], **extra) -> dict:
        name = f"{self.object_name}.chunk" if self.chat else self.object_name
        out = {"id": self.id, "object": name, "created": self.created, "model": self.model, "choices": choices}
        return {**out, **extra}

    def delta(self, text: str | None, finish_reason: str | None, tool_calls: list[ToolCall] = ()) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        delta = {} if text is None else {"content": text}
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **call.to_openai()} for i, call in enumerate(tool_calls)]
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}

    def chunks(self, deltas: Iterator[Delta], calls: ContentBeforeCalls | None) -> Iterator[dict]:
        """The stream's chunks: a chat's opens with the assistant's role; the last carries usage.
        Closing it closes `deltas`, which ends the generation."""
        try:
            if self.chat:
                opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield self.chunk([{**opening, "logprobs": None}])
            for delta in deltas:
                text, tool_calls = delta.text, []
                if calls:
                    text = calls.feed(text)
                    if delta.finish_reason:
                        rest, tool_calls = calls.finish()
                        text += rest
                if text:
                    yield self.chunk([self.delta(text, None)])
                if delta.finish_reason:
                    finish_reason = "tool_calls" if tool_calls else delta.finish_reason
                    yield self.chunk([self.delta(None, finish_reason, tool_calls)])
                    yield self.chunk([], usage=usage_json(delta.usage))
                    return
        finally:
            deltas.close()


def collected(chunks: Iterator[dict]) -> dict:
    """The whole completion the chunks of a stream (`Reply.chunks`) make up, once it ends."""
    texts, tool_calls, finish_reason, usage = [], [], None, None
    try:
        for chunk in chunks:
            if not chunk["choices"]:
                usage = chunk["usage"]
                continue
            (choice,) = chunk["choices"]
            delta = choice.get("delta", choice)
            texts.append(delta.get("content") or delta.get("text") or "")
            tool_calls += [{k: v for k, v in call.items() if k != "index"} for call in delta.get("tool_calls", [])]
            finish_reason = choice["finish_reason"] or finish_reason
    finally:
        chunks.close()
    text = "".join(texts)
    if chunk["object"] == "text_completion":
        choice = {"index": 0, "text": text}
    elif tool_calls:
        choice = {"index": 0, "message": {"role": "assistant", "content": text or None, "tool_calls": tool_calls}}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    return {
        "id": chunk["id"],
        "object": chunk["object"].removesuffix(".chunk"),
        "created": chunk["created"],
        "model": chunk["model"],
        "choices": [{**choice, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage,
    }
