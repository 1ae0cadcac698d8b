// The chat harness page: picks a model from the app config, loads it with the browser engine
// and chats with it, or with an embedding model ranks pasted paragraphs for a query (the search
// tab). Model output is only ever set as textContent, never parsed as HTML.
import { createEngine } from "/web/src/index.js";
import { appConfigUrl, checkAppConfigOrigins } from "/web/harness/app-config.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const page = {
  appConfig: null,
  engine: null,
  history: [],
};

function setState(state) {
  document.body.dataset.state = state;
  const ready = state === "ready";
  const generating = state === "generating";
  $("prompt").disabled = !(ready || generating);
  $("send-button").disabled = !ready;
  $("reset-button").disabled = !ready;
  $("stop-button").disabled = !generating;
  $("query").disabled = !ready;
  $("search-button").disabled = !ready;
  // "starting": until start() has read the app config and listens to the form, a click would submit it natively.
  const busy = state === "starting" || state === "loading" || generating;
  $("load-button").disabled = busy;
  $("model-select").disabled = busy;
}

function showError(error) {
  $("error").textContent = error ? (error.message ?? String(error)) : "";
  $("error").hidden = !error;
}

function showProgress({ phase, text, fraction }) {
  $("load-status").hidden = phase === "ready";
  $("load-text").textContent = text ?? phase;
  $("load-progress").value = Number.isFinite(fraction) ? fraction : 0;
}

function addTurn(role, text) {
  const item = document.createElement("li");
  item.className = `turn ${role}`;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "content";
  body.textContent = text;
  item.append(who, body);
  $("transcript").append(item);
  item.scrollIntoView({ block: "end" });
  return body;
}

function formatRate(value) {
  return Number.isFinite(value) ? value.toFixed(1) : "–";
}

function showStats(usage, backend) {
  const extra = usage.extra;
  $("stats").textContent = `${backend} · ${usage.prompt_tokens} prompt tokens (${extra.prefilled_tokens} prefilled, ` +
    `${formatRate(extra.prefill_tokens_per_s)} tok/s) · ${usage.completion_tokens} generated ` +
    `(${formatRate(extra.decode_tokens_per_s)} tok/s) · first token after ${extra.time_to_first_token_s.toFixed(2)} s` +
    (extra.mask_ms_per_token > 0 ? ` · format mask ${extra.mask_ms_per_token.toFixed(2)} ms/token` : "") +
    (extra.proposed_tokens > 0 ? ` · ${speculationStats(usage.completion_tokens, extra)}` : "");
}

/** Speculative decoding's acceptance, and its model steps against one per token. */
function speculationStats(tokens, { proposed_tokens: proposed, accepted_tokens: accepted, model_steps: steps }) {
  const fewer = steps > 0 ? ((tokens - 1) / steps).toFixed(1) : "–";
  return `prompt lookup: ${accepted} of ${proposed} proposed tokens taken, ${fewer}× fewer model steps`;
}

/** The response_format of the settings; a schema that is not JSON is sent as text for the engine to report. */
function responseFormat() {
  const kind = $("response-format").value;
  if (kind === "json_schema") {
    return { type: "json_schema", json_schema: { name: "harness", schema: $("json-schema").value } };
  }
  return { type: kind };
}

/** The tools of the settings (a JSON list of OpenAI tools), or undefined when the box is empty. */
function settingsTools() {
  const text = $("tools").value.trim();
  if (!text) return undefined;
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new Error(`The tools are not JSON: ${error.message}`, { cause: error });
  }
}

/** JSON text pretty-printed; anything else (plain text, a reply cut short) as it is. */
function prettyJSON(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

function shownReply(text, format) {
  return format && format.type !== "text" ? prettyJSON(text) : text;
}

/** Each tool call of a reply below its text: the function's name and its arguments. */
function showToolCalls(reply, calls) {
  for (const call of calls) {
    const box = document.createElement("div");
    box.className = "tool-call";
    const name = document.createElement("code");
    name.textContent = call.function.name;
    const args = document.createElement("pre");
    args.textContent = prettyJSON(call.function.arguments);
    box.append("Calls ", name, args);
    reply.append(box);
  }
}

function numberSetting(id) {
  const input = $(id);
  return input.value === "" ? undefined : Number(input.value);
}

async function loadModel(modelId) {
  showError(null);
  setState("loading");
  showProgress({ phase: "fetch", text: `Loading ${modelId}…`, fraction: 0 });
  await page.engine?.unload();
  page.engine = null;
  try {
    page.engine = await createEngine(page.appConfig, modelId, {
      device: params.get("device") ?? "auto", // ?device=webgpu runs on WebGPU even on a software adapter
      onProgress: showProgress,
      onError: (error) => {
        showError(error);
        setState("error");
      },
    });
  } catch (error) {
    $("load-status").hidden = true;
    showError(error);
    setState("error");
    return;
  }
  const stats = await page.engine.stats();
  const note = stats.fallback_reason ? ` (CPU fallback: ${stats.fallback_reason})` : "";
  const on = stats.backend === "wasm" ? `wasm (${stats.threads} thread${stats.threads > 1 ? "s" : ""})` : stats.library_target;
  $("stats").textContent = `Loaded ${stats.model_id} on ${on} in ${stats.load.seconds.toFixed(1)} s` +
    `${stats.load.from_cache ? " from the browser cache" : ""}${note}`;
  resetConversation();
  showKind(stats.kind);
  setState("ready");
  if (stats.kind === "embedding") {
    $("query").placeholder = "Type a query: the paragraphs are ranked by how close they are to it";
    $("query").focus();
    return;
  }
  $("prompt").placeholder = "Type a message (Enter sends, Shift+Enter adds a line, Esc stops the reply)";
  $("prompt").focus();
}

function resetConversation() {
  page.history = [];
  $("transcript").replaceChildren();
}

async function send(text) {
  showError(null);
  page.history.push({ role: "user", content: text });
  const question = addTurn("user", text);
  const reply = addTurn("assistant", "");
  setState("generating");
  const system = $("system-prompt").value.trim();
  let answer = "";
  const calls = [];
  try {
    const tools = settingsTools();
    const request = {
      messages: system ? [{ role: "system", content: system }, ...page.history] : [...page.history],
      stream: true,
      temperature: numberSetting("temperature"),
      top_p: numberSetting("top-p"),
      max_tokens: numberSetting("max-tokens"),
      speculative: $("speculative").value,
      ...(tools ? { tools, tool_choice: $("tool-choice").value } : { response_format: responseFormat() }),
    };
    for await (const chunk of await page.engine.chat.completions.create(request)) {
      const delta = chunk.choices[0]?.delta;
      if (delta?.content) {
        answer += delta.content;
        reply.textContent = answer;
        reply.scrollIntoView({ block: "end" });
      }
      calls.push(...delta?.tool_calls ?? []);
      if (chunk.usage) showStats(chunk.usage, page.engine.backend);
    }
    reply.textContent = shownReply(answer, request.response_format);
    showToolCalls(reply, calls);
    page.history.push({ role: "assistant", content: answer, ...(calls.length > 0 ? { tool_calls: calls } : {}) });
    setState("ready");
  } catch (error) {
    // The turn did not happen: take it back and leave the question in the box to send again.
    page.history.pop();
    question.parentElement.remove();
    reply.parentElement.remove();
    $("prompt").value = text;
    showError(error);
    setState(error.code === "device-lost" || error.code === "not-loaded" ? "error" : "ready");
  }
  $("prompt").focus();
}

/** The chat for a chat model, the search tab for an embedding model. */
function showKind(kind) {
  $("search").hidden = kind !== "embedding";
  $("chat-form").hidden = kind === "embedding";
  $("transcript").hidden = kind === "embedding";
}

function cosine(a, b) {
  let dot = 0, aa = 0, bb = 0;
  for (let i = 0; i < a.length; i += 1) {
    dot += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  return dot / Math.sqrt(aa * bb);
}

/** Embed the query and the paragraphs in one request, and list the paragraphs closest first. */
async function rank(query) {
  showError(null);
  const paragraphs = $("paragraphs").value.split(/\n\s*\n/).map((text) => text.trim()).filter(Boolean);
  if (paragraphs.length === 0) {
    showError(new Error("Paste a few paragraphs to search first."));
    return;
  }
  setState("generating");
  const started = performance.now();
  try {
    const reply = await page.engine.embeddings.create({ input: [query, ...paragraphs] });
    const [queryVector, ...vectors] = reply.data.map((item) => item.embedding);
    const ranked = paragraphs.map((text, index) => ({ text, score: cosine(queryVector, vectors[index]) }))
      .sort((a, b) => b.score - a.score);
    $("ranking").replaceChildren(...ranked.map(({ text, score }) => {
      const item = document.createElement("li");
      const similarity = document.createElement("span");
      similarity.className = "score";
      similarity.textContent = score.toFixed(3);
      const body = document.createElement("div");
      body.className = "content";
      body.textContent = text;
      item.append(similarity, body);
      return item;
    }));
    const seconds = (performance.now() - started) / 1000;
    $("stats").textContent = `${page.engine.backend} · ${paragraphs.length + 1} texts, ${reply.usage.prompt_tokens} tokens ` +
      `embedded in ${seconds.toFixed(2)} s`;
  } catch (error) {
    showError(error);
  }
  setState("ready");
}

function refuseToStart(error) {
  showError(error);
  setState("error");
  $("load-button").disabled = true;
}

async function start() {
  try {
    // mode "same-origin" also refuses a redirect to another origin.
    const response = await fetch(appConfigUrl(params.get("config"), location.href), { cache: "no-cache", mode: "same-origin" });
    page.appConfig = await response.json();
    checkAppConfigOrigins(page.appConfig, location.href);
  } catch (error) {
    refuseToStart(new Error(`Could not read the app config: ${error.message}`));
    return;
  }
  const select = $("model-select");
  for (const record of page.appConfig.model_list ?? []) {
    const option = document.createElement("option");
    option.value = record.model_id;
    option.textContent = `${record.model_id} (${Math.ceil(record.vram_required_MB)} MB)`;
    select.append(option);
  }
  if (select.options.length === 0) {
    refuseToStart(new Error("No browser-ready models are served here: compile one with `kiln compile SOURCE -t webgpu,wasm`."));
    return;
  }
  if (params.has("model")) select.value = params.get("model");

  $("model-form").addEventListener("submit", (event) => {
    event.preventDefault();
    loadModel(select.value);
  });
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || document.body.dataset.state !== "ready") return;
    $("prompt").value = "";
    send(text);
  });
  $("search-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const query = $("query").value.trim();
    if (query && document.body.dataset.state === "ready") rank(query);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && document.body.dataset.state === "generating") page.engine.interrupt();
  });
  $("stop-button").addEventListener("click", () => page.engine.interrupt());
  $("reset-button").addEventListener("click", async () => {
    await page.engine.resetChat();
    resetConversation();
    $("stats").textContent = "";
    $("prompt").focus();
  });
  setState("idle");
}

start();
