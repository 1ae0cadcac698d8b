"""Speculative decoding in the browser engine (web/src/speculative.js) gives the native engine's
replies: greedy with prompt lookup is plain greedy, a seeded sampled reply is the native seeded
reply, stops and lengths land where they do natively, and a response format holds; on wasm and
WebGPU, as the engine's own chat completion (its JavaScript sampler and proposer)."""

from __future__ import annotations

import json

import pytest

from kiln.browser.model import browser_model
from kiln.engine import Engine, GenerationConfig
from kiln.structured import ResponseFormat

# A prompt whose reply repeats what the model already said: the proposer has something to propose.
MESSAGES = [{"role": "user", "content": "Say it again: the cat sat on the mat. The cat sat on the mat. The cat sat on"}]
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
YES_NO = 'root ::= "The answer is " ("yes" | "no") "."'


@pytest.mark.browser
@pytest.mark.parametrize("backend", ["wasm", "webgpu"])
def test_the_browser_engine_speculates_the_native_replies(tiny_dir, backend, driver):
    native = Engine(tiny_dir)

    def expected(**config):
        native.reset()
        return native.generate_chat(MESSAGES, GenerationConfig(**config))

    cases = [
        ({"temperature": 0, "max_tokens": 40}, expected(max_tokens=40)),
        ({"temperature": 0, "max_tokens": 7}, expected(max_tokens=7)),
        *(
            ({"seed": seed, "max_tokens": 24, **SAMPLING}, expected(seed=seed, max_tokens=24, **SAMPLING))
            for seed in range(4)
        ),
    ]
    greedy = cases[0][1]
    stop = greedy.text[5:9]
    cases.append(({"temperature": 0, "max_tokens": 40, "stop": [stop]}, expected(max_tokens=40, stop=[stop])))
    grammar = {"type": "grammar", "grammar": YES_NO}
    cases.append(
        (
            {"temperature": 0, "max_tokens": 40, "response_format": grammar},
            expected(max_tokens=40, response_format=ResponseFormat.from_grammar(YES_NO)),
        )
    )
    with browser_model(tiny_dir, backend, driver) as model:
        proposed = 0
        for request, native_reply in cases:
            model.engine.call("resetChat")
            reply = model.engine.chat({"messages": MESSAGES, "speculative": "prompt-lookup", **request})
            choice = reply["completion"]["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == (
                native_reply.text,
                native_reply.finish_reason,
            ), json.dumps(request)
            extra = reply["completion"]["usage"]["extra"]
            assert extra["model_steps"] == len(native_reply.tokens) - 1 - extra["accepted_tokens"]
            proposed += extra["proposed_tokens"]
        assert proposed > 0
        model.engine.call("resetChat")
        refused = model.engine.page.evaluate(
            """async (request) => { try { await globalThis.kilnDriven.chat.completions.create(request); return null; }
               catch (error) { return error.code; } }""",
            {"messages": MESSAGES, "speculative": "sometimes"},
        )
        assert refused == "bad-request"
