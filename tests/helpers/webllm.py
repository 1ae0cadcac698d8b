"""WebLLM (@mlc-ai/web-llm, the version pinned in web/package.json) chatting with a Kiln-built
model from `kiln serve`, and the native engine's replies to hold its replies to."""

from __future__ import annotations

from pathlib import Path

from helpers.web import browser_page, served

from kiln.engine import Engine, GenerationConfig

MAX_TOKENS = 8
WEBLLM_TIMEOUT_MS = 30 * 60_000
# WebLLM from `kiln serve`, configured with nothing but the server's app config.
WEBLLM_CHAT_JS = """async ({modelId, conversations, maxTokens, request = {}}) => {
  const webllm = await import("/web/node_modules/@mlc-ai/web-llm/lib/index.js");
  const appConfig = await (await fetch("/api/app-config.json")).json();
  const engine = await webllm.CreateMLCEngine(modelId, { appConfig, logLevel: "WARN" });
  const replies = [];
  for (const messages of conversations) {
    await engine.resetChat();
    const reply = await engine.chat.completions.create({ messages, temperature: 0, max_tokens: maxTokens, ...request });
    replies.push({ text: reply.choices[0].message.content, usage: reply.usage });
  }
  await engine.unload();
  return replies;
}"""


def webllm_replies(
    driver,
    profile: Path,
    model_dir: Path,
    conversations: list[list[dict]],
    max_tokens: int = MAX_TOKENS,
    request: dict | None = None,
) -> list[dict]:
    with served(model_dir.parent) as url, browser_page(driver, profile, url) as (_, page):
        page.set_default_timeout(WEBLLM_TIMEOUT_MS)
        return page.evaluate(
            WEBLLM_CHAT_JS,
            {
                "modelId": model_dir.name,
                "conversations": conversations,
                "maxTokens": max_tokens,
                "request": request or {},
            },
        )


def assert_kiln_replies_the_same(model_dir: Path, conversations: list[list[dict]], replies: list[dict]) -> None:
    engine = Engine(model_dir)
    # WebLLM prefills the conv_template's system_prefix_token_ids but counts only the encoded text.
    uncounted = len(engine.chat_config["conv_template"]["system_prefix_token_ids"])
    for messages, reply in zip(conversations, replies, strict=True):
        engine.reset()
        expected = engine.generate_chat(messages, GenerationConfig(max_tokens=MAX_TOKENS))
        assert reply["text"] == expected.text
        assert reply["usage"]["prompt_tokens"] == len(expected.prompt_tokens) - uncounted
        assert reply["usage"]["completion_tokens"] == len(expected.tokens)
